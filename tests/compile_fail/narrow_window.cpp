// expect: full-precision window.s storage cannot hold the identity quantizer.s values exactly
// An fp32 cache whose window keeps fp16 would silently lose precision.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::NoQuantizer<float>, kvc::FullPrecisionWindow<0, 0, kvc::half_t>>;
static_assert(sizeof(Bad) > 0);
