/// \file attention_kernel.hpp (qaq, private)
/// The fused CPU attention over QAQ's mixed-bit records for one SIMD path. Included once per path by
/// qaq/decode_attention.hpp inside that path's target region, after attention/decode_attention.hpp has
/// defined the path's simd:: layer in the same namespace; no include guard by design.
///
/// One (sequence, KV head) stream, width by width (the record layout is fixed per bucket, so the width is a
/// template parameter): each record's d codes are unpacked (AVX2: into floats by one pshufb + one variable
/// shift per 8 codes; for the int16 key products into 16-bit lanes by one pshufb + mulhi per 16) once per pass
/// of query heads: keys once for the whole GQA group, values once for all heads into a scratch, or, on AVX2
/// (g % 4 == 0), straight into the FMAs' registers once per 4 heads (bucket_values); with Precision::kFast and
/// g % 4 == 0 (AVX2, AVX-512) into 16-bit lanes once per 4 heads for int16 products (bucket_values16).
///   scores:  s_t = zero_t sum_c q_c + scale_t (q . code_t) + sum_outliers q_c (x_c - x^_c)   (log2 domain;
///            a split rotated side (RecordFormat AddOutliers): + q'_c x_c with q' the un-rotated query, st.qt;
///            Precision::kFast on AVX2/AVX-512: q . code_t = qscale (qi . code_t) in exact int32, qi the
///            query rounded to int16 per head)
///   softmax: per query head over the token-major [T][g] scores, vectorised exp2; after the value pass, the
///            group's largest probability per token (SPEC Q6) in one forward pass over them (token_max)
///   values:  o += (p_t scale_t) code_t, plus p_t zero_t summed apart and added to every channel at the end,
///            plus p_t (x_c - x^_c) per outlier (split: p_t x_c in st.ot, added after the un-rotation)
///            (kFast, g % 4 == 0: p_t scale_t rounded to int16 per block of 16 records, the products in exact
///            int32 sums)
/// Per-record epilogues on the SIMD paths, 4 query heads a vector (g % 4 == 0): the scores' affine and outlier
/// terms (the outlier channel's q for 4 heads is one load of the transposed query st.qt) and the values' outlier
/// terms (accumulated channel-major in st.ot, from the token's 4 probabilities: one load of its st.s line).
/// kExact: float arithmetic; results differ from the portable path only in summation order and exp2's < 2e-7
/// relative error. kFast adds the int16 rounding of the query and of the value weights (bounds in
/// qaq/decode_attention.hpp).
#if !defined(KVC_ATTENTION_INTERNAL) || !defined(KVC_ISA_LEVEL_) || !defined(KVC_ISA_NS)
#  error "kvc/qaq/detail/attention_kernel.hpp is private: include <kvc/qaq/decode_attention.hpp>"
#endif

namespace kvc::detail::KVC_ISA_NS::qaq_kernel {

#if KVC_ISA_LEVEL_ >= 1
/// Per width W: for each of 8 lanes (codes i = 0..7 of a W-byte group), the two bytes that hold code i
/// (from byte i W / 8) and its bit offset (i W) % 8.
template <int W>
struct UnpackTables {
  alignas(32) static constexpr std::int8_t shuffle[32] = {
#  define KVC_QAQ_LANE_(i) std::int8_t((i) * W / 8), std::int8_t((i) * W / 8 + 1), -128, -128
      KVC_QAQ_LANE_(0), KVC_QAQ_LANE_(1), KVC_QAQ_LANE_(2), KVC_QAQ_LANE_(3),
      KVC_QAQ_LANE_(4), KVC_QAQ_LANE_(5), KVC_QAQ_LANE_(6), KVC_QAQ_LANE_(7)
#  undef KVC_QAQ_LANE_
  };
  alignas(32) static constexpr std::int32_t shift[8] = {0, W % 8, 2 * W % 8, 3 * W % 8, 4 * W % 8, 5 * W % 8, 6 * W % 8, 7 * W % 8};
};
#endif

#if KVC_ISA_LEVEL_ >= 1
/// Groups of 8 width-W codes whose 8-byte load stays inside `readable` bytes from the codes' start.
template <int W>
constexpr int wide_groups(int d, std::size_t readable) noexcept {
  return W == 8 ? d / 8 : (readable >= 8 ? std::min(d / 8, int((readable - 8) / W) + 1) : 0);
}

/// Group gi (channels 8 gi .. 8 gi + 7) of the width-W codes at p as 8 floats: one 8-byte load where the group
/// is below `wide` (wide_groups), else R::group_word (a narrow copy through memory would stall store-to-load
/// forwarding on the wide load that follows), then one pshufb and one variable shift.
template <class R, int W>
inline __m256 unpack_group(const std::uint8_t* p, int gi, int wide) noexcept {
  if constexpr (W == 8) {
    (void)wide;
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * gi))));
  } else {
    using T = UnpackTables<W>;
    std::uint64_t v;
    if (gi < wide) std::memcpy(&v, p + gi * W, 8);
    else v = R::template group_word<W>(p + gi * W);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi64x(static_cast<long long>(v)),
                                          _mm256_load_si256(reinterpret_cast<const __m256i*>(T::shuffle)));
    const __m256i shift = _mm256_load_si256(reinterpret_cast<const __m256i*>(T::shift));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(x, shift), _mm256_set1_epi32((1 << W) - 1)));
  }
}
#endif

