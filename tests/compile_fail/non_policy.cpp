// expect: every template argument of CompressedKVCache must be a kvc policy
// int has no policy_kind.
#include <kvc/kvc.hpp>

static_assert(sizeof(kvc::CompressedKVCache<int>) > 0);
