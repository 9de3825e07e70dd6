/// \file decode_attention.hpp (qaq)
/// Fused CPU decode attention over QAQ's mixed-bit cache, handing back each token's attention probability
/// (SPEC §2.4, §2.10). Two passes per (sequence, KV head), both over the compressed records (never
/// expanded to a K/V copy):
///  1. every key bucket, width by width: q.k^_t = zero_t sum_c q_c + scale_t sum_c q_c code_tc, plus
///     q_c (x_c - x^_c) per outlier; the score lands at the record's token;
///  2. softmax per query head over the T scores;
///  3. every value bucket: o += p_t (zero_t + scale_t code_tc), plus p_t (x_c - x^_c) per outlier;
///     then probs[t] = max over the GQA group (SPEC Q6), one forward pass over the probabilities.
/// Each record's codes are unpacked once (width-specialised) and used by every query head of the group
/// (qaq/detail/attention_kernel.hpp, compiled per SIMD path like the main kernel and chosen at run time by
/// AttentionOptions::isa).
/// Precision (AttentionOptions::precision):
///  - kFast (default) on the AVX2 and AVX-512 paths: the key dot products q . code_t are 16-bit integer
///    products (vpmaddwd, exact int32 sums) with the query rounded to int16 per head, qscale_h = max_c |q_hc| /
///    32767. The score error this adds is <= qscale_h / 2 * scale_t * sum_c code_tc, i.e. per channel at most
///    2^-16 max|q_h| (2^b - 1) step_t: next to the codes' own error bound sum_c |q_hc| step_t / 2, a ratio
///    <= 2^(b - 15) max|q_h| / mean|q_h| (b = 8, a max/mean of 10: 0.08; at b <= 4, < 0.005). With g % 4 == 0
///    the value products are int16 too: per block of 16 records and query head, the weights w_t = p_t scale_t
///    rounded against the block's largest (ws = max_t w_t / 32767, |w_t - ws wi_t| <= ws / 2), exact int32
///    sums; the output error this adds per channel is <= 16 (2^b - 1) ws / 2 per block, at most
///    16 (2^b - 1) / 32767 of the block's largest quantisation-error bound w_t / 2 (b = 8: 0.125; b <= 4:
///    < 0.0074). The zero terms, the outliers and the probabilities handed back stay float.
///  - kExact, and the portable path: float FMAs over the decoded codes.
/// Scratch: group x (T + 6 + 2 d) + 4 d floats and group x d int16 per thread. Parallel over (sequence, KV
/// head) with OpenMP. qaq_decode_step runs each stream's width update inside the same loop, right after its
/// attention. Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/attention/decode_attention.hpp>
#include <kvc/core/aligned_buffer.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/view.hpp>
#include <kvc/qaq/qaq_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif

namespace kvc::detail {
/// One (sequence, KV head) stream of QAQ attention: the kernel's inputs and buffers.
struct QaqStream {
  int d, g, T;
  const float* q;     ///< [g][d] query, pre-multiplied by scale * log2(e)
  const float* qsum;  ///< [g] sum_c q_c
  float* s;           ///< [T][g] scores, then probabilities (token-major: a record's g entries share a cache line)
  float* o;           ///< [g][d] output
  float* zsum;        ///< [g] scratch: sum_t p_t zero_t
  float* codes;       ///< [4][d] scratch: up to 4 records' codes
  float* heads;       ///< [3][g] scratch: softmax's max, sum and 1 / sum per query head
  const float* qt;    ///< [d][g] the query transposed: the g heads' q_c side by side (outlier terms, 4 heads a vector)
  float* ot;          ///< [d][g] scratch: the value outliers' terms, channel-major like qt, added to o at the end
  const std::int16_t* qi = nullptr;  ///< [g][d] q rounded to int16 per head (Precision::kFast on AVX2/AVX-512), or null
  const float* qscale = nullptr;     ///< [g] q_h ~ qscale[h] qi_h
};

/// Rounds the g rows of q [g][d] to int16 per row: qi = round(q / qscale), qscale = max |q_h| / 32767 (1 for a
/// zero row), so |q - qscale qi| <= qscale / 2 per channel.
inline void round_query16(const float* q, int g, int d, std::int16_t* qi, float* qscale) noexcept {
  for (int h = 0; h < g; ++h) {
    const float* qh = q + std::size_t(h) * d;
    float mx = 0.0f;
    for (int c = 0; c < d; ++c) mx = std::max(mx, std::fabs(qh[c]));
    qscale[h] = mx > 0.0f ? mx / 32767.0f : 1.0f;
    const float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
    for (int c = 0; c < d; ++c)
      qi[std::size_t(h) * d + c] = static_cast<std::int16_t>(std::clamp(std::nearbyint(qh[c] * inv), -32767.0f, 32767.0f));
  }
}
}  // namespace kvc::detail

KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
#define KVC_ATTENTION_INTERNAL
#define KVC_PER_ISA_HEADER <kvc/qaq/detail/attention_kernel.hpp>
#include <kvc/attention/detail/per_isa.hpp>
#undef KVC_PER_ISA_HEADER
#undef KVC_ATTENTION_INTERNAL
KVC_SUPPRESS_INTRINSIC_WARNINGS_END

namespace kvc {
namespace qaq::detail {
using ::kvc::detail::attention_threads;
using ::kvc::detail::checked_lengths;
using ::kvc::detail::query_scale;

/// decode_attention's body. after(i, thread) runs right after stream i's attention on the thread that ran it
/// (qaq_decode_step: that stream's width update, so both halves of the step share one parallel loop), outside
/// the attention's denormal flushing.
template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds, class Meta, class... Rot, class After>
void attend(const CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...>& cache, int layer,
            QueryView q, OutputView out, const AttentionOptions& opt, TokenProbs* probs, After&& after) {
  using Cache = CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...>;
  const CacheConfig& cfg = cache.config();
  const std::vector<int> lengths = checked_lengths(cache, layer, q, out, opt);  // validates opt too
  const Isa isa = resolve_isa(opt.isa);
  const int nseq = q.dim0, H = cfg.kv_heads, g = q.dim1 / H, d = cfg.head_dim;
  const float scale = query_scale(opt, d);
  const int tmax = *std::max_element(lengths.begin(), lengths.begin() + nseq);
  if (probs) probs->resize(nseq, H, tmax);
  AlignedBuffer<float> qs(std::size_t(nseq) * q.dim1 * d), result(std::size_t(nseq) * q.dim1 * d);
  // split rotated sides (qaq_cache.hpp): the key outliers' terms take the un-rotated query (qo), the value
  // outliers' terms are summed per stream apart (ots, [streams][d][g]) and added after the un-rotation
  AlignedBuffer<float> qo(Cache::kSplitKeys ? qs.size() : 0), ots(Cache::kSplitValues ? qs.size() : 0);
  const std::uint32_t* tables = cache.rotation_tables(layer);  // null without a Rotation
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < q.dim1; ++h) {
      float* row = qs.data() + (std::size_t(s) * q.dim1 + h) * d;
      for (int c = 0; c < d; ++c) row[c] = q.row(s, h)[c] * scale;
      if constexpr (Cache::kSplitKeys) std::copy_n(row, d, qo.data() + (row - qs.data()));
      if constexpr (Cache::rotation::kKeys)  // q . k = (R q) . (R k): once per query head and step
        Cache::rotation::rotate(true, tables, h / g, d, row);
    }
  // isa: a path this build contains (resolve_isa)
  const auto run = kvc::detail::select_isa(isa, [](auto tag) { return qaq_stream_kernel<Cache>(tag); });
  // the SIMD kernels' int16 key path (the portable kernel has none)
  const bool int16_keys = opt.precision == Precision::kFast && isa != Isa::kPortable;
  std::vector<unsigned char> finite(std::size_t(nseq) * H, 1);
  const int streams = nseq * H;
#if KVC_HAS_OPENMP()
#  pragma omp parallel num_threads(attention_threads(opt))
#endif
  {
    // [T][g] scores first (64-byte aligned: a token's g <= 16 scores share a line when g | 16), then
    // qsum, qscale, zsum, heads [3][g], codes [4][d], qt and ot [d][g]
    const std::size_t ns = std::size_t(g) * std::size_t(tmax), dg = std::size_t(d) * g;
    AlignedBuffer<float> scratch(ns + 6 * std::size_t(g) + 4 * std::size_t(d) + 2 * dg);
    AlignedBuffer<std::int16_t> qi(int16_keys ? std::size_t(g) * d : 0);
#if KVC_HAS_OPENMP()
    const int thread = omp_get_thread_num();
#  pragma omp for schedule(dynamic, 1)
#else
    const int thread = 0;
#endif
    for (int i = 0; i < streams; ++i) {
      const int s = i / H, kh = i % H;
      const std::size_t q0 = (std::size_t(s) * q.dim1 + std::size_t(kh) * g) * d;
      float* qsum = scratch.data() + ns;
      for (int h = 0; h < g; ++h) {
        qsum[h] = 0.0f;
        for (int c = 0; c < d; ++c) qsum[h] += qs[q0 + std::size_t(h) * d + c];
      }
      float* qscale = qsum + g;
      float* qt = qsum + 6 * g + 4 * std::size_t(d);
      const float* qrows = (Cache::kSplitKeys ? qo.data() : qs.data()) + q0;  // the outlier terms' query
      for (int h = 0; h < g; ++h)
        for (int c = 0; c < d; ++c) qt[std::size_t(c) * g + h] = qrows[std::size_t(h) * d + c];
      if (int16_keys) kvc::detail::round_query16(qs.data() + q0, g, d, qi.data(), qscale);
      const kvc::detail::QaqStream st{d,
                                      g,
                                      lengths[std::size_t(s)],
                                      qs.data() + q0,
                                      qsum,
                                      scratch.data(),
                                      result.data() + q0,
                                      qsum + 2 * g,
                                      qsum + 6 * g,
                                      qsum + 3 * g,
                                      qt,
                                      Cache::kSplitValues ? ots.data() + q0 : qt + dg,
                                      int16_keys ? qi.data() : nullptr,
                                      qscale};
      {
        const kvc::detail::FlushDenormals ftz;  // probabilities far below the max underflow (see decode_attention.hpp)
        finite[std::size_t(i)] = run(cache, cache.keys(layer, s, kh), cache.values(layer, s, kh), st,
                                     probs ? probs->row(s, kh) : nullptr);
      }
      after(i, thread);
    }
  }
  for (int i = 0; i < streams; ++i)
    KVC_CHECK(finite[std::size_t(i)], Errc::kOutOfRange, "attention scores of sequence ", i / H, " KV head ", i % H,
              " overflow float: scale the query or the cache down");
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < q.dim1; ++h) {
      float* o = result.data() + (std::size_t(s) * q.dim1 + h) * d;
      if constexpr (Cache::rotation::kValues)  // o = R^T sum_t p_t (R v_t)
        Cache::rotation::unrotate(false, tables, h / g, d, o);
      if constexpr (Cache::kSplitValues) {  // + sum_t p_t o_t, the outliers in the original basis ([d][g] per stream)
        const float* ot = ots.data() + (std::size_t(s) * q.dim1 + std::size_t(h / g) * g) * d;
        for (int c = 0; c < d; ++c) o[c] += ot[std::size_t(c) * g + std::size_t(h % g)];
      }
      std::copy_n(o, d, out.row(s, h));
    }
}