/// The d (multiple of 8) width-W codes of record r as floats. `readable`: bytes that may be read from the
/// record's codes on (the codes and what follows them in the record).
template <class R, int W>
inline void unpack(const std::byte* r, int d, std::size_t readable, float* __restrict out) noexcept {
#if KVC_ISA_LEVEL_ == 0
  (void)readable;
  R::template unpack<W>(r, d, out);
#else
  const std::uint8_t* p = R::codes(r);
  const int wide = wide_groups<W>(d, readable);
  for (int gi = 0; gi < d / 8; ++gi) _mm256_storeu_ps(out + 8 * gi, unpack_group<R, W>(p, gi, wide));
#endif
}

#if KVC_ISA_LEVEL_ == 1
/// o_h[0, d) += sum_k wv[4 h + k] x_k for 4 query heads h (o_h = o + h d) over NR <= 4 width-W records rec[k]
/// (`wide` = wide_groups of their readable bytes), 8 channels at a time: each record's group unpacked straight
/// into a register (no float copy of the codes through memory, loaded back per head), the weights broadcast
/// vectors in memory (the FMAs' memory operand): 5 of AVX2's 16 registers beside the unpack's. Per output
/// element the same FMAs in the same order as axpy_rows over the unpacked codes, so the same result bit for bit.
template <class R, int W, int NR>
inline void axpy_records(const std::byte* const* rec, int d, int wide, const __m256* wv, float* __restrict o) noexcept {
  for (int gi = 0; gi < d / 8; ++gi) {
    __m256 x[NR];
    for (int k = 0; k < NR; ++k) x[k] = unpack_group<R, W>(R::codes(rec[k]), gi, wide);
    for (int h = 0; h < 4; ++h) {
      float* oh = o + std::size_t(h) * d + 8 * gi;
      __m256 acc = _mm256_loadu_ps(oh);
      for (int k = 0; k < NR; ++k) acc = _mm256_fmadd_ps(x[k], wv[4 * h + k], acc);
      _mm256_storeu_ps(oh, acc);
    }
  }
}
#endif

#if KVC_ISA_LEVEL_ >= 1
/// Per width W < 8, per 16-bit lane i of a 128-bit lane (code i of an 8-code group): the two bytes whose word
/// holds code i at bit s = i W % 8, and 2^(16 - s), which mulhi turns into the right shift by s (AVX2 has no
/// variable 16-bit shift). s == 0 puts the code's byte in the high half instead (s = 8).
template <int W>
struct Unpack16Tables {
  static constexpr std::int8_t byte(int k) noexcept {
    const int i = k / 2, b = i * W / 8, s = i * W % 8;
    return std::int8_t(k % 2 == 0 ? (s != 0 ? b : -128) : (s != 0 ? b + 1 : b));
  }
  static constexpr std::uint16_t mul(int i) noexcept {
    const int s = i * W % 8;
    return std::uint16_t(1u << (16 - (s != 0 ? s : 8)));
  }
  alignas(16) static constexpr std::int8_t shuffle[16] = {byte(0), byte(1), byte(2),  byte(3),  byte(4),  byte(5),
                                                          byte(6), byte(7), byte(8),  byte(9),  byte(10), byte(11),
                                                          byte(12), byte(13), byte(14), byte(15)};
  /// The same for 16 codes from one 16-byte load broadcast to both lanes: the high lane's group starts W bytes on.
  static constexpr std::int8_t byte2(int k) noexcept {
    return k < 16 || byte(k - 16) < 0 ? byte(k % 16) : std::int8_t(byte(k - 16) + W);
  }
  alignas(32) static constexpr std::int8_t shuffle2[32] = {
      byte2(0),  byte2(1),  byte2(2),  byte2(3),  byte2(4),  byte2(5),  byte2(6),  byte2(7),
      byte2(8),  byte2(9),  byte2(10), byte2(11), byte2(12), byte2(13), byte2(14), byte2(15),
      byte2(16), byte2(17), byte2(18), byte2(19), byte2(20), byte2(21), byte2(22), byte2(23),
      byte2(24), byte2(25), byte2(26), byte2(27), byte2(28), byte2(29), byte2(30), byte2(31)};
  alignas(16) static constexpr std::uint16_t multiplier[8] = {mul(0), mul(1), mul(2), mul(3),
                                                              mul(4), mul(5), mul(6), mul(7)};
};

/// Codes 16 j .. 16 j + 15 of the width-W codes at p as 16-bit integers (groups 2j and 2j + 1 in the two 128-bit
/// lanes): one 16-byte load broadcast to both lanes, one pshufb, one mulhi and one and (two 8-byte words where
/// fewer than 16 bytes are readable). `readable`: bytes that may be read from p on.
template <class R, int W>
inline __m256i unpack16_slice(const std::uint8_t* p, int j, std::size_t readable) noexcept {
  if constexpr (W == 8) {
    (void)readable;
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)));
  } else {
    using T = Unpack16Tables<W>;
    const __m256i mul = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(T::multiplier)));
    __m256i x;
    if (std::size_t(2 * j * W) + 16 <= readable) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * j * W));
      const __m256i shuffle2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(T::shuffle2));
      x = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(v), shuffle2);
    } else {
      auto word = [&](int gi) {  // group gi's 8 codes: one 8-byte load where 8 bytes are readable
        std::uint64_t v;
        if (std::size_t(gi) * W + 8 <= readable) std::memcpy(&v, p + gi * W, 8);
        else v = R::template group_word<W>(p + gi * W);
        return static_cast<long long>(v);
      };
      x = _mm256_shuffle_epi8(_mm256_set_epi64x(0, word(2 * j + 1), 0, word(2 * j)),
                              _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(T::shuffle))));
    }
    return _mm256_and_si256(_mm256_mulhi_epu16(x, mul), _mm256_set1_epi16((1 << W) - 1));
  }
}

