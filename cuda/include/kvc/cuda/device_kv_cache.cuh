/// \file device_kv_cache.cuh
/// `kvc::cuda::DeviceKVCache<Policy...>`: the device-resident twin of `kvc::CompressedKVCache<Policy...>`.
/// The same policies resolve to the same `CacheLayout` (cache/policies.hpp), so `params(layer)` is the
/// same trivially-copyable Params the CPU attention reads, with device pointers, and the arenas hold the
/// same bytes: upload()/download() copy a host cache of the same policies bit for bit, and a device
/// append stores the codes and metadata a host append stores (same policy code on the same values).
///
/// Compression on the device covers block mode: uniform, group/KIVI, every selector (the window and sink,
/// LogWindow: the host runs the selector's rule over slot labels and the device moves the rows;
/// PartialLogWindow: the device quantizes the value rows whose content changed, from their fp16 rows),
/// identity fp32/fp16/bf16, and GEAR's block-scope outliers and low-rank residual (outliers and
/// backbone in one kernel, bit-identical to the host; the rank-r fit by the same power_iteration code
/// over cuBLAS/cuSOLVER, equal to the host's up to fp32 rounding). With an AlignedLoader the selector's
/// slots are AlignedKV's bit planes (aligned/slot_planes.hpp), written by the device as the host writes
/// them and read by the decode kernel at the loader's tiers. LiteralMode and LowRankInit::kWarm
/// keep host state and are host-only (a compile error here).
/// Errors: bad input throws kvc::Error (the host cache's messages) before anything is written; CUDA
/// failures throw kvc::Error(kCuda) with the runtime's text. Host API; not thread-safe.
#pragma once

#include <kvc/cache/append_plan.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/cache/policies.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/view.hpp>
#include <kvc/cuda/detail/append_kernels.cuh>
#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/device_info.cuh>
#include <kvc/cuda/error.cuh>
#include <kvc/cuda/linalg.cuh>
#include <kvc/gear/power_iteration.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace kvc {
template <class... P>
class CompressedKVCache;  // cache/compressed_kv_cache.hpp (host only: not included here)
}  // namespace kvc

namespace kvc::cuda {

template <class... P>
class DeviceKVCache {
  using R = kvc::detail::resolve_policies<P...>;
  static_assert(kvc::detail::cache_checks<P...>::kOk);  // the messages come from detail::cache_checks
  static_assert(std::is_void_v<typename R::streaming>,
                "kvc::cuda::DeviceKVCache compresses in block mode; kvc::LiteralMode recompresses the whole history "
                "and exists on the host only (CompressedKVCache)");

 public:
  using key_quantizer = typename R::key_q;
  using value_quantizer = typename R::value_q;
  using selector = typename R::selector;
  static constexpr int kBlockTokens = R::block::kTokens;
  using rotation = typename R::rotation;  ///< NoRotation when absent
  using layout = CacheLayout<key_quantizer, value_quantizer, selector, kBlockTokens, typename R::key_corr,
                             typename R::value_corr, typename R::stream_outliers, rotation, typename R::loader>;
  using params_type = typename layout::Params;
  using key_format = typename layout::key_format;
  using value_format = typename layout::value_format;
  using window_t = typename layout::window_t;
  using rules = kvc::detail::CacheRules<layout>;
  using residual = typename R::residual;  ///< void when absent
  /// Whether append() exists: LowRankInit::kWarm carries each stream's basis on the host only.
  static constexpr bool kDeviceAppend = [] {
    if constexpr (std::is_void_v<residual>) return true;
    else return residual::kInit != LowRankInit::kWarm;
  }();

