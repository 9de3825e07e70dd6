/// \file schemes_a.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): uniform, KIVI, LogQuant, layer splits, GEAR.
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_a() {
  using namespace kvc::schemes;
  return {
      entry<CompressedKVCache<keys<GroupQuantizer<8, 32, Axis::kChannel>>, values<GroupQuantizer<8, 32, Axis::kToken>>>>(
          "int8-kc", "8-bit, keys per channel over 32-token blocks, values per token in 32-channel groups, no window"),
      entry<Kivi<8>>("kivi8", "KIVI 8-bit, group 32, 128-token fp16 window"),
      entry<CompressedKVCache<keys<GroupQuantizer<4, 32, Axis::kChannel>>, values<GroupQuantizer<4, 32, Axis::kToken>>,
                              FullPrecisionWindow<128, 4>>>("kivi4-sink4",
                                                            "KIVI 4-bit with a 4-token attention sink kept in fp16"),
      entry<Kivi<3>>("kivi3", "KIVI 3-bit, group 32, 128-token fp16 window"),
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
      // AlignedKV over their fp16 parts (aligned/slot_planes.hpp): the same bytes stored, the window / set read at
      // the tiers AlignedKV's rules give.
      entry<AlignedWindow<Kivi2>>("kivi2-aligned", "kivi2 with its fp16 window read by AlignedKV's rules (slot planes)"),
      entry<AlignedWindow<Kivi4>>("kivi4-aligned", "kivi4 with its fp16 window read by AlignedKV's rules (slot planes)"),
      entry<AlignedWindow<LogQuant2>>("logquant2-aligned",
                                      "logquant2 with its fp16 set read by AlignedKV's rules (slot planes)"),
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
      entry<KiviWith<2, 32, 32, 128, OutlierFilter<100>, LowRankResidual<Rank<1>>, LiteralMode>>(
          "gear-kivi2-literal", "gear-kivi2 in literal mode (Algorithm 1: history recompressed every 32 tokens)"),
      entry<KiviWith<2, 32, 32, 128, OutlierFilter<100>>>("gear-kivi2-s1", "KIVI-2 (group 32, window 128) + 1 % outliers"),
      entry<KiviWith<2, 128, 64, 0, OutlierFilter<50>>>(
          "gear-kivi2-b128-s05", "2-bit, 128-token key groups, 64-channel value groups, no window, 0.5 % outliers"),
      entry<KiviWith<2, 128, 64, 0, OutlierFilter<100>, LowRankResidual<Rank<1>>>>(
          "gear-kivi2-b128-s1-r1", "2-bit, 128-token key groups, 64-channel value groups, no window, 1 % outliers, rank 1"),
  };
}
}  // namespace kvc::llama::detail
