// expect: the outlier-filter policy must be kvc::OutlierFilter<s>
// A policy tagged as an outlier filter that does not provide OutlierFilter's interface.
#include <kvc/kvc.hpp>

struct SparseOutliers {
  using policy_kind = kvc::kind::outlier_filter;
};
using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<8>, SparseOutliers>;
static_assert(sizeof(Bad) > 0);
