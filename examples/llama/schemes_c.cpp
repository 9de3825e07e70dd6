/// \file schemes_c.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): rotated schemes beside their plain twins.
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_c() {
  using namespace kvc::schemes;
  return {
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
      // ... with a 4-token sink (and a 16-token window): the sink halves the rotated schemes' KL
      entry<Kivi4Sink4<64, 0>>("kivi4-b64-sink4", "kivi4-b64 with a 4-token fp16 sink"),
      entry<Rotated<Kivi4Sink4<64, 0>>>("kivi4-b64-sink4-rot", "kivi4-b64-sink4 with K and V Hadamard-rotated"),
      entry<Rotated<Kivi4Sink4<128, 16>>>("kivi4-b128-w16-sink4-rot",
                                          "kivi4-b128 with a 4-token sink and a 16-token window, K and V rotated"),
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
