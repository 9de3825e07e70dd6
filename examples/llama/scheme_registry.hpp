/// \file scheme_registry.hpp
/// The schemes kvc-eval compares, by name. Adding a kvc cache configuration to the quality harness is
/// one `entry<...>` line below; the runner is instantiated for the cache type, so the engine calls the
/// same fused attention a user's engine would for that policy set.
#pragma once

#include <llama/llama_model.hpp>
#include <llama/qaq_eval.hpp>

#include <kvc/aligned/decode_attention.hpp>
#include <kvc/schemes.hpp>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace kvc::llama {

/// What one teacher-forced run with a scheme's cache produced.
struct SchemeRun {
  RowMatrix hidden;                 ///< final normalised hidden states [T][d_model]
  double bits_per_element = 0.0;    ///< of the whole cache after the run (everything counted)
  std::size_t stored_bytes = 0;     ///< of the whole cache after the run
  std::vector<double> layer_err2;   ///< per layer: sum over positions of |attn - exact attn|^2
  std::vector<double> layer_ref2;   ///< per layer: sum over positions of |exact attn|^2
  /// Adaptive-width caches (QAQ): tokens per code width 0..8 over every layer after the run, keys and
  /// values (empty for the other schemes).
  std::vector<std::size_t> key_widths, value_widths;
  /// QAQ caches: of the records the width updates re-derived over the run, the shares lowered and raised:
  /// {key lowered, key raised, value lowered, value raised} (zeros for the fixed-width qaq-uB, empty for the
  /// other schemes).
  std::vector<double> moved;
};

/// Hooks of a run: `observe` sees each layer's trace (e.g. to dump K/V), `progress` each finished layer;
/// `attention` is how the engine attends over the scheme's cache (LlamaModel::forward()).
struct RunHooks {
  std::function<void(const LayerTrace&)> observe;
  std::function<void(int)> progress;
  bool measure_layer_error = true;  ///< also attend over an fp32 cache of the same K/V, per layer
  AttentionMode attention = AttentionMode::kFast;
  const qaq::QueryNormCalibration* qaq_calibration = nullptr;  ///< QAQ's key bound (qaq_eval.hpp); QAQ only
};

struct SchemeEntry {
  std::string name, description;
  std::function<SchemeRun(const LlamaModel&, const std::vector<std::int32_t>&, const RunHooks&)> run;
};

