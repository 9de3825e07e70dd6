/// \file attention_kernel.hpp (aligned, private)
/// The fused two-pass CPU attention over AlignedKV's fp16 bit planes for one SIMD path. Included once per
/// path by aligned/decode_attention.hpp inside that path's target region, after attention/decode_attention.hpp
/// has defined the path's simd:: layer in the same namespace; no include guard by design.
///
/// One (sequence, KV head) stream:
///  1. keys, block by block, up to 4 query heads at a time: per channel (in address order; its tier, Rule 1, holds
///     for the whole stream, so the tier switch predicts well) 2N tokens' leading bits (hi8, plus mid4 / lo4 as the
///     tier asks) are put together as fp16 words in registers, converted (F16C) and multiplied into the heads'
///     scores, 2 x 2N tokens at a time on AVX-512; the staged tokens' fp16 rows whole;
///  2. softmax per query head (base 2), the probabilities normalised;
///  3. values: per query head the Rule 2 reference from the TopK candidates' hi8 rows (candidates and estimate
///     vectorised), every row's tier from the probabilities (vectorised: AlignedLoader::value_scale), then per tile
///     of rows the rows grouped by tier (branch-free loops: value tiers follow no pattern), each row's leading bits
///     put together 2N channels at a time into the heads' outputs, which stay in registers over the tile; the
///     staged rows whole.
/// Nothing is expanded into a K/V copy: 2N elements at a time live in registers. fp32 accumulation (A4).
/// Element order: one assembly yields the even elements and the odd ones of its 2N (the nibble planes hold
/// elements 2j and 2j + 1 in one byte); scores are interleaved back before they are stored, the outputs once
/// at the end.
/// No software prefetch: measured on Zen 4, prefetching the planes a few blocks or tiles ahead made both passes
/// slower (the hardware prefetchers already stream the planes; the extra instructions stall on full fill buffers).
#if !defined(KVC_ATTENTION_INTERNAL) || !defined(KVC_ISA_LEVEL_) || !defined(KVC_ISA_NS)
#  error "kvc/aligned/detail/attention_kernel.hpp is private: include <kvc/aligned/decode_attention.hpp>"
#endif

