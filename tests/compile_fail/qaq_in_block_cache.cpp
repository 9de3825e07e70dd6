// expect: kvc::QaqQuantizer composes with one kvc::Rotation
// QAQ's widths change per token and step; its cache is CompressedKVCache<QaqQuantizer<...>> with at most a
// Rotation, so a composition with a selector must be refused at compile time instead of silently storing fp16.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::FullPrecisionWindow<16>>;
static_assert(sizeof(Bad) > 0);
