/// \file simd.hpp
/// Private: the minimal vector layer of the fused CPU attention. One `VecF` (float lanes) and one
/// `VecI` (int32 lanes) per ISA: AVX-512 (16 lanes, VNNI `vpdpbusd`), AVX2 (8 lanes, `vpdpbusd`
/// emulated by `vpmaddubsw`+`vpmaddwd`, exact while |u8*s8 pair sums| < 2^15, which holds for codes
/// of <= 4 bits), portable (1 lane). All three compute the same integer dot products, so results
/// differ only in float summation order.
/// Included once per path by decode_attention.hpp, inside that path's target region, with
/// KVC_ISA_LEVEL_ (0 portable, 1 AVX2, 2 AVX-512) and KVC_ISA_NS (the path's namespace) defined; every
/// header it needs is included before the regions. No include guard by design.
#if !defined(KVC_ATTENTION_INTERNAL) || !defined(KVC_ISA_LEVEL_) || !defined(KVC_ISA_NS)
#  error "kvc/attention/detail/simd.hpp is private: include <kvc/attention/decode_attention.hpp>"
#endif

namespace kvc::detail::KVC_ISA_NS::simd {

/// Vector registers the path's register tiles may fill: 32 where the compiler may use AVX-512VL's (the
/// AVX-512 path, and every path of a build for an AVX-512 CPU, e.g. -march=native there), else AVX2's 16
/// ymm. A tile that needs more spills accumulators to the stack on every token.
#if KVC_ISA_LEVEL_ == 2 || defined(__AVX512VL__)
inline constexpr int kVecRegs = 32;
#else
inline constexpr int kVecRegs = 16;
#endif
/// Whether a register tile fits kVecRegs: `acc` accumulators, `loads` vectors loaded per step and the one
/// broadcast operand they are multiplied by.
constexpr bool fits_regs(int acc, int loads) noexcept { return acc + loads + 1 <= kVecRegs; }

// 2^x for x in [-126, 126] (inputs below are clamped, so 2^-inf ~ 2^-126 * 0 terms vanish):
// round to nearest integer n, f = x - n in [-0.5, 0.5], 2^f by its degree-6 Taylor series
// (relative error < 2e-7), then scale by 2^n.
inline constexpr float kExp2C[7] = {1.0f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                    0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f};

#if KVC_ISA_LEVEL_ == 2
struct VecF {
  static constexpr int N = 16;
  __m512 v;
  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecF load(const half_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static VecF load(const bfloat16_t* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
  }
  static VecF load(const std::uint8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static VecF load(const std::int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  /// Rounds to nearest and stores N saturated unsigned / signed bytes.
  void store_u8(std::uint8_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_cvtps_epi32(v), _mm512_setzero_si512())));
  }
  void store_i8(std::int8_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v))); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  float first() const { return _mm512_cvtss_f32(v); }
};
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF abs(VecF a) { return {_mm512_abs_ps(a.v)}; }
inline VecF round_nearest(VecF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline float reduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }
inline VecF exp2(VecF x) {
  x.v = _mm512_max_ps(_mm512_min_ps(x.v, _mm512_set1_ps(126.0f)), _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x.v, n);
  __m512 p = _mm512_set1_ps(kExp2C[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C[i]));
  return {_mm512_scalef_ps(p, n)};
}
struct VecI {
  static constexpr int N = 16;
  __m512i v;
  static VecI zero() { return {_mm512_setzero_si512()}; }
  static VecI set1(std::int32_t x) { return {_mm512_set1_epi32(x)}; }
  static VecI load(const std::uint8_t* p) { return {_mm512_loadu_si512(p)}; }  // 4N bytes
  /// acc += per-lane dot of 4 unsigned bytes of `u` with 4 signed bytes of `s`.
  VecF to_float() const { return {_mm512_cvtepi32_ps(v)}; }
  /// Byte L (unsigned) of every 32-bit lane, as floats.
  template <int L>
  VecF byte_lane() const { return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * L), _mm512_set1_epi32(0xFF)))}; }
};
inline VecI dpbusd(VecI acc, VecI u, VecI s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
#elif KVC_ISA_LEVEL_ == 1
struct VecF {
  static constexpr int N = 8;
  __m256 v;
  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecF load(const half_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static VecF load(const bfloat16_t* p) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))};
  }
  static VecF load(const std::uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  static VecF load(const std::int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  /// The 8 lanes rounded (current mode) and clamped to [0, 255] / [-128, 127], as 8 bytes: two saturating
  /// packs (int32 -> int16 -> byte) in registers, the same clamp as std::clamp of every lane.
  void store_u8(std::uint8_t* p) const {
    const __m128i w = packs_i32();
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  void store_i8(std::int8_t* p) const {
    const __m128i w = packs_i32();
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  /// The lanes as int32 (cvtps) saturated to int16, in order.
  __m128i packs_i32() const {
    const __m256i i = _mm256_cvtps_epi32(v);
    return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  float first() const { return _mm256_cvtss_f32(v); }
};
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF abs(VecF a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline VecF round_nearest(VecF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline float reduce_add(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(VecF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VecF exp2(VecF x) {
  x.v = _mm256_max_ps(_mm256_min_ps(x.v, _mm256_set1_ps(126.0f)), _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x.v, n);
  __m256 p = _mm256_set1_ps(kExp2C[6]);
  for (int i = 5; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p, _mm256_castsi256_ps(e))};
}
struct VecI {
  static constexpr int N = 8;
  __m256i v;
  static VecI zero() { return {_mm256_setzero_si256()}; }
  static VecI set1(std::int32_t x) { return {_mm256_set1_epi32(x)}; }
  static VecI load(const std::uint8_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  VecF to_float() const { return {_mm256_cvtepi32_ps(v)}; }
  template <int L>
  VecF byte_lane() const { return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * L), _mm256_set1_epi32(0xFF)))}; }
};
inline VecI dpbusd(VecI acc, VecI u, VecI s) {
  const __m256i pairs = _mm256_maddubs_epi16(u.v, s.v);
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
}
#else
struct VecF {
  static constexpr int N = 1;
  float v;
  static VecF zero() { return {0.0f}; }
  static VecF set1(float x) { return {x}; }
  static VecF load(const float* p) { return {*p}; }
  template <class T>
  static VecF load(const T* p) { return {StorageTraits<T>::load(*p)}; }
  static VecF load(const std::uint8_t* p) { return {static_cast<float>(*p)}; }
  static VecF load(const std::int8_t* p) { return {static_cast<float>(*p)}; }
  void store_u8(std::uint8_t* p) const { *p = static_cast<std::uint8_t>(std::clamp(std::nearbyint(v), 0.0f, 255.0f)); }
  void store_i8(std::int8_t* p) const { *p = static_cast<std::int8_t>(std::clamp(std::nearbyint(v), -128.0f, 127.0f)); }
  void store(float* p) const { *p = v; }
  float first() const { return v; }
};
inline VecF fma(VecF a, VecF b, VecF c) { return {std::fma(a.v, b.v, c.v)}; }
inline VecF operator*(VecF a, VecF b) { return {a.v * b.v}; }
inline VecF operator+(VecF a, VecF b) { return {a.v + b.v}; }
inline VecF operator-(VecF a, VecF b) { return {a.v - b.v}; }
inline VecF max(VecF a, VecF b) { return {std::max(a.v, b.v)}; }
inline VecF abs(VecF a) { return {std::fabs(a.v)}; }
inline VecF round_nearest(VecF a) { return {std::nearbyint(a.v)}; }
inline float reduce_add(VecF a) { return a.v; }
inline float reduce_max(VecF a) { return a.v; }
inline VecF exp2(VecF x) { return {std::exp2(std::max(x.v, -126.0f))}; }
struct VecI {
  static constexpr int N = 1;
  std::int32_t v;
  static VecI zero() { return {0}; }
  static VecI set1(std::int32_t x) { return {x}; }
  static VecI load(const std::uint8_t* p) {
    std::int32_t x;
    std::memcpy(&x, p, 4);
    return {x};
  }
  VecF to_float() const { return {static_cast<float>(v)}; }
  template <int L>
  VecF byte_lane() const { return {static_cast<float>((static_cast<std::uint32_t>(v) >> (8 * L)) & 0xFFu)}; }
};
inline VecI dpbusd(VecI acc, VecI u, VecI s) {
  std::int32_t sum = acc.v;
  for (int i = 0; i < 4; ++i)
    sum += static_cast<std::int32_t>(static_cast<std::uint8_t>(u.v >> (8 * i))) *
           static_cast<std::int32_t>(static_cast<std::int8_t>(s.v >> (8 * i)));
  return {sum};
}
#endif

/// Byte quantization of values with |x| <= mx onto [-levels, levels] (or [0, levels]): sets
/// scale = mx / levels and returns levels / mx, both 0 when mx is 0 or so small (below
/// levels / FLT_MAX, e.g. probabilities near 2^-126) that levels / mx would overflow: such values
/// are treated as zero.
inline float byte_scale(float mx, float levels, float& scale) noexcept {
  const bool representable = mx >= levels / std::numeric_limits<float>::max();
  scale = representable ? mx / levels : 0.0f;
  return representable ? levels / mx : 0.0f;
}

#if KVC_ISA_LEVEL_ == 2
/// Stores the 64 int32 lanes of v[0..3] (each in [-128, 127]) as 64 consecutive int8, in order.
inline void store_i8x64(const __m512i v[4], std::int8_t* out) noexcept {
  // packs work per 128-bit lane: lane L of the result holds dword L of each source, v0..v3.
  const __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(v[0], v[1]), _mm512_packs_epi32(v[2], v[3]));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi32(order, b));
}
/// Stores the 32 int32 lanes of v0, v1 (each in [0, 255]) as 32 consecutive uint8, in order.
inline void store_u8x32(__m512i v0, __m512i v1, std::uint8_t* out) noexcept {
  const __m512i w = _mm512_packus_epi32(v0, v1);  // lane L: v0 dwords 4L.., v1 dwords 4L.. as words
  const __m512i b = _mm512_packus_epi16(w, w);      // lane L: [v0_L, v1_L, v0_L, v1_L] as bytes
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, b)));
}
#endif