/// qaq_decode_step's access to the cache's per-stream update.
struct FusedStep {
  /// Scratch for `threads` threads (not cache state).
  template <class Cache>
  static void reserve(Cache& cache, int threads) {
    cache.reserve_staging(threads);
  }
  template <class Cache>
  static void count_update(Cache& cache) noexcept {
    ++cache.updates_;
  }
  template <class Cache>
  static void update(Cache& cache, int layer, int i, const float* p, int thread) {
    cache.update_stream(layer, i, p, cache.staging_[std::size_t(thread)]);
  }
};

/// Whether no score of `q` (a view checked_lengths accepted) can overflow float for any cache content: every
/// reconstructed or exact K element is below 2^18 in magnitude (fp16 lo and step: |lo| <= 65504 and
/// step (2^b - 1) <= 2^17 (1 + 2^-10); outliers fp16), and every term the kernels sum (per channel, per record
/// affine, kFast's qscale products) is at most 2^20 times the scaled query's L1 norm, so an L1 norm <= 2^96
/// keeps every partial sum <= 2^116; the softmax of finite scores is finite (its sum lies in [1, T]). False
/// for a non-finite query or scale. rotated: the keys' Rotation turns q into R q, whose L1 norm is at most
/// sqrt(d) ||q||_2 (the bound used then; it holds q's own L1 norm too, which a split side's key outlier terms
/// take: qaq_cache.hpp).
inline bool scores_cannot_overflow(QueryView q, int d, const AttentionOptions& opt, bool rotated = false) noexcept {
  const float fscale = query_scale(opt, d);
  if (!std::isfinite(fscale)) return false;
  const double scale = double(fscale);
  for (int s = 0; s < q.dim0; ++s)
    for (int h = 0; h < q.dim1; ++h) {
      double l1 = 0.0, l2 = 0.0;
      for (int c = 0; c < q.dim2; ++c) {
        const double x = double(q.row(s, h)[c]);
        l1 += std::fabs(x), l2 += x * x;
      }
      if (rotated) l1 = std::sqrt(double(d) * l2);
      if (!(l1 * scale <= 0x1p96)) return false;
    }
  return true;
}
}  // namespace qaq::detail

