// kvc: nvcc-safe
/// \file record_format.hpp
/// QAQ's mixed-bit storage unit: one side (key or value) of one token at width b, a fixed-size record in
/// the stream's bucket of width b (every record of a bucket has the same size, so a bucket is an array).
/// Attention is invariant under permuting tokens, so buckets hold tokens in any order; the record names
/// its token.
///   [meta: (lo, step_max), Q::meta_format::kBytes (4: two fp16; 2: LogMeta)]
///   [codes: d x b bits, dense, code c at bits [c b, (c + 1) b)]
///   [outlier value fp16 x 2k][outlier channel u8 x 2k][token: id_bytes (2 or 4) little-endian]
/// d % 16 == 0 (and an even meta size) keeps every fp16 field 2-byte aligned. Host+device.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/bit_packing.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/quant/codec.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

// Host x86 with BMI2 packs and narrows a group of 8 codes with one pext; not on AMD Zen 1/2, where pext is
// microcoded (hundreds of cycles), nor in device code.
#if defined(__BMI2__) && !defined(__CUDA_ARCH__) && !defined(__znver1) && !defined(__znver2)
#  include <immintrin.h>
#  define KVC_QAQ_PEXT_ 1
#else
#  define KVC_QAQ_PEXT_ 0
#endif
// Host x86 with AVX2 and F16C re-encodes a raised token 8 channels at a time (encode_group).
#if defined(__AVX2__) && defined(__F16C__) && !defined(__CUDA_ARCH__)
#  include <immintrin.h>
#  define KVC_QAQ_AVX2_ 1
#else
#  define KVC_QAQ_AVX2_ 0
#endif

