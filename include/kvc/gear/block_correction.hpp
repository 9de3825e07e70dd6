// kvc: nvcc-safe
/// \file block_correction.hpp
/// GEAR's two corrections of a quantized block, as one per-block region after the backbone's codes
/// and metadata (cache_layout.hpp): X~ = D^ + S + A B^T (SPEC §1.3 step 5). The attention kernels call
/// the epilogues below (host+device) right after a block's scores and right before its values, so
/// decode_attention.hpp and the CUDA kernels have no GEAR-specific code:
///   add_scores: sc[h][t] += S_t . q_h + A_t (B^T q_h)       (keys)
///   add_output: acc[h]   += S^T p_h + B (A^T p_h)           (values)
/// Region layout: [outliers (gear/outlier_filter.hpp)][factors (gear/low_rank_residual.hpp)].
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/gear/low_rank_residual.hpp>
#include <kvc/gear/outlier_filter.hpp>
#include <kvc/gear/power_iteration.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvc {

/// A block without corrections.
struct NoCorrection {
  static constexpr bool kActive = false;
  static constexpr bool kOutliers = false;
  static constexpr bool kLowRank = false;
  KVC_HOST_DEVICE static constexpr int outliers(int, int) noexcept { return 0; }
  KVC_HOST_DEVICE static constexpr int rank(int, int) noexcept { return 0; }
  KVC_HOST_DEVICE static constexpr int half_count(int, int) noexcept { return 0; }
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int, int) noexcept { return 0; }
  KVC_HOST_DEVICE static constexpr std::size_t work_floats(int, int) noexcept { return 0; }
};

/// Outliers `O` (OutlierFilter or void) and a low-rank residual `L` (LowRankResidual or void) of one
/// side (`Keys`) of blocks of n tokens.
template <class O, class L, bool Keys>
struct BlockCorrection {
  static_assert(!std::is_void_v<O> || !std::is_void_v<L>, "kvc: a BlockCorrection needs outliers or a residual");
  using outlier_filter = O;
  using residual = L;
  static constexpr bool kActive = true;
  static constexpr bool kOutliers = [] {
    if constexpr (std::is_void_v<O>) return false;
    else return O::on(Keys);
  }();
  static constexpr bool kLowRank = !std::is_void_v<L>;
  static_assert(kOutliers || kLowRank, "kvc: a BlockCorrection needs outliers or a residual on its side");

