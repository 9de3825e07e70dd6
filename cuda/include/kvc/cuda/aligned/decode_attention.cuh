/// \file decode_attention.cuh (aligned)
/// Decode attention on the GPU over AlignedKV's device cache (DeviceAlignedCache): the CPU kernel's computation
/// (aligned/decode_attention.hpp) read straight from the bit planes, each element at the tier its rule gives and
/// only the planes that tier needs: Rule 1 key tiers per (sequence, KV head), scores split over the GPU, a softmax
/// per query head, Rule 2's reference per query head, then p . V with per-row tiers, split and summed
/// (aligned/detail/kernels.cuh). fp32 accumulation; the result is the attention over the truncated cache up to
/// float summation order (a probability right at a value tier's threshold may round to the other tier).
/// Host API; kernels run on `stream`.
#pragma once

#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/core/error.hpp>
#include <kvc/cuda/aligned/detail/kernels.cuh>
#include <kvc/cuda/aligned/device_aligned_cache.cuh>
#include <kvc/cuda/decode_attention.cuh>
#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/device_info.cuh>
#include <kvc/cuda/error.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace kvc::cuda {

namespace aligned_detail {
/// Plans the splits, launches the five kernels; counters: device [kCounters] zeroed, or null (no statistics).
template <class L, int D, int Heads>
void launch_attention(const Params& p, int longest, int nseq, int group, const float* q, float* out, float scale_log2,
                      const DecodeOptions& opt, unsigned long long* counters, cudaStream_t stream) {
  const DeviceLimits dev = device_limits();
  const int items = nseq * p.kv_heads;
  const int target = opt.target_ctas > 0 ? opt.target_ctas : 4 * dev.sms;
  // a split reads at least min_blocks_per_split blocks of tokens, whole blocks, and the splits fill the GPU
  const int min_per = L::kBlock * opt.min_blocks_per_split;
  int splits = std::max(1, std::min((target + items - 1) / items, (longest + min_per - 1) / min_per));
  const int per = ((longest + splits - 1) / splits + L::kBlock - 1) / L::kBlock * L::kBlock;
  splits = (longest + per - 1) / per;
  const int qheads = p.kv_heads * group;
  const std::size_t rows = std::size_t(nseq) * qheads;
  StreamScratch<float> scores(rows * std::size_t(longest), stream), part(std::size_t(splits) * rows * D, stream),
      scales(rows * 2, stream);
  StreamScratch<std::uint8_t> ktier(std::size_t(items) * D, stream);
  key_tiers_kernel<L><<<dim3(unsigned(p.kv_heads), unsigned(nseq)), 1, 0, stream>>>(p, q, group, ktier.data(), counters);
  check_launch("aligned key_tiers_kernel");
  scores_kernel<L, D, Heads><<<dim3(unsigned(splits), unsigned(p.kv_heads), unsigned(nseq)), kThreads, 0, stream>>>(
      p, q, ktier.data(), group, scale_log2, per, scores.data(), longest);
  check_launch("aligned scores_kernel");
  softmax_kernel<L><<<dim3(unsigned(qheads), unsigned(nseq)), kThreads, 0, stream>>>(p, qheads, scores.data(), longest);
  check_launch("aligned softmax_kernel");
  reference_kernel<L, D><<<dim3(unsigned(qheads), unsigned(nseq)), kThreads, 0, stream>>>(p, group, scores.data(),
                                                                                         longest, scales.data());
  check_launch("aligned reference_kernel");
  const int chunks = (group + Heads - 1) / Heads;
  values_kernel<L, D, Heads><<<dim3(unsigned(splits), unsigned(p.kv_heads * chunks), unsigned(nseq)), kThreads, 0,
                               stream>>>(p, group, per, scores.data(), longest, scales.data(), nseq, part.data(), counters);
  check_launch("aligned values_kernel");
  sum_splits_kernel<D><<<unsigned(rows), unsigned(std::min(D, 256)), 0, stream>>>(part.data(), splits, rows, out);
  check_launch("aligned sum_splits_kernel");
}
}  // namespace aligned_detail

