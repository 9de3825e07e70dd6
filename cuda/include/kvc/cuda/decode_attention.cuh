/// \file decode_attention.cuh
/// Fused decode attention on the GPU over a compressed cache: one query token per sequence, H query heads
/// over H_kv KV heads (GQA: query head h reads KV head h / (H / H_kv)), softmax(q.K^T * scale) . V, read
/// straight from the compressed blocks (detail/decode_kernel.cuh) with flash-decoding splits and a merge.
/// Instantiated from the same CacheLayout the CPU attention reads, for head dims 64, 80, 96, 128, 256, and
/// fp32 / fp16 / bf16 queries (the output has the query's type). A Rotation's query transform runs in the
/// split kernel's prologue and its output transform in the merge kernel (once per query head, in fp32).
/// Host API; kernels run on `stream`.
#pragma once

#include <kvc/attention/split_merge.hpp>
#include <kvc/core/error.hpp>
#include <kvc/cuda/detail/decode_kernel.cuh>
#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/device_info.cuh>
#include <kvc/cuda/error.cuh>

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <vector>

namespace kvc::cuda {

/// Options of decode_attention. Invalid values throw kvc::Error (kInvalidArgument).
struct DecodeOptions {
  float scale = 0.0f;            ///< softmax scale, finite and >= 0; 0 means 1/sqrt(head_dim)
  int min_blocks_per_split = 8;  ///< >= 1: fewest quantized blocks a split gets
  int target_ctas = 0;           ///< >= 0: CTAs to aim for when splitting; 0 means 4 per SM
};

/// Head dimensions with a compiled kernel.
inline constexpr int kHeadDims[] = {64, 80, 96, 128, 256};

namespace detail {
template <class Layout, int D, int Heads, class QT>
void launch_decode(const typename Layout::Params& p, int max_blocks, int nseq, int group, const QT* q, QT* out,
                   float scale_log2, const DecodeOptions& opt, cudaStream_t stream,
                   unsigned long long* aligned_counters = nullptr) {
  using S = DecodeSmem<Layout, D, Heads>;
  auto kernel = decode_split_kernel<Layout, D, Heads, QT>;
  const DeviceLimits dev = device_limits();
  KVC_CHECK(S::bytes <= std::size_t(dev.smem_optin), Errc::kInvalidArgument, "decode kernel for block ",
            Layout::kBlockTokens, " x head_dim ", D, " needs ", S::bytes, " bytes of shared memory; this GPU allows ",
            dev.smem_optin);
  allow_dynamic_smem(kernel, S::bytes, "cudaFuncSetAttribute (decode_split_kernel shared memory)");
  const int chunks = (group + Heads - 1) / Heads;
  const int items = nseq * p.kv_heads * chunks;
  const SplitPlan plan =
      plan_splits(max_blocks, items, opt.target_ctas > 0 ? opt.target_ctas : 4 * dev.sms, opt.min_blocks_per_split);
  using Rot = typename Layout::rotation;
  const std::size_t merge_smem = sizeof(float) * std::size_t(merge_smem_floats(plan.splits) + (Rot::kValues ? D : 0));
  KVC_CHECK(merge_smem <= 48 * 1024, Errc::kInvalidArgument, "a plan of ", plan.splits,
            " splits exceeds the merge kernel's shared memory: raise DecodeOptions::min_blocks_per_split");
  const std::size_t rows = std::size_t(nseq) * p.kv_heads * group;
  StreamScratch<float> ml(rows * plan.splits * 2, stream), acc(rows * plan.splits * D, stream);
  kernel<<<dim3(unsigned(plan.splits), unsigned(p.kv_heads * chunks), unsigned(nseq)), kDecodeThreads, S::bytes,
           stream>>>(p, q, group, scale_log2, plan, ml.data(), acc.data(), aligned_counters);
  check_launch("decode_split_kernel");
  decode_merge_kernel<D, QT, Rot><<<dim3(unsigned(p.kv_heads * group), unsigned(nseq)), kDecodeThreads, merge_smem,
                                    stream>>>(plan.splits, ml.data(), acc.data(), out, p.rotation, group);
  check_launch("decode_merge_kernel");
}
/// The argument checks every device decode_attention makes first (kvc::Error kInvalidArgument naming the
/// problem): the kernel's head dimension D against the cache's, nseq in [1, batch], query_heads a positive multiple
/// of kv_heads, the pointers (`pointers_ok`, described by `pointers`), DecodeOptions.
inline void check_decode_call(int head_dim, int D, int batch, int kv_heads, int nseq, int query_heads, bool pointers_ok,
                              const char* pointers, const DecodeOptions& opt) {
  KVC_CHECK(head_dim == D, Errc::kInvalidArgument, "cache head_dim ", head_dim, " != kernel head_dim ", D);
  KVC_CHECK(nseq >= 1 && nseq <= batch, Errc::kInvalidArgument, "query holds ", nseq, " sequences; the cache has ", batch);
  KVC_CHECK(query_heads >= kv_heads && query_heads % kv_heads == 0, Errc::kInvalidArgument, "query heads ", query_heads,
            " are not a positive multiple of the cache's ", kv_heads, " KV heads");
  KVC_CHECK(pointers_ok, Errc::kInvalidArgument, "null ", pointers);
  KVC_CHECK(std::isfinite(opt.scale) && opt.scale >= 0.0f, Errc::kInvalidArgument, "DecodeOptions::scale ", opt.scale,
            " is not a finite value >= 0 (0 means 1/sqrt(head_dim))");
  KVC_CHECK(opt.min_blocks_per_split >= 1 && opt.target_ctas >= 0, Errc::kInvalidArgument,
            "DecodeOptions::min_blocks_per_split must be >= 1 and target_ctas >= 0 (got ", opt.min_blocks_per_split,
            ", ", opt.target_ctas, ")");
}
}  // namespace detail

/// Decode attention over one layer's Params with head dimension D (= p.head_dim).
/// q, out: device [nseq][query_heads][D], contiguous; nseq <= p.batch; query_heads a positive multiple
/// of p.kv_heads. host_lengths: the layer's token counts in host memory (the same as p.lengths, which
/// the kernels read; used to validate and to plan splits); every one of the nseq sequences must hold a
/// token. Asynchronous on `stream`; the query is not scanned for NaN/Inf (the output would show it).
template <class Layout, int D, class QT>
void decode_attention(const typename Layout::Params& p, const int* host_lengths, int nseq, int query_heads, const QT* q,
                      QT* out, const DecodeOptions& opt = {}, cudaStream_t stream = nullptr,
                      unsigned long long* aligned_counters = nullptr) {
  detail::check_decode_call(p.head_dim, D, p.batch, p.kv_heads, nseq, query_heads,
                            q != nullptr && out != nullptr && host_lengths != nullptr, "query, output or lengths", opt);
  int max_blocks = 0;
  for (int s = 0; s < nseq; ++s) {
    KVC_CHECK(host_lengths[s] > 0, Errc::kInvalidArgument, "sequence ", s, " is empty: nothing to attend to");
    const int nb = Layout::selector::quantized_blocks(host_lengths[s], Layout::kBlockTokens);
    max_blocks = nb > max_blocks ? nb : max_blocks;
  }
  const float scale = (opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(float(D))) * 1.4426950408889634f;
  const int group = query_heads / p.kv_heads;
  unsigned long long* c = aligned_counters;
  if (group == 1) detail::launch_decode<Layout, D, 1, QT>(p, max_blocks, nseq, group, q, out, scale, opt, stream, c);
  else if (group <= 4) detail::launch_decode<Layout, D, 4, QT>(p, max_blocks, nseq, group, q, out, scale, opt, stream, c);
  else detail::launch_decode<Layout, D, 8, QT>(p, max_blocks, nseq, group, q, out, scale, opt, stream, c);
}

/// Decode attention over `layer` of a DeviceKVCache with head dimension D.
template <int D, class Cache, class QT>
void decode_attention(const Cache& cache, int layer, int nseq, int query_heads, const QT* q, QT* out,
                      const DecodeOptions& opt = {}, cudaStream_t stream = nullptr) {
  decode_attention<typename Cache::layout, D, QT>(cache.params(layer), cache.host_lengths(layer), nseq, query_heads, q,
                                                  out, opt, stream);
}

/// The same over a cache whose selector's fp16 slots an AlignedLoader reads (schemes::AlignedWindow), with `stats`
/// (host memory, non-null) set to what the step read, as the CPU's decode_attention counts it: the slot planes at
/// the tiers the rules chose (key_bytes, value_bytes, key_tiers, value_tiers) and, in other_bytes, what it reads
/// whole (decode_read_bytes of the attended sequences less their slots). Synchronises `stream` once.
template <int D, class Cache, class QT>
  requires Cache::layout::kAlignedWindow
void decode_attention(const Cache& cache, int layer, int nseq, int query_heads, const QT* q, QT* out,
                      const DecodeOptions& opt, aligned::ReadStats* stats, cudaStream_t stream = nullptr) {
  KVC_CHECK(stats != nullptr, Errc::kInvalidArgument, "decode_attention: null read statistics (use the overload "
            "without them)");
  constexpr int K = detail::kAlignedCounters;
  StreamScratch<unsigned long long> counters(K, stream);
  check(cudaMemsetAsync(counters.data(), 0, sizeof(unsigned long long) * K, stream),
        "cudaMemsetAsync (slot planes' read statistics)");
  decode_attention<typename Cache::layout, D, QT>(cache.params(layer), cache.host_lengths(layer), nseq, query_heads, q,
                                                  out, opt, stream, counters.data());
  unsigned long long n[K] = {};
  check(cudaMemcpyAsync(n, counters.data(), sizeof n, cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync (slot planes' read statistics)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (slot planes' read statistics)");
  *stats = aligned::ReadStats{};
  for (int i = 0; i < 3; ++i) stats->count_keys(8 + 4 * i, std::size_t(n[i])), stats->count_values(8 + 4 * i, std::size_t(n[3 + i]));
  stats->key_bytes += std::size_t(n[6]), stats->value_bytes += std::size_t(n[7]);
  const auto& cfg = cache.config();
  std::vector<int> lengths(std::size_t(cfg.batch), 0);
  for (int s = 0; s < nseq; ++s) lengths[std::size_t(s)] = cache.length(layer, s);
  stats->other_bytes = Cache::rules::stored_bytes(cfg, lengths.data()) - Cache::rules::slot_bytes(cfg, lengths.data());
}

namespace detail {
/// Calls f.template operator()<D>() for the D among HeadDims... (none given: kHeadDims) that equals d; throws
/// kvc::Error naming the head dim otherwise. `what` names the kernel in the message.
template <int... HeadDims, class F>
void with_head_dim(int d, F&& f, const char* what) {
  auto one = [&]<int D>() {
    if (d != D) return false;
    f.template operator()<D>();
    return true;
  };
  bool done;
  if constexpr (sizeof...(HeadDims) == 0)
    done = (one.template operator()<64>() || one.template operator()<80>() || one.template operator()<96>() ||
            one.template operator()<128>() || one.template operator()<256>());
  else
    done = (one.template operator()<HeadDims>() || ...);
  KVC_CHECK(done, Errc::kInvalidArgument, "head_dim ", d, " has no CUDA ", what,
            " kernel here (compiled: 64, 80, 96, 128, 256 or the HeadDims given)");
}
}  // namespace detail

/// The same, dispatching the cache's head dimension at run time to the kernels of `HeadDims...`
/// (default: all of kHeadDims; name fewer to compile fewer). Throws for another head dimension.
template <int... HeadDims, class Cache, class QT>
void decode_attention_any(const Cache& cache, int layer, int nseq, int query_heads, const QT* q, QT* out,
                          const DecodeOptions& opt = {}, cudaStream_t stream = nullptr) {
  detail::with_head_dim<HeadDims...>(
      cache.config().head_dim,
      [&]<int D>() { decode_attention<D>(cache, layer, nseq, query_heads, q, out, opt, stream); }, "decode");
}
}  // namespace kvc::cuda
