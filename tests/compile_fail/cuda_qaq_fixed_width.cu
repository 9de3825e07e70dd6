// expect: DeviceQaqCache serves adaptive QAQ \(BMin < BMax\)
// Per-token uniform QAQ (BMin == BMax) is a host baseline: the device cache refuses it by name.
#include <kvc/cuda/qaq/device_qaq_cache.cuh>

kvc::cuda::DeviceQaqCache<kvc::QaqQuantizer<3, 3>>* bad = nullptr;
void use() { (void)bad->config(); }
