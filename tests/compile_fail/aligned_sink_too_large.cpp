// expect: the sink sits in block 0, so Sink must be smaller than the block
// AlignedSinkWindow masks the sink's rows of block 0: a sink as large as the block leaves it no token.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>, kvc::AlignedSinkWindow<0, 32>>;
static_assert(sizeof(Bad) > 0);
