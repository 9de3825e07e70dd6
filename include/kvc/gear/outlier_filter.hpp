// kvc: nvcc-safe
/// \file outlier_filter.hpp
/// GEAR's sparse outlier filter (SPEC §1.3 step 1, §0.4, G5, G7): the signed top s/2 and bottom s/2
/// of a block's entries stay exact; the backbone quantizer's statistics are taken over the inliers.
///
/// Scope (OutlierScope):
///  - kBlock [default]: the top/bottom s/2 of each block (BlockTokens x head_dim) of one KV head.
///    Storage per block and side, in the block's correction region, 4 bytes per outlier (SPEC G7:
///    blocked 16-bit local indices): [uint16 index x n][fp16 value x n], index = t * head_dim + c,
///    ascending, n = 2 * per_side(B * d).
///  - kStream (paper mode, SPEC §1.3 step 1 over the whole history): the top/bottom s/2 of all
///    compressed tokens of one KV head, selected again at every recompression; needs kvc::LiteralMode
///    (block mode never revisits a block). A block may hold any share of them, so they live in a
///    per-stream side table (cache_layout.hpp): the same 4-byte entries, ascending, plus one uint32
///    start offset per block; the kernels call the same epilogues on each block's slice.
/// The stored value is the correction x - D^(t, c) (the exact entry minus what the backbone's code
/// at that position decodes to), so backbone + outliers reproduce x to fp16 rounding there and the
/// backbone needs no mask in the attention kernels (SPEC G5 "masked" convention).
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kvc {

/// Over which entries the outliers are chosen (see the file comment).
enum class OutlierScope { kBlock, kStream };

/// \tparam BasisPoints      the outlier fraction s of keys in 1/10000 (200 = 2 %, GEAR's default), split
///                         s/2 to the largest and s/2 to the smallest signed entries: per_side =
///                         floor(N * s / 2) of the N entries in scope.
/// \tparam Scope            OutlierScope::kBlock [default] or kStream (paper mode, with kvc::LiteralMode)
/// \tparam ValueBasisPoints the fraction for values [default: the same]; either fraction may be 0
///                         (that side keeps no outliers), not both (SPEC G9: K and V parameterised apart).
template <int BasisPoints = 200, OutlierScope Scope = OutlierScope::kBlock, int ValueBasisPoints = BasisPoints>
struct OutlierFilter {
  static_assert((BasisPoints > 0 || ValueBasisPoints > 0) && BasisPoints >= 0 && BasisPoints < 10000 &&
                    ValueBasisPoints >= 0 && ValueBasisPoints < 10000,
                "kvc::OutlierFilter<BasisPoints>: the outlier fraction s = BasisPoints / 10000 must lie in (0, 1) "
                "(one of the key and value fractions may be 0)");
  using policy_kind = kind::outlier_filter;
  static constexpr int kBasisPoints = BasisPoints;
  static constexpr int kValueBasisPoints = ValueBasisPoints;
  static constexpr OutlierScope kScope = Scope;
  static constexpr bool kStreamScope = Scope == OutlierScope::kStream;
  static constexpr const char* name() noexcept { return "outliers"; }

  /// Whether keys (values) keep outliers at all.
  KVC_HOST_DEVICE static constexpr bool on(bool keys) noexcept { return (keys ? BasisPoints : ValueBasisPoints) > 0; }
  /// Outliers kept on each side (largest / smallest) of `elements` entries in scope. Host+device.
  KVC_HOST_DEVICE static constexpr int per_side(long long elements, bool keys = true) noexcept {
    return static_cast<int>(elements * (keys ? BasisPoints : ValueBasisPoints) / 20000);
  }
  /// Outliers stored (both sides) for `tokens` x d entries in scope.
  KVC_HOST_DEVICE static constexpr int count(int tokens, int d, bool keys = true) noexcept {
    return 2 * per_side(static_cast<long long>(tokens) * d, keys);
  }
  /// Bytes of `count(tokens, d, keys)` entries (a multiple of 4).
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int tokens, int d, bool keys = true) noexcept {
    return std::size_t(count(tokens, d, keys)) * (sizeof(std::uint16_t) + sizeof(half_t));
  }
  KVC_HOST_DEVICE static const std::uint16_t* indices(const std::byte* region) noexcept {
    return reinterpret_cast<const std::uint16_t*>(region);
  }
  KVC_HOST_DEVICE static const half_t* values(const std::byte* region, int n) noexcept {
    return reinterpret_cast<const half_t*>(region + std::size_t(n) * sizeof(std::uint16_t));
  }

  /// Token t of in-block index i = t * d + c without an integer division (a float product with the
  /// rounded 1/d: its error, < 2^-22 * t, stays far below the 0.5 / d margin for every i < 65536 and
  /// d a multiple of 16; checked exhaustively in test_gear.cpp).
  KVC_HOST_DEVICE static int token_of(int i, float inv_d) noexcept {
    return static_cast<int>((static_cast<float>(i) + 0.5f) * inv_d);
  }
  /// Score epilogue: sc[h * ld + t] += val[o] * q[h * d + c] for every outlier o at (t, c), h < g.
  /// `val`: the n values widened to float (the caller's conversion, see BlockCorrection).
  KVC_HOST_DEVICE static void add_scores(const std::uint16_t* idx, const float* val, int n, int d, const float* q,
                                         int g, float* sc, int ld) noexcept {
    const float inv_d = 1.0f / static_cast<float>(d);
    for (int o = 0; o < n; ++o) {
      const int t = token_of(idx[o], inv_d), c = idx[o] - t * d;
      for (int h = 0; h < g; ++h) sc[h * ld + t] += val[o] * q[h * d + c];
    }
  }
  /// Output epilogue: acc[h * d + c] += val[o] * p[h * ld + t] for every outlier o at (t, c), h < g.
  KVC_HOST_DEVICE static void add_output(const std::uint16_t* idx, const float* val, int n, int d, const float* p,
                                         int g, int ld, float* acc) noexcept {
    const float inv_d = 1.0f / static_cast<float>(d);
    for (int o = 0; o < n; ++o) {
      const int t = token_of(idx[o], inv_d), c = idx[o] - t * d;
      for (int h = 0; h < g; ++h) acc[h * d + c] += val[o] * p[h * ld + t];
    }
  }
  /// x[t * ldx + c] += value for every outlier at (t, c) (x: the block's [B][d] reconstruction with row
  /// stride ldx >= d). Cooperative form: (lane, lanes) adds outliers lane, lane + lanes, ...; the
  /// indices are distinct, so concurrent lanes never write the same element. Host+device.
  KVC_HOST_DEVICE static void add_to(const std::byte* region, int n, int d, float* x, int ldx, int lane = 0,
                                     int lanes = 1) noexcept {
    add_slice_to(indices(region), values(region, n), n, d, x, ldx, lane, lanes);
  }
  /// The same for entries given as (idx, val) arrays (a block's slice of a stream-scope table).
  KVC_HOST_DEVICE static void add_slice_to(const std::uint16_t* idx, const half_t* val, int n, int d, float* x,
                                           int ldx, int lane = 0, int lanes = 1) noexcept {
    const float inv_d = 1.0f / static_cast<float>(d);
    for (int o = lane; o < n; o += lanes) {
      const int t = token_of(idx[o], inv_d), c = idx[o] - t * d;
      x[t * ldx + c] += val[o].to_float();
    }
  }
};

/// Indices of the `per_side` largest and `per_side` smallest signed entries of x[0..n), ascending.
/// Ties are broken by index (the lower index counts as the more extreme), so the selection is a pure
/// function of x. O(n): two std::nth_element passes, no sort of x. Requires 2 * per_side <= n.
inline std::vector<std::uint32_t> select_outliers(const float* x, std::size_t n, std::size_t per_side) {
  if (per_side == 0) return {};
  std::vector<std::uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  auto greater = [x](std::uint32_t a, std::uint32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  auto less = [x](std::uint32_t a, std::uint32_t b) { return x[a] < x[b] || (x[a] == x[b] && a < b); };
  // order[0, k) = the k largest; then order[k, 2k) = the k smallest of the rest.
  std::nth_element(order.begin(), order.begin() + std::ptrdiff_t(per_side) - 1, order.end(), greater);
  std::nth_element(order.begin() + std::ptrdiff_t(per_side), order.begin() + std::ptrdiff_t(2 * per_side) - 1,
                   order.end(), less);
  order.resize(2 * per_side);
  std::sort(order.begin(), order.end());
  return order;
}
}  // namespace kvc
