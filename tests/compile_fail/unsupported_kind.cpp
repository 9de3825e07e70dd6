// expect: loader policies are not supported by CompressedKVCache
// A well-formed policy of a kind the cache does not implement yet.
#include <kvc/kvc.hpp>

struct PartialLoads {
  using policy_kind = kvc::kind::loader;
};
using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<8>, PartialLoads>;
static_assert(sizeof(Bad) > 0);
