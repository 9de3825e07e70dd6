/// \file device_buffer.cuh
/// A move-only, zero-initialised buffer of device memory (RAII over cudaMalloc / cudaFree). Host only.
#pragma once

#include <kvc/cuda/error.cuh>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <utility>

namespace kvc::cuda {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// n elements of T, zeroed before the constructor returns (so work on any stream, blocking or not,
  /// sees zeros), aligned to >= 256 bytes. Throws kvc::Error (kCuda) on failure.
  explicit DeviceBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
    data_ = static_cast<T*>(p);
    cudaError_t e = cudaMemset(p, 0, n * sizeof(T));
    if (e == cudaSuccess) e = cudaDeviceSynchronize();  // non-blocking streams do not wait for the legacy stream
    if (e != cudaSuccess) {
      release();
      check(e, "cudaMemset");
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }

 private:
  void release() noexcept {
    if (data_) (void)cudaFree(data_);  // never throws from a destructor
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A move-only, zero-initialised buffer of pinned host memory mapped into the device's address space
/// (cudaHostAlloc with cudaHostAllocMapped): the host writes it directly, kernels read it over the bus
/// through device_data(). For data kept off the GPU that kernels read sparsely (QAQ's mirror). Host only.
template <class T>
class MappedHostBuffer {
 public:
  MappedHostBuffer() = default;
  explicit MappedHostBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    check(cudaHostAlloc(&p, n * sizeof(T), cudaHostAllocMapped), "cudaHostAlloc (mapped)");
    data_ = static_cast<T*>(p);
    std::memset(p, 0, n * sizeof(T));
    void* d = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(&d, p, 0);
    if (e != cudaSuccess) {
      release();
      check(e, "cudaHostGetDevicePointer");
    }
    device_ = static_cast<T*>(d);
  }
  MappedHostBuffer(MappedHostBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), device_(std::exchange(o.device_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedHostBuffer& operator=(MappedHostBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      device_ = std::exchange(o.device_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  MappedHostBuffer(const MappedHostBuffer&) = delete;
  MappedHostBuffer& operator=(const MappedHostBuffer&) = delete;
  ~MappedHostBuffer() { release(); }

  T* data() noexcept { return data_; }  ///< host address
  const T* data() const noexcept { return data_; }
  const T* device_data() const noexcept { return device_; }  ///< the same memory as kernels address it
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }

 private:
  void release() noexcept {
    if (data_) (void)cudaFreeHost(data_);
    data_ = device_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  T* device_ = nullptr;
  std::size_t size_ = 0;
};

/// Stream-ordered scratch memory (cudaMallocAsync / cudaFreeAsync on `stream`): freed when the work
/// queued before the destructor ran has finished. For per-call workspaces of the kernels.
template <class T>
class StreamScratch {
 public:
  StreamScratch(std::size_t n, cudaStream_t stream) : stream_(stream) {
    if (n == 0) return;
    void* p = nullptr;
    check(cudaMallocAsync(&p, n * sizeof(T), stream), "cudaMallocAsync");
    data_ = static_cast<T*>(p);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (data_) (void)cudaFreeAsync(data_, stream_);
  }
  T* data() noexcept { return data_; }

 private:
  T* data_ = nullptr;
  cudaStream_t stream_;
};
}  // namespace kvc::cuda
