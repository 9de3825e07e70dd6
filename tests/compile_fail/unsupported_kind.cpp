// expect: a loader policy .kvc::AlignedLoader. reads fp16 bit planes
// A well-formed loader policy beside a quantizer: loaders have a cache of their own.
#include <kvc/kvc.hpp>

struct PartialLoads {
  using policy_kind = kvc::kind::loader;
};
using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<8>, PartialLoads>;
static_assert(sizeof(Bad) > 0);
