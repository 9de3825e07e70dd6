/// \file aligned_buffer.hpp
/// A zero-initialised, 64-byte aligned, move-only host buffer (cache arenas, kernel scratch).
#pragma once

#include <kvc/config.hpp>

#include <cstddef>
#include <cstring>
#include <new>
#include <utility>

namespace kvc {

template <class T>
class AlignedBuffer {
 public:
  static constexpr std::size_t kAlign = 64;
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    data_ = static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t{kAlign}));
    std::memset(static_cast<void*>(data_), 0, n * sizeof(T));
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  void release() noexcept {
    if (data_) ::operator delete[](static_cast<void*>(data_), std::align_val_t{kAlign});
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};
}  // namespace kvc
