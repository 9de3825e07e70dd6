// expect: a bare quantizer applies to both keys and values
// A quantizer for both sides plus keys<> for one side.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<8>, kvc::keys<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>>>;
static_assert(sizeof(Bad) > 0);
