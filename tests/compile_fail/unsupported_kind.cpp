// expect: the loader policy must be kvc::AlignedLoader
// A well-formed loader policy beside a quantizer that lacks the loader interface (tiers, estimate).
#include <kvc/kvc.hpp>

struct PartialLoads {
  using policy_kind = kvc::kind::loader;
};
using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<8>, PartialLoads>;
static_assert(sizeof(Bad) > 0);
