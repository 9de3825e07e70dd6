// expect: kvc::QaqQuantizer gives every token its own width
// QAQ's cache is its own container, named by the quantizer first (a Rotation may follow it): a Rotation
// before it reaches the block cache, which must refuse it instead of storing something else.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::Rotation<kvc::Hadamard<>>, kvc::QaqQuantizer<>>;
static_assert(sizeof(Bad) > 0);
