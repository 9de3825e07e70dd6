/// \file schemes_e.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): QAQ's per-token uniform baselines (paper Fig. 4),
/// every token at B bits with QAQ's own codec, one for each adaptive family (schemes_d.cpp) at its metadata,
/// outliers and rotation. They keep no token ids and no histories (B_min == B_max: nothing to adapt).
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_e() {
  using namespace kvc::schemes;
  return {
      // QAQ's per-token uniform baseline (paper Fig. 4): every token at B bits, QAQ's codec and 1 % outliers.
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
      // Rotated (rotate/rotation.hpp), outliers taken first: qaq-rot:KS:VS's baseline.
      qaq_entry<QaqQuantizer<3, 3>, Rotation<Hadamard<>>>("qaq-u3-rot", "qaq-u3 with K and V Hadamard-rotated (outliers taken first)", {1, 1}),
      qaq_entry<QaqQuantizer<4, 4>, Rotation<Hadamard<>>>("qaq-u4-rot", "qaq-u4 with K and V Hadamard-rotated (outliers taken first)", {1, 1}),
      // No outliers, K and V rotated: the baseline of qaq-a0-rot:KS:VS and qaq-a0n1-rot:KS:VS (fp16 (lo, step)) ...
      qaq_entry<QaqQuantizer<1, 1, 0>, Rotation<Hadamard<>>>("qaq-u1-a0-rot", "per-token uniform 1-bit, no outliers, K and V Hadamard-rotated", {1, 1}),
      qaq_entry<QaqQuantizer<2, 2, 0>, Rotation<Hadamard<>>>("qaq-u2-a0-rot", "per-token uniform 2-bit, no outliers, K and V Hadamard-rotated", {1, 1}),
      qaq_entry<QaqQuantizer<3, 3, 0>, Rotation<Hadamard<>>>("qaq-u3-a0-rot", "per-token uniform 3-bit, no outliers, K and V Hadamard-rotated", {1, 1}),
      qaq_entry<QaqQuantizer<4, 4, 0>, Rotation<Hadamard<>>>("qaq-u4-a0-rot", "per-token uniform 4-bit, no outliers, K and V Hadamard-rotated", {1, 1}),
      qaq_entry<QaqQuantizer<5, 5, 0>, Rotation<Hadamard<>>>("qaq-u5-a0-rot", "per-token uniform 5-bit, no outliers, K and V Hadamard-rotated", {1, 1}),
      qaq_entry<QaqQuantizer<6, 6, 0>, Rotation<Hadamard<>>>("qaq-u6-a0-rot", "per-token uniform 6-bit, no outliers, K and V Hadamard-rotated", {1, 1}),
      // ... and of qaq-a0n1-rot-lm:KS:VS (qaq::LogMeta's 2-byte (lo, step_max); 2^B - 1.5 levels, so it costs more
      // than it saves at B <= 2, README).
      qaq_entry<QaqQuantizer<2, 2, 0, 5, qaq::PaperBounds, qaq::LogMeta>, Rotation<Hadamard<>>>(
          "qaq-u2-a0-rot-lm", "qaq-u2-a0-rot with 2-byte log-grid (lo, step) metadata", {1, 1}),
      qaq_entry<QaqQuantizer<3, 3, 0, 5, qaq::PaperBounds, qaq::LogMeta>, Rotation<Hadamard<>>>(
          "qaq-u3-a0-rot-lm", "qaq-u3-a0-rot with 2-byte log-grid (lo, step) metadata", {1, 1}),
      qaq_entry<QaqQuantizer<4, 4, 0, 5, qaq::PaperBounds, qaq::LogMeta>, Rotation<Hadamard<>>>(
          "qaq-u4-a0-rot-lm", "qaq-u4-a0-rot with 2-byte log-grid (lo, step) metadata", {1, 1}),
      qaq_entry<QaqQuantizer<5, 5, 0, 5, qaq::PaperBounds, qaq::LogMeta>, Rotation<Hadamard<>>>(
          "qaq-u5-a0-rot-lm", "qaq-u5-a0-rot with 2-byte log-grid (lo, step) metadata", {1, 1}),
  };
}
}  // namespace kvc::llama::detail
