/// \file device_qaq_cache.cuh
/// `kvc::cuda::DeviceQaqCache<QaqQuantizer<...>>`: QAQ's cache on the GPU, the device twin of the host
/// `CompressedKVCache<QaqQuantizer<...>>` (qaq/qaq_cache.hpp) with the same records, histories and rule.
///   - Storage: per (layer, sequence, KV head) and side one arena (qaq/arena.hpp): the width buckets back to
///     back, so a bucket holds exactly the host bucket's bytes; record counts per width on the device.
///   - Mirror: the fp16 K/V a raise re-encodes its codes from (RecordFormat::raise). MirrorPlace::kHost
///     (default, SPEC §2.10 and the paper): mapped pinned host memory that the update kernel reads directly,
///     only the rows of raised tokens, asynchronously on the stream; MirrorPlace::kDevice keeps it in device
///     memory.
///   - append() quantizes new tokens at B_max on the device; decode_attention (qaq/decode_attention.cuh)
///     hands back each token's probability; update_widths() pushes them into the histories and rebuckets
///     every stream side with the host's rule (qaq::StepWidths), lowering by a shift and raising from the
///     mirror, all on the device.
/// Memory: each layer's arenas are allocated for the capacity at B_max (a device cache cannot grow buckets
/// in place); stored_bytes()/bits_per_element() count the records and histories, like the host; the
/// allocation is allocated_bytes(), the mirror mirror_bytes(). The width update rebuckets into a per-call
/// scratch of one layer's arenas (stream-ordered).
/// Errors: bad input throws the host cache's kvc::Error before anything is written; update_widths()
/// validates the probabilities on the device first (one synchronisation). Host API; not thread-safe.
#pragma once

#include <kvc/cache/policies.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/view.hpp>
#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/cuda/error.cuh>
#include <kvc/cuda/qaq/detail/kernels.cuh>
#include <kvc/qaq/calibration.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>
#include <kvc/qaq/setup_checks.hpp>
#include <kvc/qaq/split_outliers.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvc {
template <class... P>
class CompressedKVCache;  // host only (qaq/qaq_cache.hpp); upload() takes one
}  // namespace kvc

namespace kvc::cuda {

/// Where the full-precision mirror lives.
enum class MirrorPlace { kHost, kDevice };

/// Q: a QaqQuantizer; Rot: at most one kvc::Rotation (as the host cache: CompressedKVCache<Q, Rot...>).
template <class Q, class... Rot>
class DeviceQaqCache;

template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds, class Meta, class... Rot>
class DeviceQaqCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...> {
  static_assert(sizeof...(Rot) <= 1 && (PolicyOf<Rot, kind::rotation> && ...),
                "kvc::cuda::DeviceQaqCache<QaqQuantizer<...>, Rot...> takes at most one kvc::Rotation<...> (as the host "
                "CompressedKVCache<QaqQuantizer<...>, Rotation<...>>)");

 public:
  using quantizer = QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>;
  using record = qaq::RecordFormat<quantizer>;
  using arena = qaq::Arena<quantizer>;
  using history = typename quantizer::history;
  /// The Rotation (NoRotation without one): rows rotated on append (the host's tables, same seed), the query
  /// rotated in the scores kernel and the output un-rotated in the final sum (qaq/detail/kernels.cuh).
  using rotation = typename kvc::detail::find_policy<kind::rotation, NoRotation, Rot...>::type;
  static constexpr bool kRotated = rotation::kActive;
  using params_type = qaq_detail::Params<quantizer>;
  using host_cache = CompressedKVCache<quantizer, Rot...>;
  static constexpr int kWidths = arena::kWidths;
  static constexpr bool kAdaptive = BMin < BMax;
  static_assert(kAdaptive, "kvc::cuda::DeviceQaqCache serves adaptive QAQ (BMin < BMax); per-token uniform QAQ "
                           "(BMin == BMax) is a host baseline: use a uniform or KIVI quantizer on the device");
  /// Rotated sides with outliers, as the host cache: the outliers taken before the rotation (on the host, at append:
  /// qaq/split_outliers.hpp), the residual rotated and coded; the kernels add the outliers' terms in the original
  /// basis (qaq/detail/kernels.cuh).
  static constexpr bool kSplitKeys = qaq_detail::kSplitKeys<quantizer, rotation>;
  static constexpr bool kSplitValues = qaq_detail::kSplitValues<quantizer, rotation>;
  using key_record = qaq::RecordFormat<quantizer, kSplitKeys>;
  using value_record = qaq::RecordFormat<quantizer, kSplitValues>;