/// The d (multiple of 16) width-W codes of record r as 16-bit integers, 16 per vector (unpack16_slice).
/// `readable` as for unpack().
template <class R, int W>
inline void unpack16(const std::byte* r, int d, std::size_t readable, __m256i* out) noexcept {
  for (int j = 0; j < d / 16; ++j) out[j] = unpack16_slice<R, W>(R::codes(r), j, readable);
}

/// acc + the pairwise products of the 16-bit lanes of a and b, summed in pairs (vpmaddwd + vpaddd; one vpdpwssd
/// on the AVX-512 VNNI path). The same int32 for our operands (codes <= 255, |weights| <= 32767: no pair sum
/// reaches vpmaddwd's one overflow case).
inline __m256i madd16_add(__m256i acc, __m256i a, __m256i b) noexcept {
#  if KVC_ISA_LEVEL_ >= 2
  return _mm256_dpwssd_epi32(acc, a, b);
#  else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#  endif
}

/// res[h] = qi_h . codes (int32) for NH <= 4 heads of 16-bit query qi (row stride d): one vpmaddwd per 16
/// channels and head; exact (|sum| <= 256 * 255 * 32767 < 2^31).
template <int NH>
inline __m128i dot16_heads(const std::int16_t* __restrict qi, int d, const __m256i* codes) noexcept {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int j = 0; j < d / 16; ++j)
    for (int h = 0; h < NH; ++h)
      acc[h] = madd16_add(acc[h], codes[j],
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qi + std::size_t(h) * d + 16 * j)));
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
#endif

/// res[h] = q_h . x for NH heads (q_h = q + h d; d a multiple of the vector width): two accumulators per
/// head, so 2 NH independent FMA chains hide the FMA latency.
template <int NH>
inline void dot_heads(const float* __restrict q, int d, const float* __restrict x, float* __restrict res) noexcept {
  using F = simd::VecF;
  F a0[NH], a1[NH];
  for (int h = 0; h < NH; ++h) a0[h] = a1[h] = F::zero();
  int c = 0;
  for (; c + 2 * F::N <= d; c += 2 * F::N) {
    const F x0 = F::load(x + c), x1 = F::load(x + c + F::N);
    for (int h = 0; h < NH; ++h) {
      a0[h] = simd::fma(F::load(q + std::size_t(h) * d + c), x0, a0[h]);
      a1[h] = simd::fma(F::load(q + std::size_t(h) * d + c + F::N), x1, a1[h]);
    }
  }
  if (c < d) {
    const F x0 = F::load(x + c);
    for (int h = 0; h < NH; ++h) a0[h] = simd::fma(F::load(q + std::size_t(h) * d + c), x0, a0[h]);
  }
  for (int h = 0; h < NH; ++h) res[h] = simd::reduce_add(a0[h] + a1[h]);
}

/// o_h[0, d) += sum_k w[4 h + k] x_k[0, d) for NH heads h (o_h = o + h d) over NR <= 4 rows x_k = x + k d: each
/// output vector loaded and stored once per NR rows, each row vector loaded once for all NH heads (NH = 2 at
/// NR = 4 keeps 2 NR weights, NR rows and one output in registers: 13 of AVX2's 16).
template <int NR, int NH = 1>
inline void axpy_rows(const float* __restrict w, const float* __restrict x, int d, float* __restrict o) noexcept {
  using F = simd::VecF;
  F wv[NH][NR];
  for (int h = 0; h < NH; ++h)
    for (int k = 0; k < NR; ++k) wv[h][k] = F::set1(w[4 * h + k]);
  for (int c = 0; c < d; c += F::N) {
    F xk[NR];
    for (int k = 0; k < NR; ++k) xk[k] = F::load(x + std::size_t(k) * d + c);
    for (int h = 0; h < NH; ++h) {
      float* oh = o + std::size_t(h) * d + c;
      F acc = F::load(oh);
      for (int k = 0; k < NR; ++k) acc = simd::fma(wv[h][k], xk[k], acc);
      acc.store(oh);
    }
  }
}

/// f.template operator()<K>() for the run-time k in [1, 4].
template <class Fn>
inline void with_count(int k, Fn&& f) {
  switch (k) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    default: f.template operator()<4>(); break;
  }
}

using Stream = kvc::detail::QaqStream;

inline float to_float(half_t x) noexcept {
#if KVC_ISA_LEVEL_ == 0
  return x.to_float();
#else
  return _cvtsh_ss(x.bits);
#endif
}

/// What both passes need of one width-W record beyond its codes (already unpacked into `codes`): its
/// affine and, per outlier, the channel and the correction x_c - x^_c (x^_c as Q::decode computes it).
template <class R, int W>
struct Prepared {
  static constexpr int kMaxOut = R::quantizer::outliers(R::quantizer::kMaxHeadDim);
  Affine a;
  float corr[kMaxOut > 0 ? kMaxOut : 1];
  const std::uint8_t* idx;
  Prepared() = default;
  Prepared(const std::byte* r, int d, int nout, const float* codes) noexcept { init(r, d, nout, codes); }
  /// Fills this in place (assigning a constructed temporary copied it through a narrower store and a wider
  /// load: a store-forwarding stall per record).
  /// `codes`: the record's codes unpacked, or null to read the outliers' codes from the record.
  void init(const std::byte* r, int d, int nout, const float* codes) noexcept {
    float lo, step;
    R::meta_floats(r, [](half_t h) { return to_float(h); }, lo, step);
    a = R::quantizer::affine(lo, step, W);
    const half_t* ov = R::outlier_values(r, d, W);
    idx = R::outlier_channels(r, d, W);
    for (int j = 0; j < nout; ++j) {
      const float code = codes ? codes[idx[j]] : float(R::code_at(r, idx[j], W));
      corr[j] = R::outlier_term(to_float(ov[j]), mul_add_rounded(a.scale, code, a.zero));
    }
  }
};

