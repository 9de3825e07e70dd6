// kvc: nvcc-safe
/// \file hadamard.hpp
/// The orthonormal transforms a `kvc::Rotation` applies to one KV head's rows (rotate/rotation.hpp):
///  - `Hadamard<Seed>`: R = (C_m (x) H_p / sqrt(p)) D for head_dim d = p * m, p the largest power of two
///    dividing d, D a diagonal of random signs drawn from the seed, H_p the Walsh-Hadamard matrix (fast
///    transform, O(d log p)) and C_m the orthonormal discrete Hartley matrix of size m,
///    C[k][n] = (cos(2 pi k n / m) + sin(2 pi k n / m)) / sqrt(m) (m = 1 for power-of-two head dims:
///    QuaRot's randomized Hadamard). C_m is symmetric, its own inverse, and has no zero entry for odd m
///    (a DCT has), so head dims 80/96/112 = 16x5 / 32x3 / 16x7 are fully mixed too: every output channel
///    depends on every input channel (O(d m) more work).
///  - `NoTransform`: the identity (a side that is not rotated).
/// A transform's per-(layer, head, side) data is a table of `table_words(d)` 32-bit words, built on the
/// host by `make_table` and read by `apply` / `apply_transpose` (host+device, in place on d floats).
/// Contract: apply_transpose(apply(x)) == x and |apply(x)|_2 == |x|_2 to fp32 rounding (a few ulps per
/// log2(d) butterfly stages); the table for a given (Seed, stream id) is the same on every platform, and
/// apply() rounds every operation on its own (no FMA contraction), so the CUDA append rotates a row to
/// the same bits as the host.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/numeric.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kvc {

/// The identity transform: a side that keeps its original basis.
struct NoTransform {
  static constexpr bool kActive = false;
  static constexpr const char* name() noexcept { return "none"; }
  static constexpr bool supports(int) noexcept { return true; }
  KVC_HOST_DEVICE static constexpr std::size_t table_words(int) noexcept { return 0; }
  static void make_table(int, std::uint64_t, std::uint32_t*) noexcept {}
  KVC_HOST_DEVICE static void apply(const std::uint32_t*, int, float*) noexcept {}
  KVC_HOST_DEVICE static void apply_transpose(const std::uint32_t*, int, float*) noexcept {}
};

namespace detail {
/// splitmix64: the seed stream of the transforms' random signs (portable, no <random> distribution).
KVC_HOST_DEVICE std::uint64_t splitmix64(std::uint64_t& s) noexcept {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/// In-place unnormalised Walsh-Hadamard transform of x[0, p), p a power of two.
KVC_HOST_DEVICE void fwht(float* x, int p) noexcept {
  for (int h = 1; h < p; h <<= 1)
    for (int i = 0; i < p; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}
}  // namespace detail

/// Randomized Hadamard rotation (see the file comment). `Seed` fixes the signs of every (layer, head,
/// side) of a cache; the cache stores the tables it draws from it.
template <std::uint64_t Seed = 0x6b76632d726f7461ull>
struct Hadamard {
  static constexpr bool kActive = true;
  static constexpr std::uint64_t kSeed = Seed;
  /// Largest m = d / p served (the Hartley mix across blocks keeps m values in registers / local memory).
  static constexpr int kMaxBlocks = 64;
  static constexpr const char* name() noexcept { return "hadamard"; }

  /// p: the largest power of two dividing d; m = d / p.
  KVC_HOST_DEVICE static constexpr int block(int d) noexcept { return d & -d; }
  KVC_HOST_DEVICE static constexpr int blocks(int d) noexcept { return d / block(d); }
  /// Whether head_dim d is served (d > 0 and d / p <= kMaxBlocks).
  static constexpr bool supports(int d) noexcept { return d > 0 && blocks(d) <= kMaxBlocks; }
  /// [d sign bits, 32 per word][m x m Hartley floats when m > 1]
  KVC_HOST_DEVICE static constexpr std::size_t table_words(int d) noexcept {
    const std::size_t m = std::size_t(blocks(d));
    return (std::size_t(d) + 31u) / 32u + (m > 1 ? m * m : 0u);
  }
  /// Draws the table of stream `id` (the cache mixes layer, head and side into it) into t[table_words(d)].
  static void make_table(int d, std::uint64_t id, std::uint32_t* t) noexcept {
    std::uint64_t s = Seed ^ (0xD1B54A32D192ED03ull * (id + 1));
    const int words = (d + 31) / 32;
    for (int w = 0; w < words; ++w) t[w] = static_cast<std::uint32_t>(detail::splitmix64(s) >> 32);
    if (d % 32 != 0) t[words - 1] &= (1u << (d % 32)) - 1u;
    const int m = blocks(d);
    if (m == 1) return;
    const double two_pi = 6.28318530717958647692;
    for (int k = 0; k < m; ++k)
      for (int n = 0; n < m; ++n) {
        const double x = two_pi * ((k * n) % m) / m;
        t[words + k * m + n] = detail::float_bits(static_cast<float>((std::cos(x) + std::sin(x)) / std::sqrt(double(m))));
      }
  }

  /// x <- R x over x[0, d).
  KVC_HOST_DEVICE static void apply(const std::uint32_t* t, int d, float* x) noexcept {
    flip_signs(t, d, x);
    hadamard_blocks(d, x);
    if (blocks(d) > 1) mix_blocks(t + (d + 31) / 32, d, x);
  }
  /// x <- R^T x over x[0, d) (the inverse; H_p and C_m are symmetric).
  KVC_HOST_DEVICE static void apply_transpose(const std::uint32_t* t, int d, float* x) noexcept {
    if (blocks(d) > 1) mix_blocks(t + (d + 31) / 32, d, x);
    hadamard_blocks(d, x);
    flip_signs(t, d, x);
  }

 private:
  KVC_HOST_DEVICE static void flip_signs(const std::uint32_t* t, int d, float* x) noexcept {
    for (int c = 0; c < d; ++c)
      x[c] = detail::bits_float(detail::float_bits(x[c]) ^ (((t[c >> 5] >> (c & 31)) & 1u) << 31));
  }
  /// H_p / sqrt(p) on each of the m blocks of p channels (symmetric, its own inverse).
  KVC_HOST_DEVICE static void hadamard_blocks(int d, float* x) noexcept {
    const int p = block(d);
    // 1 / sqrt(p) = 2^-(e/2), times 1/sqrt(2) for odd e: the same float on every compiler and nvcc flag.
    float norm = 1.0f;
    int e = 0;
    while ((1 << e) < p) ++e;
    for (int i = 0; i < e / 2; ++i) norm *= 0.5f;
    if (e % 2 != 0) norm *= 0.70710678118654752f;
    for (int b = 0; b < d; b += p) {
      detail::fwht(x + b, p);
      for (int i = 0; i < p; ++i) x[b + i] *= norm;
    }
  }
  /// Across blocks, at each offset j within a block: y_k = sum_n C[k][n] x_n.
  KVC_HOST_DEVICE static void mix_blocks(const std::uint32_t* cw, int d, float* x) noexcept {
    const int p = block(d), m = blocks(d);
    float in[kMaxBlocks];
    for (int j = 0; j < p; ++j) {
      for (int n = 0; n < m; ++n) in[n] = x[n * p + j];
      for (int k = 0; k < m; ++k) {
        float acc = 0.0f;
        for (int n = 0; n < m; ++n) acc = mul_add_rounded(detail::bits_float(cw[k * m + n]), in[n], acc);
        x[k * p + j] = acc;
      }
    }
  }
};

}  // namespace kvc
