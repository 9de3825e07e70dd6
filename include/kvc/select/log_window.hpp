// kvc: nvcc-safe
/// \file log_window.hpp
/// LogQuant's log-distributed full-precision token set (SPEC §4.2, Algorithm 1, authoritative).
/// WORK IN PROGRESS (issue 13): the selection rule only; CompressedKVCache does not accept it yet.
///
/// State per sequence: FP, the positions kept in full precision, oldest first. APPEND(t):
///   |FP| < 3W:  FP.push_back(t)
///   |FP| = 3W:  evict FP[1], FP[3], ..., FP[2W-1] (W tokens, in that order, to the quantized store);
///               FP = FP[0], FP[2], ..., FP[2W-2] ++ FP[2W .. 3W-1] ++ [t]     (|FP| = 2W + 1)
/// Prefill = APPEND per token (SPEC L1 default). Evictions happen when token 3W + kW arrives (k >= 0),
/// W tokens each; position 0 is never evicted. The rule depends on the token count only, so every layer
/// and head of a sequence shares it. Host+device.
///
/// Integration plan (next step of issue 13):
///  - blocks: quantized_blocks(n, B) = evicted_count(n) / B, blocks in eviction order (SPEC L2: evicted
///    rows are staged in full precision until B = the key group size accumulate, then quantized once);
///  - full-precision rows per stream: 3W "set" slots kept in list order (an eviction compacts the slots
///    exactly like the list: slot i always holds FP[i], 2W row moves per W tokens) plus a staging area
///    of B - 1 rows (evicted_count(n) % B of them live);
///  - kernels: replace the sink/ring-specific ranges by a selector-agnostic full-precision token list,
///    `Params::fp_count(seq)` and `fp_row_at(side, seq, head, i)` (FullPrecisionWindow: sink rows then
///    the ring tail; LogWindow: set slots then staging), so the CPU and CUDA kernels serve both
///    (attention is invariant under permuting tokens: SPEC §4.1).
#pragma once

#include <kvc/config.hpp>

namespace kvc {

template <int W>
struct LogWindow {
  static_assert(W >= 1, "kvc::LogWindow<W>: the window W must be at least 1 (the set holds at most 3W tokens)");
  static constexpr int kWindow = W;
  static constexpr int kCapacity = 3 * W;  ///< most full-precision tokens at once

  /// One sequence's set: pos[0, size) oldest first.
  struct State {
    int size = 0;
    int pos[3 * W] = {};
  };

  /// Tokens evicted (quantized) once a sequence holds n tokens: W per event, events at 3W + kW.
  KVC_HOST_DEVICE static constexpr int evicted_count(int n) noexcept {
    return n > kCapacity ? W * ((n - kCapacity - 1) / W + 1) : 0;
  }
  /// Full-precision tokens once a sequence holds n tokens.
  KVC_HOST_DEVICE static constexpr int kept_count(int n) noexcept { return n - evicted_count(n); }

  /// APPEND(t) (t = the sequence's token count before it). Writes the evicted positions, in eviction
  /// order, to evicted[0, W) and returns how many (0 or W).
  KVC_HOST_DEVICE static int append(State& s, int t, int* evicted) noexcept {
    if (s.size < kCapacity) {
      s.pos[s.size++] = t;
      return 0;
    }
    for (int i = 0; i < W; ++i) evicted[i] = s.pos[2 * i + 1];
    for (int i = 1; i < W; ++i) s.pos[i] = s.pos[2 * i];  // keep FP[0], FP[2], ..., FP[2W-2]
    for (int i = 0; i < W; ++i) s.pos[W + i] = s.pos[2 * W + i];  // then FP[2W .. 3W-1]
    s.pos[2 * W] = t;
    s.size = 2 * W + 1;
    return W;
  }
};
}  // namespace kvc
