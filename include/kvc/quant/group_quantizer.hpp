// kvc: nvcc-safe
/// \file group_quantizer.hpp
/// KIVI-style group quantization (SPEC §0.3): groups along one axis of a block.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/quant/codec.hpp>

namespace kvc {

/// Asymmetric min/max quantizer over groups of `Group` values along `A`.
/// \tparam Bits  code width, 1..8
/// \tparam Group group size: tokens per channel group for Axis::kChannel (KIVI keys; the cache's
///               block then holds exactly `Group` tokens), channels per token group for Axis::kToken
///               (KIVI values; must divide the head dimension)
/// \tparam A     grouping axis
/// \tparam C     EndpointCodec (KIVI, default) or MidpointCodec
/// Error bound: |x - x^| <= step/2 of the element's group. Host+device.
template <int Bits, int Group, Axis A, Codec C = EndpointCodec>
struct GroupQuantizer {
  static_assert(Bits >= 1 && Bits <= 8, "kvc::GroupQuantizer: Bits must be in [1, 8]");
  static_assert(Group > 0, "kvc::GroupQuantizer: Group must be positive");
  static_assert(A == Axis::kToken || Group % 32 == 0,
                "kvc::GroupQuantizer: a per-channel group spans a whole block, so Group must be a multiple of 32");
  static_assert(A == Axis::kChannel || Group % 16 == 0,
                "kvc::GroupQuantizer: a per-token group must span a multiple of 16 channels");
  using policy_kind = kind::quantizer;
  using codec = C;
  static constexpr int kBits = Bits;
  static constexpr int kGroup = Group;
  static constexpr Axis kAxis = A;
  static constexpr bool kIsIdentity = false;
  static constexpr int kGroupTokens = A == Axis::kChannel ? Group : 1;
  static constexpr int kGroupChannels = A == Axis::kToken ? Group : 1;
  static constexpr int kRequiredBlockTokens = A == Axis::kChannel ? Group : 0;
  static constexpr const char* name() noexcept { return A == Axis::kChannel ? "group-channel" : "group-token"; }
};
}  // namespace kvc
