/// \file attention_kernel.hpp (aligned, private)
/// The fused two-pass CPU attention over AlignedKV's fp16 bit planes for one SIMD path. Included once per
/// path by aligned/decode_attention.hpp inside that path's target region, after attention/decode_attention.hpp
/// has defined the path's simd:: layer in the same namespace; no include guard by design.
///
/// One (sequence, KV head) stream:
///  1. keys, block by block, 16 tokens and up to 4 query heads at a time: per channel c the 16 tokens' leading
///     bits (hi8, plus mid4 / lo4 as the channel's tier asks) are put together as fp16 in registers, converted
///     (F16C) and multiplied into the heads' 16 scores; the staged tokens' fp16 rows whole;
///  2. softmax per query head (base 2), the probabilities normalised;
///  3. values: per query head the Rule 2 reference from the TopK candidates' hi8 rows, then per token row its
///     tier and its leading bits, 16 channels at a time, into every head's output; the staged rows whole.
/// Nothing is expanded into a K/V copy: 16 elements at a time live in registers. fp32 accumulation (A4).
#if !defined(KVC_ATTENTION_INTERNAL) || !defined(KVC_ISA_LEVEL_) || !defined(KVC_ISA_NS)
#  error "kvc/aligned/detail/attention_kernel.hpp is private: include <kvc/aligned/decode_attention.hpp>"
#endif

namespace kvc::detail::KVC_ISA_NS::aligned_kernel {

using F = simd::VecF;
inline constexpr int kLanes = 16;           ///< elements put together at a time
inline constexpr int kVecs = kLanes / F::N;  ///< float vectors they fill

/// 16 elements as floats, from 16 hi8 bytes and the 8 bytes of each nibble plane that hold their mid4 / lo4
/// (element 2j in the low nibble of byte j), read at `tier` (8, 12 or 16) leading bits: the nibble planes a
/// tier does not need are not touched.
inline void assemble16(const std::uint8_t* hi, const std::uint8_t* mid, const std::uint8_t* lo, int tier,
                       F (&out)[kVecs]) noexcept {
#if KVC_ISA_LEVEL_ == 0
  for (int i = 0; i < kLanes; ++i) {
    const int sh = (i % 2) * 4;
    const std::uint16_t b = tier == 8 ? ::kvc::aligned::assemble(hi[i], 0, 0, 8)
                                      : ::kvc::aligned::assemble(hi[i], std::uint8_t((mid[i / 2] >> sh) & 0xF),
                                                                 tier == 16 ? std::uint8_t((lo[i / 2] >> sh) & 0xF) : 0, tier);
    out[i] = F{half_bits_to_float(b)};
  }
#else
  // the fp16 words' low bytes (mid4 << 4 | lo4, or the fill) put together 16 at a time in bytes: elements 2j and
  // 2j + 1 from nibble byte j, then interleaved with the hi8 bytes into 16 fp16 words
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
  __m128i low;
  if (tier == 8) {
    low = _mm_set1_epi8(char(0x80));
  } else {
    const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mid));
    const __m128i f0 = _mm_set1_epi8(char(0xF0)), x0f = _mm_set1_epi8(0x0F);
    __m128i even = _mm_and_si128(_mm_slli_epi16(m, 4), f0), odd = _mm_and_si128(m, f0);
    if (tier == 16) {
      const __m128i l = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo));
      even = _mm_or_si128(even, _mm_and_si128(l, x0f));
      odd = _mm_or_si128(odd, _mm_and_si128(_mm_srli_epi16(l, 4), x0f));
    } else {
      even = _mm_or_si128(even, _mm_set1_epi8(0x08));
      odd = _mm_or_si128(odd, _mm_set1_epi8(0x08));
    }
    low = _mm_unpacklo_epi8(even, odd);
  }
  const __m128i w0 = _mm_unpacklo_epi8(low, h), w1 = _mm_unpackhi_epi8(low, h);
#  if KVC_ISA_LEVEL_ == 2
  out[0] = F{_mm512_cvtph_ps(_mm256_set_m128i(w1, w0))};
#  else
  out[0] = F{_mm256_cvtph_ps(w0)};
  out[1] = F{_mm256_cvtph_ps(w1)};
#  endif
#endif
}

using StreamView = ::kvc::detail::AlignedStream;

