// kvc: nvcc-safe
/// \file meta_format.hpp
/// How a QAQ record stores its per-token metadata (lo, step_max): QaqQuantizer's `Meta` parameter.
///  - `Fp16Meta` [default, SPEC §2.3]: lo and step_max as two fp16 (4 bytes): the midpoint codec's range
///    [lo, hi] of the non-outliers exactly as MidpointCodec::make_meta rounds it.
///  - `LogMeta` [our option, SPEC §2.6 leaves the metadata open]: 2 bytes. At head dim 64 the fp16 pair is
///    0.5 bits/element per side, the largest fixed cost of a QAQ token; this halves it. Byte 0: e, step_max on
///    a log grid of 8 steps per binade, 2^-14 .. 2^15.875 (e in [1, 240], the grid's values rounded up to fp16;
///    e = 0: step 0, an all-zero token). Byte 1: n, lo = -n step_max (rounded down to fp16). The range is
///    widened to contain 0 (lo <= 0 <= hi), so n <= 2^B_max - 1 fits the byte.
///    Cost against Fp16Meta: step_max up to 2^(1/8) (9 %) larger, on average ~4.5 %, with (2^B_max - 1.5) for
///    2^B_max levels below (0.6 % at B_max = 8); tokens whose values do not straddle 0 lose more (their range
///    grows to include 0): rare for Hadamard-rotated sides (the rotation spreads a token's mean over all
///    channels), common for unrotated keys with per-channel biases. Steps below 2^-14 (ranges under ~0.016)
///    are raised to 2^-14: absolute error <= 2^-15 at B_max. The grid's largest step covers every range of fp16
///    values for B_max >= 2 (2.5 x 60128 > 2 x 65504); at B_max = 1 ranges above ~30,000 clamp.
/// Both keep the nesting contract of QaqQuantizer (the width-b code is the B_max code shifted) and the bound
/// |x - x^| <= step_b / 2 for every non-outlier (LogMeta: of values with |x| <= 65504 - step_max). load(store(m))
/// == m for every m that codec::make_meta returns (tested for all of LogMeta's codes). Host+device.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/quant/codec.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kvc::qaq {

/// (lo, step_max) as two fp16 values: 4 bytes [default].
struct Fp16Meta {
  static constexpr const char* kName = "fp16";
  static constexpr int kBytes = 4;
  using codec = MidpointCodec;
  KVC_HOST_DEVICE static void store(std::byte* r, QuantMeta m) noexcept {
    auto* h = reinterpret_cast<half_t*>(r);
    h[0] = m.lo;
    h[1] = m.step;
  }
  KVC_HOST_DEVICE static QuantMeta load(const std::byte* r) noexcept {
    const auto* h = reinterpret_cast<const half_t*>(r);
    return {h[0], h[1]};
  }
  /// load(r) as floats, each half converted by cvt (the kernels pass their vector-unit conversion).
  template <class Cvt>
  KVC_HOST_DEVICE static void load_floats(const std::byte* r, Cvt&& cvt, float& lo, float& step) noexcept {
    const QuantMeta m = load(r);
    lo = cvt(m.lo);
    step = cvt(m.step);
  }
};

/// (lo, step_max) in 2 bytes: a log-grid step code and lo as a multiple of the step (file comment).
struct LogMeta {
  static constexpr const char* kName = "log8";
  static constexpr int kBytes = 2;
  static constexpr int kPerBinade = 8;
  static constexpr int kMaxCode = 30 * kPerBinade;  ///< e = kMaxCode: 2^15.875 (fp16 exponent field 30)

