// expect: DeviceKVCache compresses in block mode; kvc::LiteralMode recompresses the whole history
// GEAR's literal mode keeps host state (the whole history is recompressed on the host): not on the device.
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/schemes.hpp>

using Bad = kvc::cuda::device_cache_t<kvc::schemes::Gear4Literal>;
static_assert(sizeof(Bad) > 0);