/// s[h][b B + j] for NH heads of q (q_h = q + h d, scaled) over the 16 tokens j0..j0 + 15 of key block b.
template <int NH>
inline void block_scores16(const StreamView& v, int b, int j0, const float* q, const std::uint8_t* ktier, float* s) noexcept {
  const int d = v.d, B = v.block;
  F acc[NH][kVecs];
  for (auto& a : acc)
    for (auto& x : a) x = F::zero();
  const std::size_t col0 = std::size_t(b) * d;
  for (int c = 0; c < d; ++c) {
    const std::size_t col = col0 + std::size_t(c);
    F x[kVecs];
    assemble16(v.khi + col * B + j0, v.kmid + col * (B / 2) + j0 / 2, v.klo + col * (B / 2) + j0 / 2, ktier[c], x);
    for (int h = 0; h < NH; ++h) {
      const F qh = F::set1(q[std::size_t(h) * d + c]);
      for (int i = 0; i < kVecs; ++i) acc[h][i] = simd::fma(qh, x[i], acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < kVecs; ++i) acc[h][i].store(s + std::size_t(h) * v.T + std::size_t(b) * B + j0 + i * F::N);
}

inline constexpr int kTile = 8;  ///< value rows per tile

/// o_h[0, d) += sum over the nt <= kTile rows t0.. of p_h[t] row_t for NH heads (o_h = o + h d, p_h = p + h T), each
/// row read at its tier; per 16 channels the NH outputs are loaded and stored once per tile.
template <int NH>
inline void tile_values(const StreamView& v, int t0, int nt, const int* tier, const float* p, float* o) noexcept {
  const int d = v.d;
  for (int c0 = 0; c0 < d; c0 += kLanes) {
    F acc[NH][kVecs];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < kVecs; ++i) acc[h][i] = F::load(o + std::size_t(h) * d + c0 + i * F::N);
    for (int k = 0; k < nt; ++k) {
      const std::size_t t = std::size_t(t0 + k);
      F x[kVecs];
      assemble16(v.vhi + t * d + c0, v.vmid + t * (d / 2) + c0 / 2, v.vlo + t * (d / 2) + c0 / 2, tier[k], x);
      for (int h = 0; h < NH; ++h) {
        const F w = F::set1(p[std::size_t(h) * v.T + t]);
        for (int i = 0; i < kVecs; ++i) acc[h][i] = simd::fma(w, x[i], acc[h][i]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < kVecs; ++i) acc[h][i].store(o + std::size_t(h) * d + c0 + i * F::N);
  }
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
/// Returns false when a score or the softmax sum is not finite. Adds what it read to `stats`.
template <class Loader>
bool run_stream(const StreamView& v, const float* q, const std::uint8_t* ktier, float* scratch, int* ref, float* out,
                ::kvc::aligned::ReadStats& stats) noexcept {
  const int d = v.d, g = v.g, T = v.T, B = v.block, full = v.blocks * B, staged = T - full;
  float* s = scratch;                            // [g][T]
  float* o = s + std::size_t(g) * T;             // [g][d]
  float* est = o + std::size_t(g) * d;           // [d]
  // 1. scores
  for (int b = 0; b < v.blocks; ++b)
    for (int h0 = 0; h0 < g; h0 += 4)
      with_heads(g - h0, [&]<int NH>() {
        for (int j0 = 0; j0 < B; j0 += kLanes)
          block_scores16<NH>(v, b, j0, q + std::size_t(h0) * d, ktier, s + std::size_t(h0) * T);
      });
  for (int t = 0; t < staged; ++t)
    for (int h = 0; h < g; ++h) {
      F acc = F::zero();
      for (int c = 0; c < d; c += F::N)
        acc = simd::fma(F::load(q + std::size_t(h) * d + c), F::load(v.kst + std::size_t(t) * d + c), acc);
      s[std::size_t(h) * T + full + t] = simd::reduce_add(acc);
    }
  // 2. softmax per head, normalised (Rule 2 compares probabilities with the output estimate)
  bool ok = true;
  for (int h = 0; h < g; ++h) {
    float* sh = s + std::size_t(h) * T;
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
  }
  // 3. values: Rule 2's reference per head from its candidates' hi8 rows, then every row at its tier
  for (int h = 0; h < g; ++h) {
    ref[h] = Loader::estimate_reference(
        s + std::size_t(h) * T, T, d, v.vmax,
        [&](int t, int c) {
          return t < full ? ::kvc::aligned::assemble(v.vhi[std::size_t(t) * d + c], 0, 0, 8)
                          : ::kvc::aligned::truncate(v.vst[std::size_t(t - full) * d + c].bits, 8);
        },
        est);
    stats.estimate_bytes += std::size_t(std::min(Loader::kTopK, T)) * d;
  }
  std::fill_n(o, std::size_t(g) * d, 0.0f);
  // rows in tiles of kTile: per 16 channels the heads' outputs stay in registers over the tile's rows
  std::size_t vt[3] = {0, 0, 0};
  for (int t0 = 0; t0 < full; t0 += kTile) {
    const int nt = std::min(kTile, full - t0);
    int tier[kTile];
    for (int k = 0; k < nt; ++k) {
      tier[k] = Loader::value_tier(s + t0 + k, std::size_t(T), g, ref);
      ++vt[(tier[k] - 8) / 4];
    }
    for (int h0 = 0; h0 < g; h0 += 4)
      with_heads(g - h0, [&]<int NH>() { tile_values<NH>(v, t0, nt, tier, s + std::size_t(h0) * T, o + std::size_t(h0) * d); });
  }
  for (int t = 0; t < staged; ++t)
    for (int h = 0; h < g; ++h) {
      const F w = F::set1(s[std::size_t(h) * T + full + t]);
      float* oh = o + std::size_t(h) * d;
      for (int c = 0; c < d; c += F::N)
        simd::fma(w, F::load(v.vst + std::size_t(t) * d + c), F::load(oh + c)).store(oh + c);
    }
  std::copy_n(o, std::size_t(g) * d, out);
  // what was read
  std::size_t kt[3] = {0, 0, 0};
  for (int c = 0; c < d; ++c) ++kt[(ktier[c] - 8) / 4];
  const std::size_t bt = std::size_t(v.blocks) * B;
  for (int i = 0; i < 3; ++i) stats.key_tiers[i] += kt[i] * bt, stats.value_tiers[i] += vt[i] * std::size_t(d);
  stats.key_bytes += bt * d + (kt[1] + 2 * kt[2]) * bt / 2;
  stats.value_bytes += std::size_t(full) * d + (vt[1] + 2 * vt[2]) * std::size_t(d) / 2;
  stats.staged_bytes += std::size_t(staged) * d * 2 * sizeof(half_t);
  stats.meta_bytes += 2 * std::size_t(d);
  return ok;
}
}  // namespace kvc::detail::KVC_ISA_NS::aligned_kernel
