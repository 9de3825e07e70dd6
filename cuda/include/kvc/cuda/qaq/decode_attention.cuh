/// \file decode_attention.cuh
/// Decode attention on the GPU over QAQ's mixed-bit device cache (DeviceQaqCache), reading the records
/// directly (never a decompressed cache): scores over the key records (split over the GPU), a softmax per
/// (sequence, KV head) that also writes each token's probability for the width update (the largest over
/// the KV group's query heads, SPEC Q6), then p . V over the value records and a sum over splits.
/// Host API; kernels run on `stream` (qaq/detail/kernels.cuh).
#pragma once

#include <kvc/core/error.hpp>
#include <kvc/cuda/decode_attention.cuh>
#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/device_info.cuh>
#include <kvc/cuda/error.cuh>
#include <kvc/cuda/qaq/device_qaq_cache.cuh>
#include <kvc/cuda/qaq/detail/kernels.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace kvc::cuda {

namespace qaq_detail {
template <class Q, class Rot, int D, int Heads, class QT>
void launch_attention(const Params<Q>& p, int longest, int nseq, int group, const QT* q, QT* out, float* probs,
                      int probs_stride, float scale_log2, const DecodeOptions& opt, cudaStream_t stream) {
  const DeviceLimits dev = device_limits();
  const int items = nseq * p.kv_heads;
  const int target = opt.target_ctas > 0 ? opt.target_ctas : 4 * dev.sms;
  // a split reads at least 16 x min_blocks_per_split records (QAQ has no blocks), and the splits fill the GPU
  const int min_per = 16 * opt.min_blocks_per_split;
  const int splits = std::max(1, std::min((target + items - 1) / items, (longest + min_per - 1) / min_per));
  const int per = (longest + splits - 1) / splits;
  const int qheads = p.kv_heads * group;
  const std::size_t rows = std::size_t(nseq) * qheads;
  constexpr bool kSplitV = kSplitValues<Q, Rot>;  // the outliers' share of the output, kept apart (kernels.cuh)
  StreamScratch<float> scores(rows * std::size_t(longest), stream), part(std::size_t(splits) * rows * D, stream),
      opart(kSplitV ? std::size_t(splits) * rows * D : 0, stream);
  scores_kernel<Q, D, Heads, QT, Rot><<<dim3(unsigned(splits), unsigned(p.kv_heads), unsigned(nseq)), kThreads, 0, stream>>>(
      p, q, group, scale_log2, per, scores.data(), longest);
  check_launch("qaq scores_kernel");
  softmax_kernel<Q><<<dim3(unsigned(p.kv_heads), unsigned(nseq)), kThreads, 0, stream>>>(p, group, scores.data(), longest,
                                                                                         probs, probs_stride);
  check_launch("qaq softmax_kernel");
  const int chunks = (group + Heads - 1) / Heads;
  values_kernel<Q, D, Heads, Rot>
      <<<dim3(unsigned(splits), unsigned(p.kv_heads * chunks), unsigned(nseq)), kThreads, 0, stream>>>(
          p, group, per, scores.data(), longest, nseq, part.data(), opart.data());
  check_launch("qaq values_kernel");
  sum_splits_kernel<D, QT, Rot><<<unsigned(rows), unsigned(std::min(D, 256)), 0, stream>>>(
      part.data(), opart.data(), splits, rows, out, p.rotation, qheads, group);
  check_launch("qaq sum_splits_kernel");
}
}  // namespace qaq_detail

/// Decode attention over `layer` of a DeviceQaqCache with head dimension D (= the cache's head_dim).
/// q, out: device [nseq][query_heads][D]; nseq <= batch; query_heads a positive multiple of kv_heads; every
/// one of the nseq sequences must hold a token. probs: DEVICE [batch][kv_heads][probs_stride] (probs_stride >=
/// the longest sequence) receives each token's probability (max over the KV group) for update_widths(), or
/// null (rows of sequences >= nseq are not written). Asynchronous on `stream`.
template <int D, class Q, class... Rot, class QT>
void decode_attention(const DeviceQaqCache<Q, Rot...>& cache, int layer, int nseq, int query_heads, const QT* q, QT* out,
                      float* probs, int probs_stride, const DecodeOptions& opt = {}, cudaStream_t stream = nullptr) {
  const CacheConfig& cfg = cache.config();
  detail::check_decode_call(cfg.head_dim, D, cfg.batch, cfg.kv_heads, nseq, query_heads, q != nullptr && out != nullptr,
                            "query or output", opt);
  int longest = 0;
  for (int s = 0; s < nseq; ++s) {
    const int T = cache.length(layer, s);
    KVC_CHECK(T > 0, Errc::kInvalidArgument, "sequence ", s, " of layer ", layer, " holds no token");
    longest = std::max(longest, T);
  }
  KVC_CHECK(probs == nullptr || probs_stride >= longest, Errc::kInvalidArgument, "probability rows of ", probs_stride,
            " tokens are shorter than the longest sequence (", longest, ")");
  const float scale = (opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(float(D))) * 1.4426950408889634f;
  const int group = query_heads / cfg.kv_heads;
  const auto p = cache.params(layer);
  using R = typename DeviceQaqCache<Q, Rot...>::rotation;
  if (group == 1) qaq_detail::launch_attention<Q, R, D, 1, QT>(p, longest, nseq, group, q, out, probs, probs_stride, scale, opt, stream);
  else if (group <= 4) qaq_detail::launch_attention<Q, R, D, 4, QT>(p, longest, nseq, group, q, out, probs, probs_stride, scale, opt, stream);
  else qaq_detail::launch_attention<Q, R, D, 8, QT>(p, longest, nseq, group, q, out, probs, probs_stride, scale, opt, stream);
}

/// The same, dispatching the cache's head dimension at run time to the kernels of `HeadDims...` (default
/// 64, 80, 96, 128, 256; name fewer to compile fewer). Throws for another head dimension.
template <int... HeadDims, class Q, class... Rot, class QT>
void decode_attention_any(const DeviceQaqCache<Q, Rot...>& cache, int layer, int nseq, int query_heads, const QT* q, QT* out,
                          float* probs, int probs_stride, const DecodeOptions& opt = {}, cudaStream_t stream = nullptr) {
  detail::with_head_dim<HeadDims...>(
      cache.config().head_dim,
      [&]<int D>() { decode_attention<D>(cache, layer, nseq, query_heads, q, out, probs, probs_stride, opt, stream); },
      "QAQ");
}
}  // namespace kvc::cuda
