// expect: outlier-filter policies are not supported by CompressedKVCache
// A well-formed policy of a kind the cache does not implement yet.
#include <kvc/kvc.hpp>

struct SparseOutliers {
  using policy_kind = kvc::kind::outlier_filter;
};
using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<8>, SparseOutliers>;
static_assert(sizeof(Bad) > 0);