namespace kvc::detail::KVC_ISA_NS::aligned_kernel {

using F = simd::VecF;
inline constexpr int kN = F::N;
inline constexpr int kPair = 2 * kN;  ///< consecutive elements one assembly puts together
/// Assemblies per channel (keys) or per row (values) in one register tile: 2 on AVX-512 (4 heads x 2 x 2
/// accumulators of 32), 1 elsewhere (AVX2 has 16 registers).
inline constexpr int kChunks = KVC_ISA_LEVEL_ == 2 ? 2 : 1;

#if KVC_ISA_LEVEL_ == 2
/// 16-bit words of the assembly: 2N hi8 bytes as N words, and their operations (lambdas would not inherit the
/// path's target attributes).
using W = __m256i;
template <bool Half>
inline W load_hi(const std::uint8_t* p) noexcept {
  if constexpr (Half) return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
template <bool Half>
inline __m128i load_nibbles(const std::uint8_t* p) noexcept {
  if constexpr (Half) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  else return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline W slli8(W x) noexcept { return _mm256_slli_epi16(x, 8); }
inline W and_(W a, W b) noexcept { return _mm256_and_si256(a, b); }
inline W or_(W a, W b) noexcept { return _mm256_or_si256(a, b); }
inline W words(short x) noexcept { return _mm256_set1_epi16(x); }
inline W widen(__m128i x) noexcept { return _mm256_cvtepu8_epi16(x); }
inline F convert(W x) noexcept { return F{_mm512_cvtph_ps(x)}; }
#elif KVC_ISA_LEVEL_ == 1
using W = __m128i;
template <bool Half>
inline W load_hi(const std::uint8_t* p) noexcept {
  static_assert(!Half);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
template <bool Half>
inline __m128i load_nibbles(const std::uint8_t* p) noexcept {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline W slli8(W x) noexcept { return _mm_slli_epi16(x, 8); }
inline W and_(W a, W b) noexcept { return _mm_and_si128(a, b); }
inline W or_(W a, W b) noexcept { return _mm_or_si128(a, b); }
inline W words(short x) noexcept { return _mm_set1_epi16(x); }
inline W widen(__m128i x) noexcept { return _mm_cvtepu8_epi16(x); }
inline F convert(W x) noexcept { return F{_mm256_cvtph_ps(x)}; }
#endif

/// Elements 0..2N-1 (hi: their 2N hi8 bytes; mid, lo: the N nibble bytes holding them, element 2j in the low
/// nibble of byte j) read at Tier (8, 12 or 16) leading bits, as floats: e = elements 0, 2, .., o = 1, 3, ...
/// The nibble planes a tier does not need are not touched. Half (AVX-512 only): elements 0..N-1 alone (N hi8
/// bytes, N / 2 nibble bytes read); lanes N / 2.. of e and o are then meaningless.
template <int Tier, bool Half = false>
inline void assemble(const std::uint8_t* hi, const std::uint8_t* mid, const std::uint8_t* lo, F& e, F& o) noexcept {
  static_assert(Tier == 8 || Tier == 12 || Tier == 16);
#if KVC_ISA_LEVEL_ == 0
  static_assert(!Half);
  if constexpr (Tier == 8) {
    e = F{half_bits_to_float(::kvc::aligned::assemble(hi[0], 0, 0, 8))};
    o = F{half_bits_to_float(::kvc::aligned::assemble(hi[1], 0, 0, 8))};
  } else {
    const std::uint8_t l = Tier == 16 ? lo[0] : 0;
    e = F{half_bits_to_float(::kvc::aligned::assemble(hi[0], std::uint8_t(mid[0] & 0xF), std::uint8_t(l & 0xF), Tier))};
    o = F{half_bits_to_float(::kvc::aligned::assemble(hi[1], std::uint8_t(mid[0] >> 4), std::uint8_t(l >> 4), Tier))};
  }
#else
  // as 16-bit words hi[2j] | hi[2j + 1] << 8: element 2j's fp16 is (word << 8) | low_2j, element 2j + 1's
  // (word & 0xFF00) | low_2j+1, the low bytes from the nibbles (mid << 4 | lo) or the tier's fill
  const W h = load_hi<Half>(hi);
  W we = slli8(h), wo = and_(h, words(short(0xFF00)));
  if constexpr (Tier == 8) {
    we = or_(we, words(0x80));
    wo = or_(wo, words(0x80));
  } else {
    const __m128i m = load_nibbles<Half>(mid), f0 = _mm_set1_epi8(char(0xF0));
    __m128i even = _mm_and_si128(_mm_slli_epi16(m, 4), f0), odd = _mm_and_si128(m, f0);
    if constexpr (Tier == 16) {
      const __m128i l = load_nibbles<Half>(lo), x0f = _mm_set1_epi8(0x0F);
      even = _mm_or_si128(even, _mm_and_si128(l, x0f));
      odd = _mm_or_si128(odd, _mm_and_si128(_mm_srli_epi16(l, 4), x0f));
    }
    we = or_(we, widen(even));
    wo = or_(wo, widen(odd));
    if constexpr (Tier == 12) {
      we = or_(we, words(0x08));
      wo = or_(wo, words(0x08));
    }
  }
  e = convert(we);
  o = convert(wo);
#endif
}

/// The 2N elements of an assembly back in order: a = elements 0..N-1, b = N..2N-1.
inline void interleave(F e, F o, F& a, F& b) noexcept {
#if KVC_ISA_LEVEL_ == 0
  a = e, b = o;
#elif KVC_ISA_LEVEL_ == 1
  const __m256i lo = _mm256_castps_si256(_mm256_unpacklo_ps(e.v, o.v)), hi = _mm256_castps_si256(_mm256_unpackhi_ps(e.v, o.v));
  a = F{_mm256_castsi256_ps(_mm256_permute2x128_si256(lo, hi, 0x20))};
  b = F{_mm256_castsi256_ps(_mm256_permute2x128_si256(lo, hi, 0x31))};
#else
  const __m512i ia = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i ib = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  a = F{_mm512_permutex2var_ps(e.v, ia, o.v)};
  b = F{_mm512_permutex2var_ps(e.v, ib, o.v)};
#endif
}


using StreamView = ::kvc::detail::AlignedStream;

/// Indices (channels or rows) grouped by tier: idx[i][0, n[i]) at tier 8, 12, 16 for i = 0, 1, 2.
struct TierLists {
  int* idx[3];
  int n[3];
};

/// acc[h][k] += q_h[c] x the 2N tokens of assembly k (even, odd) of channel c at Tier; hi, mid, lo: the planes at
/// the block's channel 0 and first token.
template <int Tier, int NH, int NC, bool Half>
KVC_ALWAYS_INLINE void key_channel(int ci, const std::uint8_t* hi, const std::uint8_t* mid, const std::uint8_t* lo, int B,
                                   int d, const float* q, F (&acc)[NH][NC][2]) noexcept {
  const std::size_t c = std::size_t(ci), cn = c * std::size_t(B / 2);
  F qh[NH];
  for (int h = 0; h < NH; ++h) qh[h] = F::set1(q[std::size_t(h) * d + c]);
  for (int k = 0; k < NC; ++k) {
    F e, o;
    assemble<Tier, Half>(hi + c * B + k * kPair, mid + cn + k * kN, lo + cn + k * kN, e, o);
    for (int h = 0; h < NH; ++h) {
      acc[h][k][0] = simd::fma(qh[h], e, acc[h][k][0]);
      acc[h][k][1] = simd::fma(qh[h], o, acc[h][k][1]);
    }
  }
}

/// s_h[b B + j0, + NC 2N) (s_h = s + h stride) for NH heads of q (q_h = q + h d, scaled), channel c at ktier[c];
/// Half: the N tokens j0..j0 + N - 1 alone (NC 1).
template <int NH, int NC, bool Half>
inline void key_scores(const StreamView& v, int b, int j0, const float* q, const std::uint8_t* ktier, float* s,
                       std::size_t stride) noexcept {
  const int d = v.d, B = v.block;
  const std::size_t b0 = std::size_t(b) * std::size_t(d);
  const std::uint8_t* hi = v.khi + b0 * B + j0;
  const std::uint8_t* mid = v.kmid + b0 * (B / 2) + j0 / 2;
  const std::uint8_t* lo = v.klo + b0 * (B / 2) + j0 / 2;
  F acc[NH][NC][2];
  for (auto& a : acc)
    for (auto& x : a) x[0] = x[1] = F::zero();
  for (int c = 0; c < d; ++c) {  // address order (the hardware prefetchers follow it); the tier pattern repeats
    switch (ktier[c]) {           // every block, so the branch predicts well
      case 8: key_channel<8, NH, NC, Half>(c, hi, mid, lo, B, d, q, acc); break;
      case 12: key_channel<12, NH, NC, Half>(c, hi, mid, lo, B, d, q, acc); break;
      default: key_channel<16, NH, NC, Half>(c, hi, mid, lo, B, d, q, acc); break;
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int k = 0; k < NC; ++k) {
      F a, c;
      interleave(acc[h][k][0], acc[h][k][1], a, c);
      float* dst = s + std::size_t(h) * stride + std::size_t(b) * B + j0 + k * kPair;
      a.store(dst);
      if constexpr (!Half) c.store(dst + kN);
    }
}

/// The scores of key block b for NH heads: the block's tokens in register tiles of kChunks x 2N (then 2N, then
/// N on AVX-512 when Block % 2N != 0).
template <int NH>
inline void block_scores(const StreamView& v, int b, const float* q, const std::uint8_t* ktier, float* s, std::size_t stride) noexcept {
  int j0 = 0;
  for (; j0 + kChunks * kPair <= v.block; j0 += kChunks * kPair) key_scores<NH, kChunks, false>(v, b, j0, q, ktier, s, stride);
  for (; j0 + kPair <= v.block; j0 += kPair) key_scores<NH, 1, false>(v, b, j0, q, ktier, s, stride);
  if constexpr (KVC_ISA_LEVEL_ == 2)
    if (j0 < v.block) key_scores<NH, 1, true>(v, b, j0, q, ktier, s, stride);
}

inline constexpr int kTile = ::kvc::detail::kAlignedTileRows;

/// acc[h][k] += p_h[t] x channels c0 + assembly k of row t (even, odd) for the rows t of `list`, all at Tier.
template <int Tier, int NH, int NC, bool Half>
KVC_ALWAYS_INLINE void value_rows(const int* list, int n, const StreamView& v, int c0, const float* p, std::size_t stride,
                                  F (&acc)[NH][NC][2]) noexcept {
  const int d = v.d;
  for (int i = 0; i < n; ++i) {
    const std::size_t t = std::size_t(list[i]), tn = t * std::size_t(d / 2) + std::size_t(c0 / 2);
    F w[NH];
    for (int h = 0; h < NH; ++h) w[h] = F::set1(p[std::size_t(h) * stride + t]);
    for (int k = 0; k < NC; ++k) {
      F e, o;
      assemble<Tier, Half>(v.vhi + t * d + c0 + k * kPair, v.vmid + tn + k * kN, v.vlo + tn + k * kN, e, o);
      for (int h = 0; h < NH; ++h) {
        acc[h][k][0] = simd::fma(w[h], e, acc[h][k][0]);
        acc[h][k][1] = simd::fma(w[h], o, acc[h][k][1]);
      }
    }
  }
}

/// The outputs of NH heads for channels [c0, c0 + NC 2N) (N on AVX-512 with Half), accumulated over the tile's
/// rows `rows` (p_h = p + h stride) in assembly order (o_h = o + h dp: each assembly's even elements, then its odd
/// ones).
template <int NH, int NC, bool Half>
inline void value_chunk(const StreamView& v, int c0, const TierLists& rows, const float* p, std::size_t stride, float* o,
                        int dp) noexcept {
  F acc[NH][NC][2];
  for (int h = 0; h < NH; ++h)
    for (int k = 0; k < NC; ++k)
      for (int x = 0; x < 2; ++x) acc[h][k][x] = F::load(o + std::size_t(h) * dp + c0 + k * kPair + x * kN);
  value_rows<8, NH, NC, Half>(rows.idx[0], rows.n[0], v, c0, p, stride, acc);
  value_rows<12, NH, NC, Half>(rows.idx[1], rows.n[1], v, c0, p, stride, acc);
  value_rows<16, NH, NC, Half>(rows.idx[2], rows.n[2], v, c0, p, stride, acc);
  for (int h = 0; h < NH; ++h)
    for (int k = 0; k < NC; ++k)
      for (int x = 0; x < 2; ++x) acc[h][k][x].store(o + std::size_t(h) * dp + c0 + k * kPair + x * kN);
}

/// One tile's rows into NH heads' outputs, channel chunk by channel chunk.
template <int NH>
inline void tile_values(const StreamView& v, const TierLists& rows, const float* p, std::size_t stride, float* o, int dp) noexcept {
  int c0 = 0;
  for (; c0 + kChunks * kPair <= v.d; c0 += kChunks * kPair) value_chunk<NH, kChunks, false>(v, c0, rows, p, stride, o, dp);
  for (; c0 + kPair <= v.d; c0 += kPair) value_chunk<NH, 1, false>(v, c0, rows, p, stride, o, dp);
  if constexpr (KVC_ISA_LEVEL_ == 2)
    if (c0 < v.d) value_chunk<NH, 1, true>(v, c0, rows, p, stride, o, dp);
}

/// The tiers of rows [0, n) as bytes (8, 12, 16): AlignedLoader::value_tier, vectorised through value_scale
/// (scale_lo / scale_hi [g]: each head's value_scale at the low / high threshold).
template <class Loader>
inline void value_tiers(const float* p, std::size_t T, int g, int n, const float* scale_lo, const float* scale_hi,
                        std::uint8_t* tiers) noexcept {
  alignas(64) float mlo[kN], mhi[kN];
  for (int t = 0; t < n; t += kN) {
    F a = F::zero(), b = F::zero();
    for (int h = 0; h < g; ++h) {
      const F x = F::load(p + std::size_t(h) * T + std::size_t(t));  // rows past n: the scratch's own floats
      a = simd::max(a, x * F::set1(scale_lo[h]));
      b = simd::max(b, x * F::set1(scale_hi[h]));
    }
    a.store(mlo);
    b.store(mhi);
    for (int i = 0; i < kN && t + i < n; ++i) tiers[t + i] = std::uint8_t(Loader::scaled_value_tier(mlo[i], mhi[i]));
  }
}

#if KVC_ISA_LEVEL_ == 2
/// The lane indices t0, t0 + 1, .., t0 + N - 1.
inline __m512i indices_from(int t0) noexcept {
  return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(t0));
}
#elif KVC_ISA_LEVEL_ == 1
inline __m256i indices_from(int t0) noexcept { return _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(t0)); }
#endif

/// AlignedLoader::top_candidates (the argmax of every strided bucket {t : t mod TopK = j}, the first on ties),
/// vectorised over the buckets when TopK % N == 0. cand: [min(TopK, T)]; returns their count.
template <class Loader>
inline int top_candidates(const float* p, int T, int* cand) noexcept {
#if KVC_ISA_LEVEL_ == 0
  return Loader::top_candidates(p, T, cand);
#else
  constexpr int K = Loader::kTopK;
  if constexpr (K % kN != 0) {
    return Loader::top_candidates(p, T, cand);
  } else {
    if (T < 2 * K) return Loader::top_candidates(p, T, cand);
    constexpr int V = K / kN;
#  if KVC_ISA_LEVEL_ == 2
    using I = __m512i;
#  else
    using I = __m256i;
#  endif
    F best[V];
    I arg[V];
    for (int j = 0; j < V; ++j) best[j] = F::load(p + j * kN), arg[j] = indices_from(j * kN);
    const int full = T / K * K;
    for (int t0 = K; t0 < full; t0 += K)
      for (int j = 0; j < V; ++j) {
        const F x = F::load(p + t0 + j * kN);
        const auto idx = indices_from(t0 + j * kN);
#  if KVC_ISA_LEVEL_ == 2
        const __mmask16 m = _mm512_cmp_ps_mask(x.v, best[j].v, _CMP_GT_OQ);
        best[j] = F{_mm512_mask_mov_ps(best[j].v, m, x.v)};
        arg[j] = _mm512_mask_mov_epi32(arg[j], m, idx);
#  else
        const __m256 m = _mm256_cmp_ps(x.v, best[j].v, _CMP_GT_OQ);
        best[j] = F{_mm256_blendv_ps(best[j].v, x.v, m)};
        arg[j] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(arg[j]), _mm256_castsi256_ps(idx), m));
#  endif
      }
    for (int j = 0; j < V; ++j) std::memcpy(cand + j * kN, &arg[j], sizeof(I));
    for (int t = full; t < T; ++t) cand[t - full] = p[t] > p[cand[t - full]] ? t : cand[t - full];
    return K;
  }
#endif
}

/// Rule 2's reference of one query head from its probabilities p [T]: AlignedLoader::estimate_reference, the
/// candidates' tier-8 rows (hi8; staged rows truncated) summed in the same order, vectorised over the channels.
template <class Loader>
inline int estimate_reference(const StreamView& v, const float* p, int full, float* est) noexcept {
  const int d = v.d;
  int cand[Loader::kTopK];
  const int k = top_candidates<Loader>(p, v.T, cand);
  std::fill_n(est, d, 0.0f);
  for (int i = 0; i < k; ++i) {
    const int t = cand[i];
    if (t < full) {
      const F w = F::set1(p[t]);
      const std::uint8_t* row = v.vhi + std::size_t(t) * d;
      int c = 0;
      for (; c + kPair <= d; c += kPair) {
        F e, o, a, b;
        assemble<8>(row + c, nullptr, nullptr, e, o);
        interleave(e, o, a, b);
        (F::load(est + c) + w * simd::abs(a)).store(est + c);
        (F::load(est + c + kN) + w * simd::abs(b)).store(est + c + kN);
      }
      if constexpr (KVC_ISA_LEVEL_ == 2)
        if (c < d) {
          F e, o, a, b;
          assemble<8, true>(row + c, nullptr, nullptr, e, o);
          interleave(e, o, a, b);
          (F::load(est + c) + w * simd::abs(a)).store(est + c);
        }
    } else {
      for (int c = 0; c < d; ++c)
        est[c] += p[t] * std::fabs(half_bits_to_float(::kvc::aligned::truncate(v.vst[std::size_t(t - full) * d + c].bits, 8)));
    }
  }
  return Loader::value_reference(est, d, v.vmax);
}

/// f.template operator()<K>() for K = min(4, k).
template <class Fn>
inline void with_heads(int k, Fn&& f) {
  switch (k) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    default: f.template operator()<4>(); break;
  }
}

/// Attention of one stream: q [g][d] scaled by scale * log2(e), ktier [d] the key tiers (Rule 1), out [g][d].
/// scratch: aligned_scratch_floats(g, T, d) floats; ints: aligned_scratch_ints(g). Returns false when a
/// score or the softmax sum is not finite. Adds what it read to `stats`.
template <class Loader>
bool run_stream(const StreamView& v, const float* q, const std::uint8_t* ktier, float* scratch, int* ints, float* out,
                ::kvc::aligned::ReadStats& stats) noexcept {
  const int d = v.d, g = v.g, T = v.T, B = v.block, full = v.blocks * B, staged = T - full;
  const int dp = ::kvc::detail::aligned_padded_dim(d);
  const std::size_t tp = ::kvc::detail::aligned_padded_tokens(T);
  float* s = scratch;                                                 // [g][tp]: scores, then probabilities
  float* o = s + std::size_t(g) * tp;                                 // [g][dp]: outputs in assembly order
  float* est = o + std::size_t(g) * dp;                               // [d]
  float* scale = est + d;                                             // [2][g]
  auto* vtier = reinterpret_cast<std::uint8_t*>(scale + 2 * g);       // [T]
  int* ref = ints;                                                    // [g], then a tile's rows [3][kTile]
  // 1. scores
  std::size_t kt[3] = {0, 0, 0};
  for (int c = 0; c < d; ++c) ++kt[(ktier[c] - 8) / 4];
  for (int b = 0; b < v.blocks; ++b)
    for (int h0 = 0; h0 < g; h0 += 4)
      with_heads(g - h0, [&]<int NH>() { block_scores<NH>(v, b, q + std::size_t(h0) * d, ktier, s + std::size_t(h0) * tp, tp); });
  for (int t = 0; t < staged; ++t)
    for (int h = 0; h < g; ++h) {
      F acc = F::zero();
      for (int c = 0; c < d; c += F::N)
        acc = simd::fma(F::load(q + std::size_t(h) * d + c), F::load(v.kst + std::size_t(t) * d + c), acc);
      s[std::size_t(h) * tp + full + t] = simd::reduce_add(acc);
    }
  // 2. softmax per head, normalised (Rule 2 compares probabilities with the output estimate)
  bool ok = true;
  for (int h = 0; h < g; ++h) {
    float* sh = s + std::size_t(h) * tp;
    const int tv = T / F::N * F::N;
    F mv = F::set1(-std::numeric_limits<float>::infinity());
    for (int t = 0; t < tv; t += F::N) mv = simd::max(mv, F::load(sh + t));
    float m = simd::reduce_max(mv);
    for (int t = tv; t < T; ++t) m = std::max(m, sh[t]);
    const F mb = F::set1(m);
    F sv = F::zero();
    for (int t = 0; t < tv; t += F::N) {
      const F e = simd::exp2(F::load(sh + t) - mb);
      e.store(sh + t);
      sv = sv + e;
    }
    float sum = simd::reduce_add(sv);
    for (int t = tv; t < T; ++t) sum += (sh[t] = simd::exp2_scalar(sh[t] - m));
    if (!std::isfinite(m) || !std::isfinite(sum)) ok = false;
    const F inv = F::set1(1.0f / sum);
    for (int t = 0; t < tv; t += F::N) (F::load(sh + t) * inv).store(sh + t);
    for (int t = tv; t < T; ++t) sh[t] *= 1.0f / sum;
    std::fill(sh + T, sh + tp, 0.0f);  // the padding value_tiers reads
  }
  // 3. values: Rule 2's reference per head from its candidates' hi8 rows, every row's tier, then the rows
  for (int h = 0; h < g; ++h) {
    ref[h] = estimate_reference<Loader>(v, s + std::size_t(h) * tp, full, est);
    stats.estimate_bytes += std::size_t(std::min(Loader::kTopK, T)) * d;
    scale[h] = Loader::value_scale(ref[h], Loader::kValueLo);
    scale[g + h] = Loader::value_scale(ref[h], Loader::kValueHi);
  }
  value_tiers<Loader>(s, tp, g, full, scale, scale + g, vtier);
  std::fill_n(o, std::size_t(g) * dp, 0.0f);
  std::size_t vt[3] = {0, 0, 0};
  int* rl = ints + g;
  for (int t0 = 0; t0 < full; t0 += kTile) {
    TierLists rows{{rl, rl + kTile, rl + 2 * kTile}, {0, 0, 0}};  // the tile's rows grouped by tier
    for (int t = t0, end = std::min(full, t0 + kTile); t < end; ++t) {
      const int i = (vtier[t] - 8) / 4;
      rows.idx[i][rows.n[i]++] = t;
    }
    for (int i = 0; i < 3; ++i) vt[i] += std::size_t(rows.n[i]);
    for (int h0 = 0; h0 < g; h0 += 4)
      with_heads(g - h0, [&]<int NH>() {
        tile_values<NH>(v, rows, s + std::size_t(h0) * tp, tp, o + std::size_t(h0) * dp, dp);
      });
  }
  // the outputs back in channel order, then the staged rows whole
  for (int h = 0; h < g; ++h) {
    const float* oh = o + std::size_t(h) * dp;
    float* dst = out + std::size_t(h) * d;
    int c = 0;
    for (; c + kPair <= d; c += kPair) {
      F a, b;
      interleave(F::load(oh + c), F::load(oh + c + kN), a, b);
      a.store(dst + c);
      b.store(dst + c + kN);
    }
    if (c < d) {  // AVX-512, d % 32 == 16: the half assembly's elements
      alignas(64) float tmp[2 * kN];
      F a, b;
      interleave(F::load(oh + c), F::load(oh + c + kN), a, b);
      a.store(tmp);
      std::copy_n(tmp, d - c, dst + c);
    }
  }
  for (int t = 0; t < staged; ++t)
    for (int h = 0; h < g; ++h) {
      const F w = F::set1(s[std::size_t(h) * tp + full + t]);
      float* oh = out + std::size_t(h) * d;
      for (int c = 0; c < d; c += F::N)
        simd::fma(w, F::load(v.vst + std::size_t(t) * d + c), F::load(oh + c)).store(oh + c);
    }
  // what was read
  const std::size_t bt = std::size_t(v.blocks) * B;
  for (int i = 0; i < 3; ++i) stats.count_keys(8 + 4 * i, kt[i] * bt), stats.count_values(8 + 4 * i, vt[i] * std::size_t(d));
  stats.key_bytes += bt * d, stats.value_bytes += std::size_t(full) * d;  // hi8 of every block and every row
  stats.staged_bytes += std::size_t(staged) * d * 2 * sizeof(half_t);
  stats.meta_bytes += 2 * std::size_t(d);
  return ok;
}
}  // namespace kvc::detail::KVC_ISA_NS::aligned_kernel

namespace kvc::detail::KVC_ISA_NS {
/// This path's stream kernel, found through its IsaTag by kvc::decode_attention (select_isa.hpp).
template <class Loader>
constexpr auto aligned_stream_kernel(IsaTag) noexcept {
  return &aligned_kernel::run_stream<Loader>;
}
}  // namespace kvc::detail::KVC_ISA_NS
