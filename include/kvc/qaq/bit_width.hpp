// kvc: nvcc-safe
/// \file bit_width.hpp
/// QAQ's bit-width rule (SPEC §2.3, §2.4, §2.6): the fewest bits per token that keep a statistical error
/// bound below a user target, separately for keys and values.
///
/// Paper formulas (`PaperBounds`, the default; SPEC Q3's reference-code variant is not provided: its key
/// bound needs the whole attention row per token, max_j |(diag(a) - a a^T)_tj|):
///   keys:   sigma_K^2   <= log(T^3 / (T - 1) * sigma_S^2 + 1) / ||Q||^2       (one bound per stream and step)
///   values: sigma_V,t   <= sigma_X / (sqrt(T) * S^_t)                         (S^_t: max of the last n probabilities)
///   bits:   B_t = ceil(log2(range_t / (2 sqrt(3) sigma))), clamped to [B_min, B_max]
/// with ||Q||^2 the calibrated 90th percentile of the scaled query's squared norm (SPEC Q5: per layer and KV
/// head, q / sqrt(d_h); Q6: the largest over the query heads of a GQA group).
/// ceil(log2(x)) is evaluated as the smallest b with x <= 2^b (no log, no rounding at powers of two).
/// Guards (SPEC §2.6): T <= 1 -> B_max (the key bound divides by T - 1); S^_t == 0, range 0, or ||Q||^2 == 0
/// (an infinite sigma) -> B_min; a NaN ratio -> B_max. Tokens with fewer than n observations stay at B_max
/// (the caller's ring decides: AttentionHistory).
/// Host+device; double precision (T^3 at T = 2^20 is 2^60).
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/numeric.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)  // host x86-64: 8 compares as one vector compare
#  include <emmintrin.h>
#  define KVC_QAQ_SSE2_ 1
#else
#  define KVC_QAQ_SSE2_ 0
#endif

#if KVC_QAQ_SSE2_
namespace kvc::detail {
/// The number of all-ones lanes of a compare result of 8 16-bit lanes whose all-ones lanes come first (a
/// monotone compare: thresholds or limits in increasing order): the lowest clear bit of the byte mask. One
/// bit scan, valid on every x86-64 (not popcnt, which is not in its baseline; an inline function whose body
/// depended on -mpopcnt could be merged across translation units built with different flags).
inline int leading_ones_lanes16(__m128i m) noexcept {
  return std::countr_zero(~unsigned(_mm_movemask_epi8(m))) >> 1;
}
}  // namespace kvc::detail
#endif

