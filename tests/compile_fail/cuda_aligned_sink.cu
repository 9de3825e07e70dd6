// expect: AlignedSinkWindow.s masked block-0 rows are served by the CPU kernels only
// The CUDA decode kernel has no row mask: a device cache of an AlignedSinkWindow scheme must not compile.
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/kvc.hpp>

using Host = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, 32, kvc::Axis::kChannel>>,
                                    kvc::values<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>>,
                                    kvc::AlignedSinkWindow<0, 4>>;
using Bad = kvc::cuda::device_cache_t<Host>;
static_assert(sizeof(Bad) > 0);
