/// \file qaq_cache.hpp
/// `kvc::CompressedKVCache<QaqQuantizer<...>>`: QAQ's cache (SPEC §2.6, §2.10), a host container with
/// real mixed-bit storage.
///
/// Per (layer, sequence, KV head) and side, one bucket per width b in [BMin, BMax]: an array of fixed-size
/// records (qaq/record_format.hpp), each one token at width b, in any order (attention is permutation-
/// invariant; a record names its token). Beside them, per token: its attention history (the last n
/// probabilities as 8-bit codes, qaq::AttentionHistory) and, in a separate buffer, the full-precision
/// mirror (the original K and V as fp16; with a Rotation the rows as coded: R x, or R (x - o) when the outliers
/// o are taken first, see `rotation` below) from which raised widths are re-encoded.
/// Life of a token: append() quantizes it at BMax (fewer than n observations: SPEC §2.4 [code]); after
/// every decode step, update_widths() records the step's probabilities (decode_attention hands them back)
/// and moves every token whose width changed: lowering shifts its codes, raising re-encodes them from the mirror.
/// Accounting: stored_bytes() counts the records (codes, lo/step, outliers with their channels, token ids)
/// and the attention histories: the compressed cache that decode reads and updates. mirror_bytes()
/// reports the mirror separately (SPEC §2.10; host memory in the paper). bits_per_element() uses
/// stored_bytes(). Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/cache/compressed_kv_cache.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/huge_page_allocator.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/calibration.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>
#include <kvc/qaq/record_format.hpp>
#include <kvc/qaq/setup_checks.hpp>
#include <kvc/qaq/split_outliers.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif

namespace kvc {

namespace qaq {
/// Per-token attention probabilities of one decode step of one layer: [batch][kv_heads][stride], entry t
/// the largest probability token t received from the query heads of the KV head (SPEC Q6), t < length.
struct TokenProbs {
  int batch = 0, kv_heads = 0, stride = 0;
  std::vector<float> p;
  void resize(int batch_, int kv_heads_, int stride_) {
    batch = batch_, kv_heads = kv_heads_, stride = stride_;
    p.assign(std::size_t(batch_) * kv_heads_ * stride_, 0.0f);
  }
  [[nodiscard]] float* row(int seq, int head) noexcept { return p.data() + (std::size_t(seq) * kv_heads + head) * stride; }
  [[nodiscard]] const float* row(int seq, int head) const noexcept {
    return p.data() + (std::size_t(seq) * kv_heads + head) * stride;
  }
};

/// What the width updates (update_widths(), qaq_decode_step) have done since the cache was made: per side (0 keys,
/// 1 values) the records whose width was re-derived, and those lowered and raised (moved to another bucket). The
/// share moved per step is what the update costs beyond its per-record floor.
struct UpdateStats {
  std::uint64_t updates = 0;  ///< width updates (update_widths() calls and qaq_decode_step steps)
  std::array<std::uint64_t, 2> records{}, lowered{}, raised{};
  UpdateStats& operator+=(const UpdateStats& o) noexcept {
    updates += o.updates;
    for (int s = 0; s < 2; ++s) records[s] += o.records[s], lowered[s] += o.lowered[s], raised[s] += o.raised[s];
    return *this;
  }
};
namespace detail {
/// Calls f(i) for every i in [0, n) with w[i] != b, in increasing order: 16 widths compared at a time (SSE2),
/// as most records keep theirs (about 7 % of the value records move per step on SmolLM2 at 3.9 bits).
template <class F>
inline void for_each_differing(const std::uint8_t* w, std::size_t n, std::uint8_t b, F&& f) {
  std::size_t i = 0;
#if KVC_QAQ_SSE2_
  const __m128i vb = _mm_set1_epi8(static_cast<char>(b));
  for (; i + 16 <= n; i += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    for (unsigned m = ~unsigned(_mm_movemask_epi8(_mm_cmpeq_epi8(x, vb))) & 0xffffu; m != 0; m &= m - 1)
      f(i + std::size_t(std::countr_zero(m)));
  }
#endif
  for (; i < n; ++i)
    if (w[i] != b) f(i);
}
struct FusedStep;  // qaq/decode_attention.hpp: qaq_decode_step's access to the per-stream update
}  // namespace detail
}  // namespace qaq

template <int BMin, int BMax, int OutlierPermille, int Window, class Bounds, class Meta, class... Rot>
class CompressedKVCache<QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>, Rot...> {
  static_assert(sizeof...(Rot) <= 1 && (PolicyOf<Rot, kind::rotation> && ...),
                "kvc::QaqQuantizer composes with one kvc::Rotation<...> after it and nothing else: its cache is "
                "CompressedKVCache<QaqQuantizer<...>> or CompressedKVCache<QaqQuantizer<...>, Rotation<...>> (mixed-bit "
                "buckets; no selector, block size, second quantizer or GEAR correction)");

