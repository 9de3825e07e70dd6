// expect: kvc::AlignedLoader loads exact fp16 slots; kvc::PartialLogWindow keeps some of its values as
// PartialLogQuant's values that left their window are quantized rows, not fp16 planes.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>>,
                                   kvc::values<kvc::GroupQuantizer<2, 32, kvc::Axis::kToken>>, kvc::PartialLogWindow<8>,
                                   kvc::AlignedLoader<>>;
static_assert(sizeof(Bad) > 0);
