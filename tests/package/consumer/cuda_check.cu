// Compiled (never run) by the find_package consumer when kvc has CUDA: kvc::cuda must give nvcc
// C++20, the kvc include dirs and EIGEN_NO_CUDA.
#include <kvc/config.hpp>

static_assert(__cplusplus >= 202002L, "kvc::cuda must compile CUDA sources as C++20");
#ifndef EIGEN_NO_CUDA
#  error "kvc::cuda must define EIGEN_NO_CUDA"
#endif

KVC_HOST_DEVICE int kvc_consumer_twice(int x) { return 2 * x; }

__global__ void kvc_consumer_kernel(int* out) { out[threadIdx.x] = kvc_consumer_twice(threadIdx.x); }
