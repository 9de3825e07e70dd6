// kvc: nvcc-safe
/// \file cache_layout.hpp
/// Where every byte of a compressed KV cache lives, as trivially-copyable `Params` that both the
/// CPU attention and the CUDA kernels read (the host container owns the memory).
///
/// Per layer, sequence and KV head, a stream of tokens is stored as:
///  - blocks: quantized blocks of B tokens, in the order the selector hands them out (token order for
///            a window, eviction order for LogWindow), each [codes][lo x G][step x G] (fp16 metadata
///            planes, G groups), then, with GEAR's corrections, the correction region at the next
///            multiple of 16 bytes (gear/block_correction.hpp), padded to 64 bytes; identity blocks hold
///            raw elements;
///  - full-precision rows: Sel::fp_slots(B) token-major rows of selector storage W (fp16 by default);
///            the selector says which slot holds the i-th full-precision token (a window: the sink,
///            then a ring; LogWindow: the log set, then a staging area);
///  - quantized value rows (PartialLogWindow only): one TokenRowFormat row per full-precision slot, for
///            the values that left the selector's value window while their keys stay full precision;
///  - stream outliers (GEAR's OutlierScope::kStream only): the outliers of all blocks as one table,
///            [uint16 in-block index x cap][fp16 value x cap], ascending by (block, index), and
///            [uint32 x (capacity_blocks + 1)] start offsets, block b's entries at [off[b], off[b+1]).
/// Codes inside a block are in kernel order, chosen per side for the dot product that reads them:
///  - keys, codes <= 4 bits:   [c/4][t][c%4]  (4 channels per 32-bit lane: `vpdpbusd` over channels)
///  - values, codes <= 4 bits: [t/4][c][t%4]  (4 tokens per 32-bit lane: `vpdpbusd` over tokens)
///  - otherwise (5..8-bit codes, identity): keys [c][t], values [t][c] (float FMA, lanes = tokens /
///    channels).
/// Metadata planes are channel-group major: index cg * (B/gt) + tg, so per-channel key scales are
/// contiguous over channels and per-token value scales contiguous over tokens.
#pragma once

#include <kvc/config.hpp>
#include <kvc/aligned/slot_planes.hpp>
#include <kvc/core/bit_packing.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/gear/block_correction.hpp>
#include <kvc/quant/codec.hpp>
#include <kvc/rotate/rotation.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvc {

enum class Side { kKey, kValue };

namespace detail {
template <class Q, class = void>
struct identity_storage {
  using type = void;
};
template <class Q>
struct identity_storage<Q, std::void_t<typename Q::storage>> {
  using type = typename Q::storage;
};
}  // namespace detail

/// Storage format of one side's blocks: the quantizer's codes and metadata, then the correction
/// region of `Corr` (NoCorrection, or GEAR's BlockCorrection). Host+device.
template <Quantizer Q, Side S, int B, class Corr = NoCorrection>
struct BlockFormat {
  static_assert(!Corr::kActive || !Q::kIsIdentity,
                "kvc: outlier and low-rank corrections apply to quantized sides only");
  using quantizer = Q;
  using correction = Corr;
  static constexpr bool kCorrected = Corr::kActive;
  static constexpr Side kSide = S;
  static constexpr int kBlockTokens = B;
  static constexpr bool kIdentity = Q::kIsIdentity;
  static constexpr int kBits = Q::kBits;
  /// Integer dot-product path (vpdpbusd-style) for codes of <= 4 bits; float FMA otherwise.
  static constexpr bool kIntDot = !kIdentity && kBits <= 4;
  using element = std::conditional_t<kIdentity, typename detail::identity_storage<Q>::type, std::uint8_t>;
  static constexpr int kGroupTokens = Q::kGroupTokens == 0 ? B : Q::kGroupTokens;
  static_assert(kIdentity || kGroupTokens == 1 || kGroupTokens == B,
                "kvc: a quantizer group must span one token or the whole block (use BlockTokens<Group>)");
  static constexpr bool kPerTokenScale = kGroupTokens == 1;  // else constant over the block's tokens

