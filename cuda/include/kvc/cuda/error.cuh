/// \file error.cuh
/// CUDA runtime errors as kvc::Error (Errc::kCuda) carrying the runtime's own error name and text.
/// Host only.
#pragma once

#include <kvc/core/error.hpp>

#include <cuda_runtime.h>

#include <string>

namespace kvc::cuda {

/// Throws kvc::Error(Errc::kCuda, "<what>: <cudaErrorName> (<text>)") when `e` is not cudaSuccess. The
/// runtime's last-error slot is cleared first: a failed call (a cudaMalloc out of memory, say) also leaves
/// its error there, and the next check_launch would report it against an innocent kernel. (Sticky errors,
/// a fault inside a kernel, stay: the context is unusable.)
inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  kvc::detail::fail(Errc::kCuda, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

/// Checks the launch of the kernel just enqueued (configuration errors surface here; faults inside the
/// kernel surface at the next synchronising call).
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

/// Whether a CUDA device can be used; `why` gets the runtime's error text when not (tests skip with it).
inline bool device_available(std::string* why = nullptr) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why) *why = e != cudaSuccess ? std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e)
                                     : std::string("no CUDA device");
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  return true;
}
}  // namespace kvc::cuda