  explicit DeviceKVCache(const CacheConfig& cfg) : cfg_(cfg), cap_blocks_(rules::validate(cfg)) {
    const std::size_t streams = std::size_t(cfg.layers) * cfg.batch * cfg.kv_heads;
    const std::size_t d = std::size_t(cfg.head_dim);
    k_blocks_ = DeviceBuffer<std::byte>(streams * cap_blocks_ * key_format::block_bytes(cfg.head_dim));
    v_blocks_ = DeviceBuffer<std::byte>(streams * cap_blocks_ * value_format::block_bytes(cfg.head_dim));
    k_fp_ = DeviceBuffer<window_t>(streams * layout::kFpStride * d);  // rows, or slot planes of as many bytes
    v_fp_ = DeviceBuffer<window_t>(streams * layout::kFpStride * d);
    v_fq_ = DeviceBuffer<std::byte>(streams * layout::kFpSlots * layout::value_row_bytes(cfg.head_dim));
    lengths_ = DeviceBuffer<int>(std::size_t(cfg.layers) * cfg.batch);
    host_lengths_.assign(std::size_t(cfg.layers) * cfg.batch, 0);
    first_bad_ = DeviceBuffer<unsigned long long>(1);
    if constexpr (layout::kRotated) {  // the host cache's tables, drawn from the same seed
      host_rot_.resize(cfg.layers * layout::rotation_words(cfg.kv_heads, cfg.head_dim));
      rotation::make_tables(cfg.layers, cfg.kv_heads, cfg.head_dim, host_rot_.data());
      rot_ = DeviceBuffer<std::uint32_t>(host_rot_.size());
      check(cudaMemcpy(rot_.data(), host_rot_.data(), host_rot_.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
            "cudaMemcpy (rotation tables)");
    }
    if constexpr (kDeviceAppend) {
      check_compress_smem<key_format>("key");
      check_compress_smem<value_format>("value");
    }
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] int length(int layer, int seq) const {
    rules::check_index(cfg_, layer, seq);
    return host_lengths_[std::size_t(layer) * cfg_.batch + seq];
  }
  [[nodiscard]] int quantized_blocks(int layer, int seq) const {
    return selector::quantized_blocks(length(layer, seq), kBlockTokens);
  }
  /// Token counts of layer's sequences, host memory (what the launchers plan splits with).
  [[nodiscard]] const int* host_lengths(int layer) const {
    rules::check_index(cfg_, layer, 0);
    return host_lengths_.data() + std::size_t(layer) * cfg_.batch;
  }

  /// Appends k.dim0 tokens to sequence `seq` of `layer` from HOST memory (k, v: [tokens][kv_heads][head_dim],
  /// any strides): validated (and rotated, with a Rotation) on the host, copied, then compressed by the
  /// device on `stream`.
  void append(int layer, int seq, KVView k, KVView v, cudaStream_t stream = nullptr) {
    const int tokens = check_append(layer, seq, k, v);
    if (tokens == 0) return;
    std::vector<float> k_rot, v_rot;
    k = rules::rotated_input(k, true, host_rotation(layer), k_rot);
    v = rules::rotated_input(v, false, host_rotation(layer), v_rot);
    const std::size_t count = std::size_t(tokens) * cfg_.kv_heads * cfg_.head_dim;
    std::vector<float> host(2 * count);
    pack(k, host.data());
    pack(v, host.data() + count);
    StreamScratch<float> dev(2 * count, stream);
    check(cudaMemcpyAsync(dev.data(), host.data(), 2 * count * sizeof(float), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (append input)");
    enqueue_append(layer, seq, tokens, dev.data(), dev.data() + count, stream);
    // `host` is pageable: cudaMemcpyAsync has staged it before returning, so it may go out of scope.
  }

  /// Appends from DEVICE memory (k, v: contiguous [tokens][kv_heads][head_dim] fp32). The values are
  /// scanned on `stream` first (one synchronisation); the first bad one throws the host cache's error and
  /// nothing is written. The compression then reads k and v asynchronously: keep them alive (and
  /// unchanged) until the work queued on `stream` has finished.
  void append_device(int layer, int seq, KVView k, KVView v, cudaStream_t stream = nullptr) {
    const int tokens = check_append(layer, seq, k, v);
    if (tokens == 0) return;
    for (const KVView* x : {&k, &v})
      KVC_CHECK(x->stride1 == x->dim2 && x->stride0 == std::ptrdiff_t(x->dim1) * x->dim2, Errc::kInvalidArgument,
                "append_device needs contiguous [tokens][kv_heads][head_dim] inputs (strides ", x->stride0, ", ",
                x->stride1, ")");
    // With a Rotation, the rows are rotated into scratch first: the inputs are scanned for NaN/Inf, the rotated
    // rows for the range (as the host cache checks them).
    const std::size_t count = k.size();
    StreamScratch<float> rotated(layout::kRotated ? 2 * count : 0, stream);
    const float* kin = k.data;
    const float* vin = v.data;
    if constexpr (rotation::kKeys) kin = rotate_device(layer, k, "key", true, rotated.data(), stream);
    else scan(k, "key", stream);
    if constexpr (rotation::kValues) vin = rotate_device(layer, v, "value", false, rotated.data() + count, stream);
    else scan(v, "value", stream);
    enqueue_append(layer, seq, tokens, kin, vin, stream);
  }

  /// Forgets sequence `seq` in every layer (ordered on `stream` like an append).
  void clear(int seq, cudaStream_t stream = nullptr) {
    rules::check_index(cfg_, 0, seq);
    for (int l = 0; l < cfg_.layers; ++l) set_length(l, seq, 0, stream);
  }

  /// The view of one layer the CUDA kernels read (device pointers; lengths in device memory).
  [[nodiscard]] params_type params(int layer) const {
    rules::check_index(cfg_, layer, 0);
    const std::size_t s0 = std::size_t(layer) * cfg_.batch * cfg_.kv_heads, d = std::size_t(cfg_.head_dim);
    auto* self = const_cast<DeviceKVCache*>(this);
    return params_type{cfg_.batch,
                       cfg_.kv_heads,
                       cfg_.head_dim,
                       cap_blocks_,
                       self->lengths_.data() + std::size_t(layer) * cfg_.batch,
                       self->k_blocks_.data() + s0 * cap_blocks_ * key_format::block_bytes(cfg_.head_dim),
                       self->v_blocks_.data() + s0 * cap_blocks_ * value_format::block_bytes(cfg_.head_dim),
                       self->k_fp_.data() + s0 * layout::kFpStride * d,
                       self->v_fp_.data() + s0 * layout::kFpStride * d,
                       0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                       layout::kQuantizedFpValues
                           ? self->v_fq_.data() + s0 * layout::kFpSlots * layout::value_row_bytes(cfg_.head_dim)
                           : nullptr,
                       layout::kRotated ? rot_.data() + rotation_offset(layer) : nullptr};
  }

  /// Live bytes of one layer (= the bytes one decode step over it reads); the host cache's accounting.
  [[nodiscard]] std::size_t stored_bytes(int layer) const { return rules::stored_bytes(cfg_, host_lengths(layer)); }
  [[nodiscard]] std::size_t decode_read_bytes(int layer) const { return stored_bytes(layer); }
  [[nodiscard]] double bits_per_element() const {
    std::size_t bytes = 0, elems = 0;
    for (int l = 0; l < cfg_.layers; ++l) {
      bytes += stored_bytes(l);
      for (int s = 0; s < cfg_.batch; ++s) elems += std::size_t(length(l, s)) * 2u * cfg_.kv_heads * cfg_.head_dim;
    }
    return elems ? 8.0 * double(bytes) / double(elems) : 0.0;
  }
  [[nodiscard]] std::size_t allocated_bytes() const {
    return k_blocks_.bytes() + v_blocks_.bytes() + k_fp_.bytes() + v_fp_.bytes() + v_fq_.bytes() + lengths_.bytes() +
           rot_.bytes();
  }

  /// Copies a host cache of the same policies and config into this one, bit for bit (synchronous:
  /// waits for the work queued on every stream first, e.g. a decode still reading the arenas).
  template <class HostCache>
  void upload(const HostCache& host) {
    check_twin<HostCache>(host.config());
    check(cudaDeviceSynchronize(), "upload");
    transfer(host, cudaMemcpyHostToDevice);
    for (int l = 0; l < cfg_.layers; ++l)
      for (int s = 0; s < cfg_.batch; ++s) set_length(l, s, host.length(l, s), nullptr);
    check(cudaDeviceSynchronize(), "upload");
  }
  /// Copies this cache into a host cache of the same policies and config (synchronous): the live data
  /// bit for bit (ring slots of tokens already compressed are not, and are never read).
  template <class HostCache>
  void download(HostCache& host) const {
    static_assert(kDeviceAppend, "kvc::cuda::DeviceKVCache::download: a LowRankInit::kWarm host cache continues from "
                                 "each stream's basis, which only the host cache that compressed it holds");
    check_twin<HostCache>(host.config());
    check(cudaDeviceSynchronize(), "download");  // appends queued on any stream have finished
    transfer(host, cudaMemcpyDeviceToHost);
    host.lengths_ = host_lengths_;
  }

 private:
  /// The checks both appends make before anything else; returns the token count (0: nothing to do).
  int check_append(int layer, int seq, KVView k, KVView v) const {
    static_assert(kDeviceAppend, "kvc::cuda::DeviceKVCache: LowRankInit::kWarm keeps each stream's last basis on the "
                                 "host; compress with CompressedKVCache and upload(), or use LowRankInit::kRandom");
    return rules::check_append_shape(cfg_, layer, seq, length(layer, seq), k, v);
  }

  template <class HostCache>
  void check_twin(const CacheConfig& h) const {
    static_assert(std::is_same_v<typename HostCache::layout, layout>,
                  "kvc::cuda::DeviceKVCache: upload/download need a CompressedKVCache of the same policies");
    KVC_CHECK(h.layers == cfg_.layers && h.batch == cfg_.batch && h.kv_heads == cfg_.kv_heads &&
                  h.head_dim == cfg_.head_dim && h.capacity == cfg_.capacity,
              Errc::kInvalidArgument, "host cache config (layers ", h.layers, ", batch ", h.batch, ", kv_heads ",
              h.kv_heads, ", head_dim ", h.head_dim, ", capacity ", h.capacity, ") differs from the device cache's (",
              cfg_.layers, ", ", cfg_.batch, ", ", cfg_.kv_heads, ", ", cfg_.head_dim, ", ", cfg_.capacity, ")");
  }

  /// Copies every layer's arenas between the host cache's params() and ours.
  template <class HostCache>
  void transfer(const HostCache& host, cudaMemcpyKind kind) const {
    const std::size_t per_layer = std::size_t(cfg_.batch) * cfg_.kv_heads, d = std::size_t(cfg_.head_dim);
    const std::size_t kb = per_layer * cap_blocks_ * key_format::block_bytes(cfg_.head_dim);
    const std::size_t vb = per_layer * cap_blocks_ * value_format::block_bytes(cfg_.head_dim);
    const std::size_t fp = per_layer * layout::kFpStride * d * sizeof(window_t);
    const std::size_t fq = per_layer * layout::kFpSlots * layout::value_row_bytes(cfg_.head_dim);
    for (int l = 0; l < cfg_.layers; ++l) {
      const params_type h = host.params(l), g = params(l);
      auto copy = [&](void* hp, void* gp, std::size_t bytes, const char* what) {
        if (bytes == 0) return;
        check(kind == cudaMemcpyHostToDevice ? cudaMemcpy(gp, hp, bytes, kind) : cudaMemcpy(hp, gp, bytes, kind), what);
      };
      copy(h.k_blocks, g.k_blocks, kb, "cudaMemcpy (key blocks)");
      copy(h.v_blocks, g.v_blocks, vb, "cudaMemcpy (value blocks)");
      copy(h.k_fp, g.k_fp, fp, "cudaMemcpy (key full-precision rows)");
      copy(h.v_fp, g.v_fp, fp, "cudaMemcpy (value full-precision rows)");
      copy(h.v_fq, g.v_fq, fq, "cudaMemcpy (quantized value rows)");
    }
  }

  static void pack(KVView x, float* out) {
    for (int t = 0; t < x.dim0; ++t)
      for (int h = 0; h < x.dim1; ++h) {
        const float* r = x.row(t, h);
        for (int c = 0; c < x.dim2; ++c) *out++ = r[c];
      }
  }

  /// Throws for the first element of device view x the host cache would reject (rotated: x holds rotated rows,
  /// checked for the range; finite_only: only NaN/Inf, as the inputs of a rotated side are).
  void scan(KVView x, const char* what, cudaStream_t stream, bool rotated = false, bool finite_only = false) const {
    const unsigned long long n = x.size();
    unsigned long long* first = const_cast<unsigned long long*>(first_bad_.data());
    check(cudaMemcpyAsync(first, &n, sizeof n, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (scan)");
    const int blocks = static_cast<int>(std::min<unsigned long long>((n + 255) / 256, 4096));
    const float limit = finite_only ? std::numeric_limits<float>::max() : rules::input_limit();
    detail::scan_inputs_kernel<float><<<blocks, 256, 0, stream>>>(x.data, n, limit, first);
    check_launch("scan_inputs_kernel");
    unsigned long long bad = n;
    check(cudaMemcpyAsync(&bad, first, sizeof bad, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (scan)");
    check(cudaStreamSynchronize(stream), "scan_inputs_kernel");
    if (bad >= n) return;
    float value = 0.0f;
    check(cudaMemcpy(&value, x.data + bad, sizeof value, cudaMemcpyDeviceToHost), "cudaMemcpy (scan)");
    const auto per_token = std::size_t(x.dim1) * x.dim2;
    const int t = int(bad / per_token), h = int(bad % per_token / x.dim2), c = int(bad % x.dim2);
    if (rotated && std::isfinite(value)) rules::rotated_out_of_range(what, t, h, c, value);
    rules::check_value(value, what, t, h, c);
    kvc::detail::fail(Errc::kCuda, "scan_inputs_kernel flagged ", what, " element ", bad, " (", value,
                      ") that the host check accepts");
  }

  /// append_device's rotation of one side: scans x (device, contiguous) for NaN/Inf, writes its rotated rows to
  /// `out` on `stream` and scans them for the range; returns out.
  float* rotate_device(int layer, KVView x, const char* what, bool keys, float* out, cudaStream_t stream) const {
    scan(x, what, stream, false, true);
    const int rows = x.dim0 * x.dim1;
    detail::rotate_rows_kernel<rotation><<<(rows + 127) / 128, 128, 0, stream>>>(x.data, out, rows, cfg_.kv_heads,
                                                                               cfg_.head_dim, params(layer).rotation, keys);
    check_launch("rotate_rows_kernel");
    scan(KVView::contiguous(out, x.dim0, x.dim1, x.dim2), what, stream, true);
    return out;
  }

  std::size_t rotation_offset(int layer) const noexcept {
    return layer * layout::rotation_words(cfg_.kv_heads, cfg_.head_dim);
  }
  /// The host copy of one layer's rotation tables (host appends rotate on the host; nullptr without).
  const std::uint32_t* host_rotation(int layer) const noexcept {
    return layout::kRotated ? host_rot_.data() + rotation_offset(layer) : nullptr;
  }

  /// Rejects, at construction, a block the compression kernel cannot hold in shared memory.
  template <class F>
  void check_compress_smem(const char* side) const {
    const std::size_t need = F::kCorrected ? detail::gear_smem_bytes<F>(cfg_.head_dim)
                                           : detail::compress_smem_bytes<F>(cfg_.head_dim);
    const int optin = device_limits().smem_optin;
    KVC_CHECK(need <= std::size_t(optin), Errc::kInvalidArgument, side, " blocks of ", kBlockTokens, " tokens x head_dim ",
              cfg_.head_dim, " need ", need, " bytes of shared memory to compress on the device; this GPU allows ",
              optin);
  }

  /// Queues the compression of the blocks this append completes, then the full-precision slot writes
  /// (gather, then scatter: LogWindow's compaction reads slots it also writes); k, v: device
  /// [tokens][kv_heads][head_dim] fp32.
  void enqueue_append(int layer, int seq, int tokens, const float* k, const float* v, cudaStream_t stream) {
    const int n = length(layer, seq), n_after = n + tokens, d = cfg_.head_dim, H = cfg_.kv_heads;
    // The host's side: the selector's rule over slot labels (cache/append_plan.hpp).
    const auto plan = kvc::detail::AppendPlan<layout>::make(n, tokens);
    const std::vector<int>& dst = plan.dst;
    const std::vector<int>& src = plan.src;
    const std::vector<int>& requantize = plan.requantize;
    std::vector<int> table = plan.block_rows;
    table.insert(table.end(), dst.begin(), dst.end());
    table.insert(table.end(), src.begin(), src.end());
    table.insert(table.end(), requantize.begin(), requantize.end());
    StreamScratch<int> dev_table(table.size(), stream);
    if (!table.empty())
      check(cudaMemcpyAsync(dev_table.data(), table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync (append plan)");  // pageable: staged before it returns
    const int* rows = dev_table.data();
    const params_type p = params(layer);
    if (plan.blocks > 0) {  // first: the blocks read slots the writes below may overwrite
      launch_compress<key_format>(p, layer, seq, plan.first_block, plan.blocks, rows, k, stream);
      launch_compress<value_format>(p, layer, seq, plan.first_block, plan.blocks, rows, v, stream);
    }
    if (!dst.empty()) {
      const int count = int(dst.size());
      const int* dev_dst = rows + plan.block_rows.size();
      StreamScratch<float> tmp(std::size_t(count) * H * 2 * d, stream);
      const dim3 grid{unsigned(count), unsigned(H)};
      const int threads = d < 256 ? d : 256;
      detail::gather_slots_kernel<layout><<<grid, threads, 0, stream>>>(p, seq, dev_dst + count, k, v, tmp.data());
      check_launch("gather_slots_kernel");
      if constexpr (layout::kAlignedWindow) {  // one CTA per KV head: threads own whole nibble bytes
        detail::scatter_slot_planes_kernel<layout><<<unsigned(H), threads, 0, stream>>>(p, seq, dev_dst, count,
                                                                                         tmp.data());
        check_launch("scatter_slot_planes_kernel");
      } else {
        detail::scatter_slots_kernel<layout><<<grid, threads, 0, stream>>>(p, seq, dev_dst, tmp.data());
        check_launch("scatter_slots_kernel");
      }
    }
    if constexpr (layout::kQuantizedFpValues)
      if (!requantize.empty()) {
        const int* dev_slots = rows + plan.block_rows.size() + 2 * dst.size();
        const dim3 grid{unsigned(requantize.size()), unsigned(H)};
        detail::quantize_value_rows_kernel<layout><<<grid, 32, std::size_t(d) * sizeof(float), stream>>>(p, seq, dev_slots);
        check_launch("quantize_value_rows_kernel");
      }
    set_length(layer, seq, n_after, stream);
  }

  template <class F>
  void launch_compress(const params_type& p, int layer, int seq, int blk0, int blocks, const int* rows,
                       const float* in, cudaStream_t stream) {
    const dim3 grid(unsigned(blocks), unsigned(cfg_.kv_heads));
    if constexpr (!F::kCorrected) {
      auto kernel = detail::compress_blocks_kernel<layout, F>;
      const std::size_t smem = detail::compress_smem_bytes<F>(cfg_.head_dim);
      allow_dynamic_smem(kernel, smem, "cudaFuncSetAttribute (append kernel shared memory)");
      kernel<<<grid, detail::kAppendThreads, smem, stream>>>(p, seq, blk0, rows, in);
      check_launch("compress_blocks_kernel");
    } else {
      using C = typename F::correction;
      const int B = kBlockTokens, d = cfg_.head_dim, H = cfg_.kv_heads;
      const std::size_t items = std::size_t(blocks) * H;
      StreamScratch<float> res(C::kLowRank ? items * B * d : 0, stream);
      auto kernel = detail::compress_gear_kernel<layout, F>;
      const std::size_t smem = detail::gear_smem_bytes<F>(d);
      allow_dynamic_smem(kernel, smem, "cudaFuncSetAttribute (append kernel shared memory)");
      kernel<<<grid, detail::kAppendThreads, smem, stream>>>(p, seq, blk0, rows, in, res.data());
      check_launch("compress_gear_kernel");
      if constexpr (C::kLowRank) {
        // GEAR's rank-r fit of each block's residual: the host's power_iteration over cuBLAS/cuSOLVER,
        // from the same seed. One small fit per (block, head): ~4 library calls per iteration.
        const int r = C::rank(B, d);
        StreamScratch<float> a(items * B * r, stream), bm(items * d * r, stream);
        CudaLinalg& la = linalg(stream);
        for (int i = 0; i < blocks; ++i)
          for (int h = 0; h < H; ++h) {
            const std::size_t it = std::size_t(i) * H + h;
            power_iteration(la, res.data() + it * B * d, B, d, B, r, residual::kIters, residual::kEveryQR,
                            a.data() + it * B * r, bm.data() + it * d * r, false,
                            low_rank_seed(layer, seq, h, blk0 + i, F::kSide == Side::kKey));
          }
        detail::write_factors_kernel<layout, F><<<grid, 128, 0, stream>>>(p, seq, blk0, a.data(), bm.data());
        check_launch("write_factors_kernel");
      }
    }
  }

  CudaLinalg& linalg(cudaStream_t stream) {
    if (!linalg_) linalg_ = std::make_unique<CudaLinalg>(stream);
    linalg_->set_stream(stream);
    return *linalg_;
  }

  void set_length(int layer, int seq, int n, cudaStream_t stream) {
    int& h = host_lengths_[std::size_t(layer) * cfg_.batch + seq];
    h = n;
    // Pageable source: staged before cudaMemcpyAsync returns, so later changes of `h` do not race.
    check(cudaMemcpyAsync(lengths_.data() + std::size_t(layer) * cfg_.batch + seq, &h, sizeof(int),
                          cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (lengths)");
  }

  CacheConfig cfg_;
  int cap_blocks_ = 0;
  DeviceBuffer<std::byte> k_blocks_, v_blocks_;
  DeviceBuffer<window_t> k_fp_, v_fp_;  // the selector's full-precision slots
  DeviceBuffer<std::byte> v_fq_;         // their quantized value rows (PartialLogWindow)
  DeviceBuffer<int> lengths_;
  std::vector<int> host_lengths_;
  DeviceBuffer<unsigned long long> first_bad_;  // the input scan's result
  DeviceBuffer<std::uint32_t> rot_;             // Rotation: [layers][kv_heads][head_words] transform tables
  std::vector<std::uint32_t> host_rot_;         // ... and their host copy (host appends rotate with it)
  std::unique_ptr<CudaLinalg> linalg_;  // GEAR's low-rank fit, created on first use
};

/// The device twin of a host cache type: device_cache_t<kvc::schemes::Kivi2> = DeviceKVCache<same policies>.
template <class HostCache>
struct device_cache;
template <class... P>
struct device_cache<CompressedKVCache<P...>> {
  using type = DeviceKVCache<P...>;
};
template <class HostCache>
using device_cache_t = typename device_cache<HostCache>::type;
}  // namespace kvc::cuda
