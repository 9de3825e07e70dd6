/// \file schemes_b.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): KIVI with sinks and GEAR corrections.
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_b() {
  using namespace kvc::schemes;
  return {
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
  };
}
}  // namespace kvc::llama::detail