  KVC_HOST_DEVICE static constexpr int group_channels(int d) noexcept {
    return Q::kGroupChannels == 0 ? d : Q::kGroupChannels;
  }
  KVC_HOST_DEVICE static constexpr int token_groups() noexcept { return B / kGroupTokens; }
  KVC_HOST_DEVICE static constexpr int groups(int d) noexcept {
    return kIdentity ? 0 : token_groups() * (d / group_channels(d));
  }
  KVC_HOST_DEVICE static constexpr std::size_t code_bytes(int d) noexcept {
    return kIdentity ? std::size_t(B) * d * sizeof(element) : packed_bytes(std::size_t(B) * d, kBits);
  }
  /// Bytes of the codes and metadata planes.
  KVC_HOST_DEVICE static constexpr std::size_t backbone_bytes(int d) noexcept {
    return code_bytes(d) + 2u * sizeof(half_t) * static_cast<std::size_t>(groups(d));
  }
  /// Offset of the correction region (16-byte aligned).
  KVC_HOST_DEVICE static constexpr std::size_t correction_offset(int d) noexcept {
    return (backbone_bytes(d) + 15u) / 16u * 16u;
  }
  /// Bytes of one block including metadata and corrections, padded to 64.
  KVC_HOST_DEVICE static constexpr std::size_t block_bytes(int d) noexcept {
    const std::size_t raw = kCorrected ? correction_offset(d) + Corr::bytes(B, d) : backbone_bytes(d);
    return (raw + 63u) / 64u * 64u;
  }
  KVC_HOST_DEVICE static const std::byte* correction_region(const std::byte* block, int d) noexcept {
    return block + correction_offset(d);
  }
  /// Position of element (t, c) in the block's kernel order.
  KVC_HOST_DEVICE static constexpr std::size_t index(int t, int c, int d) noexcept {
    if constexpr (kIntDot) {
      if constexpr (S == Side::kKey) return (std::size_t(c >> 2) * B + t) * 4 + (c & 3);
      else return (std::size_t(t >> 2) * d + c) * 4 + (t & 3);
    } else {
      if constexpr (S == Side::kKey) return std::size_t(c) * B + t;
      else return std::size_t(t) * d + c;
    }
  }
  /// Metadata index of the group holding (t, c).
  KVC_HOST_DEVICE static constexpr int group_of(int t, int c, int d) noexcept {
    return (c / group_channels(d)) * token_groups() + t / kGroupTokens;
  }
  KVC_HOST_DEVICE static const half_t* lo_plane(const std::byte* block, int d) noexcept {
    return reinterpret_cast<const half_t*>(block + code_bytes(d));
  }
  KVC_HOST_DEVICE static const half_t* step_plane(const std::byte* block, int d) noexcept {
    return lo_plane(block, d) + groups(d);
  }
  /// Writes an identity block from the exact block x ([B][d] row-major). Cooperative form: (lane, lanes)
  /// writes elements lane, lane + lanes, ... Host+device.
  KVC_HOST_DEVICE static void store_identity(const float* x, int d, std::byte* block, int lane = 0,
                                             int lanes = 1) noexcept {
    if constexpr (kIdentity) {
      element* out = reinterpret_cast<element*>(block);
      for (int i = lane; i < B * d; i += lanes) {
        const int t = i / d, c = i - t * d;
        out[index(t, c, d)] = StorageTraits<element>::store(x[i]);
      }
    }
  }
  /// Quantizes the groups of the exact block x ([B][d] row-major): one code byte per element into
  /// codes[index(t, c, d)] and the metadata planes of `block`; the statistics skip elements i = t * d + c
  /// with excluded[i] != 0 (GEAR's outliers; nullptr: none). Then pack_codes(codes, B * d, kBits, block)
  /// completes the block's backbone. Cooperative form: (lane, lanes) quantizes groups lane, lane + lanes,
  /// ... Host+device: the host cache and the CUDA compressor run this same code.
  KVC_HOST_DEVICE static void quantize_groups(const float* x, int d, std::uint8_t* codes, std::byte* block,
                                              const std::uint8_t* excluded, int lane = 0, int lanes = 1) noexcept {
    if constexpr (!kIdentity) {
      auto* lo = reinterpret_cast<half_t*>(block + code_bytes(d));
      half_t* step = lo + groups(d);
      const int gt = kGroupTokens, gc = group_channels(d), tgroups = token_groups();
      for (int gi = lane; gi < groups(d); gi += lanes) {
        const int cg = gi / tgroups, tg = gi - cg * tgroups;
        const int t0 = tg * gt, c0 = cg * gc;
        auto at = [&](int r, int c) { return x[std::size_t(t0 + r) * d + c0 + c]; };
        auto put = [&](int r, int c, std::uint8_t code) { codes[index(t0 + r, c0 + c, d)] = code; };
        auto kept = [&](int r, int c) { return excluded == nullptr || !excluded[std::size_t(t0 + r) * d + c0 + c]; };
        const QuantMeta m = quantize_group_masked<typename Q::codec>(gt, gc, kBits, at, put, kept);
        lo[gi] = m.lo;  // gi = cg * tgroups + tg = group_of(t0, c0, d)
        step[gi] = m.step;
      }
    }
  }
  /// Reconstructed value of element (t, c) of a block. Host+device (slow path: tests, dequantize()).
  KVC_HOST_DEVICE static float decode(const std::byte* block, int t, int c, int d) noexcept {
    if constexpr (kIdentity) {
      return StorageTraits<element>::load(reinterpret_cast<const element*>(block)[index(t, c, d)]);
    } else {
      const auto code = packed_code_at(reinterpret_cast<const std::uint8_t*>(block), std::size_t(B) * d, kBits,
                                       index(t, c, d));
      const int g = group_of(t, c, d);
      const Affine a = Q::codec::affine(QuantMeta{lo_plane(block, d)[g], step_plane(block, d)[g]});
      return mul_add_rounded(a.scale, static_cast<float>(code), a.zero);  // bit-identical on the device
    }
  }
  /// The quantizer's reconstruction of the block without corrections, x[t * d + c]. Host+device.
  KVC_HOST_DEVICE static void decode_backbone(const std::byte* block, int d, float* x) noexcept {
    for (int t = 0; t < B; ++t)
      for (int c = 0; c < d; ++c) x[std::size_t(t) * d + c] = decode(block, t, c, d);
  }
  /// What the block holds, x[t * d + c] (backbone plus corrections). Host+device.
  KVC_HOST_DEVICE static void decode_block(const std::byte* block, int d, float* x) noexcept {
    decode_backbone(block, d, x);
    if constexpr (kCorrected) Corr::add_to(correction_region(block, d), B, d, x);
  }
};