  /// cfg, targets and calibration as the host cache (same checks and messages).
  DeviceQaqCache(const CacheConfig& cfg, qaq::Targets targets, qaq::QueryNormCalibration calibration,
                 MirrorPlace mirror = MirrorPlace::kHost)
      : cfg_(cfg), calib_(std::move(calibration)), place_(mirror) {
    qaq::check_setup(cfg, calib_, quantizer::kMaxHeadDim);
    set_targets(targets);
    id_bytes_ = record::id_bytes_for(cfg.capacity);
    arena_bytes_ = arena::bytes(cfg.head_dim, cfg.capacity, id_bytes_);
    const std::size_t streams = std::size_t(cfg.batch) * cfg.kv_heads;
    layers_.reserve(std::size_t(cfg.layers));
    for (int l = 0; l < cfg.layers; ++l) {
      Layer L;
      L.arenas = DeviceBuffer<std::byte>(streams * 2 * arena_bytes_);
      L.counts = DeviceBuffer<std::uint32_t>(streams * 2 * kWidths);
      L.hist = DeviceBuffer<history>(streams * std::size_t(cfg.capacity));
      L.lengths = DeviceBuffer<int>(std::size_t(cfg.batch));
      L.qnorm2 = DeviceBuffer<float>(std::size_t(cfg.kv_heads));
      check(cudaMemcpy(L.qnorm2.data(), calib_.qnorm2.data() + std::size_t(l) * cfg.kv_heads,
                       sizeof(float) * cfg.kv_heads, cudaMemcpyHostToDevice),
            "cudaMemcpy (QAQ calibration)");
      const std::size_t mirror = streams * 2 * std::size_t(cfg.capacity) * cfg.head_dim;
      if (place_ == MirrorPlace::kHost) L.host_mirror = MappedHostBuffer<half_t>(mirror);
      else L.device_mirror = DeviceBuffer<half_t>(mirror);
      layers_.push_back(std::move(L));
    }
    lengths_.assign(std::size_t(cfg.layers) * cfg.batch, 0);
    if constexpr (kRotated) {  // the host cache's tables, drawn from the same seed
      rules::check_rotation(cfg);
      host_rot_.resize(std::size_t(cfg.layers) * rotation_words());
      rotation::make_tables(cfg.layers, cfg.kv_heads, cfg.head_dim, host_rot_.data());
      rot_ = DeviceBuffer<std::uint32_t>(host_rot_.size());
      check(cudaMemcpy(rot_.data(), host_rot_.data(), host_rot_.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
            "cudaMemcpy (rotation tables)");
    }
  }

  void set_targets(qaq::Targets t) {
    qaq::check_targets(t);
    targets_ = t;
  }
  [[nodiscard]] qaq::Targets targets() const noexcept { return targets_; }
  [[nodiscard]] const CacheConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] MirrorPlace mirror_place() const noexcept { return place_; }
  [[nodiscard]] int id_bytes() const noexcept { return id_bytes_; }
  [[nodiscard]] int length(int layer, int seq) const {
    rules::check_index(cfg_, layer, seq);
    return lengths_[std::size_t(layer) * cfg_.batch + seq];
  }
  /// The layer's token counts in host memory (what the kernels read on the device).
  [[nodiscard]] const int* host_lengths(int layer) const {
    rules::check_index(cfg_, layer, 0);
    return lengths_.data() + std::size_t(layer) * cfg_.batch;
  }
  [[nodiscard]] params_type params(int layer) const {
    rules::check_index(cfg_, layer, 0);
    // the kernels write through these pointers (device memory this object owns; params() is const so that
    // attention can take a const cache)
    Layer& L = const_cast<Layer&>(layers_[std::size_t(layer)]);
    return {cfg_.batch, cfg_.kv_heads, cfg_.head_dim, cfg_.capacity, id_bytes_, arena_bytes_, L.lengths.data(),
            L.arenas.data(), L.counts.data(), L.hist.data(), L.mirror_device(), L.qnorm2.data(),
            kRotated ? rot_.data() + std::size_t(layer) * rotation_words() : nullptr};
  }
  /// The host copy of `layer`'s rotation tables, [kv_heads][rotation::head_words] (null without a Rotation).
  [[nodiscard]] const std::uint32_t* host_rotation_tables(int layer) const {
    rules::check_index(cfg_, layer, 0);
    return kRotated ? host_rot_.data() + std::size_t(layer) * rotation_words() : nullptr;
  }

