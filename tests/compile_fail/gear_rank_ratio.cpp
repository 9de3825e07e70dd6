// expect: the rank ratio rho = BasisPoints / 10000 must lie in \(0, 1\]
// rho <= 0 gives no low-rank part (leave the policy out instead).
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::UniformQuantizer<4>, kvc::LowRankResidual<kvc::Rho<0>>>;
static_assert(sizeof(Bad) > 0);