/// One token's values quantized on their own, outside any block (PartialLogWindow: a value that left
/// its window while its key is still full precision): [codes: d x kBits bits, dense, code c at bits
/// [c * kBits, (c + 1) * kBits)][lo x G][step x G] (fp16, G = d / group_channels), padded to 4 bytes.
/// The groups are the block format's per-token groups (quantize_group_masked over 1 x gc), so a block
/// later quantized from the same row holds the same codes and metadata, and decode() rounds like
/// BlockFormat::decode. Per-token quantizers only. Host+device.
template <Quantizer Q>
struct TokenRowFormat {
  static_assert(!Q::kIsIdentity && Q::kGroupTokens == 1, "kvc::TokenRowFormat: per-token quantizers only");
  static constexpr int kBits = Q::kBits;
  KVC_HOST_DEVICE static constexpr int group_channels(int d) noexcept {
    return Q::kGroupChannels == 0 ? d : Q::kGroupChannels;
  }
  KVC_HOST_DEVICE static constexpr int groups(int d) noexcept { return d / group_channels(d); }
  KVC_HOST_DEVICE static constexpr std::size_t code_bytes(int d) noexcept {
    return (std::size_t(d) * kBits + 7u) / 8u;
  }
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int d) noexcept {
    return (meta_offset(d) + 2u * sizeof(half_t) * std::size_t(groups(d)) + 3u) / 4u * 4u;
  }
  KVC_HOST_DEVICE static constexpr std::size_t meta_offset(int d) noexcept { return (code_bytes(d) + 1u) / 2u * 2u; }
  KVC_HOST_DEVICE static const half_t* lo(const std::byte* row, int d) noexcept {
    return reinterpret_cast<const half_t*>(row + meta_offset(d));
  }
  /// Quantizes x[0, d) into `row` (bytes(d) bytes).
  KVC_HOST_DEVICE static void quantize(const float* x, int d, std::byte* row) noexcept {
    auto* codes = reinterpret_cast<std::uint8_t*>(row);
    for (std::size_t i = 0; i < code_bytes(d); ++i) codes[i] = 0;
    auto* meta = const_cast<half_t*>(lo(row, d));
    const int gc = group_channels(d), ng = groups(d);
    for (int g = 0; g < ng; ++g) {
      const int c0 = g * gc;
      auto put = [&](int, int c, std::uint8_t code) { or_dense_code(codes, c0 + c, kBits, code); };
      const QuantMeta m = quantize_group_masked<typename Q::codec>(
          1, gc, kBits, [&](int, int c) { return x[c0 + c]; }, put, [](int, int) { return true; });
      meta[g] = m.lo;
      meta[ng + g] = m.step;
    }
  }
  KVC_HOST_DEVICE static int code_at(const std::byte* row, int c) noexcept {
    return dense_code_at(reinterpret_cast<const std::uint8_t*>(row), c, kBits);
  }
  /// The whole row, x[0, d) (one affine per group; decode() rounding).
  KVC_HOST_DEVICE static void decode_row(const std::byte* row, int d, float* x) noexcept {
    const half_t* m = lo(row, d);
    const int gc = group_channels(d), ng = groups(d);
    for (int g = 0; g < ng; ++g) {
      const Affine a = Q::codec::affine(QuantMeta{m[g], m[ng + g]});
      for (int c = g * gc; c < (g + 1) * gc; ++c) x[c] = mul_add_rounded(a.scale, static_cast<float>(code_at(row, c)), a.zero);
    }
  }
  /// Reconstructed element c.
  KVC_HOST_DEVICE static float decode(const std::byte* row, int c, int d) noexcept {
    const int g = c / group_channels(d);
    const half_t* m = lo(row, d);
    const Affine a = Q::codec::affine(QuantMeta{m[g], m[groups(d) + g]});
    return mul_add_rounded(a.scale, static_cast<float>(code_at(row, c)), a.zero);
  }
};