namespace kvc::qaq {

/// The two error targets of SPEC Q1 (the paper reports none; sweep them, or calibrate them to an average
/// width with calibrate_target).
struct Targets {
  double key_sigma_s = 0.0;    ///< sigma_max^(S): std of each attention probability due to key quantization
  double value_sigma_x = 0.0;  ///< sigma_max^(X): std of each output element due to value quantization
};

/// Widths a token may take (SPEC Q2 default [1, 8]; B = 0 is not allowed).
struct WidthRange {
  int min = 1;
  int max = 8;
};

/// 2 * sqrt(3): a uniform error of half-width Delta has sigma = Delta / sqrt(3), and 2 Delta 2^B = range.
inline constexpr double kTwoSqrt3 = 3.4641016151377545870548926830117;

/// Smallest b in [r.min, r.max] with ratio <= 2^b, i.e. clamp(ceil(log2(ratio))). ratio <= 0 (zero range,
/// infinite sigma) gives r.min, NaN gives r.max. Read off the binary exponent: ratio = 1.f x 2^e needs
/// b = e, plus one when f != 0 (subnormals and +inf land outside [1, 8] and clamp).
KVC_HOST_DEVICE int width_for_ratio(double ratio, WidthRange r) noexcept {
  if (ratio != ratio) return r.max;
  if (!(ratio > 0.0)) return r.min;
  const std::uint64_t u = ::kvc::detail::double_bits(ratio);
  const int b = int((u >> 52) & 0x7ffu) - 1023 + ((u & 0xfffffffffffffull) != 0 ? 1 : 0);
  return b < r.min ? r.min : (b > r.max ? r.max : b);
}

/// The paper's bounds (QAQ, SPEC §2.3).
struct PaperBounds {
  static constexpr const char* kName = "paper";
  /// sigma_K at length T for squared query norm qnorm2 (> 0, T >= 2): the same for every token of the stream.
  KVC_HOST_DEVICE static double key_sigma(int T, double sigma_s, double qnorm2) noexcept {
    const double t = double(T);
    return std::sqrt(std::log1p(t * t * t / (t - 1.0) * sigma_s * sigma_s) / qnorm2);
  }
  /// sigma_V of a token whose predicted probability is s_hat (> 0).
  KVC_HOST_DEVICE static double value_sigma(int T, double sigma_x, double s_hat) noexcept {
    return sigma_x / (std::sqrt(double(T)) * s_hat);
  }
};

/// Key width of a token with non-outlier range `range` at length T (guards in the file comment).
template <class Bounds = PaperBounds>
KVC_HOST_DEVICE int key_width(double range, int T, double sigma_s, double qnorm2, WidthRange r) noexcept {
  if (T <= 1) return r.max;
  if (!(qnorm2 > 0.0) || !(range > 0.0)) return r.min;
  return width_for_ratio(range / (kTwoSqrt3 * Bounds::key_sigma(T, sigma_s, qnorm2)), r);
}

/// Value width of a token with range `range` and predicted probability s_hat at length T.
template <class Bounds = PaperBounds>
KVC_HOST_DEVICE int value_width(double range, int T, double sigma_x, double s_hat, WidthRange r) noexcept {
  if (T <= 1) return r.max;
  if (!(s_hat > 0.0) || !(range > 0.0)) return r.min;
  return width_for_ratio(range / (kTwoSqrt3 * Bounds::value_sigma(T, sigma_x, s_hat)), r);
}

/// The width rule of one stream at one decode step with everything that does not depend on the token
/// evaluated once: key(range) == key_width(range, T, sigma_S, qnorm2) and value(range, c) ==
/// value_width(range, T, sigma_X, ProbCode::decode(c)) exactly (the same double expressions; tested).
/// ~2 KB; host+device.
template <class Bounds = PaperBounds>
struct StepWidths {
  int T;
  WidthRange r;
  bool key_min;                 // ||Q||^2 == 0: every key at r.min
  double key_denom;             // 2 sqrt(3) sigma_K
  double value_denom[256];      // 2 sqrt(3) sigma_V per probability code (255: S^ = 0, unused)
  StepWidths() = default;  ///< trivial (device shared memory): set_scalars(), then value_denom[c] = value_denom_at(c)
  KVC_HOST_DEVICE StepWidths(int T_, double sigma_s, double qnorm2, double sigma_x, WidthRange r_) noexcept;
  /// Everything but value_denom[0, 255).
  KVC_HOST_DEVICE void set_scalars(int T_, double sigma_s, double qnorm2, WidthRange r_) noexcept {
    T = T_, r = r_, key_min = !(qnorm2 > 0.0), key_denom = 1.0, value_denom[255] = 1.0;
    if (T > 1 && !key_min) key_denom = kTwoSqrt3 * Bounds::key_sigma(T, sigma_s, qnorm2);
  }
  /// The value denominator of probability code c < 255 (T >= 2): what the constructor stores; device code
  /// fills value_denom with it in parallel.
  KVC_HOST_DEVICE static double value_denom_at(int T, double sigma_x, int c) noexcept;
  KVC_HOST_DEVICE int key(double range) const noexcept {
    if (T <= 1) return r.max;
    if (key_min || !(range > 0.0)) return r.min;
    return width_for_ratio(range / key_denom, r);
  }
  KVC_HOST_DEVICE int value(double range, std::uint8_t code) const noexcept;
};

/// One token's attention history (SPEC §2.4): the last n probabilities it received, as 8-bit codes of
/// -log2(p) in 1/8 binades rounded toward larger p (the largest code whose decoded p is >= the true p, checked
/// for every float p; at most 2^(1/8) = 9 % above it;
/// the width depends on S^ only through ceil(log2), so the rounding moves a token up by at most one
/// width, never down). Code 255 stands for p < 2^-31.75, treated as 0 (SPEC's S^ == 0 guard: B_min; at any
/// T <= 2^40 such a token's value error is below 2^-11 of sigma_X per unit range). Host+device.
struct ProbCode {
  static constexpr int kStepsPerBinade = 8;
  static constexpr std::uint8_t kZero = 255;
  /// 2^(k / 8) for k in [0, 8), rounded to float.
  KVC_HOST_DEVICE static constexpr float threshold(int k) noexcept {
    switch (k) {
      case 0: return 1.0f;
      case 1: return 1.09050773f;
      case 2: return 1.18920712f;
      case 3: return 1.29683955f;
      case 4: return 1.41421356f;
      case 5: return 1.54221083f;
      case 6: return 1.68179283f;
      default: return 1.83400809f;
    }
  }
  /// floor(-8 log2 p), without a log: p = m 2^e (m in [1, 2)) gives -8 e - j with j = ceil(8 log2 m), the
  /// number of thresholds 2^(k/8), k in [0, 8), below m.
  KVC_HOST_DEVICE static std::uint8_t encode(float p) noexcept {
    if (!(p > 0.0f)) return kZero;
    if (p >= 1.0f) return 0;
    const std::uint32_t u = ::kvc::detail::float_bits(p);
    const int e = int(u >> 23) - 127;  // p < 1: sign 0, e <= -1; subnormals give -127 and end at kZero
#if KVC_QAQ_SSE2_  // the 8 compares at once, on m's mantissa bits (m and the thresholds lie in [1, 2), where
    // floats order as their bits)
    constexpr auto mant = [](int k) { return int(std::bit_cast<std::uint32_t>(threshold(k)) & 0x7fffffu); };
    const __m128i mb = _mm_set1_epi32(int(u & 0x7fffffu));
    const __m128i lo = _mm_cmpgt_epi32(mb, _mm_setr_epi32(mant(0), mant(1), mant(2), mant(3)));
    const __m128i hi = _mm_cmpgt_epi32(mb, _mm_setr_epi32(mant(4), mant(5), mant(6), mant(7)));
    const int j = ::kvc::detail::leading_ones_lanes16(_mm_packs_epi32(lo, hi));
#else
    const float m = ::kvc::detail::bits_float((u & 0x7fffffu) | 0x3f800000u);
    int j = 0;
    for (int k = 0; k < kStepsPerBinade; ++k) j += int(m > threshold(k));
#endif
    const int c = -kStepsPerBinade * e - j;
    return c >= int(kZero) ? kZero : static_cast<std::uint8_t>(c);
  }
#if KVC_QAQ_SSE2_
  /// encode() of the 4 probabilities p[0, 4) into out[0, 4) (host, SSE2): the same codes for every float.
  static void encode4(const float* p, std::uint8_t* out) noexcept {
    constexpr auto mant = [](int k) { return int(std::bit_cast<std::uint32_t>(threshold(k)) & 0x7fffffu); };
    const __m128 x = _mm_loadu_ps(p);
    const __m128i u = _mm_castps_si128(x), m = _mm_and_si128(u, _mm_set1_epi32(0x7fffff));
    // -8 e - j = 8 (127 - biased exponent) - j, j = #{k : m > mant(k)} (a true compare adds -1)
    __m128i c = _mm_slli_epi32(_mm_sub_epi32(_mm_set1_epi32(127), _mm_srli_epi32(u, 23)), 3);
    for (int k = 0; k < kStepsPerBinade; ++k) c = _mm_add_epi32(c, _mm_cmpgt_epi32(m, _mm_set1_epi32(mant(k))));
    c = _mm_and_si128(c, _mm_castps_si128(_mm_cmplt_ps(x, _mm_set1_ps(1.0f))));  // p >= 1: 0
    const __m128i zero = _mm_or_si128(_mm_castps_si128(_mm_cmpnlt_ps(_mm_setzero_ps(), x)),  // !(p > 0), NaN too
                                      _mm_cmpgt_epi32(c, _mm_set1_epi32(int(kZero) - 1)));   // below 2^-31.75
    c = _mm_or_si128(_mm_andnot_si128(zero, c), _mm_and_si128(zero, _mm_set1_epi32(kZero)));
    const int v = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(c, c), c));
    std::memcpy(out, &v, 4);
  }
