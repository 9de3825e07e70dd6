// kvc: nvcc-safe
/// \file full_precision_window.hpp
/// KIVI's sliding full-precision window, with an optional StreamingLLM-style sink.
///
/// The selector interface (`kvc::Selector`, core/concepts.hpp), shared with LogWindow: per stream the
/// cache holds quantized blocks (in the order the selector hands them out) and `fp_slots(B)` rows of
/// full-precision storage; with n tokens, quantized_blocks(n, B) blocks are live and the other
/// n - quantized_blocks(n, B) * B tokens are full precision, the i-th of them in slot fp_slot(n, i, B).
/// (AlignedSinkWindow: block 0's first kMaskedRows rows hold no token, see detail::fp_tokens.)
/// `append_token` tells the cache, as slot operations (write, move, compress; PartialLogWindow also
/// quantize_value with value_quantized / exact_values), what appending token n does; `positions` says
/// which position every stored row holds (tests, dequantize). Attention is invariant under permuting
/// tokens, so kernels read blocks and full-precision rows in storage order. Host+device.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

namespace kvc {

namespace detail {
/// The rule behind FullPrecisionWindow and AlignedSinkWindow: the first `Sink` tokens and the newest
/// `Recent` in `Storage`, blocks of B tokens from position `Origin` (Sink: after the sink; 0: on the grid
/// of absolute positions, block 0's first Sink rows holding no token). Sliding semantics (KIVI, not
/// Hugging Face's flush-everything): block k (tokens [Origin + kB, Origin + (k+1)B)) is quantized as soon
/// as it is complete and entirely older than the window, n - (Origin + (k+1)B) >= Recent. So the newest
/// max(Recent, ...) tokens, at most Recent + B - 1 of them, are always exact besides the sink, and each
/// token is quantized exactly once. Slots: [0, Sink) the sink, then a ring of Recent + B slots, token pos
/// in Sink + (pos - Origin) % ring (the ring holds fewer than Recent + B live positions).
template <int Recent, int Sink, class Storage, int Origin>
struct SinkWindowRule {
  using policy_kind = kind::selector;
  using storage = Storage;
  static constexpr int kRecent = Recent;
  static constexpr int kSink = Sink;
  static constexpr int kMaskedRows = Sink - Origin;  ///< rows of block 0 before position Sink (detail::masked_rows)

  /// Number of quantized blocks once the sequence holds n tokens.
  KVC_HOST_DEVICE static constexpr int quantized_blocks(int n, int block_tokens) noexcept {
    return n - Origin - Recent >= block_tokens ? (n - Origin - Recent) / block_tokens : 0;
  }
  /// Quantized blocks a stream of `capacity` tokens can need.
  KVC_HOST_DEVICE static constexpr int capacity_blocks(int capacity, int block_tokens) noexcept {
    return quantized_blocks(capacity, block_tokens);
  }
  /// Capacity of the ring that holds the not-yet-quantized newest tokens.
  KVC_HOST_DEVICE static constexpr int ring_tokens(int block_tokens) noexcept { return Recent + block_tokens; }
  KVC_HOST_DEVICE static constexpr int fp_slots(int block_tokens) noexcept { return Sink + ring_tokens(block_tokens); }
  /// Slot of token `pos` while it is full precision (a sink or ring token).
  KVC_HOST_DEVICE static constexpr int slot_of(int pos, int block_tokens) noexcept {
    return pos < Sink ? pos : Sink + (pos - Origin) % ring_tokens(block_tokens);
  }
  /// Position of the i-th full-precision token with n tokens: the sink, then the tail after the blocks
  /// (after the sink while no block covers it).
  KVC_HOST_DEVICE static constexpr int fp_position(int n, int i, int block_tokens) noexcept {
    const int tail = Origin + quantized_blocks(n, block_tokens) * block_tokens;
    return i < Sink ? i : (tail > Sink ? tail : Sink) + (i - Sink);
  }
  KVC_HOST_DEVICE static constexpr int fp_slot(int n, int i, int block_tokens) noexcept {
    return slot_of(fp_position(n, i, block_tokens), block_tokens);
  }

