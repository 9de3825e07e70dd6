/// \file decode_attention.hpp (qaq)
/// Fused CPU decode attention over QAQ's mixed-bit cache, handing back each token's attention probability
/// (SPEC §2.4, §2.10). Two passes per (sequence, KV head), both over the compressed records (never
/// expanded to a K/V copy):
///  1. every key bucket, width by width: q.k^_t = zero_t sum_c q_c + scale_t sum_c q_c code_tc, plus
///     q_c (x_c - x^_c) per outlier; the score lands at the record's token;
///  2. softmax per query head over the T scores; probs[t] = max over the GQA group (SPEC Q6);
///  3. every value bucket: o += p_t (zero_t + scale_t code_tc), plus p_t (x_c - x^_c) per outlier.
/// Each record's codes are unpacked once (width-specialised) and used by every query head of the group.
/// Scratch: group x T floats per stream. Float arithmetic throughout (AttentionOptions::precision has no
/// effect: there is no integer path yet), parallel over (sequence, KV head) with OpenMP. Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/attention/decode_attention.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/view.hpp>
#include <kvc/qaq/qaq_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif

namespace kvc {

/// Decode attention over `layer` of a QAQ cache; with `probs`, also each token's probability (resized to
/// [q.dim0][kv_heads][max length]) for update_widths(). Errors as kvc::decode_attention.
template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds>
void decode_attention(const CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds>>& cache,
                      int layer, QueryView q, OutputView out, const AttentionOptions& opt = {},
                      qaq::TokenProbs* probs = nullptr) {
  using Cache = CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds>>;
  using Q = typename Cache::quantizer;
  using R = typename Cache::record;
  const CacheConfig& cfg = cache.config();
  KVC_CHECK(layer >= 0 && layer < cfg.layers, Errc::kInvalidArgument, "layer ", layer, " out of range [0, ",
            cfg.layers, ")");
  std::vector<int> lengths(std::size_t(cfg.batch));
  for (int s = 0; s < cfg.batch; ++s) lengths[std::size_t(s)] = cache.length(layer, s);
  detail::check_decode_inputs(cfg.batch, cfg.kv_heads, cfg.head_dim, lengths.data(), q, out);
  (void)validate(opt);
  const int nseq = q.dim0, H = cfg.kv_heads, g = q.dim1 / H, d = cfg.head_dim;
  const float scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(float(d));
  const int tmax = *std::max_element(lengths.begin(), lengths.begin() + nseq);
  if (probs) probs->resize(nseq, H, tmax);
  std::vector<float> result(std::size_t(nseq) * q.dim1 * d);
  std::vector<unsigned char> finite(std::size_t(nseq) * H, 1);
  const int streams = nseq * H;
#if KVC_HAS_OPENMP()
  const int threads = opt.num_threads > 0 ? opt.num_threads : omp_get_max_threads();
#  pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
#endif
  for (int i = 0; i < streams; ++i) {
    const int s = i / H, kh = i % H, T = lengths[std::size_t(s)];
    std::vector<float> qs(std::size_t(g) * d), qsum(std::size_t(g), 0.0f), p(std::size_t(g) * T), o(std::size_t(g) * d, 0.0f);
    float codes[Q::kMaxHeadDim];  // one record's codes as floats
    for (int h = 0; h < g; ++h)
      for (int c = 0; c < d; ++c) {
        qs[std::size_t(h) * d + c] = q.row(s, kh * g + h)[c] * scale;
        qsum[std::size_t(h)] += qs[std::size_t(h) * d + c];
      }
    // Pass 1: scores at their tokens.
    cache.for_each_record(cache.keys(layer, s, kh), [&](const std::byte* r, int b, std::uint32_t t) {
      const typename R::Loaded k = R::load(r, d, b, codes);
      for (int h = 0; h < g; ++h) {
        const float* qh = qs.data() + std::size_t(h) * d;
        float dot = 0.0f;
        for (int c = 0; c < d; ++c) dot += qh[c] * codes[c];
        float score = k.affine.zero * qsum[std::size_t(h)] + k.affine.scale * dot;
        for (int j = 0; j < Q::outliers(d); ++j) score += qh[k.out_idx[j]] * k.correction(j);
        p[std::size_t(h) * T + t] = score;
      }
    });
    // Softmax per query head; the group's largest probability per token.
    float* pr = probs ? probs->row(s, kh) : nullptr;
    for (int h = 0; h < g; ++h) {
      float* ph = p.data() + std::size_t(h) * T;
      const float mx = *std::max_element(ph, ph + T);
      float sum = 0.0f;
      for (int t = 0; t < T; ++t) sum += (ph[t] = std::exp(ph[t] - mx));
      if (!std::isfinite(mx) || !std::isfinite(sum)) finite[std::size_t(i)] = 0;
      const float inv = 1.0f / sum;
      for (int t = 0; t < T; ++t) {
        ph[t] *= inv;
        if (pr) pr[t] = h == 0 ? ph[t] : std::max(pr[t], ph[t]);
      }
    }
    // Pass 2: the probability-weighted values.
    cache.for_each_record(cache.values(layer, s, kh), [&](const std::byte* r, int b, std::uint32_t t) {
      const typename R::Loaded v = R::load(r, d, b, codes);
      for (int h = 0; h < g; ++h) {
        const float w = p[std::size_t(h) * T + t];
        float* oh = o.data() + std::size_t(h) * d;
        const float wz = w * v.affine.zero, ws = w * v.affine.scale;
        for (int c = 0; c < d; ++c) oh[c] += wz + ws * codes[c];
        for (int j = 0; j < Q::outliers(d); ++j) oh[v.out_idx[j]] += w * v.correction(j);
      }
    });
    for (int h = 0; h < g; ++h)
      std::copy_n(o.data() + std::size_t(h) * d, d, result.data() + (std::size_t(s) * q.dim1 + kh * g + h) * d);
  }
  for (int i = 0; i < streams; ++i)
    KVC_CHECK(finite[std::size_t(i)], Errc::kOutOfRange, "attention scores of sequence ", i / H, " KV head ", i % H,
              " overflow float: scale the query or the cache down");
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < q.dim1; ++h) std::copy_n(result.data() + (std::size_t(s) * q.dim1 + h) * d, d, out.row(s, h));
}

/// One QAQ decode step of `layer` (SPEC §2.6): attention, then every token's width from the step's
/// probabilities. q.dim0 must equal the cache's batch (every sequence's history advances).
template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds>
void qaq_decode_step(CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds>>& cache, int layer,
                     QueryView q, OutputView out, const AttentionOptions& opt, qaq::TokenProbs& probs) {
  KVC_CHECK(q.dim0 == cache.config().batch, Errc::kInvalidArgument, "a QAQ decode step attends every sequence: query holds ",
            q.dim0, ", the cache ", cache.config().batch);
  decode_attention(cache, layer, q, out, opt, &probs);
  cache.update_widths(layer, probs);
}
}  // namespace kvc
