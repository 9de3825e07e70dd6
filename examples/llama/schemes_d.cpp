/// \file schemes_d.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): the adaptive QAQ schemes (AlignedKV's aligned-fp16: schemes_core.cpp).
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_d() {
  using namespace kvc::schemes;
  return {
      // Three points of the QAQ curve (paper defaults: widths 1..8, 1 % outliers, n = 5); any other targets by name
      // (qaq_scheme below); the per-token uniform baselines are in schemes_e.cpp.
      qaq_entry<QaqQuantizer<>>("qaq:1e-3:1e-2", "QAQ at sigma_S 1e-3, sigma_X 1e-2 (~3.9 bits)", {1e-3, 1e-2}),
      qaq_entry<QaqQuantizer<>>("qaq:2e-4:2e-3", "QAQ at sigma_S 2e-4, sigma_X 2e-3 (~5.1 bits)", {2e-4, 2e-3}),
      qaq_entry<QaqQuantizer<>>("qaq:1e-4:1e-3", "QAQ at sigma_S 1e-4, sigma_X 1e-3 (~5.9 bits)", {1e-4, 1e-3}),
  };
}

std::optional<SchemeEntry> qaq_scheme(const std::string& kind, const std::string& name, qaq::Targets t) {
  const std::string at = " at sigma_S " + name.substr(kind.size() + 1);
  if (kind == "qaq") return qaq_entry<QaqQuantizer<>>(name, "QAQ: widths 1..8, 1 % outliers, n = 5" + at, t);
  if (kind == "qaq-lm")  // the paper's defaults with qaq::LogMeta's 2-byte (lo, step_max): 0.25 bits/element less
    return qaq_entry<QaqQuantizer<1, 8, 10, 5, qaq::PaperBounds, qaq::LogMeta>>(
        name, "QAQ (widths 1..8, 1 % outliers, n = 5) with 2-byte log-grid (lo, step) metadata" + at, t);
  if (kind == "qaq-rot")
    return qaq_entry<QaqQuantizer<>, Rotation<Hadamard<>>>(
        name, "QAQ with K and V Hadamard-rotated (outliers taken first, the residual rotated)" + at, t);
  if (kind == "qaq-rotk")  // one side rotated: which side the rotation helps or hurts
    return qaq_entry<QaqQuantizer<>, RotateKeys<Hadamard<>>>(name, "QAQ with K Hadamard-rotated (outliers taken first)" + at, t);
  if (kind == "qaq-rotv")
    return qaq_entry<QaqQuantizer<>, RotateValues<Hadamard<>>>(name, "QAQ with V Hadamard-rotated (outliers taken first)" + at, t);
  if (kind == "qaq-n1") return qaq_entry<QaqQuantizer<1, 8, 10, 1>>(name, "QAQ ablation: attention window n = 1" + at, t);
  if (kind == "qaq-a0") return qaq_entry<QaqQuantizer<1, 8, 0, 5>>(name, "QAQ ablation: no outliers (alpha = 0)" + at, t);
  if (kind == "qaq-a0-rot")
    return qaq_entry<QaqQuantizer<1, 8, 0, 5>, Rotation<Hadamard<>>>(name, "qaq-a0 with K and V Hadamard-rotated" + at, t);
  if (kind == "qaq-a0n1-rot")  // both ablations' savings at once: no outliers, no history beyond the current step
    return qaq_entry<QaqQuantizer<1, 8, 0, 1>, Rotation<Hadamard<>>>(name, "qaq-a0 with n = 1, K and V Hadamard-rotated" + at, t);
  if (kind == "qaq-a0n1-rot-lm")  // the same with the 2-byte (lo, step_max) of qaq::LogMeta: 0.25 bits/element less
    return qaq_entry<QaqQuantizer<1, 8, 0, 1, qaq::PaperBounds, qaq::LogMeta>, Rotation<Hadamard<>>>(
        name, "qaq-a0n1-rot with 2-byte log-grid (lo, step) metadata" + at, t);
  return std::nullopt;
}
}  // namespace kvc::llama::detail
