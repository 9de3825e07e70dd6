// expect: AlignedLoader over a selector's full-precision slots .slot planes. is built on the CPU only so far
// The device cache does not hold slot planes yet: a readable error, not a silent fallback to fp16 rows.
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/schemes.hpp>

using Bad = kvc::cuda::DeviceKVCache<kvc::GroupQuantizer<2, 32, kvc::Axis::kToken>, kvc::FullPrecisionWindow<64>,
                                     kvc::AlignedLoader<>>;
static_assert(sizeof(Bad) > 0);
