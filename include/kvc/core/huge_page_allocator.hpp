/// \file huge_page_allocator.hpp
/// `kvc::HugePageAllocator<T>`: a std::allocator for large host buffers read at random (QAQ's full-precision
/// mirror). Allocations of at least 2 MiB are 2 MiB aligned and, on Linux, advised for transparent huge
/// pages (madvise MADV_HUGEPAGE; the common "madvise" THP setting gives huge pages only to such regions), so a
/// random read costs no 4 KiB page walk: one 2 MiB TLB entry covers 512 small pages. Smaller allocations go to
/// std::allocator, so short caches do not pay a 2 MiB page each. The advice is a hint: where the kernel
/// declines it, the memory is ordinary. Host only.
#pragma once

#include <kvc/config.hpp>

#include <cstddef>
#include <memory>
#include <new>

#if defined(__linux__)
#  include <sys/mman.h>
#endif

namespace kvc {

template <class T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;

  HugePageAllocator() = default;
  template <class U>
  constexpr HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  [[nodiscard]] T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return std::allocator<T>{}.allocate(n);
    void* p = ::operator new(rounded(bytes), std::align_val_t{kHugePage});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)::madvise(p, rounded(bytes), MADV_HUGEPAGE);  // a hint: failure leaves ordinary pages
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) std::allocator<T>{}.deallocate(p, n);
    else ::operator delete(static_cast<void*>(p), rounded(bytes), std::align_val_t{kHugePage});
  }
  template <class U>
  friend constexpr bool operator==(const HugePageAllocator&, const HugePageAllocator<U>&) noexcept {
    return true;
  }

 private:
  static constexpr std::size_t rounded(std::size_t bytes) noexcept { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }
};
}  // namespace kvc