 public:
  using quantizer = QaqQuantizer<BMin, BMax, OutlierPermille, Window, Bounds, Meta>;
  /// The Rotation policy (NoRotation without one): attention rotates the query and un-rotates the output
  /// (rotate/rotation.hpp); QAQ's bounds are rotation-invariant (||R q|| = ||q||). On a rotated side:
  ///  - without outliers (OutlierPermille = 0) the row is rotated, y = R x: mirror, codes, widths and raises
  ///    live in the rotated basis;
  ///  - with outliers they are taken first, in the original basis (the few channels that carry a token's
  ///    extremes), and only the residual is rotated: y = R (x - o), o = x on the outlier channels, 0 elsewhere;
  ///    the mirror holds y, the codes are y's over all d channels, and x^ = R^T y^ + o (record format
  ///    AddOutliers). Our choice (SpinQuant/QuaRot have no outliers; QAQ no rotation): rotating first spreads
  ///    the outlier channels over all of them, so the 1 % kept exact holds little, every channel's range grows
  ///    and QAQ's KL rose 2-37 % on SmolLM2 (README); taken first, the outliers keep what they hold and the
  ///    rotation spreads what is left.
  using rotation = typename detail::find_policy<kind::rotation, NoRotation, Rot...>::type;
  static constexpr bool kRotated = rotation::kActive;
  static constexpr bool kSplitKeys = rotation::kKeys && OutlierPermille > 0;
  static constexpr bool kSplitValues = rotation::kValues && OutlierPermille > 0;
  /// Sizes, lowering, raising and token ids (the same on both sides); key_record / value_record add how a
  /// side's outliers join its reconstruction.
  using record = qaq::RecordFormat<quantizer>;
  using key_record = qaq::RecordFormat<quantizer, kSplitKeys>;
  using value_record = qaq::RecordFormat<quantizer, kSplitValues>;
  using history = typename quantizer::history;
  static constexpr int kWidths = BMax - BMin + 1;
  /// BMin == BMax: every token keeps one width for good (per-token uniform quantization with QAQ's codec and
  /// outliers, the paper's Fig. 4 baseline): records stay in token order, so they carry no token id, and
  /// there are no attention histories; update_widths() has nothing to do.
  static constexpr bool kAdaptive = BMin < BMax;
  /// One stream side's mirror, fp16 [length][head_dim]: raises read its rows at random, so long mirrors live
  /// on huge pages (HugePageAllocator: a 4 KiB page walk per raised row cost more than the raise itself).
  using mirror_rows = std::vector<half_t, HugePageAllocator<half_t>>;

  /// One stream side's buckets; bucket[b - BMin] holds the records of width b.
  struct Side {
    std::array<std::vector<std::byte>, kWidths> bucket;
  };

  /// cfg as for every cache (head_dim <= 256: outlier channels are uint8); targets > 0 and finite;
  /// calibration of the same layers, KV heads and head_dim.
  CompressedKVCache(const CacheConfig& cfg, qaq::Targets targets, qaq::QueryNormCalibration calibration)
      : cfg_(cfg), calib_(std::move(calibration)) {
    qaq::check_setup(cfg, calib_, quantizer::kMaxHeadDim);
    set_targets(targets);
    id_bytes_ = kAdaptive ? record::id_bytes_for(cfg.capacity) : 0;
    const std::size_t streams = std::size_t(cfg.layers) * cfg.batch * cfg.kv_heads;
    keys_.resize(streams);
    values_.resize(streams);
    hist_.resize(streams);
    key_memo_.resize(streams);
    mirror_k_.resize(streams);
    mirror_v_.resize(streams);
    lengths_.assign(std::size_t(cfg.layers) * cfg.batch, 0);
    if constexpr (kRotated) {
      rules::check_rotation(cfg);
      rot_.resize(std::size_t(cfg.layers) * rotation_words());
      rotation::make_tables(cfg.layers, cfg.kv_heads, cfg.head_dim, rot_.data());
    }
  }

