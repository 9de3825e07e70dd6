// expect: key quantizer.s per-channel group size must equal the block size
// Per-channel key groups of 64 tokens need 64-token blocks.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 64, kvc::Axis::kChannel>>, kvc::BlockTokens<32>>;
static_assert(sizeof(Bad) > 0);
