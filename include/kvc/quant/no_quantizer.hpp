// kvc: nvcc-safe
/// \file no_quantizer.hpp
/// The identity quantizer: uncompressed fp32 / fp16 / bf16 caches through the same machinery.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

namespace kvc {

/// Identity "quantizer": stores elements as T (float, half_t, bfloat16_t). Exact up to T's rounding.
template <StorageType T>
struct NoQuantizer {
  using policy_kind = kind::quantizer;
  using storage = T;
  static constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  static constexpr bool kIsIdentity = true;
  static constexpr int kGroupTokens = 0;
  static constexpr int kGroupChannels = 0;
  static constexpr int kRequiredBlockTokens = 0;
  static constexpr const char* name() noexcept { return StorageTraits<T>::kName; }
};
}  // namespace kvc