  /// Appending token n (the sequence held n): ops.write(slot) stores it; then, when it completes a block
  /// older than the window, ops.compress(block, slot_of_row) quantizes that block from its ring slots
  /// (a row before position Sink, i.e. a masked row of block 0 on the grid, reads token Sink's slot).
  KVC_HD_CALLABLE_TEMPLATE
  template <class Ops>
  KVC_HOST_DEVICE static void append_token(int n, int block_tokens, Ops& ops) {
    ops.write(slot_of(n, block_tokens));
    const int nb = quantized_blocks(n, block_tokens);
    if (quantized_blocks(n + 1, block_tokens) > nb) {
      const int first = Origin + nb * block_tokens;
      ops.compress(nb, [first, block_tokens](int r) {
        return slot_of(first + r < Sink ? Sink : first + r, block_tokens);
      });
    }
  }

  /// Position of every stored row with n tokens (detail::stored_rows(n, B) entries): pos[b * B + r] for
  /// row r of block b (-1 for a masked row), then pos[quantized_blocks * B + i] for the i-th
  /// full-precision token.
  KVC_HOST_DEVICE static void positions(int n, int block_tokens, int* pos) noexcept {
    const int q = quantized_blocks(n, block_tokens) * block_tokens;
    for (int i = 0; i < q; ++i) pos[i] = Origin + i < Sink ? -1 : Origin + i;
    const int fp = detail::fp_tokens<SinkWindowRule>(n, block_tokens);
    for (int i = 0; i < fp; ++i) pos[q + i] = fp_position(n, i, block_tokens);
  }
};
}  // namespace detail

/// Keeps the first `Sink` tokens and the most recent `Recent` tokens in `Storage` (fp16 default); the
/// blocks start after the sink: block k holds tokens [Sink + kB, Sink + (k+1)B) (detail::SinkWindowRule).
/// Recent = 0 quantizes every complete block; the incomplete newest block stays full precision.
template <int Recent = 0, int Sink = 0, StorageType Storage = half_t>
struct FullPrecisionWindow : detail::SinkWindowRule<Recent, Sink, Storage, Sink> {
  static_assert(Recent >= 0 && Sink >= 0, "kvc::FullPrecisionWindow: sizes must be non-negative");
};

/// No window: every complete block is quantized (only the incomplete newest block stays exact).
using NoWindow = FullPrecisionWindow<0, 0>;

/// FullPrecisionWindow's sink without moving the block grid. FullPrecisionWindow<R, S> starts block 0 at
/// token S, so at a length that is a multiple of B the newest B - S tokens still wait in full precision
/// (4.86 instead of 4.53 bits/element for a 4-token sink and 4-bit KIVI on 64-token groups at 2048
/// tokens). Here block k holds tokens [kB, (k+1)B) and the sink's rows of block 0 hold no token:
/// they are quantized from copies of token Sink (so block 0's per-channel ranges come from its B - Sink
/// real tokens, which is what keeping the sink exact is for: its huge-norm keys no longer stretch its
/// neighbours' grid; statistics that weigh rows, GEAR's outlier ranks and low-rank factors, count token
/// Sink Sink + 1 times), stored and read like any row (counted in the bytes), and masked out of the
/// softmax by the kernels (probability exactly 0). The sink lives in
/// full-precision slots [0, Sink), the newest tokens in the ring. Requires 0 < Sink < B (cache_checks).
/// Served by the CPU kernels and the CUDA cache and kernel (the same row mask).
template <int Recent, int Sink, StorageType Storage = half_t>
struct AlignedSinkWindow : detail::SinkWindowRule<Recent, Sink, Storage, 0> {
  static_assert(Recent >= 0 && Sink > 0, "kvc::AlignedSinkWindow<Recent, Sink>: Recent >= 0, Sink > 0 (Sink = 0 "
                                          "is FullPrecisionWindow<Recent>)");
};
}  // namespace kvc
