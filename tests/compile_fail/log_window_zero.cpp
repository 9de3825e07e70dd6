// expect: LogWindow<W>: the window W must be at least 1
// A LogQuant cache with an empty log set is meaningless (3W = 0 full-precision tokens).
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>, kvc::LogWindow<0>>;
static_assert(sizeof(Bad) > 0);
