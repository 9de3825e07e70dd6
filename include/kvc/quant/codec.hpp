// kvc: nvcc-safe
/// \file codec.hpp
/// The two scalar uniform quantizers of SPEC §0.2, kept as distinct types because they differ in
/// error by up to ~2x at low bits:
///  - EndpointCodec (Q-A, GEAR/KIVI/LogQuant): 2^b levels, both endpoints representable,
///    step = (hi-lo)/(2^b-1), x^ = lo + q*step, |x - x^| <= step/2.
///  - MidpointCodec (Q-B, QAQ): 2^b equal bins, w = (hi-lo)/2^b, x^ = lo + (q+0.5)*w,
///    |x - x^| <= w/2, and q >> (B-B') is exactly the B'-bit code (nesting).
/// Metadata is fp16 (lo, step) [default, as KIVI]: lo is rounded toward -inf and step toward +inf
/// so the stored grid still covers [lo, hi] and the bounds above hold against the stored step.
/// A zero-range group (hi == lo exactly representable) stores step 0 and reconstructs exactly.
/// Both decode to the affine form x^ = zero + scale*q that fused kernels fold into dot products.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/numeric.hpp>

#include <cmath>
#include <cstdint>

namespace kvc {

/// Per-group metadata of both codecs (4 bytes, trivially copyable: goes into kernel Params).
struct QuantMeta {
  half_t lo;
  half_t step;
};

/// x^ = zero + scale * code.
struct Affine {
  float zero;
  float scale;
};

/// Q-A: endpoint asymmetric uniform quantizer (round to nearest, ties to even).
struct EndpointCodec {
  static constexpr const char* kName = "endpoint";
  /// x^ = lo + (code + kZeroOffset) * step.
  static constexpr float kZeroOffset = 0.0f;
  KVC_HOST_DEVICE static QuantMeta make_meta(float lo, float hi, int bits) noexcept {
    const half_t lo16 = half_round_down(lo);
    const float range = hi - lo16.to_float();
    return {lo16, range > 0.0f ? half_round_up_nonneg(div_rounded(range, static_cast<float>((1 << bits) - 1))) : half_t{0}};
  }
  KVC_HOST_DEVICE static std::uint8_t encode(float x, QuantMeta m, float inv_step, int bits) noexcept {
    const float q = std::rint((x - m.lo.to_float()) * inv_step);
    const float top = static_cast<float>((1 << bits) - 1);
    return static_cast<std::uint8_t>(q < 0.0f ? 0.0f : (q > top ? top : q));
  }
  KVC_HOST_DEVICE static Affine affine(QuantMeta m) noexcept {
    const float w = m.step.to_float();
    return {m.lo.to_float() + kZeroOffset * w, w};
  }
  /// Largest |x - x^| for an x inside the group's range.
  KVC_HOST_DEVICE static float max_error(QuantMeta m) noexcept { return 0.5f * m.step.to_float(); }
};

/// Q-B: midpoint (bin-centre) quantizer of QAQ.
struct MidpointCodec {
  static constexpr const char* kName = "midpoint";
  static constexpr float kZeroOffset = 0.5f;
  KVC_HOST_DEVICE static QuantMeta make_meta(float lo, float hi, int bits) noexcept {
    const half_t lo16 = half_round_down(lo);
    const float range = hi - lo16.to_float();
    return {lo16, range > 0.0f ? half_round_up_nonneg(div_rounded(range, static_cast<float>(1 << bits))) : half_t{0}};
  }
  KVC_HOST_DEVICE static std::uint8_t encode(float x, QuantMeta m, float inv_step, int bits) noexcept {
    const float q = std::floor((x - m.lo.to_float()) * inv_step);
    const float top = static_cast<float>((1 << bits) - 1);
    return static_cast<std::uint8_t>(q < 0.0f ? 0.0f : (q > top ? top : q));
  }
  /// Zero-range groups (step 0) reconstruct lo exactly: zero = lo + 0.5*0.
  KVC_HOST_DEVICE static Affine affine(QuantMeta m) noexcept {
    const float w = m.step.to_float();
    return {m.lo.to_float() + kZeroOffset * w, w};
  }
  KVC_HOST_DEVICE static float max_error(QuantMeta m) noexcept { return 0.5f * m.step.to_float(); }
};

template <class C>
concept Codec = requires(float x, QuantMeta m, int b) {
  { C::make_meta(x, x, b) } -> std::same_as<QuantMeta>;
  { C::encode(x, m, x, b) } -> std::same_as<std::uint8_t>;
  { C::affine(m) } -> std::same_as<Affine>;
  { C::kZeroOffset } -> std::convertible_to<float>;
};

/// The reciprocal of m's step that encode() multiplies by (0 for a zero-range group): re-encoding values
/// against stored metadata with it gives exactly the codes quantize_group gave. Host+device.
KVC_HOST_DEVICE float inverse_step(QuantMeta m) noexcept {
  const float step = m.step.to_float();
  return step > 0.0f ? div_rounded(1.0f, step) : 0.0f;
}

/// quantize_group with the statistics (lo, hi) taken over the elements where `keep(r, c)` holds
/// (GEAR: the inliers); every element is still encoded (the others clamp to the range). A group
/// with no kept element gets lo = hi = 0. Host+device.
KVC_HD_CALLABLE_TEMPLATE
template <Codec C, class At, class Put, class Keep>
KVC_HOST_DEVICE QuantMeta quantize_group_masked(int rows, int cols, int bits, At&& at, Put&& put, Keep&& keep) noexcept {
  bool any = false;
  float lo = 0.0f, hi = 0.0f;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      if (!keep(r, c)) continue;
      const float x = at(r, c);
      lo = !any || x < lo ? x : lo;
      hi = !any || x > hi ? x : hi;
      any = true;
    }
  const QuantMeta m = C::make_meta(lo, hi, bits);
  const float inv = inverse_step(m);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) put(r, c, C::encode(at(r, c), m, inv, bits));
  return m;
}

/// Quantizes one group of rows x cols values given by an accessor `at(r, c)`: writes codes through
/// `put(r, c, code)` and returns the group's metadata. Host+device.
KVC_HD_CALLABLE_TEMPLATE
template <Codec C, class At, class Put>
KVC_HOST_DEVICE QuantMeta quantize_group(int rows, int cols, int bits, At&& at, Put&& put) noexcept {
  return quantize_group_masked<C>(rows, cols, bits, at, put, [](int, int) { return true; });
}
}  // namespace kvc