/// Prefetches the g scores st.s[t][0, g) of record j's token t (for writing or reading): records lie in any
/// token order, so these are random accesses of a [T][g] array often larger than L2 (token-major: one cache
/// line per token for g <= 16 at a 64-byte-aligned s and g | 16, at most two otherwise).
template <class R, class Token>
inline void prefetch_token_scores(const std::byte* bk, std::size_t j, std::size_t n, std::size_t rb, Token& token,
                                  const Stream& st) noexcept {
  if (j >= n) return;
  const float* p = st.s + token(bk + j * rb, j) * std::size_t(st.g);
  __builtin_prefetch(p, 1, 3);
  if (((reinterpret_cast<std::uintptr_t>(p) ^ reinterpret_cast<std::uintptr_t>(p + st.g - 1)) & ~std::uintptr_t(63)) != 0)
    __builtin_prefetch(p + st.g - 1, 1, 3);
}
inline constexpr std::size_t kScoreAhead = 16;  ///< records ahead whose scores are prefetched

/// A pass's prefetches at its record j (every pass over a bucket, in order): the scores of record j + kScoreAhead's
/// token and the bytes of record j + R::kRecordAhead (RecordFormat::prefetch).
template <class R, class Token>
inline void prefetch_ahead(const std::byte* bk, std::size_t j, std::size_t n, std::size_t rb, Token& token,
                           const Stream& st) noexcept {
  prefetch_token_scores<R>(bk, j + kScoreAhead, n, rb, token, st);
  R::prefetch(bk, j + R::kRecordAhead, n, rb);
}

/// Scores of the n records of one width-W bucket (records of `rb` bytes; token(r, i) names record i's token).
template <class R, int W, class Token>
void bucket_scores(const std::byte* bk, std::size_t n, std::size_t rb, Token&& token, const Stream& st) noexcept {
  const int d = st.d, g = st.g, nout = R::quantizer::outliers(d);
  float dots[4];
  for (std::size_t j = 0; j < std::min(kScoreAhead, n); ++j) prefetch_token_scores<R>(bk, j, n, rb, token, st);
  for (std::size_t i = 0; i < n; ++i) {
    prefetch_ahead<R>(bk, i, n, rb, token, st);
    const std::byte* r = bk + i * rb;
    unpack<R, W>(r, d, rb - 4, st.codes);
    const Prepared<R, W> k(r, d, nout, st.codes);
    const std::size_t t = token(r, i);
    for (int h0 = 0; h0 < g; h0 += 4) {
      const int nh = std::min(4, g - h0);
      with_count(nh, [&]<int NH>() { dot_heads<NH>(st.q + std::size_t(h0) * d, d, st.codes, dots); });
      for (int h = h0; h < h0 + nh; ++h) {
        float score = k.a.zero * st.qsum[h] + k.a.scale * dots[h - h0];
        for (int j = 0; j < nout; ++j) score += st.qt[std::size_t(k.idx[j]) * g + std::size_t(h)] * k.corr[j];
        st.s[t * std::size_t(g) + std::size_t(h)] = score;
      }
    }
  }
}

#if KVC_ISA_LEVEL_ >= 1
/// bucket_scores with the codes' dot products in 16-bit integers (Precision::kFast): st.qi is the query rounded
/// to int16 per head (q_h ~ qscale_h qi_h), so s_t = zero_t sum_c q_c + scale_t qscale_h (qi_h . code_t) + the
/// outliers' float corrections.
template <class R, int W, class Token>
void bucket_scores16(const std::byte* bk, std::size_t n, std::size_t rb, Token&& token, const Stream& st) noexcept {
  const int d = st.d, g = st.g, nout = R::quantizer::outliers(d);
  alignas(32) __m256i codes[R::quantizer::kMaxHeadDim / 16];
  alignas(16) float dots[4];
  for (std::size_t j = 0; j < std::min(kScoreAhead, n); ++j) prefetch_token_scores<R>(bk, j, n, rb, token, st);
  for (std::size_t i = 0; i < n; ++i) {
    prefetch_ahead<R>(bk, i, n, rb, token, st);
    const std::byte* r = bk + i * rb;
    // 16-byte loads may run into the bucket's next records: checked only in its last record
    if (i + 1 < n) unpack16<R, W>(r, d, std::numeric_limits<std::size_t>::max(), codes);
    else unpack16<R, W>(r, d, rb - 4, codes);
    float lo, step;
    R::meta_floats(r, [](half_t h) { return to_float(h); }, lo, step);
    const Affine a = R::quantizer::affine(lo, step, W);
    const half_t* ov = R::outlier_values(r, d, W);
    const std::uint8_t* idx = R::outlier_channels(r, d, W);
    float corr[Prepared<R, W>::kMaxOut > 0 ? Prepared<R, W>::kMaxOut : 1];
    for (int j = 0; j < nout; ++j) {
      std::uint16_t code;  // 16-bit lane c of the unpacked codes is channel c
      std::memcpy(&code, reinterpret_cast<const char*>(codes) + 2 * std::size_t(idx[j]), 2);
      corr[j] = R::outlier_term(to_float(ov[j]), mul_add_rounded(a.scale, float(code), a.zero));
    }
    const std::size_t t = token(r, i);
    for (int h0 = 0; h0 < g; h0 += 4) {
      const int nh = std::min(4, g - h0);
      with_count(nh, [&]<int NH>() {
        _mm_store_ps(dots, _mm_cvtepi32_ps(dot16_heads<NH>(st.qi + std::size_t(h0) * d, d, codes)));
      });
      if (nh == 4) {  // the 4 heads' scores as one vector; their outlier terms from the transposed query
        __m128 sc = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(a.scale), _mm_loadu_ps(st.qscale + h0)), _mm_load_ps(dots),
                                 _mm_mul_ps(_mm_set1_ps(a.zero), _mm_loadu_ps(st.qsum + h0)));
        for (int j = 0; j < nout; ++j)
          sc = _mm_fmadd_ps(_mm_loadu_ps(st.qt + std::size_t(idx[j]) * g + std::size_t(h0)), _mm_set1_ps(corr[j]), sc);
        _mm_storeu_ps(st.s + t * std::size_t(g) + std::size_t(h0), sc);
        continue;
      }
      for (int h = h0; h < h0 + nh; ++h) {
        float score = a.zero * st.qsum[h] + a.scale * st.qscale[h] * dots[h - h0];
        for (int j = 0; j < nout; ++j) score += st.qt[std::size_t(idx[j]) * g + std::size_t(h)] * corr[j];
        st.s[t * std::size_t(g) + std::size_t(h)] = score;
      }
    }
  }
}
#endif