/// Decode attention over `layer` of a QAQ cache; with `probs`, also each token's probability (resized to
/// [q.dim0][kv_heads][max length]) for update_widths(). Errors as kvc::decode_attention.
template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds, class Meta, class... Rot>
void decode_attention(const CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...>& cache,
                      int layer, QueryView q, OutputView out, const AttentionOptions& opt = {},
                      qaq::TokenProbs* probs = nullptr) {
  qaq::detail::attend(cache, layer, q, out, opt, probs, [](int, int) noexcept {});
}

/// One QAQ decode step of `layer` (SPEC §2.6): attention, then every token's width from the step's
/// probabilities (handed back in `probs`); the same result as decode_attention then update_widths. q.dim0 must
/// equal the cache's batch (every sequence's history advances). Each stream's update runs right after its
/// attention on the same thread, in one parallel loop (its probabilities still in cache, no second fork and
/// uneven update work levelled by the loop's dynamic schedule; T = 32768: 13.5 -> 12.9 ms a step at rho 0.995,
/// 14.8 -> 13.7 at rho 0). That needs the attention not to fail once streams are updated: the inputs are
/// checked first, and for a query whose scores could overflow float (qaq::detail::scores_cannot_overflow false,
/// far beyond real queries) the step runs the two halves apart, so an overflow error leaves the cache
/// unchanged. The probabilities of the fused step are valid by construction (finite softmax outputs in
/// [0, 1]): not re-checked.
template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds, class Meta, class... Rot>
void qaq_decode_step(CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...>& cache, int layer,
                     QueryView q, OutputView out, const AttentionOptions& opt, qaq::TokenProbs& probs) {
  using Cache = CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...>;
  KVC_CHECK(q.dim0 == cache.config().batch, Errc::kInvalidArgument, "a QAQ decode step attends every sequence: query holds ",
            q.dim0, ", the cache ", cache.config().batch);
  (void)qaq::detail::checked_lengths(cache, layer, q, out, opt);  // before the overflow test reads the query
  if (!Cache::kAdaptive || !qaq::detail::scores_cannot_overflow(q, cache.config().head_dim, opt, Cache::rotation::kKeys)) {
    decode_attention(cache, layer, q, out, opt, &probs);
    cache.update_widths(layer, probs);  // (BMin == BMax: counts the step; nothing moves)
    return;
  }
  using Access = qaq::detail::FusedStep;
  Access::reserve(cache, qaq::detail::attention_threads(opt));
  qaq::detail::attend(cache, layer, q, out, opt, &probs, [&](int i, int thread) {
    Access::update(cache, layer, i, probs.row(i / cache.config().kv_heads, i % cache.config().kv_heads), thread);
  });
  Access::count_update(cache);
}
}  // namespace kvc
