// kvc: nvcc-safe
/// \file literal_mode.hpp
/// GEAR's streaming modes (SPEC §1.3 step 6, G6). The fp16 buffer of n_b tokens is the cache's ring
/// (the newest tokens not yet in a full block, plus the selector's window); n_b = BlockTokens.
///  - block mode [default, no policy]: each block is compressed once, when it leaves the ring, from
///    its exact tokens. O(B d r) per block; errors never compound.
///  - kvc::LiteralMode (Algorithm 1, for reproducing the paper): at every flush (an append that
///    completes one or more blocks; prefill is one flush) the whole compressed history is rebuilt
///    from its reconstruction X~ (backbone + outliers + low-rank) followed by the new blocks' exact
///    tokens, and every block is compressed again: outliers (re)selected (over the whole history with
///    OutlierScope::kStream), backbone re-quantized, residual re-fitted. Slow: a flush costs O(n d r)
///    for n stored tokens, so T decode steps cost O(T^2 d r / n_b), and the error compounds across
///    flushes, as in the paper.
/// Choice (documented, SPEC leaves it open): the backbone's groups and the low-rank fit stay per
/// block in both modes, so both modes share the block format and the fused kernels; the paper's
/// per-tensor statistics over the whole history are what OutlierScope::kStream reproduces for the
/// outliers.
#pragma once

#include <kvc/core/concepts.hpp>

namespace kvc {

/// Policy: GEAR's literal streaming mode (see the file comment). Requires OutlierFilter and/or
/// LowRankResidual in the same cache.
struct LiteralMode {
  using policy_kind = kind::streaming;
  static constexpr const char* name() noexcept { return "literal"; }
};
}  // namespace kvc
