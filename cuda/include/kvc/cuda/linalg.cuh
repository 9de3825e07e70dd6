/// \file linalg.cuh
/// The device backend of gear/power_iteration.hpp (the same LinalgBackend interface as the host's
/// Eigen backend, so GEAR's low-rank fit runs the same algorithm code on the GPU):
///   gemm            cublasSgemm, fp32 (CUBLAS_DEFAULT_MATH: no TF32)
///   orthonormalize  cuSOLVER thin QR: Sgeqrf then Sorgqr (Householder, LAPACK's sign convention, like Eigen)
///   fill_uniform    a kernel writing uniform_pm1(seed, j * m + i): bit-identical to the host backend
/// Matrices are column-major fp32 in device memory; calls are queued on the backend's stream. Owns its
/// cuBLAS / cuSOLVER handles and workspace (RAII). Not thread-safe. Host only.
#pragma once

#include <kvc/cuda/device_buffer.cuh>
#include <kvc/cuda/error.cuh>
#include <kvc/gear/power_iteration.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <cstdint>
#include <utility>

namespace kvc::cuda {

/// Throws kvc::Error (kCuda) naming the cuBLAS status.
inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) kvc::detail::fail(Errc::kCuda, what, ": ", cublasGetStatusName(s), " (", cublasGetStatusString(s), ")");
}
/// Throws kvc::Error (kCuda) naming the cuSOLVER status (cuSOLVER has no status-string function).
inline void check(cusolverStatus_t s, const char* what) {
  if (s == CUSOLVER_STATUS_SUCCESS) return;
  const char* name = "unknown cuSOLVER status";
  switch (s) {
    case CUSOLVER_STATUS_NOT_INITIALIZED: name = "CUSOLVER_STATUS_NOT_INITIALIZED"; break;
    case CUSOLVER_STATUS_ALLOC_FAILED: name = "CUSOLVER_STATUS_ALLOC_FAILED"; break;
    case CUSOLVER_STATUS_INVALID_VALUE: name = "CUSOLVER_STATUS_INVALID_VALUE"; break;
    case CUSOLVER_STATUS_ARCH_MISMATCH: name = "CUSOLVER_STATUS_ARCH_MISMATCH"; break;
    case CUSOLVER_STATUS_EXECUTION_FAILED: name = "CUSOLVER_STATUS_EXECUTION_FAILED"; break;
    case CUSOLVER_STATUS_INTERNAL_ERROR: name = "CUSOLVER_STATUS_INTERNAL_ERROR"; break;
    default: break;
  }
  kvc::detail::fail(Errc::kCuda, what, ": ", name, " (status ", static_cast<int>(s), ")");
}

namespace detail {
/// (a template: a __global__ function in a header must not be defined once per translation unit)
template <class T>
__global__ void fill_uniform_kernel(int m, int n, T* A, int lda, std::uint64_t seed) {
  const long long total = static_cast<long long>(m) * n;
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long j = e / m, i = e - j * m;
    A[j * lda + i] = uniform_pm1(seed, static_cast<std::uint64_t>(e));
  }
}
}  // namespace detail

class CudaLinalg {
 public:
  explicit CudaLinalg(cudaStream_t stream = nullptr) : stream_(stream) {
    check(cublasCreate(&blas_), "cublasCreate");
    const cusolverStatus_t s = cusolverDnCreate(&solver_);
    if (s != CUSOLVER_STATUS_SUCCESS) {
      cublasDestroy(blas_);
      check(s, "cusolverDnCreate");
    }
    try {
      check(cublasSetStream(blas_, stream), "cublasSetStream");
      check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
      check(cusolverDnSetStream(solver_, stream), "cusolverDnSetStream");
      info_ = DeviceBuffer<int>(1);
    } catch (...) {
      destroy();
      throw;
    }
  }
  CudaLinalg(const CudaLinalg&) = delete;
  CudaLinalg& operator=(const CudaLinalg&) = delete;
  ~CudaLinalg() { destroy(); }

  cudaStream_t stream() const noexcept { return stream_; }
  /// Queues later calls on `stream`, after everything already queued on the previous one (the
  /// handles' and the QR's scratch is shared by all calls).
  void set_stream(cudaStream_t stream) {
    if (stream == stream_) return;
    if (!switched_) check(cudaEventCreateWithFlags(&switched_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(switched_, stream_), "cudaEventRecord");
    check(cudaStreamWaitEvent(stream, switched_, 0), "cudaStreamWaitEvent");
    check(cublasSetStream(blas_, stream), "cublasSetStream");
    check(cusolverDnSetStream(solver_, stream), "cusolverDnSetStream");
    stream_ = stream;
  }

  /// C (m x n) = op(A) (m x k) * B (k x n).
  void gemm(Trans ta, int m, int n, int k, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    check(cublasSgemm(blas_, ta == Trans::kNo ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, lda, B, ldb,
                      &zero, C, ldc),
          "cublasSgemm");
  }
  /// A (m x n, m >= n) <- the Q of its thin QR.
  void orthonormalize(int m, int n, float* A, int lda) {
    int lw_qr = 0, lw_q = 0;
    reserve_tau(n);
    check(cusolverDnSgeqrf_bufferSize(solver_, m, n, A, lda, &lw_qr), "cusolverDnSgeqrf_bufferSize");
    check(cusolverDnSorgqr_bufferSize(solver_, m, n, n, A, lda, tau_.data(), &lw_q), "cusolverDnSorgqr_bufferSize");
    reserve_work(lw_qr > lw_q ? lw_qr : lw_q);
    check(cusolverDnSgeqrf(solver_, m, n, A, lda, tau_.data(), work_.data(), int(work_.size()), info_.data()),
          "cusolverDnSgeqrf");
    check(cusolverDnSorgqr(solver_, m, n, n, A, lda, tau_.data(), work_.data(), int(work_.size()), info_.data()),
          "cusolverDnSorgqr");
  }
  /// A (m x n) <- uniform [-1, 1) from `seed`, element (i, j) = uniform_pm1(seed, j * m + i).
  void fill_uniform(int m, int n, float* A, int lda, std::uint64_t seed) {
    const long long total = static_cast<long long>(m) * n;
    const int blocks = static_cast<int>((total + 255) / 256 < 1024 ? (total + 255) / 256 : 1024);
    if (total == 0) return;
    detail::fill_uniform_kernel<float><<<blocks, 256, 0, stream_>>>(m, n, A, lda, seed);
    check_launch("fill_uniform_kernel");
  }

 private:
  void reserve_tau(int n) {
    if (tau_.size() < std::size_t(n)) {
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");  // the old buffer may be in use
      tau_ = DeviceBuffer<float>(std::size_t(n));
    }
  }
  void reserve_work(int n) {
    if (work_.size() < std::size_t(n)) {
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");  // the old workspace may be in use
      work_ = DeviceBuffer<float>(std::size_t(n));
    }
  }
  void destroy() noexcept {
    if (switched_) cudaEventDestroy(switched_);
    switched_ = nullptr;
    if (solver_) cusolverDnDestroy(solver_);
    if (blas_) cublasDestroy(blas_);
    solver_ = nullptr;
    blas_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cusolverDnHandle_t solver_ = nullptr;
  cudaEvent_t switched_ = nullptr;  // orders a new stream after the previous one
  DeviceBuffer<float> tau_, work_;
  DeviceBuffer<int> info_;
};
static_assert(LinalgBackend<CudaLinalg>);
}  // namespace kvc::cuda
