// expect: OutlierFilter / LowRankResidual correct a quantized backbone
// GEAR's corrections on an uncompressed cache: nothing to correct.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::NoQuantizer<kvc::half_t>, kvc::OutlierFilter<200>>;
static_assert(sizeof(Bad) > 0);