  /// Changes the error targets (SPEC Q1); they take effect at the next width update (update_widths(),
  /// qaq_decode_step).
  void set_targets(qaq::Targets t) {
    qaq::check_targets(t);
    targets_ = t;
  }
  [[nodiscard]] qaq::Targets targets() const noexcept { return targets_; }
  [[nodiscard]] const CacheConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] int id_bytes() const noexcept { return id_bytes_; }
  [[nodiscard]] int length(int layer, int seq) const {
    check_index(layer, seq);
    return lengths_[std::size_t(layer) * cfg_.batch + seq];
  }
  [[nodiscard]] const Side& keys(int layer, int seq, int head) const { return keys_[stream(layer, seq, head)]; }
  [[nodiscard]] const Side& values(int layer, int seq, int head) const { return values_[stream(layer, seq, head)]; }
  /// The attention histories of one stream, by token, and its mirror (side 0: keys, 1: values; fp16
  /// [length][head_dim]): what a device cache uploads.
  [[nodiscard]] const std::vector<history>& histories(int layer, int seq, int head) const {
    check_index(layer, seq);
    return hist_[stream(layer, seq, head)];
  }
  [[nodiscard]] const mirror_rows& mirror(int layer, int seq, int head, int side) const {
    check_index(layer, seq);
    return side == 0 ? mirror_k_[stream(layer, seq, head)] : mirror_v_[stream(layer, seq, head)];
  }
  /// The rotation tables of `layer`, [kv_heads][rotation::head_words] (null without a Rotation).
  [[nodiscard]] const std::uint32_t* rotation_tables(int layer) const {
    check_index(layer, 0);
    return kRotated ? rot_.data() + std::size_t(layer) * rotation_words() : nullptr;
  }
  /// Records in a bucket of width b (bytes / record size).
  [[nodiscard]] std::size_t records(const Side& s, int b) const {
    return s.bucket[std::size_t(b - BMin)].size() / record::bytes(cfg_.head_dim, b, id_bytes_);
  }

  /// Appends k.dim0 tokens (prefill or one decode token): mirror, then a record at BMax per side.
  /// k, v: [tokens][kv_heads][head_dim], finite, |x| <= 65504 (with a Rotation: the rotated rows or residuals
  /// too, the error naming the rotated channel). Validates everything first.
  void append(int layer, int seq, KVView k, KVView v) {
    check_index(layer, seq);
    int& n = lengths_[std::size_t(layer) * cfg_.batch + seq];
    if (rules::check_append_shape(cfg_, layer, seq, n, k, v) == 0) return;
    std::vector<float> k_rot, v_rot;  // Rotation: the rows as stored (R k or R (k - o); R v or R (v - o))
    Outliers k_out, v_out;            // split sides: the outliers taken before the rotation
    k = qaq::stored_rows<kSplitKeys, rules>(k, true, rotation_tables(layer), k_rot, k_out);
    v = qaq::stored_rows<kSplitValues, rules>(v, false, rotation_tables(layer), v_rot, v_out);
    const int d = cfg_.head_dim;
    for (int h = 0; h < cfg_.kv_heads; ++h) {
      const std::size_t s = stream(layer, seq, h);
      for (int t = 0; t < k.dim0; ++t) {
        const std::uint32_t id = std::uint32_t(n + t);
        for (int side = 0; side < 2; ++side) {
          const float* src = (side == 0 ? k : v).row(t, h);
          auto& mirror = side == 0 ? mirror_k_[s] : mirror_v_[s];
          for (int c = 0; c < d; ++c) mirror.push_back(half_t::from_float(src[c]));
          const bool split = side == 0 ? kSplitKeys : kSplitValues;
          const typename Outliers::Row o = (side == 0 ? k_out : v_out).row(t, h);
          put(side == 0 ? keys_[s] : values_[s], mirror.data() + std::size_t(id) * d, id, split ? &o : nullptr);
        }
        if constexpr (kAdaptive) {
          history h0;
          h0.reset();
          hist_[s].push_back(h0);
        }
      }
    }
    n += k.dim0;
  }