namespace detail {
/// One run with the cache `make(model.cache_config(T))` builds.
template <class Cache, class Make>
SchemeRun run_with(const LlamaModel& model, const std::vector<std::int32_t>& tokens, const RunHooks& hooks, Make&& make) {
  const int T = int(tokens.size());
  const LlamaConfig& c = model.config();
  Cache cache = make(model.cache_config(T));
  SchemeRun r;
  r.layer_err2.assign(std::size_t(c.layers), 0.0);
  r.layer_ref2.assign(std::size_t(c.layers), 0.0);
  // Per-layer error of the cache alone: the exact attention over the SAME K/V (this run's own inputs),
  // so errors from earlier layers do not count twice. It uses the fp32 fused kernel in every attention
  // mode (its own float rounding, ~1e-7 relative, is far below any scheme's error).
  auto observe = [&](const LayerTrace& tr) {
    if (hooks.observe) hooks.observe(tr);
    if (!hooks.measure_layer_error) return;
    schemes::Fp32 exact(CacheConfig{1, 1, c.kv_heads, c.head_dim, T});
    std::vector<float> out(std::size_t(c.heads) * c.head_dim);
    AttentionOptions opt;
    opt.num_threads = 1;
    double e2 = 0.0, r2 = 0.0;
    for (int t = 0; t < T; ++t) {
      exact.append(0, 0, KVView::contiguous(tr.k->row(t).data(), 1, c.kv_heads, c.head_dim),
                   KVView::contiguous(tr.v->row(t).data(), 1, c.kv_heads, c.head_dim));
      decode_attention(exact, 0, QueryView::contiguous(tr.q->row(t).data(), 1, c.heads, c.head_dim),
                       OutputView::contiguous(out.data(), 1, c.heads, c.head_dim), opt);
      const float* a = tr.attn->row(t).data();
      for (std::size_t i = 0; i < out.size(); ++i) {
        e2 += double(a[i] - out[i]) * double(a[i] - out[i]);
        r2 += double(out[i]) * double(out[i]);
      }
    }
    r.layer_err2[std::size_t(tr.layer)] = e2;
    r.layer_ref2[std::size_t(tr.layer)] = r2;
  };
  ForwardOptions fo;
  fo.attention = hooks.attention;
  fo.observe = observe;
  fo.progress = hooks.progress;
  r.hidden = model.forward(tokens, cache, fo);
  r.bits_per_element = cache.bits_per_element();
  r.stored_bytes = cache.stored_bytes();
  if constexpr (requires { cache.cache().width_counts(0, 0); }) {
    r.key_widths.assign(9, 0);
    r.value_widths.assign(9, 0);
    for (int l = 0; l < c.layers; ++l) {
      const auto kw = cache.cache().width_counts(l, 0), vw = cache.cache().width_counts(l, 1);
      for (std::size_t b = 0; b < 9; ++b) r.key_widths[b] += kw[b], r.value_widths[b] += vw[b];
    }
  }
  if constexpr (requires { cache.cache().update_stats(); }) {
    const qaq::UpdateStats u = cache.cache().update_stats();
    for (int side = 0; side < 2; ++side) {
      const double n = std::max<double>(1.0, double(u.records[std::size_t(side)]));
      r.moved.push_back(double(u.lowered[std::size_t(side)]) / n);
      r.moved.push_back(double(u.raised[std::size_t(side)]) / n);
    }
  }
  return r;
}

template <class Cache>
SchemeEntry entry(std::string name, std::string description) {
  return SchemeEntry{std::move(name), std::move(description),
                     [](const LlamaModel& m, const std::vector<std::int32_t>& tokens, const RunHooks& h) {
                       return run_with<Cache>(m, tokens, h, [](const CacheConfig& cfg) { return Cache(cfg); });
                     }};
}

/// A QAQ scheme (qaq_eval.hpp) at targets t; the calibration comes from the run's hooks.
template <class Q>
SchemeEntry qaq_entry(std::string name, std::string description, qaq::Targets t) {
  return SchemeEntry{std::move(name), std::move(description),
                     [t](const LlamaModel& m, const std::vector<std::int32_t>& tokens, const RunHooks& h) {
                       KVC_CHECK(h.qaq_calibration != nullptr, Errc::kInvalidArgument,
                                 "QAQ schemes need the ||q||^2 calibration (RunHooks::qaq_calibration)");
                       KVC_CHECK(!CompressedKVCache<Q>::kAdaptive || h.attention != AttentionMode::kReference,
                                 Errc::kInvalidArgument,
                                 "adaptive QAQ needs the fused attention's probabilities: use --attention fast or exact");
                       return run_with<QaqEvalCache<Q>>(m, tokens, h, [&](const CacheConfig& cfg) {
                         return QaqEvalCache<Q>(cfg, t, *h.qaq_calibration);
                       });
                     }};
}
}  // namespace detail

/// KIVI-style `Bits` backbone with 64-token blocks (key groups), 64-channel value groups, the first 64
/// tokens in fp16 (an attention sink; 64 keeps the blocks aligned at 2048 tokens) and a `Window`-token
/// fp16 window, then `Corrections`.
template <int Bits, int Window = 0, class... Corrections>
using SinkKivi = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<Bits, 64, kvc::Axis::kChannel>>,
                                        kvc::values<kvc::GroupQuantizer<Bits, 64, kvc::Axis::kToken>>,
                                        kvc::FullPrecisionWindow<Window, 64>, Corrections...>;