#endif
  KVC_HOST_DEVICE static float decode(std::uint8_t c) noexcept {
    return c == kZero ? 0.0f : std::exp2(-float(c) / float(kStepsPerBinade));
  }
};

template <class Bounds>
KVC_HOST_DEVICE double StepWidths<Bounds>::value_denom_at(int T, double sigma_x, int c) noexcept {
  return kTwoSqrt3 * Bounds::value_sigma(T, sigma_x, double(ProbCode::decode(std::uint8_t(c))));
}
template <class Bounds>
KVC_HOST_DEVICE StepWidths<Bounds>::StepWidths(int T_, double sigma_s, double qnorm2, double sigma_x, WidthRange r_) noexcept {
  set_scalars(T_, sigma_s, qnorm2, r_);
  if (T <= 1) return;
  for (int c = 0; c < 255; ++c) value_denom[c] = value_denom_at(T, sigma_x, c);
}
template <class Bounds>
KVC_HOST_DEVICE int StepWidths<Bounds>::value(double range, std::uint8_t code) const noexcept {
  if (T <= 1) return r.max;
  if (code == ProbCode::kZero || !(range > 0.0)) return r.min;
  return width_for_ratio(range / value_denom[code], r);
}

/// Ring of the last N probability codes of one token, plus how many it has seen (saturating at N).
/// Max of probabilities = min of codes. 8 bytes for N <= 7. Host+device.
template <int N>
struct AttentionHistory {
  static_assert(N >= 1 && N <= 7, "kvc::qaq::AttentionHistory: window n must be in [1, 7]");
  std::uint8_t code[N];
  std::uint8_t seen;
  KVC_HOST_DEVICE void reset() noexcept {
    for (int i = 0; i < N; ++i) code[i] = ProbCode::kZero;
    seen = 0;
  }
  /// Records probability p (the newest observation replaces the oldest).
  KVC_HOST_DEVICE void push(float p) noexcept { push_code(ProbCode::encode(p)); }
  /// Records a probability already encoded (ProbCode::encode or encode4).
  KVC_HOST_DEVICE void push_code(std::uint8_t c) noexcept {
    for (int i = N - 1; i > 0; --i) code[i] = code[i - 1];
    code[0] = c;
    if (seen < N) ++seen;
  }
  KVC_HOST_DEVICE bool full() const noexcept { return seen >= N; }
  /// The code of S^_t (the smallest code: the largest probability; ProbCode::kZero before any).
  KVC_HOST_DEVICE std::uint8_t s_hat_code() const noexcept {
    std::uint8_t m = ProbCode::kZero;
    for (int i = 0; i < N; ++i) m = code[i] < m ? code[i] : m;
    return m;
  }
  /// S^_t: the largest of the recorded probabilities (0 before any).
  KVC_HOST_DEVICE float s_hat() const noexcept { return ProbCode::decode(s_hat_code()); }
};

/// Bisection in log space for the target (in [lo, hi], both > 0) at which `average_bits(target)`, a
/// non-increasing function (larger targets allow fewer bits), reaches `want`: returns the largest target
/// tried whose average is >= want (the cheapest target that still spends the requested bits), after `iters`
/// halvings of log(hi / lo). Host only (calls the caller's function).
template <class F>
double calibrate_target(F&& average_bits, double want, double lo, double hi, int iters = 40) {
  double a = std::log(lo), b = std::log(hi);
  if (average_bits(hi) >= want) return hi;
  if (average_bits(lo) < want) return lo;
  for (int i = 0; i < iters; ++i) {
    const double m = 0.5 * (a + b);
    if (average_bits(std::exp(m)) >= want) a = m;
    else b = m;
  }
  return std::exp(a);
}
}  // namespace kvc::qaq