/// Decode attention over `layer` of a DeviceAlignedCache with head dimension D (= the cache's head_dim).
/// q, out: device fp32 [nseq][query_heads][D]; nseq <= batch; query_heads a positive multiple of kv_heads; every
/// one of the nseq sequences must hold a token. Asynchronous on `stream`, except with `stats` (host memory):
/// then set to what the call read (aligned::ReadStats, as the CPU kernel counts it) after one synchronisation
/// of `stream`. Scores are not checked for overflow (the CPU kernel throws; here the output shows NaN / Inf).
template <int D, class L>
void decode_attention(const DeviceAlignedCache<L>& cache, int layer, int nseq, int query_heads, const float* q,
                      float* out, const DecodeOptions& opt = {}, aligned::ReadStats* stats = nullptr,
                      cudaStream_t stream = nullptr) {
  const CacheConfig& cfg = cache.config();
  detail::check_decode_call(cfg.head_dim, D, cfg.batch, cfg.kv_heads, nseq, query_heads, q != nullptr && out != nullptr,
                            "query or output", opt);
  constexpr int B = L::kBlock;
  int longest = 0;
  aligned::ReadStats known;  // what the lengths alone decide: estimate, staging, metadata
  const int group = query_heads / cfg.kv_heads;
  for (int s = 0; s < nseq; ++s) {
    const int T = cache.length(layer, s);
    KVC_CHECK(T > 0, Errc::kInvalidArgument, "sequence ", s, " of layer ", layer, " holds no token");
    longest = std::max(longest, T);
    const std::size_t H = std::size_t(cfg.kv_heads);
    known.estimate_bytes += H * std::size_t(group) * std::size_t(std::min(L::kTopK, T)) * D;
    known.staged_bytes += H * std::size_t(T % B) * D * 2 * sizeof(half_t);
    known.meta_bytes += H * 2 * std::size_t(D);
  }
  const float scale = (opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(float(D))) * 1.4426950408889634f;
  const aligned_detail::Params p = cache.params(layer);
  StreamScratch<unsigned long long> counters(stats ? aligned_detail::kCounters : 0, stream);
  if (stats)
    check(cudaMemsetAsync(counters.data(), 0, sizeof(unsigned long long) * aligned_detail::kCounters, stream),
          "cudaMemsetAsync (AlignedKV read statistics)");
  if (group == 1) aligned_detail::launch_attention<L, D, 1>(p, longest, nseq, group, q, out, scale, opt, counters.data(), stream);
  else if (group <= 4) aligned_detail::launch_attention<L, D, 4>(p, longest, nseq, group, q, out, scale, opt, counters.data(), stream);
  else aligned_detail::launch_attention<L, D, 8>(p, longest, nseq, group, q, out, scale, opt, counters.data(), stream);
  if (!stats) return;
  unsigned long long n[aligned_detail::kCounters] = {};
  check(cudaMemcpyAsync(n, counters.data(), sizeof n, cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync (AlignedKV read statistics)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (AlignedKV read statistics)");
  // key elements by tier, value rows of D elements by tier: hi8 each, plus their nibble planes
  *stats = known;
  for (int i = 0; i < 3; ++i) stats->count_keys(8 + 4 * i, std::size_t(n[i])), stats->count_values(8 + 4 * i, std::size_t(n[3 + i]) * D);
  stats->key_bytes += std::size_t(n[0] + n[1] + n[2]), stats->value_bytes += std::size_t(n[3] + n[4] + n[5]) * D;
}

/// The same, dispatching the cache's head dimension at run time to the kernels of `HeadDims...` (default
/// 64, 80, 96, 128, 256; name fewer to compile fewer). Throws for another head dimension.
template <int... HeadDims, class L>
void decode_attention_any(const DeviceAlignedCache<L>& cache, int layer, int nseq, int query_heads, const float* q,
                          float* out, const DecodeOptions& opt = {}, aligned::ReadStats* stats = nullptr,
                          cudaStream_t stream = nullptr) {
  detail::with_head_dim<HeadDims...>(
      cache.config().head_dim,
      [&]<int D>() { decode_attention<D>(cache, layer, nseq, query_heads, q, out, opt, stats, stream); }, "AlignedKV");
}
}  // namespace kvc::cuda
