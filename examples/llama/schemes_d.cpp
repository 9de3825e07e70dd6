/// \file schemes_d.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): AlignedKV and QAQ.
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_d() {
  using namespace kvc::schemes;
  return {
      // AlignedKV (SPEC §3): fp16 K/V in bit planes, decode attention loading 8, 12 or 16 leading bits per element.
      entry<CompressedKVCache<AlignedLoader<>>>("aligned-fp16",
                                               "AlignedKV: fp16 planes read at Rule 1/2 tiers (4 / 8 binades, top-32)"),
      // QAQ's per-token uniform baseline (paper Fig. 4): every token at B bits, QAQ's codec and 1 % outliers.
      // The adaptive QAQ schemes carry their targets in the name (find_scheme).
      qaq_entry<QaqQuantizer<1, 1>>("qaq-u1", "per-token uniform 1-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      qaq_entry<QaqQuantizer<2, 2>>("qaq-u2", "per-token uniform 2-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      qaq_entry<QaqQuantizer<3, 3>>("qaq-u3", "per-token uniform 3-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      qaq_entry<QaqQuantizer<4, 4>>("qaq-u4", "per-token uniform 4-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      qaq_entry<QaqQuantizer<5, 5>>("qaq-u5", "per-token uniform 5-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      qaq_entry<QaqQuantizer<6, 6>>("qaq-u6", "per-token uniform 6-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      qaq_entry<QaqQuantizer<8, 8>>("qaq-u8", "per-token uniform 8-bit + 1 % outliers (QAQ's codec)", {1, 1}),
      // The same baseline with qaq::LogMeta's 2-byte (lo, step_max): qaq-lm's comparison at equal metadata.
      qaq_entry<QaqQuantizer<1, 1, 10, 5, qaq::PaperBounds, qaq::LogMeta>>("qaq-u1-lm", "qaq-u1 with 2-byte log-grid (lo, step) metadata", {1, 1}),
      qaq_entry<QaqQuantizer<2, 2, 10, 5, qaq::PaperBounds, qaq::LogMeta>>("qaq-u2-lm", "qaq-u2 with 2-byte log-grid (lo, step) metadata", {1, 1}),
      qaq_entry<QaqQuantizer<3, 3, 10, 5, qaq::PaperBounds, qaq::LogMeta>>("qaq-u3-lm", "qaq-u3 with 2-byte log-grid (lo, step) metadata", {1, 1}),
      qaq_entry<QaqQuantizer<4, 4, 10, 5, qaq::PaperBounds, qaq::LogMeta>>("qaq-u4-lm", "qaq-u4 with 2-byte log-grid (lo, step) metadata", {1, 1}),
      // Three points of the QAQ curve (paper defaults: widths 1..8, 1 % outliers, n = 5); any other targets by name.
      qaq_entry<QaqQuantizer<>>("qaq:1e-3:1e-2", "QAQ at sigma_S 1e-3, sigma_X 1e-2 (~3.9 bits)", {1e-3, 1e-2}),
      qaq_entry<QaqQuantizer<>>("qaq:2e-4:2e-3", "QAQ at sigma_S 2e-4, sigma_X 2e-3 (~5.1 bits)", {2e-4, 2e-3}),
      qaq_entry<QaqQuantizer<>>("qaq:1e-4:1e-3", "QAQ at sigma_S 1e-4, sigma_X 1e-3 (~5.9 bits)", {1e-4, 1e-3}),
      // Rotated QAQ (rotate/rotation.hpp): the per-token baseline and the adaptive scheme (qaq-rot:KS:VS by name).
      qaq_entry<QaqQuantizer<3, 3>, Rotation<Hadamard<>>>("qaq-u3-rot", "qaq-u3 with K and V Hadamard-rotated (outliers taken first)", {1, 1}),
      qaq_entry<QaqQuantizer<4, 4>, Rotation<Hadamard<>>>("qaq-u4-rot", "qaq-u4 with K and V Hadamard-rotated (outliers taken first)", {1, 1}),
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
