// expect: the outlier fraction s = BasisPoints / 10000 must lie in \(0, 1\)
// s = 0 is not an outlier filter (leave the policy out instead).
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<4>, kvc::OutlierFilter<0>>;
static_assert(sizeof(Bad) > 0);
