// expect: OutlierScope::kStream selects outliers over the whole history, which only kvc::LiteralMode
// Stream-scope (paper-mode) outliers need literal mode: block mode never revisits a block.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<4>, kvc::OutlierFilter<200, kvc::OutlierScope::kStream>>;
static_assert(sizeof(Bad) > 0);
