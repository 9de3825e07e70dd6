// expect: kvc::AlignedLoader loads exact fp16 slots; kvc::PartialLogWindow keeps some of its values as
// The device cache takes AlignedLoader over a selector's fp16 slots (slot planes) and rejects, with the host's
// message, what the host cache rejects: PartialLogQuant's values that left their window are quantized rows.
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/schemes.hpp>

using Bad = kvc::cuda::DeviceKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>>,
                                     kvc::values<kvc::GroupQuantizer<2, 32, kvc::Axis::kToken>>, kvc::PartialLogWindow<8>,
                                     kvc::AlignedLoader<>>;
static_assert(sizeof(Bad) > 0);
