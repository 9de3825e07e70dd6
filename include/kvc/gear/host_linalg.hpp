/// \file host_linalg.hpp
/// The host backend of gear/power_iteration.hpp: fp32 GEMM and thin QR through Eigen
/// (HouseholderQR), uniform [-1, 1) fill from a splitmix64 stream.
#pragma once

#include <kvc/gear/power_iteration.hpp>

#include <Eigen/Dense>

#include <cstdint>

namespace kvc {

/// Stateless; one instance may serve any number of calls (not shared across threads concurrently
/// only because Eigen's temporaries allocate).
struct HostLinalg {
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  using CMap = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
  using MMap = Eigen::Map<Mat, 0, Eigen::OuterStride<>>;

  void gemm(Trans ta, int m, int n, int k, const float* A, int lda, const float* B, int ldb, float* C,
            int ldc) const {
    MMap c(C, m, n, Eigen::OuterStride<>(ldc));
    const CMap b(B, k, n, Eigen::OuterStride<>(ldb));
    if (ta == Trans::kNo) c.noalias() = CMap(A, m, k, Eigen::OuterStride<>(lda)) * b;
    else c.noalias() = CMap(A, k, m, Eigen::OuterStride<>(lda)).transpose() * b;
  }
  void orthonormalize(int m, int n, float* A, int lda) const {
    MMap a(A, m, n, Eigen::OuterStride<>(lda));
    const Eigen::HouseholderQR<Mat> qr(a);
    a = qr.householderQ() * Mat::Identity(m, n);
  }
  void fill_uniform(int m, int n, float* A, int lda, std::uint64_t seed) const {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) A[std::size_t(j) * lda + i] = uniform_pm1(seed, std::uint64_t(j) * m + i);
  }
};
static_assert(LinalgBackend<HostLinalg>);
}  // namespace kvc
