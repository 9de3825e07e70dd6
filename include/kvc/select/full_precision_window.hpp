// kvc: nvcc-safe
/// \file full_precision_window.hpp
/// KIVI's sliding full-precision window, with an optional StreamingLLM-style sink.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

namespace kvc {

/// Keeps the first `Sink` tokens and the most recent `Recent` tokens in `Storage` (fp16 default).
/// Sliding semantics (KIVI, not Hugging Face's flush-everything): with n tokens, block k (tokens
/// [Sink + kB, Sink + (k+1)B)) is quantized as soon as it is complete and entirely older than the
/// window, i.e. when n - (Sink + (k+1)B) >= Recent. So the newest max(Recent, ...) tokens, at most
/// Recent + B - 1 of them, are always exact, and each token is quantized exactly once.
/// Recent = 0 quantizes every complete block; the incomplete newest block stays full precision.
template <int Recent = 0, int Sink = 0, StorageType Storage = half_t>
struct FullPrecisionWindow {
  static_assert(Recent >= 0 && Sink >= 0, "kvc::FullPrecisionWindow: sizes must be non-negative");
  using policy_kind = kind::selector;
  using storage = Storage;
  static constexpr int kRecent = Recent;
  static constexpr int kSink = Sink;

  /// Number of quantized blocks once the sequence holds n tokens. Host+device.
  KVC_HOST_DEVICE static constexpr int quantized_blocks(int n, int block_tokens) noexcept {
    return n > Sink + Recent ? (n - Sink - Recent) / block_tokens : 0;
  }
  /// Capacity of the ring that holds the not-yet-quantized newest tokens.
  KVC_HOST_DEVICE static constexpr int ring_tokens(int block_tokens) noexcept { return Recent + block_tokens; }
};

/// No window: every complete block is quantized (only the incomplete newest block stays exact).
using NoWindow = FullPrecisionWindow<0, 0>;
}  // namespace kvc