#if KVC_ISA_LEVEL_ >= 1
/// st.ot[c][h] += p_t,h corr_c for the nout outliers of prepared value record v of token t, 4 query heads a vector
/// (g % 4 == 0): the record's g probabilities are one line of st.s.
template <class P>
inline void add_value_outliers4(const P& v, std::size_t t, int nout, const Stream& st) noexcept {
  const std::size_t g = std::size_t(st.g);
  for (std::size_t h0 = 0; h0 < g; h0 += 4) {
    const __m128 w4 = _mm_loadu_ps(st.s + t * g + h0);
    for (int j = 0; j < nout; ++j) {
      float* ot = st.ot + std::size_t(v.idx[j]) * g + h0;
      _mm_storeu_ps(ot, _mm_fmadd_ps(w4, _mm_set1_ps(v.corr[j]), _mm_loadu_ps(ot)));
    }
  }
}
#endif

/// Probability-weighted values of the n records of one width-W bucket, up to 4 records at a time.
///  - AVX2 with g % 4 == 0: axpy_records, 4 query heads a pass, the codes unpacked straight into the FMAs'
///    registers (against unpacking into st.codes and loading them back by axpy_rows<4, 2>: the values' pass
///    2.11 -> 1.74-1.76 times the update's cpu-clock samples in the T = 32768 step, the step -8 %).
///  - otherwise the codes unpacked side by side into st.codes (4 d floats), then on the SIMD paths with
///    g % 4 == 0 two query heads per pass over them (axpy_rows<NR, 2>: a code vector loaded once for both heads;
///    one head a pass loads each code vector g times: 80 vector loads per record at g = 4 against 48, for the
///    same 64 FMAs); AVX-512 keeps this path (its 16-float FMAs; the direct one is unmeasured there).
/// Both give the same result bit for bit (the same FMAs in the same order per output element).
template <class R, int W, class Token>
void bucket_values(const std::byte* bk, std::size_t n, std::size_t rb, Token&& token, const Stream& st) noexcept {
  const int d = st.d, g = st.g, nout = R::quantizer::outliers(d);
  constexpr bool kDirectIsa = KVC_ISA_LEVEL_ == 1;
  const bool direct = kDirectIsa && g % 4 == 0;
  // every FMA of a record waits for its probability: prefetched kScoreAhead records ahead
  for (std::size_t j = 0; j < std::min(kScoreAhead, n); ++j) prefetch_token_scores<R>(bk, j, n, rb, token, st);
  for (std::size_t i = 0; i < n; i += 4) {
    const int nr = int(std::min<std::size_t>(4, n - i));
    for (int k = 0; k < nr; ++k) prefetch_ahead<R>(bk, i + std::size_t(k), n, rb, token, st);
    Prepared<R, W> v[4];
    std::size_t t[4];
    const std::byte* rec[4];
    for (int k = 0; k < nr; ++k) {
      rec[k] = bk + (i + std::size_t(k)) * rb;
      float* codes = direct ? nullptr : st.codes + std::size_t(k) * d;
      if (!direct) unpack<R, W>(rec[k], d, rb - 4, codes);
      v[k].init(rec[k], d, nout, codes);
      t[k] = token(rec[k], i + std::size_t(k));
    }
#if KVC_ISA_LEVEL_ == 1
    if (direct) {
      const int wide = wide_groups<W>(d, rb - 4);
      alignas(32) __m256 wv[16];  // [head][record]: p_t,h scale_t broadcast
      for (int h0 = 0; h0 < g; h0 += 4) {
        for (int h = 0; h < 4; ++h) {
          float z = 0.0f;  // summed in a register, added to zsum once (not a chain through memory per record)
          for (int k = 0; k < nr; ++k) {
            const float w = st.s[t[k] * std::size_t(g) + std::size_t(h0 + h)];
            wv[4 * h + k] = _mm256_set1_ps(w * v[k].a.scale);
            z += w * v[k].a.zero;
          }
          st.zsum[h0 + h] += z;
        }
        with_count(nr, [&]<int NR>() { axpy_records<R, W, NR>(rec, d, wide, wv, st.o + std::size_t(h0) * d); });
      }
    }
#endif
    // SIMD paths with g % 4 == 0: two heads per pass over the codes, and the outliers 4 heads a vector below
    const bool vec4 = KVC_ISA_LEVEL_ >= 1 && g % 4 == 0;
    const int hs = vec4 ? 2 : 1;
    for (int h = 0; h < g && !direct; h += hs) {
      float w[2][4], ws[2][4];
      for (int e = 0; e < hs; ++e) {
        float z = 0.0f;
        for (int k = 0; k < nr; ++k) {
          w[e][k] = st.s[t[k] * std::size_t(g) + std::size_t(h + e)];
          ws[e][k] = w[e][k] * v[k].a.scale;
          z += w[e][k] * v[k].a.zero;
        }
        st.zsum[h + e] += z;
      }
      float* oh = st.o + std::size_t(h) * d;
      with_count(nr, [&]<int NR>() {
        if (hs == 2) axpy_rows<NR, 2>(ws[0], st.codes, d, oh);
        else axpy_rows<NR>(ws[0], st.codes, d, oh);
      });
      if (vec4) continue;
      for (int k = 0; k < nr; ++k)
        for (int j = 0; j < nout; ++j) {
          if constexpr (R::kAddOutliers)  // in the original basis: added after the un-rotation
            st.ot[std::size_t(v[k].idx[j]) * g + std::size_t(h)] += w[0][k] * v[k].corr[j];
          else
            oh[v[k].idx[j]] += w[0][k] * v[k].corr[j];
        }
    }
#if KVC_ISA_LEVEL_ >= 1
    if (g % 4 == 0)
      for (int k = 0; k < nr; ++k) add_value_outliers4(v[k], t[k], nout, st);
#endif
  }
}