/// out[i] = the sum of the lanes of v[i], for i < N (one horizontal sum per vector, batched).
inline void hsum_lanes(const VecF (&v)[VecF::N], float* out) noexcept {
#if KVC_ISA_LEVEL_ == 2
  // Pairs, then quads, within 128-bit lanes; then the four 128-bit lanes of four quads at once.
  __m512 p[4];
  for (int k = 0; k < 4; ++k) {
    const __m512 a = v[4 * k].v, b = v[4 * k + 1].v, c = v[4 * k + 2].v, d = v[4 * k + 3].v;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    p[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  }  // p[k], 128-bit lane L: partial sums of v[4k..4k+3] over that lane's elements
  const __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], 0x44), _mm512_shuffle_f32x4(p[0], p[1], 0xEE));
  const __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], 0x44), _mm512_shuffle_f32x4(p[2], p[3], 0xEE));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, 0x88), _mm512_shuffle_f32x4(r01, r23, 0xDD)));
#else
  for (int i = 0; i < VecF::N; ++i) out[i] = reduce_add(v[i]);
#endif
}

/// Scalar 2^x through the vector polynomial (cheaper than libm's exp2f in the softmax update).
inline float exp2_scalar(float x) noexcept { return exp2(VecF::set1(x)).first(); }

/// Unpacks n plane-packed codes (see core/bit_packing.hpp) into one byte each.
template <int Bits>
inline void unpack_codes(const std::uint8_t* __restrict packed, std::size_t n, std::uint8_t* __restrict out) noexcept {
#if KVC_ISA_LEVEL_ == 0
  kvc::unpack_codes(packed, n, Bits, out);  // portable: the reference routine
#else
  std::size_t base = 0;
  constexpr int kPlanes = plane_count(Bits);
  [&]<int... P>(std::integer_sequence<int, P...>) {
    (
        [&] {
          constexpr int w = plane_width(Bits, P), off = plane_offset(Bits, P), per = 8 / w;
          constexpr std::uint8_t mask = static_cast<std::uint8_t>((1u << w) - 1u);
          const std::size_t vectors = n / (64u * per);
          for (std::size_t m = 0; m < vectors; ++m) {
            const std::uint8_t* src = packed + base + m * 64;
            std::uint8_t* dst = out + m * per * 64;
#if KVC_ISA_LEVEL_ == 2
            const __m512i x = _mm512_loadu_si512(src);
            for (int i = 0; i < per; ++i) {
              __m512i y = _mm512_and_si512(_mm512_srli_epi16(x, i * w), _mm512_set1_epi8(static_cast<char>(mask)));
              if constexpr (off != 0)
                y = _mm512_or_si512(_mm512_loadu_si512(dst + i * 64), _mm512_slli_epi16(y, off));
              _mm512_storeu_si512(dst + i * 64, y);
            }
#else
            for (int half = 0; half < 2; ++half) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * half));
              for (int i = 0; i < per; ++i) {
                __m256i y = _mm256_and_si256(_mm256_srli_epi16(x, i * w), _mm256_set1_epi8(static_cast<char>(mask)));
                auto* d = reinterpret_cast<__m256i*>(dst + i * 64 + 32 * half);
                if constexpr (off != 0) y = _mm256_or_si256(_mm256_loadu_si256(d), _mm256_slli_epi16(y, off));
                _mm256_storeu_si256(d, y);
              }
            }
#endif
          }
          base += n * w / 8;
        }(),
        ...);
  }(std::make_integer_sequence<int, kPlanes>{});
#endif
}
}  // namespace kvc::detail::KVC_ISA_NS::simd