namespace detail {
/// Whether selector S keeps some full-precision tokens' values as quantized rows (PartialLogWindow).
template <class S>
constexpr bool selector_quantizes_values() {
  if constexpr (requires { S::kQuantizedValues; }) return S::kQuantizedValues;
  else return false;
}
}  // namespace detail

/// One block's share of a stream-scope outlier table (gear/outlier_filter.hpp's entry format).
struct OutlierSlice {
  const std::uint16_t* idx;
  const half_t* val;
  int n;
};

/// Compile-time description of a cache: key/value block formats (with their corrections), the
/// full-precision selector, the stream-scope outlier filter (void when outliers are per block or
/// absent; it applies to the quantized sides), the rotation (NoRotation: rows stored as given) and the
/// loader of the full-precision slots (void: fp rows; kvc::AlignedLoader: AlignedKV's bit planes,
/// aligned/slot_planes.hpp).
template <Quantizer KQ, Quantizer VQ, Selector Sel, int B, class KCorr = NoCorrection, class VCorr = NoCorrection,
          class StreamOutliers = void, class Rot = NoRotation, class Loader = void>
struct CacheLayout {
  using key_format = BlockFormat<KQ, Side::kKey, B, KCorr>;
  using value_format = BlockFormat<VQ, Side::kValue, B, VCorr>;
  using selector = Sel;
  using window_t = typename Sel::storage;
  static constexpr int kBlockTokens = B;
  static constexpr int kFpSlots = Sel::fp_slots(B);  ///< full-precision rows per stream and side
  /// AlignedLoader over the full-precision slots: they are stored as bit planes (aligned::SlotPlanes).
  using loader = Loader;
  static constexpr bool kAlignedWindow = !std::is_void_v<Loader>;
  /// Slots a stream side's region holds: kFpSlots, rounded up to the block with slot planes (whole chunks).
  static constexpr int kFpStride = kAlignedWindow ? (kFpSlots + B - 1) / B * B : kFpSlots;
  /// PartialLogWindow: full-precision slots also hold a quantized value row (value_row_format).
  static constexpr bool kQuantizedFpValues = detail::selector_quantizes_values<Sel>();
  using value_row_format = std::conditional_t<kQuantizedFpValues, TokenRowFormat<VQ>, void>;
  /// Bytes of one slot's quantized value row (0 without).
  KVC_HOST_DEVICE static constexpr std::size_t value_row_bytes(int d) noexcept {
    if constexpr (kQuantizedFpValues) return value_row_format::bytes(d);
    else return 0;
  }
  /// Full-precision tokens whose value is exact with n tokens (the others are quantized rows).
  KVC_HOST_DEVICE static constexpr int exact_fp_values(int n) noexcept {
    const int fp = detail::fp_tokens<Sel>(n, B);
    if constexpr (kQuantizedFpValues) return Sel::exact_values(n, B) < fp ? Sel::exact_values(n, B) : fp;
    else return fp;
  }
  using stream_outliers = StreamOutliers;
  static constexpr bool kStreamOutliers = !std::is_void_v<StreamOutliers>;
  template <bool Keys>
  static constexpr bool stream_outliers_on() {
    if constexpr (std::is_void_v<StreamOutliers>) return false;
    else return StreamOutliers::on(Keys);
  }
  static constexpr bool kKeyStreamOutliers = stream_outliers_on<true>() && !KQ::kIsIdentity;
  static constexpr bool kValueStreamOutliers = stream_outliers_on<false>() && !VQ::kIsIdentity;
  /// Every stored row (blocks and full-precision slots) is R x; attention rotates the query with the
  /// key transform and un-rotates its output with the value transform (rotate/rotation.hpp).
  using rotation = Rot;
  static constexpr bool kRotated = Rot::kActive;
  /// 32-bit words of one layer's rotation tables, [kv_heads][Rot::head_words] (0 without a rotation); a
  /// container holds [layers] of them, layer l's at l * rotation_words.
  KVC_HOST_DEVICE static constexpr std::size_t rotation_words(int kv_heads, int d) noexcept {
    return std::size_t(kv_heads) * Rot::head_words(d);
  }
  KVC_HOST_DEVICE static constexpr std::size_t rotation_bytes(int kv_heads, int d) noexcept {
    return rotation_words(kv_heads, d) * sizeof(std::uint32_t);
  }