  /// SPEC §2.6 after a decode step of `layer`: records every token's probability (probs from
  /// decode_attention), then moves each token whose width changes (lowering: a shift of its codes;
  /// raising: codes re-encoded from the mirror). Probabilities must be finite and in [0, 1]; validated first.
  void update_widths(int layer, const qaq::TokenProbs& probs) {
    check_index(layer, 0);
    KVC_CHECK(probs.batch == cfg_.batch && probs.kv_heads == cfg_.kv_heads, Errc::kInvalidArgument,
              "QAQ probabilities are for ", probs.batch, " sequences x ", probs.kv_heads, " KV heads, the cache has ",
              cfg_.batch, " x ", cfg_.kv_heads);
    for (int s = 0; s < cfg_.batch; ++s) {
      const int T = length(layer, s);
      KVC_CHECK(T <= probs.stride, Errc::kInvalidArgument, "QAQ probabilities hold ", probs.stride,
                " tokens per stream, sequence ", s, " holds ", T);
      auto invalid = [](float p) { return !(p >= 0.0f && p <= 1.0f); };  // NaN fails both comparisons
      for (int h = 0; h < cfg_.kv_heads; ++h) {
        const float* row = probs.row(s, h);
        bool bad = false;  // a branch-free scan, the culprit found only on failure
        for (int t = 0; t < T; ++t) bad |= invalid(row[t]);
        if (!bad) continue;
        const int t = int(std::find_if(row, row + T, invalid) - row);
        KVC_CHECK(false, Errc::kInvalidArgument, "QAQ probability of sequence ", s, " KV head ", h, " token ", t, " is ",
                  row[t], " (must be in [0, 1])");
      }
    }
    ++updates_;
    if constexpr (!kAdaptive) return;
    for_each_stream([&](int i, Staging& sg) {
      update_stream(layer, i, probs.row(i / cfg_.kv_heads, i % cfg_.kv_heads), sg);
    });
  }

  /// Counts of every width update so far (qaq::UpdateStats).
  [[nodiscard]] qaq::UpdateStats update_stats() const {
    qaq::UpdateStats total;
    for (const Staging& sg : staging_) total += sg.stats;
    total.updates = updates_;
    return total;
  }

  /// Forgets sequence `seq` in every layer.
  void clear(int seq) {
    check_index(0, seq);
    for (int l = 0; l < cfg_.layers; ++l) {
      lengths_[std::size_t(l) * cfg_.batch + seq] = 0;
      for (int h = 0; h < cfg_.kv_heads; ++h) {
        const std::size_t st = stream(l, seq, h);
        keys_[st] = Side{};
        values_[st] = Side{};
        hist_[st].clear();
        key_memo_[st] = KeyMemo{};
        mirror_k_[st].clear();
        mirror_v_[st].clear();
      }
    }
  }

  /// Reconstruction of (layer, seq) as attention sees it, k, v: [length][kv_heads][head_dim], in the original
  /// basis (a Rotation's rows un-rotated) (tests).
  void dequantize(int layer, int seq, float* k, float* v) const {
    const int d = cfg_.head_dim, H = cfg_.kv_heads;
    const std::uint32_t* tables = rotation_tables(layer);
    for (int h = 0; h < H; ++h) {
      const std::size_t st = stream(layer, seq, h);
      for (int side = 0; side < 2; ++side) {
        const Side& sd = side == 0 ? keys_[st] : values_[st];
        float* out = side == 0 ? k : v;
        for_each_record(sd, [&](const std::byte* r, int b, std::uint32_t t) {
          float* row = out + (std::size_t(t) * H + h) * d;
          if (side == 0) qaq::reconstruct<key_record, rotation>(r, d, b, true, tables, h, row);
          else qaq::reconstruct<value_record, rotation>(r, d, b, false, tables, h, row);
        });
      }
    }
  }

  /// Calls f(record, width, token) for every record of one side.
  template <class F>
  void for_each_record(const Side& sd, F&& f) const {
    const int d = cfg_.head_dim;
    for (int b = BMin; b <= BMax; ++b) {
      const std::size_t rb = record::bytes(d, b, id_bytes_);
      const std::vector<std::byte>& bk = sd.bucket[std::size_t(b - BMin)];
      std::uint32_t i = 0;
      for (std::size_t o = 0; o < bk.size(); o += rb, ++i)
        f(bk.data() + o, b, kAdaptive ? record::token(bk.data() + o, rb, id_bytes_) : i);
    }
  }

  /// Tokens of one layer (and, with side 0/1, of keys/values) per width b in [0, 8]: a width histogram.
  [[nodiscard]] std::array<std::size_t, 9> width_counts(int layer, int side) const {
    std::array<std::size_t, 9> n{};
    for (int s = 0; s < cfg_.batch; ++s)
      for (int h = 0; h < cfg_.kv_heads; ++h) {
        const Side& sd = side == 0 ? keys_[stream(layer, s, h)] : values_[stream(layer, s, h)];
        for (int b = BMin; b <= BMax; ++b) n[std::size_t(b)] += records(sd, b);
      }
    return n;
  }

