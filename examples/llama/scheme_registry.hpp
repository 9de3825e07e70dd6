/// \file scheme_registry.hpp
/// The schemes kvc-eval compares, by name. Adding a kvc cache configuration to the quality harness is
/// one `entry<...>` line in one of the registry's parts (schemes_*.cpp; schemes_core.cpp only for a scheme the
/// llama.* tests run); the runner is instantiated for the cache type, so the engine calls the same fused attention
/// a user's engine would for that policy set.
#pragma once

#include <llama/llama_model.hpp>
#include <llama/qaq_eval.hpp>

#include <kvc/aligned/decode_attention.hpp>
#include <kvc/schemes.hpp>

#include <algorithm>
#include <functional>
#include <optional>
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
/// One layer's attention error against an fp32 cache of the same K/V (RunHooks::measure_layer_error): sets
/// r.layer_err2 / layer_ref2 [tr.layer]. The exact attention over this run's own inputs, so errors from earlier
/// layers do not count twice; the fp32 fused kernel in every attention mode (its own float rounding, ~1e-7
/// relative, is far below any scheme's error). Not a template, so kvc-eval compiles it once, not per scheme.
inline void measure_layer_error(const LlamaConfig& c, int T, const LayerTrace& tr, SchemeRun& r) {
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
}