  /// One layer's view of the cache. Trivially copyable; pointers are host or device memory.
  struct Params {
    int batch;            ///< sequences
    int kv_heads;
    int head_dim;
    int capacity_blocks;  ///< quantized blocks a stream can hold
    const int* lengths;   ///< [batch] tokens per sequence
    std::byte* k_blocks;  ///< [batch][kv_heads][capacity_blocks] blocks of key_format::block_bytes
    std::byte* v_blocks;
    window_t* k_fp;  ///< [batch][kv_heads][kFpStride][head_dim] (kAlignedWindow: that many elements, as planes)
    window_t* v_fp;
    int outlier_capacity;       ///< stream-scope outlier entries per stream (0 without)
    std::uint32_t* k_out_off;   ///< [batch][kv_heads][capacity_blocks + 1] (nullptr without)
    std::uint16_t* k_out_idx;   ///< [batch][kv_heads][outlier_capacity]
    half_t* k_out_val;          ///< [batch][kv_heads][outlier_capacity]
    std::uint32_t* v_out_off;
    std::uint16_t* v_out_idx;
    half_t* v_out_val;
    std::byte* v_fq = nullptr;  ///< [batch][kv_heads][kFpSlots] quantized value rows (kQuantizedFpValues only)
    const std::uint32_t* rotation = nullptr;  ///< [kv_heads][Rot::head_words] this layer's tables (kRotated only)