  /// Bytes of the compressed cache of one layer: records and attention histories (see the file comment).
  [[nodiscard]] std::size_t stored_bytes(int layer) const {
    check_index(layer, 0);
    std::size_t total = 0;
    for (int s = 0; s < cfg_.batch; ++s)
      for (int h = 0; h < cfg_.kv_heads; ++h) {
        const std::size_t st = stream(layer, s, h);
        for (int b = 0; b < kWidths; ++b) total += keys_[st].bucket[std::size_t(b)].size() + values_[st].bucket[std::size_t(b)].size();
        total += hist_[st].size() * sizeof(history);
      }
    // the layer's rotation tables, read by every decode step (as CacheRules::stored_bytes counts them)
    if (kRotated && std::any_of(lengths_.begin() + std::ptrdiff_t(layer) * cfg_.batch,
                                lengths_.begin() + std::ptrdiff_t(layer + 1) * cfg_.batch, [](int n) { return n > 0; }))
      total += layout::rotation_bytes(cfg_.kv_heads, cfg_.head_dim);
    return total;
  }
  [[nodiscard]] std::size_t stored_bytes() const { return detail::stored_bytes_all_layers(*this); }
  /// Bytes one decode step over `layer` reads: every record once and every history (which it also writes).
  [[nodiscard]] std::size_t decode_read_bytes(int layer) const { return stored_bytes(layer); }
  /// Bytes of the full-precision mirror (fp16 K and V of every token), not part of stored_bytes().
  [[nodiscard]] std::size_t mirror_bytes() const {
    std::size_t total = 0;
    for (std::size_t i = 0; i < mirror_k_.size(); ++i) total += (mirror_k_[i].size() + mirror_v_[i].size()) * sizeof(half_t);
    return total;
  }
  [[nodiscard]] std::size_t elements() const { return detail::cached_elements(*this); }
  [[nodiscard]] double bits_per_element() const { return detail::bits_per_cached_element(*this); }
  /// Average code width of one side over every token (0 when empty).
  [[nodiscard]] double average_width(int side) const {
    double sum = 0.0, n = 0.0;
    for (int l = 0; l < cfg_.layers; ++l) {
      const auto c = width_counts(l, side);
      for (int b = 0; b <= 8; ++b) sum += double(b) * double(c[std::size_t(b)]), n += double(c[std::size_t(b)]);
    }
    return n > 0.0 ? sum / n : 0.0;
  }

 private:
  /// One thread's scratch of the width update (push_and_decide_values, decide_keys, rebucket), kept between steps
  /// (its capacity is reused: no allocation per step).
  struct Staging {
    Side moved;                          // the movers, by new width
    std::vector<std::uint8_t> width;     // new width of every record of the side being updated (decide_keys and
                                         // push_and_decide_values)
    std::vector<std::uint8_t> s_hat;     // per token: the S^ code after this step's push (push_and_decide_values)
    std::vector<std::uint32_t> movers;   // indices of the records of the bucket being rebucketed that move (rebucket)
    std::vector<std::uint32_t> raises;   // those of them being raised
    qaq::UpdateStats stats;              // this thread's share of update_stats()
  };
  [[nodiscard]] std::size_t stream(int layer, int seq, int head) const noexcept {
    return (std::size_t(layer) * cfg_.batch + seq) * cfg_.kv_heads + head;
  }
  /// The fp16 cache's layout and rules (QAQ's mirror is fp16), with this cache's rotation: the append checks,
  /// rotated_input and the tables' size.
  using layout = typename CompressedKVCache<NoQuantizer<half_t>, Rot...>::layout;
  using rules = detail::CacheRules<layout>;
  void check_index(int layer, int seq) const { rules::check_index(cfg_, layer, seq); }
  [[nodiscard]] std::size_t rotation_words() const noexcept { return layout::rotation_words(cfg_.kv_heads, cfg_.head_dim); }
  using Outliers = qaq::SplitOutliers<quantizer>;
  /// Quantizes a mirror row and appends its record at BMax; a split side (o: the row's outliers, taken before the
  /// rotation) codes the row, its rotated residual, over all channels.
  void put(Side& sd, const half_t* row, std::uint32_t id, const typename Outliers::Row* o) {
    std::vector<std::byte>& bk = sd.bucket[std::size_t(BMax - BMin)];
    const std::size_t at = bk.size();
    bk.resize(at + record::bytes(cfg_.head_dim, BMax, id_bytes_));
    if (o) record::write_residual(bk.data() + at, cfg_.head_dim, BMax, id_bytes_, row, o->val, o->idx, id);
    else record::write_row(bk.data() + at, cfg_.head_dim, BMax, id_bytes_, row, id);
  }
  /// The width rule of KV head `head` of `layer` at length T under the current targets.
  [[nodiscard]] qaq::StepWidths<Bounds> step_rule(int layer, int head, int T) const {
    return qaq::StepWidths<Bounds>(T, targets_.key_sigma_s, double(calib_.at(layer, head)), targets_.value_sigma_x,
                                   quantizer::widths());
  }