#if KVC_ISA_LEVEL_ >= 1
/// bucket_values with the code products in 16-bit integers (Precision::kFast, g % 4 == 0; 256-bit vectors on AVX2 and
/// AVX-512), kBlock records at a time. Per block and query head the weights w_t = p_t scale_t are rounded to int16
/// against the block's largest, w_t ~ ws wi_t with ws = max_t w_t / 32767, so |w_t - ws wi_t| <= ws / 2. Two records'
/// codes are interleaved into one vector of 16-bit lanes (channel c of records a and b side by side), so one vpmaddwd
/// takes 8 channels of two records against the pair (wi_a, wi_b), with exact int32 sums over the block (<= kBlock 255 *
/// 32767 < 2^31); o += ws * sum once per block. The added error per channel and head is at most kBlock ws / 2 (2^b - 1)
/// per block, at most kBlock (2^b - 1) / 32767 times the block's largest quantisation-error bound w_t / 2 (b = 8:
/// 0.125; b <= 4: <= 0.0074), in practice far less (roundings of random sign). Zero terms, outliers and the
/// probabilities handed back stay float. Against the float FMAs of bucket_values: per 16 channels and two records, 2
/// unpacks, 2 interleaves and 8 products for 4 heads instead of 4 unpacks to float and 16 FMAs (products and sums:
/// madd16_add, one vpdpwssd each on AVX-512).
template <class R, int W, class Token>
void bucket_values16(const std::byte* bk, std::size_t n, std::size_t rb, Token&& token, const Stream& st) noexcept {
  constexpr int kBlock = 16, kPairs = kBlock / 2;
  const int d = st.d, g = st.g, nout = R::quantizer::outliers(d);
  for (std::size_t j = 0; j < std::min(kScoreAhead, n); ++j) prefetch_token_scores<R>(bk, j, n, rb, token, st);
  for (std::size_t i = 0; i < n; i += kBlock) {
    const int nb = int(std::min<std::size_t>(kBlock, n - i)), np = (nb + 1) / 2;
    Prepared<R, W> v[kBlock];
    std::size_t t[kBlock];
    const std::uint8_t* codes[kBlock + 1];
    for (int k = 0; k < nb; ++k) {
      prefetch_ahead<R>(bk, i + std::size_t(k), n, rb, token, st);
      const std::byte* r = bk + (i + std::size_t(k)) * rb;
      codes[k] = R::codes(r);
      v[k].init(r, d, nout, nullptr);
      t[k] = token(r, i + std::size_t(k));
    }
    codes[nb] = codes[nb - 1];  // an odd block's last pair: weight 0
    // Loads of 16 code bytes may run into the bucket's next records: checked only in its last block.
    const std::size_t last = (n - i - std::size_t(nb - 1)) * rb - 4;  // readable from the block's last codes
    const bool checked = i + std::size_t(nb) == n;
    for (int h0 = 0; h0 < g; h0 += 4) {
      // the block's weights for 4 heads: one vector per record, its heads in the lanes
      __m128 w[kBlock], wmax = _mm_setzero_ps(), z = _mm_setzero_ps();
      for (int k = 0; k < nb; ++k) {
        const __m128 p = _mm_loadu_ps(st.s + t[k] * std::size_t(g) + std::size_t(h0));
        w[k] = _mm_mul_ps(p, _mm_set1_ps(v[k].a.scale));
        z = _mm_fmadd_ps(p, _mm_set1_ps(v[k].a.zero), z);
        wmax = _mm_max_ps(wmax, w[k]);
      }
      _mm_storeu_ps(st.zsum + h0, _mm_add_ps(_mm_loadu_ps(st.zsum + h0), z));
      const __m128 positive = _mm_cmpgt_ps(wmax, _mm_setzero_ps());
      const __m128 inv = _mm_and_ps(_mm_div_ps(_mm_set1_ps(32767.0f), wmax), positive);  // 0 where all are 0
      const __m128 ws = _mm_div_ps(wmax, _mm_set1_ps(32767.0f));
      alignas(32) __m256i wp[kPairs][4];  // [pair][head]: (wi_a, wi_b) broadcast, the products' memory operand
      for (int m = 0; m < np; ++m) {
        const __m128i a = _mm_cvtps_epi32(_mm_mul_ps(w[2 * m], inv));
        const __m128i b = 2 * m + 1 < nb ? _mm_cvtps_epi32(_mm_mul_ps(w[2 * m + 1], inv)) : _mm_setzero_si128();
        const __m128i ab = _mm_or_si128(a, _mm_slli_epi32(b, 16));
        wp[m][0] = _mm256_broadcastd_epi32(ab);
        wp[m][1] = _mm256_broadcastd_epi32(_mm_shuffle_epi32(ab, 1));
        wp[m][2] = _mm256_broadcastd_epi32(_mm_shuffle_epi32(ab, 2));
        wp[m][3] = _mm256_broadcastd_epi32(_mm_shuffle_epi32(ab, 3));
      }
      alignas(16) float wsh[4];
      _mm_store_ps(wsh, ws);
      for (int j = 0; j < d / 16; ++j) {
        __m256i acc[4][2];
        for (auto& a : acc) a[0] = a[1] = _mm256_setzero_si256();
        auto pairs = [&]<bool kChecked>() {
          for (int m = 0; m < np; ++m) {
            const int ka = 2 * m, kb = 2 * m + 1;
            constexpr std::size_t kAll = std::numeric_limits<std::size_t>::max();
            const __m256i xa = unpack16_slice<R, W>(codes[ka], j, !kChecked ? kAll : ka == nb - 1 ? last : last + rb);
            const __m256i xb = unpack16_slice<R, W>(codes[kb], j, !kChecked ? kAll : kb >= nb - 1 ? last : last + rb);
            const __m256i lo = _mm256_unpacklo_epi16(xa, xb), hi = _mm256_unpackhi_epi16(xa, xb);
            for (int h = 0; h < 4; ++h) {
              acc[h][0] = madd16_add(acc[h][0], lo, wp[m][h]);
              acc[h][1] = madd16_add(acc[h][1], hi, wp[m][h]);
            }
          }
        };
        if (checked) pairs.template operator()<true>();
        else pairs.template operator()<false>();
        // lanes of acc[h][0]: channels 0-3 | 8-11 of the slice, acc[h][1]: 4-7 | 12-15
        for (int h = 0; h < 4; ++h) {
          float* o = st.o + std::size_t(h0 + h) * d + 16 * j;
          const __m256 f = _mm256_set1_ps(wsh[h]);
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(acc[h][0], acc[h][1], 0x20));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(acc[h][0], acc[h][1], 0x31));
          _mm256_storeu_ps(o, _mm256_fmadd_ps(lo, f, _mm256_loadu_ps(o)));
          _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(hi, f, _mm256_loadu_ps(o + 8)));
        }
      }
    }
    for (int k = 0; k < nb; ++k) add_value_outliers4(v[k], t[k], nout, st);
  }
}
#endif

