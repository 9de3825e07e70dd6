// expect: kvc::AlignedLoader splits fp16 bit patterns: the full-precision window it loads must be stored in
// AlignedLoader beside a quantizer loads the selector's full-precision slots as fp16 bit planes: an fp32 window
// has no fp16 planes to split.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>, kvc::FullPrecisionWindow<64, 0, float>,
                                   kvc::AlignedLoader<>>;
static_assert(sizeof(Bad) > 0);