  /// n_full: tokens [0, n_full) of a stream are those whose histories will be full after this step's push, taken
  /// before it (full() is monotone in the token id, as every update observes every token and tokens are appended
  /// in order: a token has seen at least as many steps as any later one, so n_full is one partition point; one
  /// more observation fills a history that has seen kWindow - 1). Both deciders (values and keys) use it.
  [[nodiscard]] static std::uint32_t full_after_push(const std::vector<history>& hist) noexcept {
    return std::uint32_t(std::partition_point(hist.begin(), hist.end(),
                                              [](const history& h) { return h.seen + 1 >= quantizer::kWindow; }) -
                         hist.begin());
  }
  /// Calls f(b, records, count, record bytes) for every bucket of `sd`, width BMin first.
  template <class F>
  void each_bucket(const Side& sd, F&& f) const {
    for (int b = BMin; b <= BMax; ++b) {
      const std::size_t rb = record::bytes(cfg_.head_dim, b, id_bytes_);
      const std::vector<std::byte>& bk = sd.bucket[std::size_t(b - BMin)];
      f(b, bk.data(), bk.size() / rb, rb);
    }
  }
  /// At least one Staging per thread of a parallel loop of `threads` threads (kept: not cache state).
  void reserve_staging(int threads) { staging_.resize(std::max(staging_.size(), std::size_t(std::max(1, threads)))); }
  /// Runs f(i, staging) for every (sequence, KV head) stream index i, in parallel.
  template <class F>
  void for_each_stream(F&& f) {
    const int streams = cfg_.batch * cfg_.kv_heads;
#if KVC_HAS_OPENMP()
    reserve_staging(omp_get_max_threads());
#  pragma omp parallel for schedule(dynamic, 1) if (streams > 1)
#else
    reserve_staging(1);
#endif
    for (int i = 0; i < streams; ++i) {
#if KVC_HAS_OPENMP()
      f(i, staging_[std::size_t(omp_get_thread_num())]);
#else
      f(i, staging_[0]);
#endif
    }
  }
  friend struct qaq::detail::FusedStep;
  /// update_widths' work for stream i (sequence i / kv_heads, KV head i % kv_heads) of `layer`, on one thread's
  /// scratch: p, the stream's probabilities of this step (valid: finite, in [0, 1]), recorded in its histories,
  /// then every record at the width the rule gives. Touches stream i's state and sg only: distinct streams may be
  /// updated concurrently (qaq_decode_step runs each right after its attention).
  void update_stream(int layer, int i, const float* p, Staging& sg) {
    const std::size_t st = stream(layer, i / cfg_.kv_heads, i % cfg_.kv_heads);
    const int T = lengths_[std::size_t(layer) * cfg_.batch + i / cfg_.kv_heads];
    const qaq::StepWidths<Bounds> rule = step_rule(layer, i % cfg_.kv_heads, T);
    typename quantizer::StepLimits limits(rule);  // the rule as integer compares on step_max's fp16 bits
    const std::uint32_t n_full = full_after_push(hist_[st]);
    push_and_decide_values(st, p, n_full, limits, sg);
    rebucket(st, false, sg.width.data(), sg);
    decide_keys(st, n_full, limits, sg.width);
    rebucket(st, true, sg.width.data(), sg);
    key_memo_[st] = {limits.key_limits(), n_full, true};  // once the keys are where decide_keys put them
  }