  KVC_HOST_DEVICE static constexpr int outliers(int n, int d) noexcept {
    if constexpr (kOutliers) return O::count(n, d, Keys);
    else return 0;
  }
  KVC_HOST_DEVICE static constexpr int rank(int n, int d) noexcept {
    if constexpr (kLowRank) return L::rank(Keys, n, d);
    else return 0;
  }
  KVC_HOST_DEVICE static constexpr std::size_t outlier_bytes(int n, int d) noexcept {
    if constexpr (kOutliers) return O::bytes(n, d, Keys);
    else return 0;
  }
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int n, int d) noexcept {
    if constexpr (kLowRank) return outlier_bytes(n, d) + L::bytes(rank(n, d), n, d);
    else return outlier_bytes(n, d);
  }
  /// The region's fp16 payload, contiguous: the outlier values, then the factors A^T, B^T. Callers
  /// widen it to float once per block with their fastest conversion (the CPU kernel: F16C/AVX-512
  /// loads; widen() is the generic one) and pass it to the epilogues as `work`.
  KVC_HOST_DEVICE static const half_t* halves(const std::byte* region, int n, int d) noexcept {
    return reinterpret_cast<const half_t*>(region + std::size_t(outliers(n, d)) * sizeof(std::uint16_t));
  }
  KVC_HOST_DEVICE static constexpr int half_count(int n, int d) noexcept {
    return outliers(n, d) + rank(n, d) * (n + d);
  }
  /// Floats of `work` the epilogues read.
  KVC_HOST_DEVICE static constexpr std::size_t work_floats(int n, int d) noexcept { return std::size_t(half_count(n, d)); }
  KVC_HOST_DEVICE static void widen(const std::byte* region, int n, int d, float* work) noexcept {
    const half_t* h = halves(region, n, d);
    for (int i = 0, e = half_count(n, d); i < e; ++i) work[i] = h[i].to_float();
  }

  /// sc[h * ld + t] += corrections of key t . q_h for the block's n tokens, h < g; q: [g][d];
  /// work: the widened payload (widen()).
  KVC_HOST_DEVICE static void add_scores(const std::byte* region, const float* work, int n, int d, const float* q,
                                         int g, float* sc, int ld) noexcept {
    const int no = outliers(n, d);
    if constexpr (kOutliers) O::add_scores(O::indices(region), work, no, d, q, g, sc, ld);
    if constexpr (kLowRank) L::add_scores(work + no, rank(n, d), n, d, q, g, sc, ld);
  }
  /// acc[h * d + c] += sum_t p[h * ld + t] * (correction of value t)[c], h < g; work as above.
  KVC_HOST_DEVICE static void add_output(const std::byte* region, const float* work, int n, int d, const float* p,
                                         int g, int ld, float* acc) noexcept {
    const int no = outliers(n, d);
    if constexpr (kOutliers) O::add_output(O::indices(region), work, no, d, p, g, ld, acc);
    if constexpr (kLowRank) L::add_output(work + no, rank(n, d), n, d, p, g, ld, acc);
  }
  /// x[t * ldx + c] += the correction of (t, c), for the block's [n][d] reconstruction (row stride
  /// ldx >= d). Cooperative form: `lanes` callers with lanes 0..lanes-1 (separated by a barrier from
  /// whatever reads x) add every correction once and never write one element concurrently, the outliers'
  /// pass before the residual's (an outlier and a residual term may hit one element). Host+device.
  KVC_HOST_DEVICE static void add_to(const std::byte* region, int n, int d, float* x) noexcept {
    add_outliers_to(region, n, d, x, d, 0, 1);
    add_residual_to(region, n, d, x, d, 0, 1);
  }
  KVC_HOST_DEVICE static void add_outliers_to(const std::byte* region, int n, int d, float* x, int ldx, int lane,
                                              int lanes) noexcept {
    if constexpr (kOutliers) O::add_to(region, outliers(n, d), d, x, ldx, lane, lanes);
  }
  KVC_HOST_DEVICE static void add_residual_to(const std::byte* region, int n, int d, float* x, int ldx, int lane,
                                              int lanes) noexcept {
    if constexpr (kLowRank) L::add_to(region + outlier_bytes(n, d), rank(n, d), n, d, x, ldx, lane, lanes);
  }

  /// Host: writes the region from the exact block x and the backbone's reconstruction xhat (both
  /// [n][d] row-major), given the outlier positions (ascending, from select_outliers, whose entries
  /// the backbone's statistics excluded). Outliers store fp16(x - xhat); the low-rank factors fit the
  /// residual x - xhat - S (0 at outliers up to the fp16 rounding of their values).
  /// `basis`: d x r floats, the warm-start basis (read if `warm`, updated either way) or nullptr.
  template <class Linalg>
  static void fit(const float* x, const float* xhat, const std::uint32_t* out_idx, int n, int d, std::byte* region,
                  Linalg& la, float* basis, bool warm, std::uint64_t seed) {
    std::vector<float> res(std::size_t(n) * d);
    for (std::size_t i = 0; i < res.size(); ++i) res[i] = x[i] - xhat[i];
    if constexpr (kOutliers) {
      const int no = outliers(n, d);
      auto* idx = reinterpret_cast<std::uint16_t*>(region);
      auto* val = reinterpret_cast<half_t*>(region + std::size_t(no) * sizeof(std::uint16_t));
      for (int o = 0; o < no; ++o) {
        const std::uint32_t i = out_idx[o];
        idx[o] = static_cast<std::uint16_t>(i);
        val[o] = half_t::from_float(res[i]);
        res[i] -= val[o].to_float();
      }
    }
    if constexpr (kLowRank) {
      const int r = rank(n, d);
      std::vector<float> rc(std::size_t(n) * d), a(std::size_t(n) * r), b_local;
      for (int t = 0; t < n; ++t)  // column-major n x d
        for (int c = 0; c < d; ++c) rc[std::size_t(c) * n + t] = res[std::size_t(t) * d + c];
      float* b = basis;
      if (b == nullptr) {
        b_local.resize(std::size_t(d) * r);
        b = b_local.data();
      }
      power_iteration(la, rc.data(), n, d, n, r, L::kIters, L::kEveryQR, a.data(), b, warm, seed);
      // Column-major A (n x r) is A^T row-major (r x n); likewise B: the stored order directly.
      auto* f = reinterpret_cast<half_t*>(region + outlier_bytes(n, d));
      for (std::size_t i = 0; i < a.size(); ++i) f[i] = half_t::from_float(a[i]);
      for (std::size_t i = 0; i < std::size_t(d) * r; ++i) f[a.size() + i] = half_t::from_float(b[i]);
    }
  }
};
}  // namespace kvc