/// Softmax of each query head's T scores (log2 domain) in place, over the token-major [T][g] array: element i
/// belongs to head i % g. Vectors run over the flat array with P = g / gcd(g, N) lane patterns (P vectors cover
/// whole tokens), so every lane of pattern v always holds the same head. Returns false if a max or a sum is not
/// finite.
inline bool softmax(const Stream& st) noexcept {
  using F = simd::VecF;
  constexpr int kMaxPhases = 16;
  const int g = st.g, P = g / std::gcd(g, F::N), L = P * F::N;
  const std::size_t n = std::size_t(st.T) * g;
  float* s = st.s;
  float *m = st.heads, *sum = st.heads + g, *inv = st.heads + 2 * g;
  std::fill_n(m, g, -std::numeric_limits<float>::infinity());
  std::fill_n(sum, g, 0.0f);
  alignas(64) float lanes[kMaxPhases * F::N];
  F acc[kMaxPhases], pat[kMaxPhases];
  // lanes -> per head, and per head -> a pattern of P vectors (P <= kMaxPhases)
  auto fold = [&](float* per_head, auto&& combine) {
    for (int v = 0; v < P; ++v) acc[v].store(lanes + v * F::N);
    for (int j = 0; j < L; ++j) per_head[j % g] = combine(per_head[j % g], lanes[j]);
  };
  auto pattern = [&](const float* per_head) {
    for (int j = 0; j < L; ++j) lanes[j] = per_head[j % g];
    for (int v = 0; v < P; ++v) pat[v] = F::load(lanes + v * F::N);
  };
  if (P > kMaxPhases) {  // a group size with too many lane patterns: element by element
    for (std::size_t i = 0; i < n; ++i) m[i % g] = std::max(m[i % g], s[i]);
    for (std::size_t i = 0; i < n; ++i) sum[i % g] += (s[i] = simd::exp2_scalar(s[i] - m[i % g]));
  } else {
    const std::size_t nv = n / std::size_t(L) * std::size_t(L);
    for (int v = 0; v < P; ++v) acc[v] = F::set1(-std::numeric_limits<float>::infinity());
    for (std::size_t i = 0; i < nv; i += std::size_t(L))
      for (int v = 0; v < P; ++v) acc[v] = simd::max(acc[v], F::load(s + i + v * F::N));
    fold(m, [](float a, float b) { return std::max(a, b); });
    for (std::size_t i = nv; i < n; ++i) m[i % g] = std::max(m[i % g], s[i]);
    pattern(m);
    for (int v = 0; v < P; ++v) acc[v] = F::zero();
    for (std::size_t i = 0; i < nv; i += std::size_t(L))
      for (int v = 0; v < P; ++v) {
        const F e = simd::exp2(F::load(s + i + v * F::N) - pat[v]);
        e.store(s + i + v * F::N);
        acc[v] = acc[v] + e;
      }
    fold(sum, [](float a, float b) { return a + b; });
    for (std::size_t i = nv; i < n; ++i) sum[i % g] += (s[i] = simd::exp2_scalar(s[i] - m[i % g]));
  }
  bool ok = true;
  for (int h = 0; h < g; ++h) {
    if (!std::isfinite(m[h]) || !std::isfinite(sum[h])) ok = false;
    inv[h] = 1.0f / sum[h];
  }
  std::size_t i = 0;
  if (P <= kMaxPhases) {
    pattern(inv);
    for (; i + std::size_t(L) <= n; i += std::size_t(L))
      for (int v = 0; v < P; ++v) (F::load(s + i + v * F::N) * pat[v]).store(s + i + v * F::N);
  }
  for (; i < n; ++i) s[i] *= inv[i % g];
  return ok;
}

