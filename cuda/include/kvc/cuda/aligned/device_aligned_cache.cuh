/// \file device_aligned_cache.cuh
/// `kvc::cuda::DeviceAlignedCache<AlignedLoader<...>>`: AlignedKV's cache on the GPU, the device twin of the host
/// `CompressedKVCache<AlignedLoader<...>>` (aligned/aligned_cache.hpp) with the same bytes per (layer, sequence,
/// KV head) stream:
///   - keys of the complete blocks channel-major per block: hi8 [blocks][d][Block], mid4 / lo4 [blocks][d][Block / 2];
///   - values of those tokens token-major: hi8 [tokens][d], mid4 / lo4 [tokens][d / 2];
///   - the incomplete block's fp16 K and V in staging, [tokens][d] (< Block tokens);
///   - Kmax / Vmax [d]: the fp16 exponent fields of the largest |K|, |V| per channel.
/// Each stream's planes are allocated for the capacity's complete blocks (capacity / Block), its staging for
/// Block - 1 tokens. Filled by append() on the device (the host cache's bytes) or upload() from a host cache
/// (synchronous); read by decode_attention (aligned/decode_attention.cuh).
/// Errors: bad input throws kvc::Error before anything is written. Host API; not thread-safe.
#pragma once

#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/cache/policies.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>
#include <kvc/cuda/aligned/detail/kernels.cuh>
#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/cuda/error.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvc {
template <class... P>
class CompressedKVCache;  // host only (aligned/aligned_cache.hpp); upload() takes one
}  // namespace kvc

namespace kvc::cuda {

template <class L>
class DeviceAlignedCache;

template <int KLo, int KHi, int VLo, int VHi, int TopK, int Block>
class DeviceAlignedCache<AlignedLoader<KLo, KHi, VLo, VHi, TopK, Block>> {
 public:
  using loader = AlignedLoader<KLo, KHi, VLo, VHi, TopK, Block>;
  using host_cache = CompressedKVCache<loader>;
  using params_type = aligned_detail::Params;
  static constexpr int kBlockTokens = Block;

  /// One stream's bytes copied back from the device (the host cache's Stream vectors, same sizes and layout).
  struct StreamCopy {
    std::vector<std::uint8_t> khi, kmid, klo, vhi, vmid, vlo;
    std::vector<half_t> kst, vst;
    std::vector<std::uint8_t> kmax, vmax;
  };

  /// cfg as for every cache: positive sizes, head_dim a multiple of 16 (the host cache's checks and messages).
  explicit DeviceAlignedCache(const CacheConfig& cfg) : cfg_(cfg) {
    (void)rules::validate(cfg);
    const int d = cfg.head_dim;
    hi_stride_ = std::size_t(cfg.capacity / Block) * Block * d;
    stage_stride_ = std::size_t(Block - 1) * d;
    const std::size_t streams = std::size_t(cfg.batch) * cfg.kv_heads;
    layers_.reserve(std::size_t(cfg.layers));
    for (int l = 0; l < cfg.layers; ++l) {
      Layer L;
      L.khi = DeviceBuffer<std::uint8_t>(streams * hi_stride_);
      L.kmid = DeviceBuffer<std::uint8_t>(streams * hi_stride_ / 2);
      L.klo = DeviceBuffer<std::uint8_t>(streams * hi_stride_ / 2);
      L.vhi = DeviceBuffer<std::uint8_t>(streams * hi_stride_);
      L.vmid = DeviceBuffer<std::uint8_t>(streams * hi_stride_ / 2);
      L.vlo = DeviceBuffer<std::uint8_t>(streams * hi_stride_ / 2);
      L.kst = DeviceBuffer<half_t>(streams * stage_stride_);
      L.vst = DeviceBuffer<half_t>(streams * stage_stride_);
      L.kmax = DeviceBuffer<std::uint8_t>(streams * d);
      L.vmax = DeviceBuffer<std::uint8_t>(streams * d);
      L.lengths = DeviceBuffer<int>(std::size_t(cfg.batch));
      layers_.push_back(std::move(L));
    }
    lengths_.assign(std::size_t(cfg.layers) * cfg.batch, 0);
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] int length(int layer, int seq) const {
    rules::check_index(cfg_, layer, seq);
    return lengths_[std::size_t(layer) * cfg_.batch + seq];
  }
  /// The layer's token counts in host memory (what the kernels read on the device).
  [[nodiscard]] const int* host_lengths(int layer) const {
    rules::check_index(cfg_, layer, 0);
    return lengths_.data() + std::size_t(layer) * cfg_.batch;
  }
  /// What the kernels read of `layer` (device pointers).
  [[nodiscard]] params_type params(int layer) const {
    rules::check_index(cfg_, layer, 0);
    // append() writes through these pointers (device memory this object owns; params() is const so that
    // attention can take a const cache, whose kernels only read)
    Layer& L = const_cast<Layer&>(layers_[std::size_t(layer)]);
    return {cfg_.batch,  cfg_.kv_heads,  cfg_.head_dim,  Block,         hi_stride_,     stage_stride_,
            L.lengths.data(), L.khi.data(), L.kmid.data(), L.klo.data(), L.vhi.data(), L.vmid.data(),
            L.vlo.data(),     L.kst.data(), L.vst.data(),  L.kmax.data(), L.vmax.data()};
  }

