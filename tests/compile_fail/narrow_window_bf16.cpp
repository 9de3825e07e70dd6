// expect: full-precision window.s storage cannot hold the identity quantizer.s values exactly
// A bf16 cache whose window keeps fp16 would round every token twice (bf16 -> fp16 -> bf16).
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::NoQuantizer<kvc::bfloat16_t>, kvc::FullPrecisionWindow<0, 0, kvc::half_t>>;
static_assert(sizeof(Bad) > 0);
