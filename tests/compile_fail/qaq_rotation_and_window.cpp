// expect: kvc::QaqQuantizer composes with one kvc::Rotation
// QAQ's mixed-bit cache takes a Rotation and nothing else: a window beside it must be refused.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>, kvc::FullPrecisionWindow<16>>;
static_assert(sizeof(Bad) > 0);
