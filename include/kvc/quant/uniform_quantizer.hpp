// kvc: nvcc-safe
/// \file uniform_quantizer.hpp
/// Uniform min/max quantization with one (lo, step) per token or per tensor.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/quant/codec.hpp>

namespace kvc {

/// Statistics scope of UniformQuantizer.
/// kToken: one group per token (all head_dim channels of one KV head).
/// kTensor: one group per stored tensor, which in an append-only cache is one block (BlockTokens x
/// head_dim) of one KV head [default]: the whole-history per-tensor mode of GEAR needs recompression
/// and belongs to GEAR's scheduler.
enum class Scope { kToken, kTensor };

/// \tparam Bits 1..8   \tparam S scope   \tparam C EndpointCodec (default) or MidpointCodec.
/// Error bound: |x - x^| <= step/2 of the element's group. Host+device.
template <int Bits, Scope S = Scope::kToken, Codec C = EndpointCodec>
struct UniformQuantizer {
  static_assert(Bits >= 1 && Bits <= 8, "kvc::UniformQuantizer: Bits must be in [1, 8]");
  using policy_kind = kind::quantizer;
  using codec = C;
  static constexpr int kBits = Bits;
  static constexpr Scope kScope = S;
  static constexpr bool kIsIdentity = false;
  static constexpr int kGroupTokens = S == Scope::kToken ? 1 : 0;
  static constexpr int kGroupChannels = 0;
  static constexpr int kRequiredBlockTokens = 0;
  static constexpr const char* name() noexcept { return S == Scope::kToken ? "uniform-token" : "uniform-tensor"; }
};
}  // namespace kvc