/// pr[t] = the largest of token t's g probabilities (SPEC Q6), for t in [0, T): one forward pass over the
/// token-major [T][g] array (taken per record in the value pass instead, a store at a random token each, the
/// step's attention at T = 32768 was about 1 ms slower). SIMD paths with g % 4 == 0: 4 heads a vector.
inline void token_max(const Stream& st, float* __restrict pr) noexcept {
  const int g = st.g;
  const float* s = st.s;
#if KVC_ISA_LEVEL_ >= 1
  if (g % 4 == 0) {
    for (int t = 0; t < st.T; ++t, s += g) {
      __m128 m = _mm_loadu_ps(s);
      for (int h0 = 4; h0 < g; h0 += 4) m = _mm_max_ps(m, _mm_loadu_ps(s + h0));
      m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
      pr[t] = _mm_cvtss_f32(_mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    return;
  }
#endif
  for (int t = 0; t < st.T; ++t, s += g) {
    float m = s[0];
    for (int h = 1; h < g; ++h) m = std::max(m, s[h]);
    pr[t] = m;
  }
}

/// Attention of one stream of a QAQ cache: ks/vs its key/value sides. Returns false on float overflow.
template <class Cache>
bool run_stream(const Cache& cache, const typename Cache::Side& ks, const typename Cache::Side& vs, const Stream& st,
                float* pr) noexcept {
  using R = typename Cache::record;
  using RK = typename Cache::key_record;    // how each side's outliers join: R plus outlier_term
  using RV = typename Cache::value_record;
  using Q = typename Cache::quantizer;
  const int d = st.d, ids = cache.id_bytes();
  // Calls pass.template operator()<W>(records, count, record bytes, token) for every width-W bucket of `side`.
  auto each_bucket = [&](const typename Cache::Side& side, auto&& pass) {
    for (int b = Q::kMinBits; b <= Q::kMaxBits; ++b) {
      const auto& bk = side.bucket[std::size_t(b - Q::kMinBits)];
      const std::size_t rb = R::bytes(d, b, ids);
      if (bk.empty()) continue;
      ::kvc::qaq::with_width<Q::kMinBits, Q::kMaxBits>(b, [&]<int W>() {
        auto token = [&](const std::byte* r, std::size_t i) -> std::size_t {
          if constexpr (Cache::kAdaptive) return (void)i, std::size_t(R::token(r, rb, ids));
          else return (void)r, i;
        };
        pass.template operator()<W>(bk.data(), bk.size() / rb, rb, token);
      });
    }
  };
  each_bucket(ks, [&]<int W>(const std::byte* bk, std::size_t n, std::size_t rb, auto&& token) {
#if KVC_ISA_LEVEL_ >= 1
    if (st.qi) return bucket_scores16<RK, W>(bk, n, rb, token, st);
#endif
    bucket_scores<RK, W>(bk, n, rb, token, st);
  });
  const bool ok = softmax(st);
  std::fill_n(st.o, std::size_t(st.g) * d, 0.0f);
  std::fill_n(st.ot, std::size_t(st.g) * d, 0.0f);
  std::fill_n(st.zsum, st.g, 0.0f);
  each_bucket(vs, [&]<int W>(const std::byte* bk, std::size_t n, std::size_t rb, auto&& token) {
#if KVC_ISA_LEVEL_ >= 1
    if (st.qi && st.g % 4 == 0) return bucket_values16<RV, W>(bk, n, rb, token, st);  // kFast
#endif
    bucket_values<RV, W>(bk, n, rb, token, st);
  });
  if (pr) token_max(st, pr);
  for (int h = 0; h < st.g; ++h)  // RV::kAddOutliers: st.ot is added after the un-rotation (decode_attention.hpp)
    for (int c = 0; c < d; ++c)
      st.o[std::size_t(h) * d + c] += st.zsum[h] + (RV::kAddOutliers ? 0.0f : st.ot[std::size_t(c) * st.g + h]);
  return ok;
}
}  // namespace kvc::detail::KVC_ISA_NS::qaq_kernel

namespace kvc::detail::KVC_ISA_NS {
/// This path's stream kernel, found through its IsaTag by kvc::decode_attention (select_isa.hpp).
template <class Cache>
constexpr auto qaq_stream_kernel(IsaTag) noexcept {
  return &qaq_kernel::run_stream<Cache>;
}
}  // namespace kvc::detail::KVC_ISA_NS
