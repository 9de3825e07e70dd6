// kvc: nvcc-safe
/// \file numeric.hpp
/// 16-bit storage types (`half_t` = IEEE binary16, `bfloat16_t`) with host+device scalar
/// conversion, and host batch conversion that uses F16C / AVX-512 when compiled for it.
/// Contract: float -> 16-bit rounds to nearest, ties to even; NaN stays NaN; overflow gives Inf.
#pragma once

#include <kvc/config.hpp>

#include <cstddef>
#include <cstdint>
#include <concepts>
#include <cstring>

#if !defined(__CUDA_ARCH__) && (KVC_HAS_F16C() || KVC_HAS_AVX512())
#  include <immintrin.h>
#endif

namespace kvc {

namespace detail {
KVC_HOST_DEVICE std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
KVC_HOST_DEVICE float bits_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
KVC_HOST_DEVICE std::uint64_t double_bits(double x) noexcept {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

/// IEEE float -> binary16, round to nearest even: the classic bit-exact algorithm on the host, the
/// hardware conversion (same rounding; NaN payloads may differ) on the device.
KVC_HOST_DEVICE std::uint16_t float_to_half_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return static_cast<std::uint16_t>(sign | (abs > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {                                                    // subnormal half or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);             // < 2^-25: rounds to 0
    const std::uint32_t e = abs >> 23;
    const std::uint32_t m = (abs & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // 14..24
    const std::uint32_t half_m = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t mid = 1u << (shift - 1u);
    const std::uint32_t r = half_m + ((rem > mid || (rem == mid && (half_m & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | r);
  }
  // normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits to nearest even
  abs += 0xC8000000u;  // (15 - 127) << 23
  const std::uint32_t r = abs + 0x0FFFu + ((abs >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
#endif
}

KVC_HOST_DEVICE float half_bits_to_float(std::uint16_t h) noexcept {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(h)));  // exact, like the host path
  return f;
#else
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu;
  const std::uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_float(sign | 0x7F800000u | (m << 13));
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  // zero / subnormal: m * 2^-24, exact in float
  const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
  return sign ? -v : v;
#endif
}

KVC_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
KVC_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}
}  // namespace detail

/// a * b + c with the product rounded to float before the add (never contracted into an FMA), so a
/// reconstruction computed on the device is bit-identical to the host's.
KVC_HOST_DEVICE float mul_add_rounded(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(a, b), c);
#else
  float p = a * b;
#  if defined(__GNUC__) && defined(__x86_64__)
  asm("" : "+x"(p));  // materialise the rounded product: no FMA even under -ffp-contract=fast (gnu++ modes)
#  endif
  return p + c;
#endif
}
/// a / b correctly rounded on the host and on the device, whatever nvcc's -prec-div / --use_fast_math:
/// quantizer metadata computed on the GPU equals the host's.
KVC_HOST_DEVICE float div_rounded(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

/// IEEE binary16 storage. A plain 16-bit POD (trivially copyable, usable in kernel Params);
/// arithmetic happens in float.
struct half_t {
  std::uint16_t bits;
  static constexpr float kMax = 65504.0f;  ///< largest finite value
  KVC_HOST_DEVICE static half_t from_float(float f) noexcept { return half_t{detail::float_to_half_bits(f)}; }
  KVC_HOST_DEVICE float to_float() const noexcept { return detail::half_bits_to_float(bits); }
  friend KVC_HOST_DEVICE bool operator==(half_t a, half_t b) noexcept { return a.bits == b.bits; }
};

/// bfloat16 storage (the top half of an IEEE float).
struct bfloat16_t {
  std::uint16_t bits;
  static constexpr float kMax = 3.3895313892515355e38f;
  KVC_HOST_DEVICE static bfloat16_t from_float(float f) noexcept { return bfloat16_t{detail::float_to_bf16_bits(f)}; }
  KVC_HOST_DEVICE float to_float() const noexcept { return detail::bf16_bits_to_float(bits); }
  friend KVC_HOST_DEVICE bool operator==(bfloat16_t a, bfloat16_t b) noexcept { return a.bits == b.bits; }
};

/// Storage-type traits: how a stored element converts to and from float.
template <class T>
struct StorageTraits;
template <>
struct StorageTraits<float> {
  static constexpr float kMax = 3.4028234663852886e38f;
  static constexpr const char* kName = "fp32";
  KVC_HOST_DEVICE static float load(float x) noexcept { return x; }
  KVC_HOST_DEVICE static float store(float x) noexcept { return x; }
};
template <>
struct StorageTraits<half_t> {
  static constexpr float kMax = half_t::kMax;
  static constexpr const char* kName = "fp16";
  KVC_HOST_DEVICE static float load(half_t x) noexcept { return x.to_float(); }
  KVC_HOST_DEVICE static half_t store(float x) noexcept { return half_t::from_float(x); }
};
template <>
struct StorageTraits<bfloat16_t> {
  static constexpr float kMax = bfloat16_t::kMax;
  static constexpr const char* kName = "bf16";
  KVC_HOST_DEVICE static float load(bfloat16_t x) noexcept { return x.to_float(); }
  KVC_HOST_DEVICE static bfloat16_t store(float x) noexcept { return bfloat16_t::from_float(x); }
};

template <class T>
concept StorageType = requires(T x, float f) {
  { StorageTraits<T>::load(x) } -> std::same_as<float>;
  StorageTraits<T>::store(f);
};

/// Round a float to the nearest fp16 value that is <= f (toward -inf). Host+device.
/// Used for quantizer metadata so the stored range still covers the data.
KVC_HOST_DEVICE half_t half_round_down(float f) noexcept {
  half_t h = half_t::from_float(f);
  if (h.to_float() > f) h.bits = (h.bits & 0x8000u) ? static_cast<std::uint16_t>(h.bits + 1u)
                                : (h.bits == 0 ? std::uint16_t{0x8001u} : static_cast<std::uint16_t>(h.bits - 1u));
  return h;
}
/// Round a non-negative float to the nearest fp16 value that is >= f (toward +inf).
KVC_HOST_DEVICE half_t half_round_up_nonneg(float f) noexcept {
  half_t h = half_t::from_float(f);
  if (h.to_float() < f) h.bits = static_cast<std::uint16_t>(h.bits + 1u);
  return h;
}

// Host functions (declared in nvcc's device pass too, where host code that calls them is parsed; the
// SIMD branches are compiled out there: KVC_HAS_* are 0 under __CUDA_ARCH__).
KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
/// Host batch conversion fp16 -> fp32 (vcvtph2ps when compiled with F16C / AVX-512).
inline void convert(const half_t* src, float* dst, std::size_t n) noexcept {
  std::size_t i = 0;
#  if KVC_HAS_AVX512()
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#  elif KVC_HAS_F16C()
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#  endif
  for (; i < n; ++i) dst[i] = src[i].to_float();
}
/// Host batch conversion fp32 -> fp16, round to nearest even.
inline void convert(const float* src, half_t* dst, std::size_t n) noexcept {
  std::size_t i = 0;
#  if KVC_HAS_AVX512()
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#  elif KVC_HAS_F16C()
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#  endif
  for (; i < n; ++i) dst[i] = half_t::from_float(src[i]);
}
inline void convert(const float* src, float* dst, std::size_t n) noexcept {
  if (n != 0) std::memcpy(dst, src, n * sizeof(float));  // memcpy(nullptr, nullptr, 0) is UB
}
inline void convert(const bfloat16_t* src, float* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = src[i].to_float();
}
inline void convert(const float* src, bfloat16_t* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = bfloat16_t::from_float(src[i]);
}
KVC_SUPPRESS_INTRINSIC_WARNINGS_END

}  // namespace kvc