  /// step_max of code e (0: step 0; [1, kMaxCode]: 2^(-14 + (e - 1) / 8) rounded up to fp16; larger e: as
  /// kMaxCode). Integer arithmetic on the fp16 bits: the same value on the host and the device.
  KVC_HOST_DEVICE static half_t step_of(int e) noexcept {
    if (e <= 0) return half_t{0};
    if (e > kMaxCode) e = kMaxCode;
    const int i = e - 1;
    return half_t{static_cast<std::uint16_t>(((i / kPerBinade + 1) << 10) | mantissa(i % kPerBinade))};
  }
  /// The fp16 mantissa field of 2^(j / 8), rounded up: ceil((2^(j/8) - 1) * 1024).
  KVC_HOST_DEVICE static constexpr std::uint16_t mantissa(int j) noexcept {
    constexpr std::uint16_t m[kPerBinade] = {0, 93, 194, 304, 425, 556, 699, 855};
    return m[j];
  }
  /// step_of(e) as a float, by bit operations (e in [1, kMaxCode]: normal fp16 values). Equal to
  /// step_of(e).to_float(), which on the host keeps its inf and subnormal branches in the kernels' per-record path.
  KVC_HOST_DEVICE static float step_float(int e) noexcept {
    const int i = (e > kMaxCode ? kMaxCode : e) - 1;
    return kvc::detail::bits_float(std::uint32_t(i / kPerBinade + 1 + 112) << 23 | std::uint32_t(mantissa(i % kPerBinade)) << 13);
  }
  /// -n step rounded toward -inf to fp16, as a float, by bit operations: n step is exact in float and, for n >= 1,
  /// >= 2^-14 (a normal fp16), so rounding its magnitude up to 11 significant bits is fp16's rounding (a carry
  /// into the exponent is right); make_meta keeps it <= 65504, which rounds to itself. n = 0 gives -0.
  KVC_HOST_DEVICE static float lo_float(float step, int n) noexcept {
    std::uint32_t b = kvc::detail::float_bits(float(n) * step);
    if (b & 0x1FFFu) b = (b | 0x1FFFu) + 1u;
    return -kvc::detail::bits_float(b);
  }
  /// lo of step code e and offset n: lo_float as fp16 (exactly representable, so the conversion does not round).
  KVC_HOST_DEVICE static half_t lo_of(half_t step, int n) noexcept { return half_t::from_float(lo_float(step.to_float(), n)); }

  /// The midpoint codec with this grid's metadata: encode / affine as MidpointCodec, make_meta on the grid.
  struct codec : MidpointCodec {
    static constexpr const char* kName = "midpoint-log8";
    /// The smallest grid step with 2^bits levels over [min(lo, 0), max(hi, 0)] and lo a multiple of it:
    /// step >= range / (2^bits - 1.5), n = ceil(-lo / step) <= 2^bits - 1; the half margin absorbs lo's
    /// rounding to fp16 (< step / 4), so lo16 + 2^bits step >= hi.
    KVC_HOST_DEVICE static QuantMeta make_meta(float lo, float hi, int bits) noexcept {
      const double l = lo < 0.0f ? double(lo) : 0.0;
      const double range = (hi > 0.0f ? double(hi) : 0.0) - l;
      if (!(range > 0.0)) return {half_t{0}, half_t{0}};  // all zero: step 0, lo 0, exact
      const double s = range / (double(1 << bits) - 1.5);
      int a = 1, b = kMaxCode;  // smallest e in [1, kMaxCode] with step_of(e) >= s (kMaxCode if none)
      while (a < b) {
        const int mid = (a + b) / 2;
        if (double(step_of(mid).to_float()) >= s) b = mid;
        else a = mid + 1;
      }
      const half_t step = step_of(a);
      const double q = std::ceil(-l / double(step.to_float()));
      const double cap = double((1 << bits) - 1);
      const double nmax = std::floor(double(half_t::kMax) / double(step.to_float()));  // lo stays finite
      const int n = int(std::fmin(q, std::fmin(cap, nmax)));
      return {lo_of(step, n), step};
    }
  };

  KVC_HOST_DEVICE static void store(std::byte* r, QuantMeta m) noexcept {
    int e = 0, n = 0;
    if (m.step.bits != 0) {
      const int exp = m.step.bits >> 10, man = m.step.bits & 1023;
      int j = 0;
      while (j + 1 < kPerBinade && mantissa(j) != man) ++j;
      e = (exp - 1) * kPerBinade + j + 1;
      n = int(std::rint(-m.lo.to_float() / m.step.to_float()));  // lo is within step / 4 of -n step
    }
    r[0] = std::byte(static_cast<std::uint8_t>(e));
    r[1] = std::byte(static_cast<std::uint8_t>(n));
  }
  KVC_HOST_DEVICE static QuantMeta load(const std::byte* r) noexcept {
    const int e = int(static_cast<std::uint8_t>(r[0]));
    if (e == 0) return {half_t{0}, half_t{0}};
    const half_t step = step_of(e);
    return {lo_of(step, int(static_cast<std::uint8_t>(r[1]))), step};
  }
  /// load(r) as floats, by bit operations (cvt unused): the kernels' per-record path.
  template <class Cvt>
  KVC_HOST_DEVICE static void load_floats(const std::byte* r, Cvt&&, float& lo, float& step) noexcept {
    const int e = int(static_cast<std::uint8_t>(r[0]));
    if (e == 0) {  // an all-zero token
      lo = step = 0.0f;
      return;
    }
    step = step_float(e);
    lo = lo_float(step, int(static_cast<std::uint8_t>(r[1])));
  }
};
}  // namespace kvc::qaq