  /// Appends k.dim0 tokens from HOST memory (fp32 [tokens][kv_heads][head_dim], finite, |x| <= 65504) as the host
  /// cache does, on the device: the same bytes (fp16 by half_t::from_float; completed blocks into the planes, the
  /// rest into the staging; Kmax / Vmax). Validates everything first (the host cache's errors): an error leaves
  /// the cache unchanged. Asynchronous on `stream` (the input is staged before the call returns).
  void append(int layer, int seq, KVView k, KVView v, cudaStream_t stream = nullptr) {
    rules::check_index(cfg_, layer, seq);
    int& n = lengths_[std::size_t(layer) * cfg_.batch + seq];
    const int tokens = rules::check_append_shape(cfg_, layer, seq, n, k, v);
    if (tokens == 0) return;
    rules::check_values(k, "key");
    rules::check_values(v, "value");
    const int d = cfg_.head_dim, H = cfg_.kv_heads;
    const std::size_t half = std::size_t(tokens) * H * d;
    std::vector<float> x(2 * half);  // keys, then values, [tokens][kv_heads][head_dim] contiguous
    for (int t = 0; t < tokens; ++t)
      for (int h = 0; h < H; ++h) {
        std::copy_n(k.row(t, h), d, x.begin() + std::ptrdiff_t((std::size_t(t) * H + h) * d));
        std::copy_n(v.row(t, h), d, x.begin() + std::ptrdiff_t(half + (std::size_t(t) * H + h) * d));
      }
    StreamScratch<float> dx(x.size(), stream);
    check(cudaMemcpyAsync(dx.data(), x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (AlignedKV append)");  // pageable source: staged before the call returns
    aligned_detail::append_kernel<Block><<<unsigned(H), 256, 0, stream>>>(params(layer), seq, n, tokens, dx.data(),
                                                                          dx.data() + half);
    check_launch("aligned append_kernel");
    n += tokens;
  }

  /// Copies a host cache of the same config (every layer: planes, staging, Kmax / Vmax, lengths); synchronous.
  /// A different config throws kvc::Error (kInvalidArgument) and leaves this cache unchanged.
  void upload(const host_cache& host) {
    const CacheConfig& hc = host.config();
    KVC_CHECK(hc.layers == cfg_.layers && hc.batch == cfg_.batch && hc.kv_heads == cfg_.kv_heads &&
                  hc.head_dim == cfg_.head_dim && hc.capacity == cfg_.capacity,
              Errc::kInvalidArgument, "upload: the host cache's config differs from the device cache's");
    const int d = cfg_.head_dim;
    const std::size_t streams = std::size_t(cfg_.batch) * cfg_.kv_heads;
    for (int l = 0; l < cfg_.layers; ++l) {
      Layer& L = layers_[std::size_t(l)];
      std::vector<std::uint8_t> planes[6];
      for (int i = 0; i < 6; ++i) planes[i].assign(streams * (i % 3 == 0 ? hi_stride_ : hi_stride_ / 2), 0);
      std::vector<half_t> kst(streams * stage_stride_), vst(streams * stage_stride_);
      std::vector<std::uint8_t> kmax(streams * d), vmax(streams * d);
      for (int s = 0; s < cfg_.batch; ++s)
        for (int h = 0; h < cfg_.kv_heads; ++h) {
          const std::size_t st = std::size_t(s) * cfg_.kv_heads + h;
          const auto& hs = host.stream(l, s, h);
          const std::vector<std::uint8_t>* src[6] = {&hs.khi, &hs.kmid, &hs.klo, &hs.vhi, &hs.vmid, &hs.vlo};
          for (int i = 0; i < 6; ++i)
            std::copy(src[i]->begin(), src[i]->end(),
                      planes[i].begin() + std::ptrdiff_t(st * (i % 3 == 0 ? hi_stride_ : hi_stride_ / 2)));
          std::copy(hs.kst.begin(), hs.kst.end(), kst.begin() + std::ptrdiff_t(st * stage_stride_));
          std::copy(hs.vst.begin(), hs.vst.end(), vst.begin() + std::ptrdiff_t(st * stage_stride_));
          std::copy(hs.kmax.begin(), hs.kmax.end(), kmax.begin() + std::ptrdiff_t(st * d));
          std::copy(hs.vmax.begin(), hs.vmax.end(), vmax.begin() + std::ptrdiff_t(st * d));
        }
      std::uint8_t* dst[6] = {L.khi.data(), L.kmid.data(), L.klo.data(), L.vhi.data(), L.vmid.data(), L.vlo.data()};
      for (int i = 0; i < 6; ++i) put(dst[i], planes[i].data(), planes[i].size());
      put(L.kst.data(), kst.data(), kst.size());
      put(L.vst.data(), vst.data(), vst.size());
      put(L.kmax.data(), kmax.data(), kmax.size());
      put(L.vmax.data(), vmax.data(), vmax.size());
      std::vector<int> lengths(std::size_t(cfg_.batch));
      for (int s = 0; s < cfg_.batch; ++s) lengths[std::size_t(s)] = host.length(l, s);
      put(L.lengths.data(), lengths.data(), lengths.size());
      std::copy(lengths.begin(), lengths.end(), lengths_.begin() + std::ptrdiff_t(std::size_t(l) * cfg_.batch));
    }
  }

  /// One stream's bytes as the host cache holds them (synchronous; tests).
  [[nodiscard]] StreamCopy stream(int layer, int seq, int head) const {
    rules::check_index(cfg_, layer, seq);
    KVC_CHECK(head >= 0 && head < cfg_.kv_heads, Errc::kInvalidArgument, "KV head ", head, " out of range [0, ",
              cfg_.kv_heads, ")");
    const Layer& L = layers_[std::size_t(layer)];
    const int d = cfg_.head_dim, T = length(layer, seq), full = T / Block * Block;
    const std::size_t st = std::size_t(seq) * cfg_.kv_heads + head, hi = std::size_t(full) * d;
    const std::size_t staged = std::size_t(T - full) * d;
    StreamCopy c;
    get(c.khi, L.khi.data() + st * hi_stride_, hi);
    get(c.kmid, L.kmid.data() + st * (hi_stride_ / 2), hi / 2);
    get(c.klo, L.klo.data() + st * (hi_stride_ / 2), hi / 2);
    get(c.vhi, L.vhi.data() + st * hi_stride_, hi);
    get(c.vmid, L.vmid.data() + st * (hi_stride_ / 2), hi / 2);
    get(c.vlo, L.vlo.data() + st * (hi_stride_ / 2), hi / 2);
    get(c.kst, L.kst.data() + st * stage_stride_, staged);
    get(c.vst, L.vst.data() + st * stage_stride_, staged);
    get(c.kmax, L.kmax.data() + st * d, std::size_t(d));
    get(c.vmax, L.vmax.data() + st * d, std::size_t(d));
    return c;
  }

  /// Device memory held: every layer's planes, staging, Kmax / Vmax and lengths.
  [[nodiscard]] std::size_t allocated_bytes() const {
    std::size_t total = 0;
    for (const Layer& L : layers_)
      total += L.khi.bytes() + L.kmid.bytes() + L.klo.bytes() + L.vhi.bytes() + L.vmid.bytes() + L.vlo.bytes() +
               L.kst.bytes() + L.vst.bytes() + L.kmax.bytes() + L.vmax.bytes() + L.lengths.bytes();
    return total;
  }

 private:
  // the shape and index checks of every cache (the fp16 cache's rules, as the host AlignedKV cache uses)
  using rules = typename DeviceKVCache<NoQuantizer<half_t>>::rules;
  struct Layer {
    DeviceBuffer<std::uint8_t> khi, kmid, klo, vhi, vmid, vlo, kmax, vmax;
    DeviceBuffer<half_t> kst, vst;
    DeviceBuffer<int> lengths;
  };
  template <class T>
  static void put(T* dst, const T* src, std::size_t n) {
    if (n) check(cudaMemcpy(dst, src, n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy (AlignedKV upload)");
  }
  template <class T>
  static void get(std::vector<T>& dst, const T* src, std::size_t n) {
    dst.resize(n);
    if (n) check(cudaMemcpy(dst.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy (AlignedKV download)");
  }

  CacheConfig cfg_;
  std::size_t hi_stride_ = 0, stage_stride_ = 0;
  std::vector<Layer> layers_;
  std::vector<int> lengths_;
};
}  // namespace kvc::cuda
