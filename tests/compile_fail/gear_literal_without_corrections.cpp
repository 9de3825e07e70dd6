// expect: kvc::LiteralMode recompresses GEAR's corrections
// Literal mode without an outlier filter or a low-rank residual has nothing to recompress.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<4>, kvc::LiteralMode>;
static_assert(sizeof(Bad) > 0);
