// Compiled (never run) by the find_package consumer when kvc has CUDA: kvc::cuda must give nvcc
// C++20, the kvc include dirs (the installed cuda headers among them) and EIGEN_NO_CUDA.
#include <kvc/config.hpp>
#include <kvc/cuda/kvc_cuda.cuh>
#include <kvc/schemes.hpp>

static_assert(__cplusplus >= 202002L, "kvc::cuda must compile CUDA sources as C++20");
#ifndef EIGEN_NO_CUDA
#  error "kvc::cuda must define EIGEN_NO_CUDA"
#endif

KVC_HOST_DEVICE int kvc_consumer_twice(int x) { return 2 * x; }

__global__ void kvc_consumer_kernel(int* out) { out[threadIdx.x] = kvc_consumer_twice(threadIdx.x); }

// The device cache of a host scheme and its decode kernel instantiate from the installed headers.
void kvc_consumer_decode(const kvc::cuda::device_cache_t<kvc::schemes::Kivi2>& cache, const kvc::half_t* q,
                         kvc::half_t* out) {
  kvc::cuda::decode_attention<128>(cache, 0, 1, 8, q, out);
}
