// kvc: nvcc-safe
/// \file low_rank_residual.hpp
/// GEAR's low-rank residual (SPEC §1.3 steps 4-5, Algorithm 2): the quantization residual R (n x d)
/// of a block is approximated by A * B^T, A (n x r, orthonormal columns) and B (d x r), found by
/// power iteration (gear/power_iteration.hpp) and stored in fp16.
///
/// Storage per block and side: [A^T: fp16 r x n][B^T: fp16 r x d] (each factor column contiguous, so
/// both epilogues are r dot products plus r axpys). Attention uses the factored form and never
/// materialises A * B^T (SPEC §1.3 step 5):
///   keys:   scores_t += sum_j A[t][j] (B[:, j] . q)
///   values: out_c    += sum_j B[c][j] (A[:, j] . p)
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

#include <cstddef>

namespace kvc {
namespace detail {
/// a . b over n floats with 8 independent partial sums: compilers vectorize it without
/// -ffast-math (a single running sum is a serial chain of n dependent adds). Host+device.
KVC_HOST_DEVICE float dot8(const float* a, const float* b, int n) noexcept {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}
}  // namespace detail

/// Rank rule r = max(1, floor(rho * min(n, d))) with rho = BasisPoints / 10000 (SPEC §1.4 [default]).
template <int BasisPoints>
struct Rho {
  static_assert(BasisPoints > 0 && BasisPoints <= 10000,
                "kvc::Rho<BasisPoints>: the rank ratio rho = BasisPoints / 10000 must lie in (0, 1]");
  KVC_HOST_DEVICE static constexpr int rank(int n, int d) noexcept {
    const long long r = static_cast<long long>(n < d ? n : d) * BasisPoints / 10000;
    return r < 1 ? 1 : static_cast<int>(r);
  }
};
/// A fixed rank R (the cache rejects R > min(block tokens, head_dim) at construction).
template <int R>
struct Rank {
  static_assert(R >= 1, "kvc::Rank<R>: the rank must be at least 1");
  KVC_HOST_DEVICE static constexpr int rank(int, int) noexcept { return R; }
};

/// How power iteration starts (SPEC §1.3 step 4).
enum class LowRankInit {
  kRandom,  ///< B uniform in [-1, 1), fp32, from a seed fixed per (stream, block, side) [default: reproducible]
  kWarm,    ///< the previous block's B of the same stream and side (random for the first block)
};

/// \tparam KRank, VRank rank rules for keys and values (Rho<bp> or Rank<r>; SPEC G9: separate ranks)
/// \tparam Iters        power iterations L_it (>= 1; SPEC G3 default 3)
/// \tparam Init         LowRankInit::kRandom [default] or kWarm
/// \tparam EveryQR      orthonormalize B and A at every iteration [default: true; the same subspace in
///                      exact arithmetic, and it keeps the columns apart in fp32] or only at the last
///                      (false: Algorithm 2 literally)
template <class KRank = Rho<200>, class VRank = KRank, int Iters = 3, LowRankInit Init = LowRankInit::kRandom,
          bool EveryQR = true>
struct LowRankResidual {
  static_assert(Iters >= 1, "kvc::LowRankResidual: at least one power iteration (Iters >= 1)");
  static_assert(sizeof(KRank) > 0 && sizeof(VRank) > 0);  // instantiates the rank rules' own checks
  using policy_kind = kind::residual;
  static constexpr int kIters = Iters;
  static constexpr LowRankInit kInit = Init;
  static constexpr bool kEveryQR = EveryQR;
  static constexpr const char* name() noexcept { return "low-rank"; }

  /// Rank of a side's residual for blocks of n tokens and head dimension d. Host+device.
  KVC_HOST_DEVICE static constexpr int rank(bool keys, int n, int d) noexcept {
    return keys ? KRank::rank(n, d) : VRank::rank(n, d);
  }
  /// Bytes of the factors of one block (a multiple of 2).
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int r, int n, int d) noexcept {
    return std::size_t(r) * (n + d) * sizeof(half_t);
  }
  KVC_HOST_DEVICE static const half_t* a_t(const std::byte* region) noexcept {
    return reinterpret_cast<const half_t*>(region);
  }
  KVC_HOST_DEVICE static const half_t* b_t(const std::byte* region, int r, int n) noexcept {
    return a_t(region) + std::size_t(r) * n;
  }
  /// Score epilogue: sc[h * ld + t] += sum_j A[t][j] (B[:, j] . q_h), h < g. `work`: the factors
  /// (A^T then B^T) widened to float.
  KVC_HOST_DEVICE static void add_scores(const float* work, int r, int n, int d, const float* q, int g, float* sc,
                                         int ld) noexcept {
    const float* at = work;
    const float* bt = work + std::size_t(r) * n;
    for (int h = 0; h < g; ++h) {
      const float* qh = q + std::size_t(h) * d;
      float* sh = sc + std::size_t(h) * ld;
      for (int j = 0; j < r; ++j) {
        const float u = detail::dot8(bt + std::size_t(j) * d, qh, d);
        const float* aj = at + std::size_t(j) * n;
        for (int t = 0; t < n; ++t) sh[t] += aj[t] * u;
      }
    }
  }
  /// Output epilogue: acc[h * d + c] += sum_j B[c][j] (A[:, j] . p_h), h < g. `work` as above.
  KVC_HOST_DEVICE static void add_output(const float* work, int r, int n, int d, const float* p, int g, int ld,
                                         float* acc) noexcept {
    const float* at = work;
    const float* bt = work + std::size_t(r) * n;
    for (int h = 0; h < g; ++h) {
      const float* ph = p + std::size_t(h) * ld;
      float* oh = acc + std::size_t(h) * d;
      for (int j = 0; j < r; ++j) {
        const float w = detail::dot8(at + std::size_t(j) * n, ph, n);
        const float* bj = bt + std::size_t(j) * d;
        for (int c = 0; c < d; ++c) oh[c] += bj[c] * w;
      }
    }
  }
  /// x[t * ldx + c] += (A B^T)[t][c] (x: the block's [n][d] reconstruction, row stride ldx >= d).
  /// Cooperative form: (lane, lanes) updates elements t * d + c = lane, lane + lanes, ... Host+device.
  KVC_HOST_DEVICE static void add_to(const std::byte* region, int r, int n, int d, float* x, int ldx, int lane = 0,
                                     int lanes = 1) noexcept {
    const half_t* at = a_t(region);
    const half_t* bt = b_t(region, r, n);
    for (int i = lane; i < n * d; i += lanes) {
      const int t = i / d, c = i - t * d;
      float s = 0.0f;
      for (int j = 0; j < r; ++j)  // rounded products: the device reconstruction equals the host's
        s = mul_add_rounded(at[std::size_t(j) * n + t].to_float(), bt[std::size_t(j) * d + c].to_float(), s);
      x[std::size_t(t) * ldx + c] += s;
    }
  }
};
}  // namespace kvc