    KVC_HOST_DEVICE int stream(int seq, int head) const noexcept { return seq * kv_heads + head; }
    /// Block `blk`'s stream-scope outliers of one side (only with kStreamOutliers on that side).
    KVC_HOST_DEVICE OutlierSlice outliers(Side side, int seq, int head, int blk) const noexcept {
      const bool k = side == Side::kKey;
      const std::size_t st = std::size_t(stream(seq, head));
      const std::uint32_t* off = (k ? k_out_off : v_out_off) + st * (capacity_blocks + 1);
      const std::size_t base = st * outlier_capacity + off[blk];
      return {(k ? k_out_idx : v_out_idx) + base, (k ? k_out_val : v_out_val) + base, int(off[blk + 1] - off[blk])};
    }
    KVC_HOST_DEVICE int quantized_blocks(int seq) const noexcept { return Sel::quantized_blocks(lengths[seq], B); }
    KVC_HOST_DEVICE std::byte* key_block(int seq, int head, int blk) const noexcept {
      return k_blocks + (std::size_t(stream(seq, head)) * capacity_blocks + blk) * key_format::block_bytes(head_dim);
    }
    KVC_HOST_DEVICE std::byte* value_block(int seq, int head, int blk) const noexcept {
      return v_blocks + (std::size_t(stream(seq, head)) * capacity_blocks + blk) * value_format::block_bytes(head_dim);
    }
    /// Full-precision tokens of sequence `seq` (everything outside its quantized blocks).
    KVC_HOST_DEVICE int fp_count(int seq) const noexcept { return detail::fp_tokens<Sel>(lengths[seq], B); }
    /// Row of full-precision slot `slot` of one stream side (fp rows: not kAlignedWindow).
    KVC_HOST_DEVICE window_t* fp_slot_row(Side side, int seq, int head, int slot) const noexcept {
      static_assert(!kAlignedWindow, "kvc: slot planes have no rows; use fp_planes");
      return (side == Side::kKey ? k_fp : v_fp) + (std::size_t(stream(seq, head)) * kFpStride + slot) * head_dim;
    }
    /// The slot planes of one stream side (kAlignedWindow only).
    KVC_HOST_DEVICE aligned::SlotPlanes fp_planes(Side side, int seq, int head) const noexcept {
      window_t* r = (side == Side::kKey ? k_fp : v_fp) + std::size_t(stream(seq, head)) * kFpStride * head_dim;
      return {reinterpret_cast<std::uint8_t*>(r), kFpStride, head_dim, side == Side::kKey};
    }
    /// Row of the i-th full-precision token of (seq, head), i < fp_count(seq) (storage order).
    KVC_HOST_DEVICE window_t* fp_row_at(Side side, int seq, int head, int i) const noexcept {
      return fp_slot_row(side, seq, head, Sel::fp_slot(lengths[seq], i, B));
    }
    /// Whether the i-th full-precision token of `seq` keeps only a quantized value row.
    KVC_HOST_DEVICE bool fp_value_quantized(int seq, int i) const noexcept {
      if constexpr (kQuantizedFpValues) return Sel::value_quantized(lengths[seq], i, B);
      else return false;
    }
    /// Quantized value row of full-precision slot `slot` (kQuantizedFpValues only).
    KVC_HOST_DEVICE std::byte* value_row_slot(int seq, int head, int slot) const noexcept {
      return v_fq + (std::size_t(stream(seq, head)) * kFpSlots + slot) * value_row_bytes(head_dim);
    }
    KVC_HOST_DEVICE const std::byte* value_row_at(int seq, int head, int i) const noexcept {
      return value_row_slot(seq, head, Sel::fp_slot(lengths[seq], i, B));
    }
    /// Element c of the i-th full-precision token of one side, as attention sees it (slow path: the
    /// CUDA tile loader, dequantize()).
    KVC_HOST_DEVICE float fp_element(Side side, int seq, int head, int i, int c) const noexcept {
      if constexpr (kQuantizedFpValues)
        if (side == Side::kValue && fp_value_quantized(seq, i))
          return value_row_format::decode(value_row_at(seq, head, i), c, head_dim);
      if constexpr (kAlignedWindow)
        return detail::half_bits_to_float(fp_planes(side, seq, head).bits(Sel::fp_slot(lengths[seq], i, B), c));
      else
        return StorageTraits<window_t>::load(fp_row_at(side, seq, head, i)[c]);
    }
  };
  static_assert(std::is_trivially_copyable_v<Params>, "kvc: CacheLayout::Params must be trivially copyable");
};
}  // namespace kvc
