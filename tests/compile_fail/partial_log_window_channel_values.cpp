// expect: PartialLogWindow quantizes a value on its own when it leaves the value window
// PartialLogQuant stores a value that left its window as one quantized token row; per-channel value
// groups span a whole block and cannot be formed one token at a time.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>, kvc::PartialLogWindow<8>>;
static_assert(sizeof(Bad) > 0);