namespace kvc::qaq {

/// Runs f.template operator()<W>() with W the run-time width b in [BMin, BMax] (nothing outside it): code that
/// handles one width at a time gets it as a constant (lower / raise inlined with constant widths: fixed group
/// sizes, no per-byte loops). Host.
template <int BMin, int BMax, class F>
void with_width(int b, F&& f) {
  if constexpr (BMin <= BMax) {
    if (b == BMin) f.template operator()<BMin>();
    else with_width<BMin + 1, BMax>(b, f);
  }
}

/// AddOutliers: how the outliers join the codes' reconstruction x^_c = Q::decode(code_c). false: they replace
/// their channels (x_c stored, the kernels add x_c - x^_c). true (the rotated sides of a QAQ cache with outliers,
/// qaq_cache.hpp): the codes are of the rotated residual y = R (x - o), o the outliers in the original basis, and
/// the reconstruction is R^T y^ + o: the kernels add x_c itself, in the original basis (the output after its
/// un-rotation, the score with the un-rotated query). Same bytes either way.
template <class Q, bool AddOutliers = false>
struct RecordFormat {
  using quantizer = Q;
  using meta_format = typename Q::meta_format;
  /// Bytes of the metadata at the record's start; the codes follow.
  static constexpr std::size_t kMetaBytes = std::size_t(meta_format::kBytes);
  static_assert(kMetaBytes % 2 == 0, "kvc::qaq::RecordFormat: the metadata must keep the fp16 outlier values 2-byte aligned");
  static constexpr bool kAddOutliers = AddOutliers;
  /// What an outlier x_c adds to the reconstruction of its channel, whose code decodes to x^_c.
  KVC_HOST_DEVICE static float outlier_term(float x, float decoded) noexcept { return AddOutliers ? x : x - decoded; }
  /// Token id bytes of an adaptive cache of `capacity` tokens: 2 up to 65,536 tokens, else 4.
  KVC_HOST_DEVICE static constexpr int id_bytes_for(int capacity) noexcept { return capacity <= 65536 ? 2 : 4; }
  KVC_HOST_DEVICE static constexpr std::size_t code_bytes(int d, int b) noexcept { return std::size_t(d) * b / 8; }
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int d, int b, int id_bytes) noexcept {
    return kMetaBytes + code_bytes(d, b) + 3 * std::size_t(Q::outliers(d)) + std::size_t(id_bytes);
  }
  KVC_HOST_DEVICE static QuantMeta meta(const std::byte* r) noexcept { return meta_format::load(r); }
  /// meta(r) as floats (lo, step_max), each fp16 converted by cvt where the format stores fp16.
  template <class Cvt>
  KVC_HOST_DEVICE static void meta_floats(const std::byte* r, Cvt&& cvt, float& lo, float& step) noexcept {
    meta_format::load_floats(r, cvt, lo, step);
  }
  KVC_HOST_DEVICE static const std::uint8_t* codes(const std::byte* r) noexcept {
    return reinterpret_cast<const std::uint8_t*>(r + kMetaBytes);
  }
  KVC_HOST_DEVICE static const half_t* outlier_values(const std::byte* r, int d, int b) noexcept {
    return reinterpret_cast<const half_t*>(r + kMetaBytes + code_bytes(d, b));
  }
  KVC_HOST_DEVICE static const std::uint8_t* outlier_channels(const std::byte* r, int d, int b) noexcept {
    return reinterpret_cast<const std::uint8_t*>(r + kMetaBytes + code_bytes(d, b) + 2 * std::size_t(Q::outliers(d)));
  }
  KVC_HOST_DEVICE static std::uint32_t token(const std::byte* r, int d, int b, int id_bytes) noexcept {
    return token(r, bytes(d, b, id_bytes), id_bytes);
  }
  /// The token id of record r of rb bytes (id_bytes 2 or 4), for loops that know rb: the record's last 4 bytes
  /// as one little-endian word (GCC and Clang merge the 4 byte loads into one load on x86) shifted right over the
  /// bytes before the id (every record has at least 4: its metadata, 2 or 4 bytes, then d >= 16 codes at >= 1
  /// bit). A byte loop over id_bytes from the record's start, sized per call, cost the attention's two passes
  /// about 8 % (BM_QaqDecodeStep, cpu-clock).
  KVC_HOST_DEVICE static std::uint32_t token(const std::byte* r, std::size_t rb, int id_bytes) noexcept {
    const auto* p = reinterpret_cast<const std::uint8_t*>(r + rb - 4);
    const std::uint32_t w = std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
                            std::uint32_t(p[3]) << 24;
    return w >> (32 - 8 * id_bytes);
  }
  /// Host: asks the cache lines of the first and last byte of bucket record j (of n, rb bytes each) into the caches,
  /// if it exists (all of a record of <= 65 bytes, such as every width <= 3 at head dim 128). Walks over a bucket call
  /// it kRecordAhead records ahead: the attention's passes and the width update. The records are read in order, but
  /// the hardware's prefetch alone left their loads waiting: on a Xeon (AVX-512) the code loads took 30 % of the key
  /// pass's cpu-clock samples, and with the records asked 16 to 64 ahead QAQ's attention at T = 32768 ran 12-16 %
  /// faster. A loop over every line of the record measured no faster than none (README).
  static void prefetch(const std::byte* bucket, std::size_t j, std::size_t n, std::size_t rb) noexcept {
    if (j >= n) return;
    const std::byte* r = bucket + j * rb;
    __builtin_prefetch(r, 0, 3);
    __builtin_prefetch(r + rb - 1, 0, 3);
  }
  static constexpr std::size_t kRecordAhead = 32;  ///< for prefetch (16, 32 and 64 measured alike)
  /// Width-b code of channel c.
  KVC_HOST_DEVICE static int code_at(const std::byte* r, int c, int b) noexcept { return dense_code_at(codes(r), c, b); }
  /// The 8 width-W codes of one group (the W bytes at p) as one little-endian word, assembled byte by byte
  /// (reads exactly W bytes; in registers, no narrow copy through memory).
  template <int W>
  KVC_HOST_DEVICE static std::uint64_t group_word(const std::uint8_t* p) noexcept {
    return group_word(p, W);
  }
  /// group_word for a run-time width b in [1, 8].
  KVC_HOST_DEVICE static std::uint64_t group_word(const std::uint8_t* p, int b) noexcept {
    std::uint64_t v = 0;
    for (int j = 0; j < b; ++j) v |= std::uint64_t(p[j]) << (8 * j);
    return v;
  }
  /// Stores a group word of width b (8 codes) as its b bytes.
  KVC_HOST_DEVICE static void put_group(std::uint8_t* p, int b, std::uint64_t v) noexcept {
    for (int j = 0; j < b; ++j) p[j] = static_cast<std::uint8_t>(v >> (8 * j));
  }
  /// The 8 width-b codes of group word v, each narrowed to its top nb <= b bits, packed at width nb.
  KVC_HOST_DEVICE static std::uint64_t narrow_group(std::uint64_t v, int b, int nb) noexcept {
    std::uint64_t keep = 0;  // the top nb bits of every b-bit field
    for (int i = 0; i < 8; ++i) keep |= ((std::uint64_t(1) << nb) - 1u) << (i * b + (b - nb));
#if KVC_QAQ_PEXT_
    return _pext_u64(v, keep);
#else
    std::uint64_t w = 0;
    for (int i = 0; i < 8; ++i) w |= ((v >> (i * b + (b - nb))) & ((std::uint64_t(1) << nb) - 1u)) << (i * nb);
    return w;
#endif
  }
  /// 8 codes < 2^b, one per byte of `bytes` (code i in byte i), packed at width b.
  KVC_HOST_DEVICE static std::uint64_t pack_bytes(std::uint64_t bytes, int b) noexcept {
#if KVC_QAQ_PEXT_
    return _pext_u64(bytes, 0x0101010101010101ull * ((1u << b) - 1u));
#else
    std::uint64_t w = 0;
    for (int i = 0; i < 8; ++i) w |= ((bytes >> (8 * i)) & 0xffu) << (i * b);
    return w;
#endif
  }
  /// All d width-W codes as floats (W the record's width, d % 8 == 0): 8 codes fill exactly W bytes.
  template <int W>
  KVC_HOST_DEVICE static void unpack(const std::byte* r, int d, float* out) noexcept {
    const std::uint8_t* p = codes(r);
    constexpr std::uint64_t mask = (std::uint64_t(1) << W) - 1u;
    for (int c0 = 0; c0 < d; c0 += 8, p += W) {
      const std::uint64_t v = group_word<W>(p);
      for (int i = 0; i < 8; ++i) out[c0 + i] = float((v >> (i * W)) & mask);
    }
  }
  /// unpack<b>(r, d, out) for a run-time width b in [1, 8].
  KVC_HOST_DEVICE static void unpack(const std::byte* r, int d, int b, float* out) noexcept {
    switch (b) {
      case 1: unpack<1>(r, d, out); break;
      case 2: unpack<2>(r, d, out); break;
      case 3: unpack<3>(r, d, out); break;
      case 4: unpack<4>(r, d, out); break;
      case 5: unpack<5>(r, d, out); break;
      case 6: unpack<6>(r, d, out); break;
      case 7: unpack<7>(r, d, out); break;
      default: unpack<8>(r, d, out); break;
    }
  }
  /// Writes a record at width b from one-byte-per-channel codes at width `from` >= b (narrowed by shifting:
  /// Q's codes nest), the metadata and the outliers.
  KVC_HOST_DEVICE static void write(std::byte* r, int d, int b, int id_bytes, QuantMeta m, const std::uint8_t* codes_from,
                                    int from, const half_t* out_val, const std::uint8_t* out_idx,
                                    std::uint32_t token_id) noexcept {
    meta_format::store(r, m);
    // 8 codes at a time, assembled in a register (d % 8 == 0): the group is exactly b bytes
    auto* p = reinterpret_cast<std::uint8_t*>(r + kMetaBytes);
    for (int c0 = 0; c0 < d; c0 += 8, p += b) {
      std::uint64_t v = 0;
      for (int i = 0; i < 8; ++i) v |= std::uint64_t(unsigned(codes_from[c0 + i]) >> (from - b)) << (8 * i);
      put_group(p, b, pack_bytes(v, b));
    }
    const int n = Q::outliers(d);
    auto* ov = reinterpret_cast<half_t*>(r + kMetaBytes + code_bytes(d, b));
    auto* oi = reinterpret_cast<std::uint8_t*>(r + kMetaBytes + code_bytes(d, b) + 2 * std::size_t(n));
    for (int j = 0; j < n; ++j) {
      ov[j] = out_val[j];
      oi[j] = out_idx[j];
    }
    std::byte* t = r + bytes(d, b, id_bytes) - id_bytes;
    for (int i = 0; i < id_bytes; ++i) t[i] = std::byte((token_id >> (8 * i)) & 0xffu);
  }
  /// Quantizes the fp16 row x[0, d) (a mirror row) with Q and writes its record at width b: what appending it
  /// at B_max and lowering to b gives (Q's codes nest), and what a raise from the mirror writes.
  KVC_HOST_DEVICE static void write_row(std::byte* r, int d, int b, int id_bytes, const half_t* row,
                                        std::uint32_t token_id) noexcept {
    float x[Q::kMaxHeadDim] = {};  // zeroed: GCC cannot see that quantize reads only x[0, d)
    std::uint8_t codes8[Q::kMaxHeadDim], idx[Q::kMaxHeadDim];
    half_t val[Q::kMaxHeadDim];
    for (int c = 0; c < d; ++c) x[c] = row[c].to_float();
    const QuantMeta m = Q::quantize(x, d, codes8, idx, val);
    write(r, d, b, id_bytes, m, codes8, Q::kMaxBits, val, idx, token_id);
  }
  /// Re-writes record `src` (width b) as `dst` at width nb < b: a shift of every code (exactly what quantizing
  /// the original at nb gives); metadata, outliers and token unchanged.
  KVC_HOST_DEVICE static void lower(const std::byte* src, int b, std::byte* dst, int nb, int d, int id_bytes) noexcept {
    for (std::size_t i = 0; i < kMetaBytes; ++i) dst[i] = src[i];  // lo, step
    // per group of 8 codes: each code's top nb bits, repacked at width nb in a register
    const std::uint8_t* s = codes(src);
    auto* o = reinterpret_cast<std::uint8_t*>(dst + kMetaBytes);
    for (int c0 = 0; c0 < d; c0 += 8, s += b, o += nb) put_group(o, nb, narrow_group(group_word(s, b), b, nb));
    copy_tail(src, b, dst, nb, d, id_bytes);
  }
  /// Copies what follows the codes (outlier values, channels, token id) from a width-b record to a width-nb one.
  KVC_HOST_DEVICE static void copy_tail(const std::byte* src, int b, std::byte* dst, int nb, int d, int id_bytes) noexcept {
    const std::size_t tail = 3 * std::size_t(Q::outliers(d)) + std::size_t(id_bytes);
    const std::byte* ts = src + kMetaBytes + code_bytes(d, b);
    std::byte* td = dst + kMetaBytes + code_bytes(d, nb);
    for (std::size_t i = 0; i < tail; ++i) td[i] = ts[i];
  }
  /// Re-writes record `src` (width b) as `dst` at width nb > b from the token's mirror row (the fp16 values
  /// it was quantized from): every channel re-encoded at B_max with the record's own (lo, step_max) and the
  /// reciprocal quantize used (inverse_step), then narrowed to nb; metadata, outliers and token copied. The outlier scan
  /// and the range are not redone, as neither depends on the width: the result equals write_row(dst, d, nb,
  /// id_bytes, row, token) byte for byte (tested).
  KVC_HOST_DEVICE static void raise(const std::byte* src, int b, std::byte* dst, int nb, int d, int id_bytes,
                                    const half_t* row) noexcept {
    for (std::size_t i = 0; i < kMetaBytes; ++i) dst[i] = src[i];  // lo, step
    const QuantMeta m = meta(src);
    const float inv = inverse_step(m);
    auto* o = reinterpret_cast<std::uint8_t*>(dst + kMetaBytes);
    for (int c0 = 0; c0 < d; c0 += 8, o += nb) put_group(o, nb, pack_bytes(encode_group(row + c0, m, inv, nb), nb));
    copy_tail(src, b, dst, nb, d, id_bytes);
  }
  /// The B_max codes of the 8 fp16 values row[0, 8) under (m, inv = inverse_step(m)), narrowed to nb, one per
  /// byte (code i in byte i): Q::codec::encode per value. With AVX2 + F16C all 8 at once, by the same IEEE sub,
  /// mul, floor and clamp, so the same codes.
  KVC_HOST_DEVICE static std::uint64_t encode_group(const half_t* row, QuantMeta m, float inv, int nb) noexcept {
    static_assert(std::is_base_of_v<MidpointCodec, typename Q::codec>, "RecordFormat::encode_group is MidpointCodec::encode");
#if KVC_QAQ_AVX2_
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    const __m256 q = _mm256_min_ps(
        _mm256_max_ps(_mm256_floor_ps(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_set1_ps(m.lo.to_float())), _mm256_set1_ps(inv))),
                      _mm256_setzero_ps()),
        _mm256_set1_ps(float((1 << Q::kMaxBits) - 1)));
    const __m256i c = _mm256_srl_epi32(_mm256_cvttps_epi32(q), _mm_cvtsi32_si128(Q::kMaxBits - nb));
    const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return static_cast<std::uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(c16, c16)));
