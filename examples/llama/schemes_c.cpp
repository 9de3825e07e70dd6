/// \file schemes_c.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): rotated schemes beside their plain twins
/// (continued in schemes_f.cpp).
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
      // ... the sink on the block grid (AlignedSinkWindow): the sink costs its 4 tokens, not a block
      entry<KiviGridSink<4, 64>>("kivi4-b64-gsink4", "kivi4-b64 with a 4-token fp16 sink on the block grid"),
      entry<Rotated<KiviGridSink<4, 64>>>("kivi4-b64-gsink4-rot", "kivi4-b64-gsink4 with K and V Hadamard-rotated"),
      entry<RotatedValues<KiviGridSink<4, 64>>>("kivi4-b64-gsink4-rotv", "kivi4-b64-gsink4 with V Hadamard-rotated"),
      // ... and with two other seeds of the random signs: how much of a rotated row's KL is the draw
      entry<Rotated<KiviGridSink<4, 64>, Rotation<Hadamard<2>>>>("kivi4-b64-gsink4-rot-s2", "kivi4-b64-gsink4-rot, seed 2"),
      entry<Rotated<KiviGridSink<4, 64>, Rotation<Hadamard<3>>>>("kivi4-b64-gsink4-rot-s3", "kivi4-b64-gsink4-rot, seed 3"),
      entry<Rotated<KiviGridSink<4, 64>, RotateValues<Hadamard<2>>>>("kivi4-b64-gsink4-rotv-s2", "kivi4-b64-gsink4-rotv, seed 2"),
      entry<Rotated<KiviGridSink<4, 64>, RotateValues<Hadamard<3>>>>("kivi4-b64-gsink4-rotv-s3", "kivi4-b64-gsink4-rotv, seed 3"),
      entry<Rotated<KiviGridSink<4, 64, 8>>>("kivi4-b64-gsink8-rot", "kivi4-b64 with an 8-token grid sink, K and V rotated"),
      entry<KiviGridSink<4, 128>>("kivi4-b128-gsink4", "kivi4-b128 with a 4-token fp16 sink on the block grid"),
      entry<Rotated<KiviGridSink<4, 128>>>("kivi4-b128-gsink4-rot", "kivi4-b128-gsink4 with K and V Hadamard-rotated"),
      entry<RotatedValues<KiviGridSink<4, 128>>>("kivi4-b128-gsink4-rotv", "kivi4-b128-gsink4 with V Hadamard-rotated"),
  };
}
}  // namespace kvc::llama::detail
