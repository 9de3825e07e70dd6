// expect: kvc::QaqQuantizer gives every token its own width
// QAQ's widths change per token and step; the fixed-width block cache must refuse it at compile time
// instead of silently storing fp16.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::QaqQuantizer<>>;
static_assert(sizeof(Bad) > 0);
