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

#if KVC_ISA_LEVEL_ >= 1
/// 8 bytes of a nibble plane as 16 16-bit lanes: lane 2j the low nibble of byte j, lane 2j + 1 its high nibble.
inline __m256i nibbles16(const std::uint8_t* p) noexcept {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i l = _mm_and_si128(x, _mm_set1_epi16(0xF)), h = _mm_srli_epi16(x, 4);
  return _mm256_set_m128i(_mm_unpackhi_epi16(l, h), _mm_unpacklo_epi16(l, h));
}
#endif

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
  __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))), 8);
  if (tier == 8) {
    b = _mm256_or_si256(b, _mm256_set1_epi16(0x80));
  } else {
    b = _mm256_or_si256(b, _mm256_slli_epi16(nibbles16(mid), 4));
    b = _mm256_or_si256(b, tier == 12 ? _mm256_set1_epi16(0x8) : nibbles16(lo));
  }
#  if KVC_ISA_LEVEL_ == 2
  out[0] = F{_mm512_cvtph_ps(b)};
#  else
  out[0] = F{_mm256_cvtph_ps(_mm256_castsi256_si128(b))};
  out[1] = F{_mm256_cvtph_ps(_mm256_extracti128_si256(b, 1))};
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

/// o_h[c0, c0 + 16) += p_h x for NH heads (o_h = o + h d, p_h = p[h T]).
template <int NH>
inline void add_row16(const F (&x)[kVecs], const float* p, std::size_t T, float* o, int d) noexcept {
  for (int h = 0; h < NH; ++h) {
    const F w = F::set1(p[std::size_t(h) * T]);
    float* oh = o + std::size_t(h) * d;
    for (int i = 0; i < kVecs; ++i) simd::fma(w, x[i], F::load(oh + i * F::N)).store(oh + i * F::N);
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
bool run_stream(const StreamView& v, const float* q, const std::uint8_t* ktier, float* scratch, float* out,
                ::kvc::aligned::ReadStats& stats) noexcept {
  const int d = v.d, g = v.g, T = v.T, B = v.block, full = v.blocks * B, staged = T - full;
  float* s = scratch;                            // [g][T]
  float* o = s + std::size_t(g) * T;             // [g][d]
  float* est = o + std::size_t(g) * d;           // [d]
  int* ref = reinterpret_cast<int*>(est + d);    // [g]
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
  int cand[Loader::kTopK];
  for (int h = 0; h < g; ++h) {
    const float* ph = s + std::size_t(h) * T;
    const int k = Loader::top_candidates(ph, T, cand);
    std::fill_n(est, d, 0.0f);
    for (int i = 0; i < k; ++i) {
      const int t = cand[i];
      for (int c = 0; c < d; ++c) {
        const std::uint16_t bits = t < full ? ::kvc::aligned::assemble(v.vhi[std::size_t(t) * d + c], 0, 0, 8)
                                            : ::kvc::aligned::truncate(v.vst[std::size_t(t - full) * d + c].bits, 8);
        est[c] += ph[t] * std::fabs(half_bits_to_float(bits));
      }
    }
    ref[h] = Loader::value_reference(est, d, v.vmax);
    stats.estimate_bytes += std::size_t(k) * d;
  }
  std::fill_n(o, std::size_t(g) * d, 0.0f);
  std::size_t vt[3] = {0, 0, 0};
  for (int t = 0; t < full; ++t) {
    const int tier = Loader::value_tier(s + t, std::size_t(T), g, ref);
    ++vt[(tier - 8) / 4];
    const std::uint8_t* hi = v.vhi + std::size_t(t) * d;
    const std::uint8_t* mid = v.vmid + std::size_t(t) * (d / 2);
    const std::uint8_t* lo = v.vlo + std::size_t(t) * (d / 2);
    for (int h0 = 0; h0 < g; h0 += 4)
      with_heads(g - h0, [&]<int NH>() {
        for (int c0 = 0; c0 < d; c0 += kLanes) {
          F x[kVecs];
          assemble16(hi + c0, mid + c0 / 2, lo + c0 / 2, tier, x);
          add_row16<NH>(x, s + std::size_t(h0) * T + t, std::size_t(T), o + std::size_t(h0) * d + c0, d);
        }
      });
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