/// KIVI-4 on `Block`-token key groups and 64-channel value groups with no full-precision tokens beyond the
/// incomplete block (none at multiples of `Block`).
template <int Block>
using Kivi4Blocks = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, Block, kvc::Axis::kChannel>>,
                                               kvc::values<kvc::GroupQuantizer<4, 64, kvc::Axis::kToken>>>;

/// Outliers on one side only: 0.4 % of a 64 x 64 block is 16 outliers, exactly one 64-byte line.
template <int BasisPoints>
using KeyOutliers = kvc::OutlierFilter<BasisPoints, kvc::OutlierScope::kBlock, 0>;
template <int BasisPoints>
using ValueOutliers = kvc::OutlierFilter<0, kvc::OutlierScope::kBlock, BasisPoints>;

/// Ablation: scheme `Lo` on layers [0, Split), `Hi` on layers [Split, L), e.g. to measure how much of a
/// scheme's loss the early layers cause alone. Accounting sums both caches (bits over all layers).
template <class Lo, class Hi, int Split>
class LayerSplitCache {
 public:
  explicit LayerSplitCache(const CacheConfig& cfg)
      : cfg_(cfg), lo_(with_layers(cfg, Split)), hi_(with_layers(cfg, cfg.layers - Split)) {}
  const CacheConfig& config() const noexcept { return cfg_; }
  int length(int layer, int seq) const { return layer < Split ? lo_.length(layer, seq) : hi_.length(layer - Split, seq); }
  void append(int layer, int seq, KVView k, KVView v) {
    if (layer < Split) lo_.append(layer, seq, k, v);
    else hi_.append(layer - Split, seq, k, v);
  }
  void dequantize(int layer, int seq, float* k, float* v) const {
    if (layer < Split) lo_.dequantize(layer, seq, k, v);
    else hi_.dequantize(layer - Split, seq, k, v);
  }
  std::size_t stored_bytes() const { return lo_.stored_bytes() + hi_.stored_bytes(); }
  double bits_per_element() const {
    const double e = double(lo_.elements() + hi_.elements());
    return e > 0 ? 8.0 * double(stored_bytes()) / e : 0.0;
  }
  /// The engine's unqualified decode_attention(cache, layer, ...) finds this overload.
  friend void decode_attention(const LayerSplitCache& c, int layer, QueryView q, OutputView out,
                               const AttentionOptions& opt = {}) {
    if (layer < Split) kvc::decode_attention(c.lo_, layer, q, out, opt);
    else kvc::decode_attention(c.hi_, layer - Split, q, out, opt);
  }

 private:
  static CacheConfig with_layers(CacheConfig c, int layers) {
    KVC_CHECK(layers > 0, Errc::kInvalidArgument, "LayerSplitCache: split ", Split, " leaves no layers");
    c.layers = layers;
    return c;
  }
  CacheConfig cfg_;
  Lo lo_;
  Hi hi_;
};

