// expect: LowRankInit::kWarm keeps each stream's last basis on the host
// A warm-started low-rank fit carries each stream's basis on the host: appending on the device is refused.
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/schemes.hpp>

using Warm = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kTensor>,
                                    kvc::LowRankResidual<kvc::Rho<200>, kvc::Rho<200>, 3, kvc::LowRankInit::kWarm>,
                                    kvc::BlockTokens<64>>;
void bad(kvc::cuda::device_cache_t<Warm>& c, kvc::KVView k) { c.append(0, 0, k, k); }
