// expect: duplicate policy kind
// Two rotations in one composition (one Rotation takes a transform per side).
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<4>, kvc::RotateKeys<kvc::Hadamard<>>,
                                   kvc::RotateValues<kvc::Hadamard<>>>;
static_assert(sizeof(Bad) > 0);
