// kvc::cuda::CudaLinalg (cuBLAS GEMM, cuSOLVER thin QR, the uniform fill) against the host's Eigen
// backend on random matrices, and GEAR's power iteration run through both.
#include <kvc/gear/host_linalg.hpp>

#include "cuda_test_util.cuh"

#include <random>

namespace {
using namespace kvc_cuda_test;

std::vector<float> random_matrix(int m, int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> a(std::size_t(m) * n);
  for (auto& x : a) x = n01(rng);
  return a;
}

TEST(CudaLinalg, GemmMatchesEigen) {
  KVC_REQUIRE_GPU();
  kvc::cuda::CudaLinalg dev;
  const kvc::HostLinalg host;
  for (auto [m, n, k] : {std::array<int, 3>{64, 2, 128}, {128, 1, 64}, {33, 7, 17}})
    for (kvc::Trans t : {kvc::Trans::kNo, kvc::Trans::kYes}) {
      const int lda = t == kvc::Trans::kNo ? m : k;
      const auto a = random_matrix(lda, t == kvc::Trans::kNo ? k : m, 1), b = random_matrix(k, n, 2);
      std::vector<float> want(std::size_t(m) * n);
      host.gemm(t, m, n, k, a.data(), lda, b.data(), k, want.data(), m);
      DeviceArray<float> da(a), db(b), dc(want.size());
      dev.gemm(t, m, n, k, da.data(), lda, db.data(), k, dc.data(), m);
      const auto got = dc.get();
      for (std::size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4 * std::sqrt(double(k)));
    }
}

TEST(CudaLinalg, ThinQrIsOrthonormalAndSpansTheInput) {
  KVC_REQUIRE_GPU();
  kvc::cuda::CudaLinalg dev;
  const kvc::HostLinalg host;
  for (auto [m, n] : {std::array<int, 2>{128, 2}, {64, 1}, {96, 5}}) {
    const auto a = random_matrix(m, n, 3);
    DeviceArray<float> da(a);
    dev.orthonormalize(m, n, da.data(), m);
    const auto q = da.get();
    std::vector<float> qh = a;
    host.orthonormalize(m, n, qh.data(), m);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        double dot = 0.0;
        for (int r = 0; r < m; ++r) dot += double(q[std::size_t(i) * m + r]) * q[std::size_t(j) * m + r];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-5);
      }
    // Householder QR with LAPACK's convention on both sides: the same Q, column signs included.
    for (std::size_t i = 0; i < q.size(); ++i) ASSERT_NEAR(q[i], qh[i], 1e-4);
  }
}

TEST(CudaLinalg, UniformFillIsBitIdenticalToTheHost) {
  KVC_REQUIRE_GPU();
  kvc::cuda::CudaLinalg dev;
  const kvc::HostLinalg host;
  std::vector<float> want(100 * 3);
  host.fill_uniform(100, 3, want.data(), 100, 99);
  DeviceArray<float> d(want.size());
  dev.fill_uniform(100, 3, d.data(), 100, 99);
  EXPECT_EQ(d.get(), want);
}

TEST(CudaLinalg, PowerIterationMatchesTheHostFit) {
  KVC_REQUIRE_GPU();
  kvc::cuda::CudaLinalg dev;
  kvc::HostLinalg host;
  const int n = 64, d = 128, r = 2;
  // a residual with a decaying spectrum (singular values ~4^-i), column-major n x d
  const auto u = random_matrix(n, 8, 5), v = random_matrix(d, 8, 6);
  std::vector<float> res(std::size_t(n) * d, 0.0f);
  for (int i = 0; i < 8; ++i)
    for (int c = 0; c < d; ++c)
      for (int t = 0; t < n; ++t)
        res[std::size_t(c) * n + t] += std::ldexp(1.0f, -2 * i) * u[std::size_t(i) * n + t] * v[std::size_t(i) * d + c];
  std::vector<float> a(std::size_t(n) * r), b(std::size_t(d) * r);
  kvc::power_iteration(host, res.data(), n, d, n, r, 3, true, a.data(), b.data(), false, 1234);
  DeviceArray<float> dr(res), da(a.size()), db(b.size());
  kvc::power_iteration(dev, dr.data(), n, d, n, r, 3, true, da.data(), db.data(), false, 1234);
  const auto ga = da.get(), gb = db.get();
  // compare the products A B^T (the fit), not the factors
  double err = 0.0, ref = 0.0;
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) {
      double x = 0.0, y = 0.0;
      for (int j = 0; j < r; ++j) {
        x += double(a[std::size_t(j) * n + t]) * b[std::size_t(j) * d + c];
        y += double(ga[std::size_t(j) * n + t]) * gb[std::size_t(j) * d + c];
      }
      err = std::max(err, std::fabs(x - y));
      ref = std::max(ref, std::fabs(x));
    }
  EXPECT_LE(err, 1e-4 * ref);
}
}  // namespace
