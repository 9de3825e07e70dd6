// expect: GroupQuantizer: Bits must be in .1, 8.
// 9-bit codes do not exist.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<9, 32, kvc::Axis::kToken>>;
static_assert(sizeof(Bad) > 0);