#else
    float x[8];
#  if defined(__CUDA_ARCH__)
    for (int i = 0; i < 8; ++i) x[i] = row[i].to_float();
#  else
    convert(row, x, 8);
#  endif
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t(Q::narrow(Q::codec::encode(x[i], m, inv, Q::kMaxBits), nb)) << (8 * i);
    return v;
#endif
  }
  /// The token's reconstruction x[0, d) (Q::decode per channel, then the exact outliers). AddOutliers: the
  /// codes' part only, in the rotated basis (un-rotate it, then add_outliers).
  KVC_HOST_DEVICE static void decode(const std::byte* r, int d, int b, float* x) noexcept {
    const QuantMeta m = meta(r);
    for (int c = 0; c < d; ++c) x[c] = Q::decode(m, b, static_cast<std::uint8_t>(code_at(r, c, b)));
    if constexpr (!AddOutliers) {
      const half_t* ov = outlier_values(r, d, b);
      const std::uint8_t* oi = outlier_channels(r, d, b);
      for (int j = 0; j < Q::outliers(d); ++j) x[oi[j]] = ov[j].to_float();
    }
  }
  /// AddOutliers: x[c] += x_c for every outlier of the record (x: the un-rotated codes' part).
  KVC_HOST_DEVICE static void add_outliers(const std::byte* r, int d, int b, float* x) noexcept {
    const half_t* ov = outlier_values(r, d, b);
    const std::uint8_t* oi = outlier_channels(r, d, b);
    for (int j = 0; j < Q::outliers(d); ++j) x[oi[j]] += ov[j].to_float();
  }
  /// AddOutliers: writes a record at width b from the fp16 rotated residual `row` (a mirror row: codes over all
  /// d channels) and the outliers taken before the rotation; a raise re-encodes the same row (raise()).
  KVC_HOST_DEVICE static void write_residual(std::byte* r, int d, int b, int id_bytes, const half_t* row,
                                             const half_t* out_val, const std::uint8_t* out_idx,
                                             std::uint32_t token_id) noexcept {
    float x[Q::kMaxHeadDim] = {};
    std::uint8_t codes8[Q::kMaxHeadDim];
    for (int c = 0; c < d; ++c) x[c] = row[c].to_float();
    const QuantMeta m = Q::quantize_all(x, d, codes8);
    write(r, d, b, id_bytes, m, codes8, Q::kMaxBits, out_val, out_idx, token_id);
  }
};
}  // namespace kvc::qaq
