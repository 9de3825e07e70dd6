/// \file device_info.cuh
/// The current device's limits the launchers need, queried once per device, and the dynamic
/// shared-memory opt-in of a kernel. Host only.
#pragma once

#include <kvc/cuda/error.cuh>

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace kvc::cuda {

struct DeviceLimits {
  int sms = 0;         ///< streaming multiprocessors
  int smem_optin = 0;  ///< most dynamic shared memory one block may opt into (bytes)
};

/// Limits of the current device (cached per device; thread-safe).
inline DeviceLimits device_limits() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  static std::mutex mu;
  static std::vector<DeviceLimits> cache;
  const std::lock_guard<std::mutex> lock(mu);
  if (cache.size() <= std::size_t(dev)) cache.resize(std::size_t(dev) + 1);
  DeviceLimits& l = cache[std::size_t(dev)];
  if (l.sms == 0) {
    check(cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  }
  return l;
}

/// Lets `kernel` launch with `bytes` of dynamic shared memory (an opt-in above the default 48 KB; the
/// caller has checked `bytes` against device_limits().smem_optin).
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, std::size_t bytes, const char* what) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), what);
}
}  // namespace kvc::cuda