/// Every scheme kvc-eval knows, in a stable order. The first entry is the exact reference.
inline const std::vector<SchemeEntry>& scheme_registry() {
  using namespace kvc::schemes;
  using detail::entry;
  static const std::vector<SchemeEntry> registry = {
      entry<Fp32>("fp32", "uncompressed fp32: the exact reference"),
      entry<Fp16>("fp16", "uncompressed fp16"),
      entry<Int8>("int8", "8-bit per-token uniform (endpoint codec)"),
      entry<CompressedKVCache<keys<GroupQuantizer<8, 32, Axis::kChannel>>, values<GroupQuantizer<8, 32, Axis::kToken>>>>(
          "int8-kc", "8-bit, keys per channel over 32-token blocks, values per token in 32-channel groups, no window"),
      entry<Kivi<8>>("kivi8", "KIVI 8-bit, group 32, 128-token fp16 window"),
      entry<Kivi4>("kivi4", "KIVI 4-bit: per-channel keys, per-token values, group 32, 128-token fp16 window"),
      entry<CompressedKVCache<keys<GroupQuantizer<4, 32, Axis::kChannel>>, values<GroupQuantizer<4, 32, Axis::kToken>>,
                              FullPrecisionWindow<128, 4>>>("kivi4-sink4",
                                                            "KIVI 4-bit with a 4-token attention sink kept in fp16"),
      entry<Kivi<3>>("kivi3", "KIVI 3-bit, group 32, 128-token fp16 window"),
      entry<Kivi2>("kivi2", "KIVI 2-bit, group 32, 128-token fp16 window"),
      entry<Kivi<2, 32, 32>>("kivi2-w32", "KIVI 2-bit, group 32, 32-token fp16 window"),
      entry<CompressedKVCache<keys<GroupQuantizer<2, 32, Axis::kChannel>>, values<GroupQuantizer<2, 32, Axis::kToken>>,
                              FullPrecisionWindow<128, 4>>>("kivi2-sink4",
                                                            "KIVI 2-bit with a 4-token attention sink kept in fp16"),
      entry<Kivi<1>>("kivi1", "KIVI 1-bit, group 32, 128-token fp16 window"),
      // LogQuant (SPEC §4): the log-distributed fp16 set of <= 3W tokens instead of the newest R, beside
      // KIVI on the same quantizer (G = 64) and budget (R = 126 = 3 x 42).
      entry<LogQuant2>("logquant2", "LogQuant 2-bit: G 64, log set W = 42 (<= 126 fp16 tokens) + staged evictions"),
      entry<LogQuant4>("logquant4", "LogQuant 4-bit: G 64, log set W = 42"),
      entry<LogQuant<2, 42, 32>>("logquant2-g32", "LogQuant 2-bit with 32-token groups/blocks, W = 42"),
      entry<LogQuant<2, 21>>("logquant2-w21", "LogQuant 2-bit, G 64, W = 21 (<= 63 fp16 tokens in the set)"),
      entry<PartialLogQuant2>("partiallogquant2",
                              "PartialLogQuant 2-bit: G 64, keys log set W = 64 (<= 192 fp16), values newest 64 fp16"),
      entry<PartialLogQuant<2, 42>>("partiallogquant2-w42",
                                    "PartialLogQuant 2-bit, W = 42: LogQuant2's key set, values newest 42 fp16"),
      entry<Kivi2Budget126>("kivi2-g64-w126", "KIVI 2-bit on LogQuant2's quantizer and budget: G 64, 126-token window"),
      entry<Kivi<4, 64, 126>>("kivi4-g64-w126", "KIVI 4-bit, G 64, 126-token window (LogQuant4's side-by-side)"),
      entry<CompressedKVCache<keys<GroupQuantizer<2, 64, Axis::kChannel>>, values<GroupQuantizer<2, 64, Axis::kToken>>,
                              FullPrecisionWindow<125, 1>>>(
          "kivi2-g64-w125-sink1", "kivi2-g64-w126 with position 0 kept instead of one window token (the sink LogQuant keeps)"),
      // Where the loss comes from: the scheme on layers 0-11 only (diffuse attention: both sets cover
      // about the same mass there, README) or on 12-29 only, fp16 elsewhere.
      entry<LayerSplitCache<LogQuant2, Fp16, 12>>("logquant2-l0-11", "logquant2 on layers 0-11, fp16 on 12-29"),
      entry<LayerSplitCache<Fp16, LogQuant2, 12>>("logquant2-l12-29", "fp16 on layers 0-11, logquant2 on 12-29"),
      entry<LayerSplitCache<Kivi2Budget126, Fp16, 12>>("kivi2-g64-w126-l0-11", "kivi2-g64-w126 on layers 0-11 only"),
      entry<LayerSplitCache<Fp16, Kivi2Budget126, 12>>("kivi2-g64-w126-l12-29", "kivi2-g64-w126 on layers 12-29 only"),
      entry<Gear4>("gear4", "GEAR (paper): per-block 4-bit, 2 % outliers, rank rho 2 %, 64-token blocks"),
      entry<Gear4Literal>("gear4-literal", "gear4 in literal mode (Algorithm 1: history recompressed every 64 tokens)"),
      entry<Gear4Paper>("gear4-paper", "gear4 literal mode with outliers over each head's whole history (paper mode)"),
      entry<OutlierQuant4>("outlier4", "GEAR ablation: per-block 4-bit + 5 % outliers (outlier-reduced quantization)"),
      entry<LowRankQuant4>("lowrank4", "GEAR ablation: per-block 4-bit + rank rho 5 %"),
      entry<GearKivi4>("gear-kivi4", "GEAR on KIVI-4: 128-token blocks, 64-channel value groups, 1 % outliers, rank 1"),
      entry<KiviWith<4, 32, 32, 128, OutlierFilter<100>>>("gear-kivi4-w128-s1",
                                                            "KIVI-4 (group 32, window 128) + 1 % outliers"),
      entry<KiviWith<4, 32, 32, 128, OutlierFilter<50>>>("gear-kivi4-w128-s05",
                                                           "KIVI-4 (group 32, window 128) + 0.5 % outliers"),
      entry<KiviWith<4, 64, 64, 64, OutlierFilter<100>>>(
          "gear-kivi4-b64-w64-s1", "4-bit, 64-token key groups, 64-channel value groups, window 64, 1 % outliers"),
      entry<KiviWith<3, 64, 64, 128, OutlierFilter<100>>>(
          "gear-kivi3-b64-w128-s1", "3-bit, 64-token key groups, 64-channel value groups, window 128, 1 % outliers"),
      entry<KiviWith<3, 64, 64, 64, OutlierFilter<100>>>(
          "gear-kivi3-b64-w64-s1", "3-bit, 64-token key groups, 64-channel value groups, window 64, 1 % outliers"),
      entry<KiviWith<3, 128, 64, 0, OutlierFilter<100>>>(
          "gear-kivi3-b128-s1", "3-bit, 128-token key groups, 64-channel value groups, no window, 1 % outliers"),
      entry<GearKivi2>("gear-kivi2", "GEAR on KIVI-2 (group 32, window 128): 0.5 % outliers, rank 1"),
      entry<KiviWith<2, 32, 32, 128, OutlierFilter<100>, LowRankResidual<Rank<1>>, LiteralMode>>(
          "gear-kivi2-literal", "gear-kivi2 in literal mode (Algorithm 1: history recompressed every 32 tokens)"),
      entry<KiviWith<2, 32, 32, 128, OutlierFilter<100>>>("gear-kivi2-s1", "KIVI-2 (group 32, window 128) + 1 % outliers"),
      entry<KiviWith<2, 128, 64, 0, OutlierFilter<50>>>(
          "gear-kivi2-b128-s05", "2-bit, 128-token key groups, 64-channel value groups, no window, 0.5 % outliers"),
      entry<KiviWith<2, 128, 64, 0, OutlierFilter<100>, LowRankResidual<Rank<1>>>>(
          "gear-kivi2-b128-s1-r1", "2-bit, 128-token key groups, 64-channel value groups, no window, 1 % outliers, rank 1"),
      // A 64-token attention sink (the first tokens, fp16) and no window, 64-token blocks, so blocks
      // stay aligned at 2048 tokens: KIVI alone, and with GEAR's outliers (is it the sink or GEAR?).
      entry<SinkKivi<2>>("kivi2-b64-sink64", "2-bit, 64-token key groups, 64-channel value groups, 64-token fp16 sink"),
      entry<SinkKivi<3>>("kivi3-b64-sink64", "3-bit, 64-token key groups, 64-channel value groups, 64-token fp16 sink"),
      entry<SinkKivi<4>>("kivi4-b64-sink64", "4-bit, 64-token key groups, 64-channel value groups, 64-token fp16 sink"),
      entry<SinkKivi<2, 0, OutlierFilter<20>>>("gear-kivi2-b64-sink64-s02", "kivi2-b64-sink64 + 0.2 % outliers"),
      entry<SinkKivi<2, 0, KeyOutliers<40>>>("gear-kivi2-b64-sink64-k04", "kivi2-b64-sink64 + 0.4 % outliers, keys only"),
      entry<SinkKivi<2, 0, ValueOutliers<40>>>("gear-kivi2-b64-sink64-v04",
                                               "kivi2-b64-sink64 + 0.4 % outliers, values only"),
      entry<SinkKivi<2, 0, OutlierFilter<50>>>("gear-kivi2-b64-sink64-s05", "kivi2-b64-sink64 + 0.5 % outliers"),
      entry<SinkKivi<2, 0, OutlierFilter<100>>>("gear-kivi2-b64-sink64-s1", "kivi2-b64-sink64 + 1 % outliers"),
      entry<SinkKivi<3, 0, OutlierFilter<20>>>("gear-kivi3-b64-sink64-s02", "kivi3-b64-sink64 + 0.2 % outliers"),
      entry<SinkKivi<3, 0, OutlierFilter<30>>>("gear-kivi3-b64-sink64-s03", "kivi3-b64-sink64 + 0.3 % outliers"),
      entry<SinkKivi<3, 0, KeyOutliers<40>>>("gear-kivi3-b64-sink64-k04", "kivi3-b64-sink64 + 0.4 % outliers, keys only"),
      entry<SinkKivi<3, 0, ValueOutliers<40>>>("gear-kivi3-b64-sink64-v04",
                                               "kivi3-b64-sink64 + 0.4 % outliers, values only"),
      entry<SinkKivi<3, 0, OutlierFilter<100>>>("gear-kivi3-b64-sink64-s1", "kivi3-b64-sink64 + 1 % outliers"),
      entry<SinkKivi<4, 0, OutlierFilter<20>>>("gear-kivi4-b64-sink64-s02", "kivi4-b64-sink64 + 0.2 % outliers"),
      entry<SinkKivi<4, 0, KeyOutliers<40>>>("gear-kivi4-b64-sink64-k04", "kivi4-b64-sink64 + 0.4 % outliers, keys only"),
      entry<SinkKivi<4, 0, ValueOutliers<40>>>("gear-kivi4-b64-sink64-v04",
                                               "kivi4-b64-sink64 + 0.4 % outliers, values only"),
      entry<SinkKivi<4, 0, OutlierFilter<50>>>("gear-kivi4-b64-sink64-s05", "kivi4-b64-sink64 + 0.5 % outliers"),
      entry<SinkKivi<4, 0, OutlierFilter<100>>>("gear-kivi4-b64-sink64-s1", "kivi4-b64-sink64 + 1 % outliers"),
      entry<SinkKivi<4, 64>>("kivi4-b64-w64-sink64", "kivi4-b64-sink64 with a 64-token fp16 window"),
      entry<SinkKivi<4, 64, OutlierFilter<50>>>("gear-kivi4-b64-w64-sink64-s05", "kivi4-b64-w64-sink64 + 0.5 % outliers"),
      entry<SinkKivi<4, 64, OutlierFilter<100>>>("gear-kivi4-b64-w64-sink64-s1", "kivi4-b64-w64-sink64 + 1 % outliers"),
      entry<KiviWith<2, 32, 32, 128, OutlierFilter<100>, LowRankResidual<Rank<1>>>>(
          "gear-kivi2-s1-r1", "KIVI-2 (group 32, window 128) + 1 % outliers, rank 1"),
      // Rotation (rotate/rotation.hpp): K and V through a randomized Hadamard transform before quantization,
      // beside the same schemes unrotated; "-rotv" rotates the values only (per-channel key groups keep theirs).
      entry<Int4>("int4", "4-bit per-token uniform (endpoint codec), no window"),
      entry<Rotated<Int4>>("int4-rot", "int4 with K and V Hadamard-rotated"),
      entry<CompressedKVCache<UniformQuantizer<4, Scope::kToken>, FullPrecisionWindow<16>>>(
          "int4-w16", "4-bit per-token uniform, 16-token fp16 window"),
      entry<Rotated<CompressedKVCache<UniformQuantizer<4, Scope::kToken>, FullPrecisionWindow<16>>>>(
          "int4-w16-rot", "int4-w16 with K and V Hadamard-rotated"),
      entry<CompressedKVCache<UniformQuantizer<3, Scope::kToken>>>("int3", "3-bit per-token uniform, no window"),
      entry<Rotated<CompressedKVCache<UniformQuantizer<3, Scope::kToken>>>>("int3-rot", "int3 with K and V Hadamard-rotated"),
      entry<Rotated<Kivi4>>("kivi4-rot", "kivi4 with K and V Hadamard-rotated"),
      entry<RotatedValues<Kivi4>>("kivi4-rotv", "kivi4 with V Hadamard-rotated"),
      entry<Rotated<Kivi<3>>>("kivi3-rot", "kivi3 with K and V Hadamard-rotated"),
      entry<RotatedValues<Kivi<3>>>("kivi3-rotv", "kivi3 with V Hadamard-rotated"),
      entry<Rotated<Kivi2>>("kivi2-rot", "kivi2 with K and V Hadamard-rotated"),
      entry<RotatedValues<Kivi2>>("kivi2-rotv", "kivi2 with V Hadamard-rotated"),
      entry<Rotated<SinkKivi<4>>>("kivi4-b64-sink64-rot", "kivi4-b64-sink64 with K and V Hadamard-rotated"),
      entry<RotatedValues<SinkKivi<4>>>("kivi4-b64-sink64-rotv", "kivi4-b64-sink64 with V Hadamard-rotated"),
      // 4.5 / 4.375 bits at 2048 tokens: KIVI-4 on 64- or 128-token key blocks, 64-channel value groups, no fp16 tokens.
      entry<Kivi4Blocks<64>>("kivi4-b64", "4-bit, 64-token key groups, 64-channel value groups, no fp16 tokens"),
      entry<Rotated<Kivi4Blocks<64>>>("kivi4-b64-rot", "kivi4-b64 with K and V Hadamard-rotated"),
      entry<RotatedValues<Kivi4Blocks<64>>>("kivi4-b64-rotv", "kivi4-b64 with V Hadamard-rotated"),
      entry<Kivi4Blocks<128>>("kivi4-b128", "4-bit, 128-token key groups, 64-channel value groups, no fp16 tokens"),
      entry<Rotated<Kivi4Blocks<128>>>("kivi4-b128-rot", "kivi4-b128 with K and V Hadamard-rotated"),
      entry<RotatedValues<Kivi4Blocks<128>>>("kivi4-b128-rotv", "kivi4-b128 with V Hadamard-rotated"),
      entry<Rotated<LogQuant2>>("logquant2-rot", "logquant2 with K and V Hadamard-rotated"),
      entry<RotatedValues<LogQuant2>>("logquant2-rotv", "logquant2 with V Hadamard-rotated"),
      entry<Rotated<LogQuant4>>("logquant4-rot", "logquant4 with K and V Hadamard-rotated"),
      entry<RotatedValues<LogQuant4>>("logquant4-rotv", "logquant4 with V Hadamard-rotated"),
      entry<Rotated<Gear4>>("gear4-rot", "gear4 with K and V Hadamard-rotated"),
      entry<Rotated<GearKivi2>>("gear-kivi2-rot", "gear-kivi2 with K and V Hadamard-rotated"),
      entry<RotatedValues<GearKivi2>>("gear-kivi2-rotv", "gear-kivi2 with V Hadamard-rotated"),
      // AlignedKV (SPEC §3): fp16 K/V in bit planes, decode attention loading 8, 12 or 16 leading bits per element.
      entry<CompressedKVCache<AlignedLoader<>>>("aligned-fp16",
                                               "AlignedKV: fp16 planes read at Rule 1/2 tiers (4 / 8 binades, top-32)"),
      // QAQ's per-token uniform baseline (paper Fig. 4): every token at B bits, QAQ's codec and 1 % outliers.
      // The adaptive QAQ schemes carry their targets in the name (find_scheme).
      detail::qaq_entry<QaqQuantizer<1, 1>>("qaq-u1", "per-token uniform 1-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      detail::qaq_entry<QaqQuantizer<2, 2>>("qaq-u2", "per-token uniform 2-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      detail::qaq_entry<QaqQuantizer<3, 3>>("qaq-u3", "per-token uniform 3-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      detail::qaq_entry<QaqQuantizer<4, 4>>("qaq-u4", "per-token uniform 4-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      detail::qaq_entry<QaqQuantizer<5, 5>>("qaq-u5", "per-token uniform 5-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      detail::qaq_entry<QaqQuantizer<6, 6>>("qaq-u6", "per-token uniform 6-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      detail::qaq_entry<QaqQuantizer<8, 8>>("qaq-u8", "per-token uniform 8-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      // Three points of the QAQ curve (paper defaults: widths 1..8, 1 % outliers, n = 5); any other targets by name.
      detail::qaq_entry<QaqQuantizer<>>("qaq:1e-3:1e-2", "QAQ at sigma_S 1e-3, sigma_X 1e-2 (~3.9 bits)", {1e-3, 1e-2}),
      detail::qaq_entry<QaqQuantizer<>>("qaq:2e-4:2e-3", "QAQ at sigma_S 2e-4, sigma_X 2e-3 (~5.1 bits)", {2e-4, 2e-3}),
      detail::qaq_entry<QaqQuantizer<>>("qaq:1e-4:1e-3", "QAQ at sigma_S 1e-4, sigma_X 1e-3 (~5.9 bits)", {1e-4, 1e-3}),
  };
  return registry;
}

/// The registry entry called `name`, or a QAQ scheme with its targets in the name (qaq_eval.hpp:
/// qaq:KS:VS, qaq-n1:KS:VS, qaq-a0:KS:VS); throws kvc::Error listing the known names otherwise.
inline SchemeEntry find_scheme(const std::string& name) {
  std::string known;
  for (const SchemeEntry& e : scheme_registry()) {
    if (e.name == name) return e;
    known += (known.empty() ? "" : ", ") + e.name;
  }
  const auto colon = name.find(':');
  qaq::Targets t;
  if (colon != std::string::npos && detail::parse_targets(name.substr(colon + 1), t)) {
    const std::string kind = name.substr(0, colon), at = " at sigma_S " + name.substr(colon + 1);
    if (kind == "qaq") return detail::qaq_entry<QaqQuantizer<>>(name, "QAQ: widths 1..8, 1 % outliers, n = 5" + at, t);
    if (kind == "qaq-n1")
      return detail::qaq_entry<QaqQuantizer<1, 8, 10, 1>>(name, "QAQ ablation: attention window n = 1" + at, t);
    if (kind == "qaq-a0")
      return detail::qaq_entry<QaqQuantizer<1, 8, 0, 5>>(name, "QAQ ablation: no outliers (alpha = 0)" + at, t);
  }
  KVC_CHECK(false, Errc::kInvalidArgument, "unknown scheme '", name, "' (known: ", known,
            ", and qaq:KS:VS, qaq-n1:KS:VS, qaq-a0:KS:VS with positive targets sigma_S = KS, sigma_X = VS)");
  return scheme_registry().front();  // unreachable
}
}  // namespace kvc::llama
