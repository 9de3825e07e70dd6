// expect: PartialLogWindow: GEAR's corrections and LiteralMode need each value's exact row
// GEAR's low-rank residual corrects both sides, but a PartialLogQuant value is quantized before its
// block exists, so its block's residual has no exact row to fit.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>>,
                                   kvc::values<kvc::GroupQuantizer<2, 32, kvc::Axis::kToken>>,
                                   kvc::PartialLogWindow<8>, kvc::LowRankResidual<kvc::Rank<1>>>;
static_assert(sizeof(Bad) > 0);
