/// \file schemes_core.cpp
/// Part of kvc-eval's scheme registry (scheme_registry.hpp): the schemes the llama.* tests run (the exact reference,
/// fp16, int8, KIVI-4/2, GEAR on KIVI-2, rotated KIVI-2, AlignedKV), the whole registry of kvc-eval-core.
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> schemes_core() {
  using namespace kvc::schemes;
  return {
      entry<Fp32>("fp32", "uncompressed fp32: the exact reference"),
      entry<Fp16>("fp16", "uncompressed fp16"),
      entry<Int8>("int8", "8-bit per-token uniform (endpoint codec)"),
      entry<Kivi4>("kivi4", "KIVI 4-bit: per-channel keys, per-token values, group 32, 128-token fp16 window"),
      entry<Kivi2>("kivi2", "KIVI 2-bit, group 32, 128-token fp16 window"),
      entry<GearKivi2>("gear-kivi2", "GEAR on KIVI-2 (group 32, window 128): 0.5 % outliers, rank 1"),
      entry<Rotated<Kivi2>>("kivi2-rot", "kivi2 with K and V Hadamard-rotated"),
      // AlignedKV (SPEC §3): fp16 K/V in bit planes, decode attention loading 8, 12 or 16 leading bits per element.
      entry<CompressedKVCache<AlignedLoader<>>>("aligned-fp16",
                                               "AlignedKV: fp16 planes read at Rule 1/2 tiers (4 / 8 binades, top-32)"),
  };
}
}  // namespace kvc::llama::detail
