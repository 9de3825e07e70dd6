// kvc: nvcc-safe
/// \file power_iteration.hpp
/// GEAR's low-rank fit (SPEC §1.3 step 4, Appendix A Algorithm 2), written once against a small
/// dense linear-algebra backend so the host (Eigen, gear/host_linalg.hpp) and the CUDA code
/// (cuBLAS + cuSOLVER) run the same algorithm. A backend provides, on column-major fp32 matrices
/// in its own memory space:
///   gemm(trans_a, m, n, k, A, lda, B, ldb, C, ldc)   C (m x n) = op(A) (m x k) * B (k x n)
///   orthonormalize(m, n, A, lda)                     A <- Q of the thin QR of A (m >= n)
///   fill_uniform(m, n, A, lda, seed)                 A <- uniform [-1, 1), a pure function of seed
/// The start is symmetric [default], not the reference code's uniform [0, 1): those columns share a
/// large common component, and 3 iterations from them stayed 1.75x above the optimal error on a
/// spectrum decaying 0.4x per index (rank 2, 64 x 64), against 1.02x from [-1, 1) (test_gear.cpp).
#pragma once

#include <kvc/config.hpp>

#include <cstdint>

namespace kvc {

enum class Trans { kNo, kYes };

/// Element e of the uniform [-1, 1) stream of `seed` (splitmix64 at seed + (e + 1) * golden ratio):
/// fill_uniform writes element (i, j) of an m x n matrix as e = j * m + i, so the host and device
/// backends start power iteration from bit-identical bases. Host+device.
KVC_HOST_DEVICE float uniform_pm1(std::uint64_t seed, std::uint64_t e) noexcept {
  std::uint64_t z = seed + (e + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1.0p-23f - 1.0f;
}

/// The power-iteration seed of one block's residual: fixed per (layer, sequence, KV head, block, side),
/// so compression is reproducible and the host and device caches start from the same basis. Host+device.
KVC_HOST_DEVICE std::uint64_t low_rank_seed(int layer, int seq, int head, int blk, bool keys) noexcept {
  return ((((std::uint64_t(layer) * 0x100000001B3ull + std::uint64_t(seq)) * 0x9E3779B1ull + std::uint64_t(head)) *
               0x85EBCA77ull +
           std::uint64_t(blk))
          << 1) |
         (keys ? 0u : 1u);
}

template <class L>
concept LinalgBackend = requires(L& la, const float* cp, float* p, int i, std::uint64_t s) {
  la.gemm(Trans::kNo, i, i, i, cp, i, cp, i, p, i);
  la.orthonormalize(i, i, p, i);
  la.fill_uniform(i, i, p, i, s);
};

/// Power iteration for a rank-r approximation A * B^T of R (n x d, column-major, leading dim ldr).
/// Out: A (n x r, lda = n) with orthonormal columns and B (d x r, ldb = d), so A B^T = A A^T R is the
/// projection of R onto the iteration's r-dimensional column subspace (an approximation of the top-r
/// singular subspace: its error is within a factor (1 + eps) of the optimal sqrt(sum_{i>r} s_i^2),
/// eps shrinking like (s_{r+1} / s_r)^(2 * iters)).
/// B is the starting basis if `warm`, else it is filled from `seed`. EveryQR = false orthonormalizes
/// only in the last iteration (Algorithm 2 literally); true at every iteration (same subspace in exact
/// arithmetic, and the columns stay apart in fp32). Requires 1 <= r <= min(n, d), iters >= 1.
template <LinalgBackend L>
void power_iteration(L& la, const float* R, int n, int d, int ldr, int r, int iters, bool every_qr, float* A,
                     float* B, bool warm, std::uint64_t seed) {
  if (!warm) la.fill_uniform(d, r, B, d, seed);
  for (int l = 0; l < iters; ++l) {
    const bool qr = every_qr || l == iters - 1;
    if (qr) la.orthonormalize(d, r, B, d);
    la.gemm(Trans::kNo, n, r, d, R, ldr, B, d, A, n);   // A = R B
    if (qr) la.orthonormalize(n, r, A, n);
    la.gemm(Trans::kYes, d, r, n, R, ldr, A, n, B, d);  // B = R^T A
  }
}
}  // namespace kvc
