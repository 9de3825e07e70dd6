/// \file schemes_f.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): rotated schemes beside their plain twins, continued
/// from schemes_c.cpp (split from it for the build's balance: as one file it compiled for 8.5 minutes on one core,
/// half again the next-longest part's 343 s, and finished last in CI's two-job build).
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_f() {
  using namespace kvc::schemes;
  return {
      // KIVI-4 and KIVI-2 as the sweep runs them (group 32, 128-token window) with the grid sink: rotating
      // per-channel key groups pays once the sink no longer shares block 0's grid
      entry<KiviGridSink<4, 32, 4, 128, 32>>("kivi4-gsink4", "kivi4 with a 4-token fp16 sink on the block grid"),
      entry<Rotated<KiviGridSink<4, 32, 4, 128, 32>>>("kivi4-gsink4-rot", "kivi4-gsink4 with K and V Hadamard-rotated"),
      entry<RotatedValues<KiviGridSink<4, 32, 4, 128, 32>>>("kivi4-gsink4-rotv", "kivi4-gsink4 with V Hadamard-rotated"),
      entry<Rotated<KiviGridSink<4, 32, 4, 128, 32>, RotateValues<Hadamard<2>>>>("kivi4-gsink4-rotv-s2",
                                                                                  "kivi4-gsink4-rotv, seed 2"),
      entry<Rotated<KiviGridSink<4, 32, 4, 128, 32>, RotateValues<Hadamard<3>>>>("kivi4-gsink4-rotv-s3",
                                                                                  "kivi4-gsink4-rotv, seed 3"),
      entry<KiviGridSink<2, 32, 4, 128, 32>>("kivi2-gsink4", "kivi2 with a 4-token fp16 sink on the block grid"),
      entry<Rotated<KiviGridSink<2, 32, 4, 128, 32>>>("kivi2-gsink4-rot", "kivi2-gsink4 with K and V Hadamard-rotated"),
      entry<KiviGridSink<3, 32, 4, 128, 32>>("kivi3-gsink4", "kivi3 with a 4-token fp16 sink on the block grid"),
      entry<Rotated<KiviGridSink<3, 32, 4, 128, 32>>>("kivi3-gsink4-rot", "kivi3-gsink4 with K and V Hadamard-rotated"),
      // ... and on 64-token groups, no window (3.53 / 2.53 bits at 2048 tokens)
      entry<KiviGridSink<3, 64>>("kivi3-b64-gsink4", "3-bit, 64-token key groups, 64-channel value groups, 4-token grid sink"),
      entry<Rotated<KiviGridSink<3, 64>>>("kivi3-b64-gsink4-rot", "kivi3-b64-gsink4 with K and V Hadamard-rotated"),
      entry<KiviGridSink<2, 64>>("kivi2-b64-gsink4", "2-bit, 64-token key groups, 64-channel value groups, 4-token grid sink"),
      entry<Rotated<KiviGridSink<2, 64>>>("kivi2-b64-gsink4-rot", "kivi2-b64-gsink4 with K and V Hadamard-rotated"),
      entry<Rotated<CompressedKVCache<UniformQuantizer<4, Scope::kToken>, AlignedSinkWindow<0, 4>>>>(
          "int4-gsink4-rot", "int4 with a 4-token fp16 sink on the block grid, K and V Hadamard-rotated"),
      entry<Rotated<CompressedKVCache<UniformQuantizer<4, Scope::kToken>, FullPrecisionWindow<0, 4>>>>(
          "int4-sink4-rot", "int4 with a 4-token fp16 sink, K and V Hadamard-rotated"),
      entry<Rotated<CompressedKVCache<UniformQuantizer<4, Scope::kToken>, FullPrecisionWindow<16, 4>>>>(
          "int4-w16-sink4-rot", "int4 with a 4-token sink and a 16-token window, K and V Hadamard-rotated"),
      entry<Rotated<LogQuant2>>("logquant2-rot", "logquant2 with K and V Hadamard-rotated"),
      entry<RotatedValues<LogQuant2>>("logquant2-rotv", "logquant2 with V Hadamard-rotated"),
      entry<Rotated<LogQuant4>>("logquant4-rot", "logquant4 with K and V Hadamard-rotated"),
      entry<RotatedValues<LogQuant4>>("logquant4-rotv", "logquant4 with V Hadamard-rotated"),
      entry<Rotated<Gear4>>("gear4-rot", "gear4 with K and V Hadamard-rotated"),
      entry<Rotated<GearKivi2>>("gear-kivi2-rot", "gear-kivi2 with K and V Hadamard-rotated"),
      entry<RotatedValues<GearKivi2>>("gear-kivi2-rotv", "gear-kivi2 with V Hadamard-rotated"),
  };
}
}  // namespace kvc::llama::detail
