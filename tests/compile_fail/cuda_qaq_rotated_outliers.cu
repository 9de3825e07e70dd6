// expect: DeviceQaqCache rotates QAQ without outliers only
// The host takes QAQ's outliers before a Rotation and rotates the residual; the device kernels do not yet, so the
// device cache refuses a Rotation with outliers by name.
#include <kvc/cuda/qaq/device_qaq_cache.cuh>

kvc::cuda::DeviceQaqCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>* bad = nullptr;
void use() { (void)bad->config(); }