  /// Records this step's probability p[t] in every token's history, then gives each value record its new width
  /// (quantizer::value_width through `limits`) in sg.width[j], records numbered bucket by bucket (width BMin first)
  /// in their order. Two sequential passes: the histories in token order (push, then S^ into sg.s_hat), then the
  /// value records in bucket order, each reading its token's S^ from that T-byte array (L1/L2-resident), not its
  /// history (a random line per record: pushing and deciding in record order cost the update about 0.8 ms more
  /// at T = 32768). n_full: full_after_push(hist_[st]) taken before this call, so t < n_full <=> hist[t].full()
  /// after the push. Every token has exactly one value record.
  void push_and_decide_values(std::size_t st, const float* p, std::uint32_t n_full,
                              typename quantizer::StepLimits& limits, Staging& sg) {
    const int ids = id_bytes_;  // a local: the width stores (uint8_t) may alias members, which would be reloaded
    const std::size_t T = hist_[st].size();
    history* hist = hist_[st].data();
    sg.s_hat.resize(T);
    std::uint8_t* s_hat = sg.s_hat.data();
    std::size_t t = 0;
#if KVC_QAQ_SSE2_
    for (alignas(16) std::uint8_t c[16]; t + 16 <= T; t += 16) {  // the codes 4 at a time, then the rings
      for (int k = 0; k < 16; k += 4) qaq::ProbCode::encode4(p + t + k, c + k);
      for (std::size_t k = 0; k < 16; ++k) {
        hist[t + k].push_code(c[k]);
        s_hat[t + k] = hist[t + k].s_hat_code();
      }
    }
#endif
    for (; t < T; ++t) {
      hist[t].push(p[t]);
      s_hat[t] = hist[t].s_hat_code();
    }
    sg.width.resize(T);
    std::uint8_t* w = sg.width.data();
    each_bucket(values_[st], [&](int, const std::byte* bk, std::size_t n, std::size_t rb) {
      for (std::size_t i = 0; i < n; ++i) {
        const std::byte* r = bk + i * rb;
        record::prefetch(bk, i + record::kRecordAhead, n, rb);  // update_ms at T = 32768: 2.9-3.2 -> 2.6-3.0 (README)
        const std::uint32_t tok = record::token(r, rb, ids);
        *w++ = std::uint8_t(tok < n_full ? limits.value(record::meta(r).step.bits, s_hat[tok]) : BMax);
      }
    });
  }
  /// The new width of every key record (numbered as push_and_decide_values numbers values): B_max for tokens
  /// [n_full, T) (histories not yet full), quantizer::key_width through `limits` for the others. Keys depend on
  /// the step only through the limits, which the bound (varying as log T) moves rarely at long context (at
  /// T = 32768 once in 30 to 250 steps, at T = 2048 once in 1.5 to 14). While they equal the last update's,
  /// only the keys whose histories filled since then (tokens >= the last n_full: all in bucket B_max) are
  /// decided, and every other key keeps its width: the same result as deciding all of them (step_max is a
  /// finite fp16 >= 0 by construction, which the limits cover exactly), without reading their records. The
  /// caller records the limits and n_full in the memo once the keys have moved.
  void decide_keys(std::size_t st, std::uint32_t n_full, const typename quantizer::StepLimits& limits,
                   std::vector<std::uint8_t>& width) const {
    const int ids = id_bytes_;
    const Side& sd = keys_[st];
    const KeyMemo& memo = key_memo_[st];
    const bool same = memo.valid && memo.limits == limits.key_limits();
    const std::uint32_t first = same ? memo.decided : 0;  // tokens below it keep their widths
    width.resize(hist_[st].size());
    std::uint8_t* w = width.data();
    each_bucket(sd, [&](int b, const std::byte* bk, std::size_t n, std::size_t rb) {
      if (same && b < BMax) {  // every key below B_max is a token < memo.decided
        w = std::fill_n(w, n, std::uint8_t(b));
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        const std::byte* r = bk + i * rb;
        const std::uint32_t t = record::token(r, rb, ids);
        *w++ = std::uint8_t(t < first ? b : (t < n_full ? limits.key(record::meta(r).step.bits) : BMax));
      }
    });
  }
  /// Moves the records of one stream side whose new width (width[j], records numbered bucket by bucket) differs
  /// from their bucket's, in place, bucket by bucket: the bucket is compacted over the records that
  /// stay (one memmove per run of them) and the movers are staged, lowered by a shift or raised from the mirror
  /// (RecordFormat::raise; the mirror row of the raise kAhead further on is prefetched, as those rows are cold,
  /// random reads), then appended to their new buckets at the end. A bucket nobody leaves is not touched.
  void rebucket(std::size_t st, bool key, const std::uint8_t* width, Staging& sg) {
    constexpr std::size_t kAhead = 8;
    const int d = cfg_.head_dim;
    Side& sd = key ? keys_[st] : values_[st];
    const half_t* mirror = (key ? mirror_k_[st] : mirror_v_[st]).data();
    const std::size_t row_bytes = std::size_t(d) * sizeof(half_t);
    auto prefetch = [](const void* p, std::size_t bytes) {
      for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 1);
    };
    const int side = key ? 0 : 1;
    for (auto& bk : sg.moved.bucket) bk.clear();  // keeps its capacity: no allocation (and page faults) per step
    for (int b = BMin; b <= BMax; ++b) {
      const std::size_t rb = record::bytes(d, b, id_bytes_);
      std::vector<std::byte>& bk = sd.bucket[std::size_t(b - BMin)];
      const std::size_t n = bk.size() / rb;
      const std::uint8_t* wb = width;
      width += n;
      sg.stats.records[side] += n;
      auto token = [&](std::size_t i) { return record::token(bk.data() + i * rb, rb, id_bytes_); };
      sg.movers.clear();
      sg.raises.clear();
      std::array<std::size_t, kWidths> incoming{};  // movers into each width
      qaq::detail::for_each_differing(wb, n, std::uint8_t(b), [&](std::size_t i) {
        sg.movers.push_back(std::uint32_t(i));
        ++incoming[std::size_t(wb[i] - BMin)];
        if (wb[i] > b) sg.raises.push_back(std::uint32_t(i));
      });
      const std::size_t movers = sg.movers.size();
      if (movers == 0) continue;
      // the movers' slots in the staged buckets, sized once (not one resize, and its zero fill, per record)
      std::array<std::byte*, kWidths> out{};
      for (int nb = BMin; nb <= BMax; ++nb) {
        std::vector<std::byte>& dst = sg.moved.bucket[std::size_t(nb - BMin)];
        const std::size_t at = dst.size(), add = nb == b ? 0 : incoming[std::size_t(nb - BMin)];
        dst.resize(at + add * record::bytes(d, nb, id_bytes_));
        out[std::size_t(nb - BMin)] = dst.data() + at;
      }
      for (std::size_t j = 0; j < std::min(kAhead, sg.raises.size()); ++j)
        prefetch(mirror + std::size_t(token(sg.raises[j])) * d, row_bytes);
      // records [run, i) stay and are not yet moved down to `keep` (moved as one block per run)
      std::size_t keep = 0, run = 0, raised = 0;
      auto flush_run = [&](std::size_t end) {
        if (keep != run && end > run) std::memmove(bk.data() + keep, bk.data() + run, end - run);
        keep += end - run;
      };
      qaq::with_width<BMin, BMax>(b, [&]<int B>() {  // both widths constants in lower / raise (inlined)
        for (const std::uint32_t mover : sg.movers) {
          const std::size_t i = mover;
          const int nb = wb[i];
          const std::byte* r = bk.data() + i * rb;
          flush_run(i * rb);
          run = (i + 1) * rb;
          std::byte*& dst = out[std::size_t(nb - BMin)];
          if (nb < B) {
            qaq::with_width<BMin, B - 1>(nb, [&]<int NB>() { record::lower(r, B, dst, NB, d, id_bytes_); });
          } else {
            if (raised + kAhead < sg.raises.size())
              prefetch(mirror + std::size_t(token(sg.raises[raised + kAhead])) * d, row_bytes);
            ++raised;
            const half_t* row = mirror + std::size_t(token(i)) * d;
            qaq::with_width<B + 1, BMax>(nb, [&]<int NB>() { record::raise(r, B, dst, NB, d, id_bytes_, row); });
          }
          dst += record::bytes(d, nb, id_bytes_);
        }
      });
      flush_run(bk.size());
      sg.stats.raised[side] += sg.raises.size();
      sg.stats.lowered[side] += movers - sg.raises.size();
      bk.resize(keep);
    }
    for (int b = 0; b < kWidths; ++b) {
      const std::vector<std::byte>& src = sg.moved.bucket[std::size_t(b)];
      sd.bucket[std::size_t(b)].insert(sd.bucket[std::size_t(b)].end(), src.begin(), src.end());
    }
  }

  CacheConfig cfg_;
  qaq::Targets targets_;
  qaq::QueryNormCalibration calib_;
  int id_bytes_ = 4;
  std::vector<Side> keys_, values_;
  std::vector<std::vector<history>> hist_;
  /// Per stream, the key limits and n_full of its last update (decide_keys).
  struct KeyMemo {
    typename quantizer::StepLimits::Limits limits{};
    std::uint32_t decided = 0;
    bool valid = false;
  };
  std::vector<KeyMemo> key_memo_;
  std::vector<mirror_rows> mirror_k_, mirror_v_;
  std::vector<int> lengths_;
  std::vector<std::uint32_t> rot_;  // Rotation: [layers][kv_heads][rotation::head_words] transform tables
  std::vector<Staging> staging_;  // the width update's per-thread scratch (not cache state) and counts; one per
                                  // thread of for_each_stream or of qaq_decode_step (FusedStep::reserve)
  std::uint64_t updates_ = 0;
};
}  // namespace kvc