/// One run with the cache `make(model.cache_config(T))` builds.
template <class Cache, class Make>
SchemeRun run_with(const LlamaModel& model, const std::vector<std::int32_t>& tokens, const RunHooks& hooks, Make&& make) {
  const int T = int(tokens.size());
  const LlamaConfig& c = model.config();
  Cache cache = make(model.cache_config(T));
  SchemeRun r;
  r.layer_err2.assign(std::size_t(c.layers), 0.0);
  r.layer_ref2.assign(std::size_t(c.layers), 0.0);
  auto observe = [&](const LayerTrace& tr) {
    if (hooks.observe) hooks.observe(tr);
    if (hooks.measure_layer_error) measure_layer_error(c, T, tr, r);
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

/// A QAQ scheme (qaq_eval.hpp) at targets t, with at most one Rotation; the calibration comes from the run's hooks.
template <class Q, class... Rot>
SchemeEntry qaq_entry(std::string name, std::string description, qaq::Targets t) {
  return SchemeEntry{std::move(name), std::move(description),
                     [t](const LlamaModel& m, const std::vector<std::int32_t>& tokens, const RunHooks& h) {
                       KVC_CHECK(h.qaq_calibration != nullptr, Errc::kInvalidArgument,
                                 "QAQ schemes need the ||q||^2 calibration (RunHooks::qaq_calibration)");
                       KVC_CHECK(!(CompressedKVCache<Q, Rot...>::kAdaptive) || h.attention != AttentionMode::kReference,
                                 Errc::kInvalidArgument,
                                 "adaptive QAQ needs the fused attention's probabilities: use --attention fast or exact");
                       return run_with<QaqEvalCache<Q, Rot...>>(m, tokens, h, [&](const CacheConfig& cfg) {
                         return QaqEvalCache<Q, Rot...>(cfg, t, *h.qaq_calibration);
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

/// KIVI-4 on `Block`-token key groups and 64-channel value groups with a 4-token fp16 attention sink and a
/// `Window`-token fp16 window. At 2048 tokens the blocks after the sink leave an incomplete block of
/// Block - 4 - Window tokens in fp16 (counted): the sink costs a block, not 4 tokens, at that length.
template <int Block, int Window>
using Kivi4Sink4 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, Block, kvc::Axis::kChannel>>,
                                          kvc::values<kvc::GroupQuantizer<4, 64, kvc::Axis::kToken>>,
                                          kvc::FullPrecisionWindow<Window, 4>>;

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

namespace detail {
// The registry in parts, each compiled in a file of its own (examples/llama/schemes_*.cpp): every entry instantiates
// the engine and the fused attention of its cache on every SIMD path, so one file for all of them is the longest
// compile of the build (26 min on one core); in parts, a parallel build shares them. Two programs link them:
// kvc-eval (every part; registry_all.cpp) and kvc-eval-core (schemes_core alone; registry_core.cpp), the one the
// test build makes and the llama.* tests run: the other parts are ~1,000 CPU-seconds of compilation that no test
// reads (README "Quality on a real model").
std::vector<SchemeEntry> schemes_core();  ///< the schemes the llama.* tests run, fp32 (the exact reference) first
std::vector<SchemeEntry> schemes_a();  ///< uniform, KIVI, LogQuant, layer splits, GEAR
std::vector<SchemeEntry> schemes_b();  ///< KIVI with sinks and GEAR corrections
std::vector<SchemeEntry> schemes_c();  ///< rotated schemes beside their plain twins
std::vector<SchemeEntry> schemes_f();  ///< ... continued (KIVI grid sinks, int4 sinks, LogQuant, GEAR)
std::vector<SchemeEntry> schemes_d();  ///< the adaptive QAQ schemes
std::vector<SchemeEntry> schemes_e();  ///< QAQ's per-token uniform baselines
/// Every entry of the parts this program links, schemes_core first (registry_all.cpp / registry_core.cpp).
std::vector<SchemeEntry> linked_schemes();
/// What find_scheme adds to its error for an unknown name: empty in kvc-eval, where to find the other schemes in
/// kvc-eval-core.
const char* registry_note();
/// A QAQ scheme named by its kind ("qaq", "qaq-n1", "qaq-a0", "qaq-rot", "qaq-rotk", "qaq-rotv", "qaq-a0-rot",
/// "qaq-a0n1-rot", "qaq-a0n1-rot-lm", "qaq-lm") and targets (schemes_d.cpp); nullopt for another kind. In
/// kvc-eval-core (registry_core.cpp) every QAQ kind throws kvc::Error naming kvc-eval.
std::optional<SchemeEntry> qaq_scheme(const std::string& kind, const std::string& name, qaq::Targets t);
}  // namespace detail

/// Every scheme this program knows, in a stable order. The first entry is the exact reference.
inline const std::vector<SchemeEntry>& scheme_registry() {
  static const std::vector<SchemeEntry> registry = detail::linked_schemes();
  return registry;
}

/// The registry entry called `name`, or a QAQ scheme with its targets in the name (qaq_eval.hpp:
/// qaq:KS:VS, qaq-n1:KS:VS, qaq-a0:KS:VS, qaq-rot:KS:VS, qaq-rotk:KS:VS, qaq-rotv:KS:VS, qaq-a0-rot:KS:VS,
/// qaq-a0n1-rot:KS:VS); throws kvc::Error listing the known names otherwise.
inline SchemeEntry find_scheme(const std::string& name) {
  std::string known;
  for (const SchemeEntry& e : scheme_registry()) {
    if (e.name == name) return e;
    known += (known.empty() ? "" : ", ") + e.name;
  }
  const auto colon = name.find(':');
  qaq::Targets t;
  if (colon != std::string::npos && detail::parse_targets(name.substr(colon + 1), t))
    if (auto e = detail::qaq_scheme(name.substr(0, colon), name, t)) return *e;
  KVC_CHECK(false, Errc::kInvalidArgument, "unknown scheme '", name, "' (known: ", known,
            ", and qaq:KS:VS, qaq-n1:KS:VS, qaq-a0:KS:VS, qaq-rot:KS:VS, qaq-rotk:KS:VS, qaq-rotv:KS:VS, "
            "qaq-a0-rot:KS:VS, qaq-a0n1-rot:KS:VS, qaq-a0n1-rot-lm:KS:VS, qaq-lm:KS:VS with positive targets "
            "sigma_S = KS, sigma_X = VS)", detail::registry_note());
  return scheme_registry().front();  // unreachable
}
}  // namespace kvc::llama
