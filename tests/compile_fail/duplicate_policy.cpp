// expect: duplicate policy kind
// Two selectors in one composition.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>, kvc::FullPrecisionWindow<128>,
                                   kvc::FullPrecisionWindow<64>>;
static_assert(sizeof(Bad) > 0);
