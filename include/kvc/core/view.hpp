// kvc: nvcc-safe
/// \file view.hpp
/// Non-owning views of the dense tensors that cross kvc's API: K/V inputs [tokens][heads][head_dim],
/// queries and outputs [sequences][heads][head_dim]. The innermost dimension is contiguous.
#pragma once

#include <kvc/config.hpp>

#include <cstddef>

namespace kvc {

/// A rank-3 strided view with a contiguous last dimension. Trivially copyable.
template <class T>
struct Tensor3View {
  T* data = nullptr;
  int dim0 = 0, dim1 = 0, dim2 = 0;
  std::ptrdiff_t stride0 = 0, stride1 = 0;  ///< in elements

  /// A contiguous [d0][d1][d2] view.
  KVC_HOST_DEVICE static Tensor3View contiguous(T* p, int d0, int d1, int d2) noexcept {
    return {p, d0, d1, d2, std::ptrdiff_t(d1) * d2, d2};
  }
  KVC_HOST_DEVICE T* row(int i, int j) const noexcept { return data + i * stride0 + j * stride1; }
  KVC_HOST_DEVICE std::size_t size() const noexcept { return std::size_t(dim0) * dim1 * dim2; }
};

using KVView = Tensor3View<const float>;      ///< keys or values to append: [tokens][kv_heads][head_dim]
using QueryView = Tensor3View<const float>;   ///< [sequences][query_heads][head_dim]
using OutputView = Tensor3View<float>;        ///< [sequences][query_heads][head_dim]
}  // namespace kvc