  /// Appends k.dim0 tokens from HOST memory (fp32 [tokens][kv_heads][head_dim], finite, |x| <= 65504; with a
  /// Rotation the rotated rows too, rotated on the host as the host cache does, a split side's outliers taken
  /// there first), as the host cache: the mirror rows, then a record at B_max per side, quantized on the device.
  /// Validates first.
  void append(int layer, int seq, KVView k, KVView v, cudaStream_t stream = nullptr) {
    rules::check_index(cfg_, layer, seq);
    int& n = lengths_[std::size_t(layer) * cfg_.batch + seq];
    const int tokens = rules::check_append_shape(cfg_, layer, seq, n, k, v);
    if (tokens == 0) return;
    std::vector<float> k_rot, v_rot;  // Rotation: the rows as stored (R k or R (k - o); R v or R (v - o))
    qaq::SplitOutliers<quantizer> k_out, v_out;
    k = qaq::stored_rows<kSplitKeys, rules>(k, true, host_rotation_tables(layer), k_rot, k_out);
    v = qaq::stored_rows<kSplitValues, rules>(v, false, host_rotation_tables(layer), v_rot, v_out);
    Layer& L = layers_[std::size_t(layer)];
    const int d = cfg_.head_dim;
    // mirror rows [n, n + tokens) of every head and side: [head][side][token][d] in the mirror's layout
    std::vector<half_t> rows(std::size_t(cfg_.kv_heads) * 2 * tokens * d);
    for (int h = 0; h < cfg_.kv_heads; ++h)
      for (int side = 0; side < 2; ++side)
        for (int t = 0; t < tokens; ++t)
          for (int c = 0; c < d; ++c)
            rows[((std::size_t(h) * 2 + side) * tokens + t) * d + c] = half_t::from_float((side == 0 ? k : v).row(t, h)[c]);
    for (int h = 0; h < cfg_.kv_heads; ++h)
      for (int side = 0; side < 2; ++side) {
        const std::size_t at = ((std::size_t(seq * cfg_.kv_heads + h) * 2 + side) * cfg_.capacity + n) * d;
        const half_t* src = rows.data() + (std::size_t(h) * 2 + side) * tokens * d;
        const std::size_t bytes = std::size_t(tokens) * d * sizeof(half_t);
        // Rows beyond the sequence's length are read by no queued kernel, so host writes cannot race them.
        if (place_ == MirrorPlace::kHost) std::memcpy(L.host_mirror.data() + at, src, bytes);
        else check(cudaMemcpyAsync(L.device_mirror.data() + at, src, bytes, cudaMemcpyHostToDevice, stream),
                   "cudaMemcpyAsync (QAQ mirror)");  // pageable source: staged before the call returns
      }
    // split sides: their outliers, [tokens][kv_heads][outliers(d)] (pageable sources: staged before the calls return)
    const std::size_t no = std::size_t(tokens) * cfg_.kv_heads * quantizer::outliers(d);
    StreamScratch<half_t> out_val(std::size_t(kSplitKeys + kSplitValues) * no, stream);
    StreamScratch<std::uint8_t> out_idx(std::size_t(kSplitKeys + kSplitValues) * no, stream);
    qaq_detail::SplitRows split{{nullptr, nullptr}, {nullptr, nullptr}};
    int used = 0;
    for (int side = 0; side < 2; ++side) {
      if (!(side == 0 ? kSplitKeys : kSplitValues)) continue;
      const qaq::SplitOutliers<quantizer>& o = side == 0 ? k_out : v_out;
      split.val[side] = out_val.data() + std::size_t(used) * no;
      split.idx[side] = out_idx.data() + std::size_t(used) * no;
      check(cudaMemcpyAsync(const_cast<half_t*>(split.val[side]), o.values().data(), no * sizeof(half_t),
                            cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync (QAQ outliers)");
      check(cudaMemcpyAsync(const_cast<std::uint8_t*>(split.idx[side]), o.channels().data(), no, cudaMemcpyHostToDevice,
                            stream),
            "cudaMemcpyAsync (QAQ outliers)");
      ++used;
    }
    const params_type p = params(layer);
    const int threads = tokens * cfg_.kv_heads * 2;
    qaq_detail::append_kernel<quantizer><<<unsigned((threads + 127) / 128), 128, 0, stream>>>(p, seq, n, tokens, split);
    check_launch("qaq append_kernel");
    qaq_detail::append_commit_kernel<quantizer><<<1, unsigned(2 * cfg_.kv_heads + 1), 0, stream>>>(p, seq, tokens);
    check_launch("qaq append_commit_kernel");
    n += tokens;
  }

  /// SPEC §2.6 after a decode step of `layer`, on the device: probs (DEVICE memory, [batch][kv_heads][stride],
  /// decode_attention's) are validated (finite, in [0, 1]: one synchronisation; a bad one throws and nothing
  /// changes), pushed into the histories, and every stream side is rebucketed by the host's rule.
  void update_widths(int layer, const float* probs, int stride, cudaStream_t stream = nullptr) {
    rules::check_index(cfg_, layer, 0);
    KVC_CHECK(probs != nullptr, Errc::kInvalidArgument, "null QAQ probabilities");
    int longest = 0;
    for (int s = 0; s < cfg_.batch; ++s) longest = std::max(longest, length(layer, s));
    KVC_CHECK(longest <= stride, Errc::kInvalidArgument, "QAQ probabilities hold ", stride,
              " tokens per stream, a sequence holds ", longest);
    if (longest == 0) return;
    const params_type p = params(layer);
    const unsigned streams = unsigned(cfg_.batch * cfg_.kv_heads);
    DeviceBuffer<unsigned long long>& bad = layers_[std::size_t(layer)].bad;
    if (bad.size() == 0) bad = DeviceBuffer<unsigned long long>(1);
    const unsigned long long none = std::numeric_limits<unsigned long long>::max();
    unsigned long long first = none;
    check(cudaMemcpyAsync(bad.data(), &none, sizeof none, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (QAQ check)");
    qaq_detail::check_probs_kernel<quantizer><<<streams, 256, 0, stream>>>(p, probs, stride, bad.data());
    check_launch("qaq check_probs_kernel");
    check(cudaMemcpyAsync(&first, bad.data(), sizeof first, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (QAQ check)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (QAQ probabilities)");
    if (first != none) {
      float x = 0.0f;
      check(cudaMemcpy(&x, probs + first, sizeof x, cudaMemcpyDeviceToHost), "cudaMemcpy (QAQ probability)");
      const std::size_t s = first / std::size_t(stride);
      KVC_CHECK(false, Errc::kInvalidArgument, "QAQ probability of sequence ", s / cfg_.kv_heads, " KV head ",
                s % cfg_.kv_heads, " token ", first % std::size_t(stride), " is ", x, " (must be in [0, 1])");
    }
    qaq_detail::push_kernel<quantizer><<<dim3(unsigned(cfg_.kv_heads), unsigned(cfg_.batch)), 256, 0, stream>>>(p, probs,
                                                                                                          stride);
    check_launch("qaq push_kernel");
    StreamScratch<std::byte> scratch(std::size_t(streams) * 2 * arena_bytes_, stream);
    qaq_detail::update_kernel<quantizer>
        <<<dim3(unsigned(cfg_.kv_heads), unsigned(cfg_.batch), 2), qaq_detail::kUpdateThreads, 0, stream>>>(
            p, targets_, scratch.data());
    check_launch("qaq update_kernel");
  }

  /// Forgets sequence `seq` in every layer (its records, counts and length; asynchronous on `stream`).
  void clear(int seq, cudaStream_t stream = nullptr) {
    rules::check_index(cfg_, 0, seq);
    const std::size_t per = std::size_t(cfg_.kv_heads) * 2 * kWidths;
    for (int l = 0; l < cfg_.layers; ++l) {
      Layer& L = layers_[std::size_t(l)];
      check(cudaMemsetAsync(L.counts.data() + std::size_t(seq) * per, 0, per * sizeof(std::uint32_t), stream),
            "cudaMemsetAsync (QAQ clear)");
      check(cudaMemsetAsync(L.lengths.data() + seq, 0, sizeof(int), stream), "cudaMemsetAsync (QAQ clear)");
      lengths_[std::size_t(l) * cfg_.batch + seq] = 0;
    }
  }

  /// Copies a host cache of the same config and policies (every layer: records, histories, mirror, lengths; the
  /// rotation tables are drawn from the same seed); synchronous.
  void upload(const host_cache& host) {
    const CacheConfig& hc = host.config();
    KVC_CHECK(hc.layers == cfg_.layers && hc.batch == cfg_.batch && hc.kv_heads == cfg_.kv_heads &&
                  hc.head_dim == cfg_.head_dim && hc.capacity == cfg_.capacity && host.id_bytes() == id_bytes_,
              Errc::kInvalidArgument, "upload: the host cache's config differs from the device cache's");
    const int d = cfg_.head_dim;
    const std::size_t streams = std::size_t(cfg_.batch) * cfg_.kv_heads;
    for (int l = 0; l < cfg_.layers; ++l) {
      Layer& L = layers_[std::size_t(l)];
      std::vector<std::byte> bytes(streams * 2 * arena_bytes_);
      std::vector<std::uint32_t> counts(streams * 2 * kWidths);
      std::vector<history> hist(streams * std::size_t(cfg_.capacity));
      std::vector<half_t> mirror(streams * 2 * std::size_t(cfg_.capacity) * d);
      for (int s = 0; s < cfg_.batch; ++s) {
        const int T = host.length(l, s);
        lengths_[std::size_t(l) * cfg_.batch + s] = T;
        for (int h = 0; h < cfg_.kv_heads; ++h) {
          const std::size_t st = std::size_t(s) * cfg_.kv_heads + h;
          for (int side = 0; side < 2; ++side) {
            const auto& sd = side == 0 ? host.keys(l, s, h) : host.values(l, s, h);
            std::size_t o = (st * 2 + side) * arena_bytes_;
            for (int w = 0; w < kWidths; ++w) {
              const auto& bk = sd.bucket[std::size_t(w)];
              std::memcpy(bytes.data() + o, bk.data(), bk.size());
              o += bk.size();
              counts[(st * 2 + side) * kWidths + w] = std::uint32_t(host.records(sd, BMin + w));
            }
            const auto& m = host.mirror(l, s, h, side);
            std::copy(m.begin(), m.end(), mirror.begin() + std::ptrdiff_t((st * 2 + side) * cfg_.capacity * d));
          }
          const std::vector<history>& hh = host.histories(l, s, h);
          std::copy(hh.begin(), hh.end(), hist.begin() + std::ptrdiff_t(st * cfg_.capacity));
        }
      }
      check(cudaMemcpy(L.arenas.data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy (QAQ upload)");
      check(cudaMemcpy(L.counts.data(), counts.data(), counts.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
            "cudaMemcpy (QAQ upload)");
      check(cudaMemcpy(L.hist.data(), hist.data(), hist.size() * sizeof(history), cudaMemcpyHostToDevice),
            "cudaMemcpy (QAQ upload)");
      check(cudaMemcpy(L.lengths.data(), lengths_.data() + std::size_t(l) * cfg_.batch, sizeof(int) * cfg_.batch,
                       cudaMemcpyHostToDevice),
            "cudaMemcpy (QAQ upload)");
      if (place_ == MirrorPlace::kHost) std::copy(mirror.begin(), mirror.end(), L.host_mirror.data());
      else check(cudaMemcpy(L.device_mirror.data(), mirror.data(), mirror.size() * sizeof(half_t), cudaMemcpyHostToDevice),
                 "cudaMemcpy (QAQ upload)");
    }
  }

  /// One stream side's records as the host would hold them (synchronous): per width, the bucket's bytes.
  [[nodiscard]] std::array<std::vector<std::byte>, kWidths> buckets(int layer, int seq, int head, int side) const {
    rules::check_index(cfg_, layer, seq);
    const Layer& L = layers_[std::size_t(layer)];
    const std::size_t st = std::size_t(seq) * cfg_.kv_heads + head;
    std::uint32_t n[kWidths];
    check(cudaMemcpy(n, L.counts.data() + (st * 2 + side) * kWidths, sizeof n, cudaMemcpyDeviceToHost), "cudaMemcpy (QAQ)");
    std::array<std::vector<std::byte>, kWidths> out;
    std::size_t o = (st * 2 + side) * arena_bytes_;
    for (int w = 0; w < kWidths; ++w) {
      out[std::size_t(w)].resize(std::size_t(n[w]) * record::bytes(cfg_.head_dim, BMin + w, id_bytes_));
      check(cudaMemcpy(out[std::size_t(w)].data(), L.arenas.data() + o, out[std::size_t(w)].size(), cudaMemcpyDeviceToHost),
            "cudaMemcpy (QAQ)");
      o += out[std::size_t(w)].size();
    }
    return out;
  }
  /// Reconstruction of (layer, seq) as attention sees it, k, v: host [length][kv_heads][head_dim], in the original
  /// basis (a Rotation's rows un-rotated) (tests).
  void dequantize(int layer, int seq, float* k, float* v) const {
    const int d = cfg_.head_dim, H = cfg_.kv_heads;
    const std::uint32_t* tables = host_rotation_tables(layer);
    for (int h = 0; h < H; ++h)
      for (int side = 0; side < 2; ++side) {
        const auto bk = buckets(layer, seq, h, side);
        for (int w = 0; w < kWidths; ++w) {
          const std::size_t rb = record::bytes(d, BMin + w, id_bytes_);
          for (std::size_t o = 0; o < bk[std::size_t(w)].size(); o += rb) {
            const std::byte* r = bk[std::size_t(w)].data() + o;
            float* row = (side == 0 ? k : v) + (std::size_t(record::token(r, d, BMin + w, id_bytes_)) * H + h) * d;
            if (side == 0) qaq::reconstruct<key_record, rotation>(r, d, BMin + w, true, tables, h, row);
            else qaq::reconstruct<value_record, rotation>(r, d, BMin + w, false, tables, h, row);
          }
        }
      }
  }

  /// Tokens of one layer per width b in [0, 8] (side 0 keys, 1 values), as the host cache; synchronous.
  [[nodiscard]] std::array<std::size_t, 9> width_counts(int layer, int side) const {
    rules::check_index(cfg_, layer, 0);
    std::vector<std::uint32_t> n(std::size_t(cfg_.batch) * cfg_.kv_heads * 2 * kWidths);
    check(cudaMemcpy(n.data(), layers_[std::size_t(layer)].counts.data(), n.size() * sizeof(std::uint32_t),
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy (QAQ counts)");
    std::array<std::size_t, 9> out{};
    for (std::size_t st = 0; st < std::size_t(cfg_.batch) * cfg_.kv_heads; ++st)
      for (int w = 0; w < kWidths; ++w) out[std::size_t(BMin + w)] += n[(st * 2 + side) * kWidths + w];
    return out;
  }
  /// Average code width of one side over every layer's tokens (0 when empty); synchronous.
  [[nodiscard]] double average_width(int side) const {
    double sum = 0.0, n = 0.0;
    for (int l = 0; l < cfg_.layers; ++l) {
      const auto c = width_counts(l, side);
      for (int b = 0; b <= 8; ++b) sum += double(b) * double(c[std::size_t(b)]), n += double(c[std::size_t(b)]);
    }
    return n > 0.0 ? sum / n : 0.0;
  }
  /// Bytes of the compressed cache (records, histories and rotation tables, as the host cache counts them);
  /// synchronous.
  [[nodiscard]] std::size_t stored_bytes() const {
    std::size_t total = 0;
    const std::size_t streams = std::size_t(cfg_.batch) * cfg_.kv_heads;
    std::vector<std::uint32_t> n(streams * 2 * kWidths);
    for (int l = 0; l < cfg_.layers; ++l) {
      check(cudaMemcpy(n.data(), layers_[std::size_t(l)].counts.data(), n.size() * sizeof(std::uint32_t),
                       cudaMemcpyDeviceToHost),
            "cudaMemcpy (QAQ counts)");
      for (std::size_t i = 0; i < n.size(); ++i)
        total += std::size_t(n[i]) * record::bytes(cfg_.head_dim, BMin + int(i % kWidths), id_bytes_);
      const int* n = host_lengths(l);
      for (int s = 0; s < cfg_.batch; ++s) total += std::size_t(n[s]) * cfg_.kv_heads * sizeof(history);
      if (kRotated && std::any_of(n, n + cfg_.batch, [](int t) { return t > 0; }))
        total += layout::rotation_bytes(cfg_.kv_heads, cfg_.head_dim);  // read by every decode step
    }
    return total;
  }
  [[nodiscard]] std::size_t elements() const {
    std::size_t n = 0;
    for (int t : lengths_) n += std::size_t(t);
    return n * cfg_.kv_heads * cfg_.head_dim * 2;
  }
  [[nodiscard]] double bits_per_element() const {
    const std::size_t e = elements();
    return e == 0 ? 0.0 : 8.0 * double(stored_bytes()) / double(e);
  }
  /// The fp16 mirror of every cached token (host or device memory, per mirror_place()).
  [[nodiscard]] std::size_t mirror_bytes() const { return elements() * sizeof(half_t); }
  /// Device memory held: arenas at capacity, counts, histories, lengths, rotation tables (and the mirror when on
  /// the device).
  [[nodiscard]] std::size_t allocated_bytes() const {
    std::size_t total = 0;
    for (const Layer& L : layers_)
      total += L.arenas.bytes() + L.counts.bytes() + L.hist.bytes() + L.lengths.bytes() + L.qnorm2.bytes() +
               L.device_mirror.bytes();
    return total + rot_.bytes();
  }

 private:
  // the shape, index and value checks of every cache and the tables' size (the fp16 cache's layout and rules, with
  // this cache's rotation: they do not depend on the codec)
  using layout = typename DeviceKVCache<NoQuantizer<half_t>, Rot...>::layout;
  using rules = kvc::detail::CacheRules<layout>;
  [[nodiscard]] std::size_t rotation_words() const noexcept { return layout::rotation_words(cfg_.kv_heads, cfg_.head_dim); }
  struct Layer {
    DeviceBuffer<std::byte> arenas;
    DeviceBuffer<std::uint32_t> counts;
    DeviceBuffer<history> hist;
    DeviceBuffer<int> lengths;
    DeviceBuffer<float> qnorm2;
    DeviceBuffer<half_t> device_mirror;
    MappedHostBuffer<half_t> host_mirror;
    DeviceBuffer<unsigned long long> bad;
    [[nodiscard]] const half_t* mirror_device() const {
      return device_mirror.size() ? device_mirror.data() : host_mirror.device_data();
    }
  };
  CacheConfig cfg_;
  qaq::Targets targets_;
  qaq::QueryNormCalibration calib_;
  MirrorPlace place_;
  int id_bytes_ = 2;
  std::size_t arena_bytes_ = 0;
  std::vector<Layer> layers_;
  std::vector<int> lengths_;
  std::vector<std::uint32_t> host_rot_;  // Rotation: [layers][kv_heads][head_words] tables (host appends rotate here)
  DeviceBuffer<std::uint32_t> rot_;      // ... and their device copy (the kernels')
};
}  // namespace kvc::cuda
