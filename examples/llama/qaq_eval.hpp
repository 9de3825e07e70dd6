/// \file qaq_eval.hpp
/// QAQ in kvc-eval. The engine's attention call over a QAQ cache is QAQ's whole decode step (SPEC §2.6):
/// the fused attention, which hands back each token's probability, then every token's width from it.
/// Schemes (find_qaq_scheme):
///   qaq:KS:VS      QaqQuantizer<> (widths 1..8, 1 % outliers, n = 5) with sigma_S = KS, sigma_X = VS
///   qaq-n1:KS:VS   the attention-window ablation, n = 1 (paper Table 3)
///   qaq-a0:KS:VS   the outlier ablation, alpha = 0 (paper Table 2)
///   qaq-uB         B in 1..6, 8: every token at B bits, QAQ's codec and 1 % outliers (paper Fig. 4's baseline)
///   qaq-rot:KS:VS  qaq:KS:VS with K and V Hadamard-rotated (rotate/rotation.hpp; the outliers taken before the
///                  rotation, the residual rotated: qaq_cache.hpp); qaq-rotk / qaq-rotv:KS:VS one side only;
///                  qaq-a0-rot:KS:VS, qaq-a0n1-rot:KS:VS (alpha = 0 and n = 1) and qaq-uB-rot (B = 3, 4)
///                  likewise
///   qaq-a0n1-rot-lm:KS:VS  qaq-a0n1-rot with qaq::LogMeta's 2-byte (lo, step_max) (qaq/meta_format.hpp)
///   qaq-lm:KS:VS   qaq:KS:VS with LogMeta; qaq-uB-lm (B = 1..4) its uniform baseline at equal metadata
///   qaq-uB-a0-rot  B in 1..6: every token at B bits, no outliers, K and V rotated: qaq-a0(n1)-rot's baseline;
///                  qaq-uB-a0-rot-lm (B = 2..5) the same with LogMeta, qaq-a0n1-rot-lm's (schemes_e.cpp)
/// The key bound needs the ||q||^2 calibration (qaq/calibration.hpp): kvc-eval computes it on a segment of
/// the text after the evaluated tokens (or loads --qaq-calibration) and passes it in RunHooks.
/// Only AttentionMode::kFast and kExact run the step; kReference attends without probabilities, so its
/// widths stay at B_max (rejected for adaptive schemes).
#pragma once

#include <llama/llama_model.hpp>

#include <kvc/qaq/decode_attention.hpp>
#include <kvc/qaq/qaq_cache.hpp>

#include <cstdlib>
#include <optional>
#include <string>

namespace kvc::llama {

/// A QAQ cache as the engine sees it: append, then decode_attention = attention + width update. Rot: at most one
/// Rotation.
template <class Q, class... Rot>
class QaqEvalCache {
 public:
  using cache_type = CompressedKVCache<Q, Rot...>;
  QaqEvalCache(const CacheConfig& cfg, qaq::Targets targets, const qaq::QueryNormCalibration& calib)
      : c_(cfg, targets, calib) {}
  const CacheConfig& config() const noexcept { return c_.config(); }
  int length(int layer, int seq) const { return c_.length(layer, seq); }
  void append(int layer, int seq, KVView k, KVView v) { c_.append(layer, seq, k, v); }
  void dequantize(int layer, int seq, float* k, float* v) const { c_.dequantize(layer, seq, k, v); }
  std::size_t stored_bytes() const { return c_.stored_bytes(); }
  double bits_per_element() const { return c_.bits_per_element(); }
  const cache_type& cache() const noexcept { return c_; }
  /// The engine's unqualified decode_attention(cache, layer, ...) finds this: one QAQ decode step.
  friend void decode_attention(const QaqEvalCache& c, int layer, QueryView q, OutputView out,
                               const AttentionOptions& opt = {}) {
    qaq_decode_step(c.c_, layer, q, out, opt, c.probs_);
  }

 private:
  mutable cache_type c_;  // the step updates widths: the engine's attention call is QAQ's decode step
  mutable qaq::TokenProbs probs_;
};

/// The ||q / sqrt(d)||^2 90th percentiles of `model` over `tokens` (an exact fp32 run), per layer and KV head.
inline qaq::QueryNormCalibration calibrate_query_norms(const LlamaModel& model, const std::vector<std::int32_t>& tokens) {
  const LlamaConfig& c = model.config();
  qaq::QueryNormCalibration calib(c.layers, c.kv_heads, c.head_dim);
  schemes::Fp32 cache(model.cache_config(int(tokens.size())));
  ForwardOptions fo;
  fo.observe = [&](const LayerTrace& tr) { calib.set_layer(tr.layer, tr.q->data(), int(tr.q->rows()), c.heads); };
  (void)model.forward(tokens, cache, fo);
  return calib;
}

namespace detail {
/// Parses "KS:VS" (two positive numbers) into targets; false when malformed.
inline bool parse_targets(const std::string& s, qaq::Targets& t) {
  const auto colon = s.find(':');
  if (colon == std::string::npos) return false;
  char* end = nullptr;
  const std::string a = s.substr(0, colon), b = s.substr(colon + 1);
  t.key_sigma_s = std::strtod(a.c_str(), &end);
  if (a.empty() || *end != '\0') return false;
  t.value_sigma_x = std::strtod(b.c_str(), &end);
  if (b.empty() || *end != '\0') return false;
  return t.key_sigma_s > 0.0 && t.value_sigma_x > 0.0;
}
}  // namespace detail
}  // namespace kvc::llama
