// QAQ in a blocked layout: a measured PROTOTYPE (not library code) of the design the library's QAQ cache may move to
// (README, QAQ's "What is left"). Standalone: its own synthetic mixed-width data for 8 streams (KV heads) of T
// tokens, d = 128, GQA 4, both sides at ~2.06 code bits (every width 1..8 present, keys nearly in token order,
// values shuffled within buckets), its own layout and kernels, a double-precision reference over the same decoded
// values, and the library's KIVI-2 attention (kvc::decode_attention) timed alternately in the same loop; then the
// width-update floor (histories as byte planes) and the value moves (7 % of the value tokens a step, half lowered,
// half raised from an fp16 mirror), checked against the logical data after every kind of step.
// Build (x86-64 with AVX-512 VNNI/VBMI and GFNI at run time; checked at start):
//   cmake --build build --target kvc_qaq_blocked_prototype
//   OMP_NUM_THREADS=2 ./build/benchmarks/kvc_qaq_blocked_prototype 32768 60   # T, steps; then "check" (errors only),
//                                                                             # "moves" (moves only) or "prof"
// Measured 2026-12-08 on an AMD EPYC Zen 4 (2 cores; README): attention 0.92-1.10x KIVI-2's at T = 32768, warm and
// cold, 1 and 2 threads (one thread: 17.5 against 18.2 ns per token and KV head); output error <= 3.1e-4 of its
// norm; the update floor 0.14 ms a step on 2 threads; the moves 2.3-2.8 ms a step (~250-300 ns a moved record and
// thread): the whole step 1.75-2.5x KIVI-2, the moves the part still too slow.
//
// Layout (per stream, per side, per width b in [1, 8]): a bucket of blocks of 16 same-width tokens.
//   block codes: 16 tokens x 128 channels x b bits = 256 b bytes, as "target vectors" of 64 bytes (32 per block)
//     key side:   target j (0..31)          byte 4 t + i = code of token t, channel 4 j + i   (vpdpbusd lane = token)
//     value side: target j = 4 cg + k        byte 4 l + i = code of token 4 k + i, channel 16 cg + l (lane = channel)
//   b is split into power-of-two components (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1); a w-bit component stores
//   8/w targets per 64-byte vector, target m of a vector in bits [m w, m w + w) of every byte; one GF2P8AFFINEQB
//   per component moves a target's field to its place in the byte (one OR / ternlog joins components).
//   metadata / outliers / ids as arrays per block: lo[16] fp16, step_max[16] fp16, outlier value[2][16] fp16,
//   outlier channel[2][16] u8, token id[16] u16. The code of an outlier's channel is stored as 0 (the
//   reconstruction replaces that channel, so its code carries no information; the kernels add x_c - zero).
// Kernels: keys: query as two int8 planes (qi = 256 qh + ql, |qi| <= 32639, exact int32 sums), vpdpbusd with
//   16 tokens per instruction, per-block vector epilogue (affine, 2 outliers via vpermt2ps lookups of the
//   float query), scores stored token-major [T][4]; running max per head.
//   softmax: exp2 in place (unnormalised e), sums; token max of e * inv per token -> pr[T].
//   values: e gathered by token id (16-byte rows), w = e scale rounded to [0, 32639] (two int8 planes) against the
//   max of a group of G blocks, vpdpbusd with 16 channels x 4 tokens per instruction; zero terms and
//   outliers in float.
#include "bench_util.hpp"

#include <immintrin.h>
#include <sys/mman.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace proto {

constexpr int D = 128, G4 = 4, KVH = 8, BLK = 16;
constexpr int kMinB = 1, kMaxB = 8;

template <class T>
struct AVec {  // 64-byte aligned, zeroed
  T* p = nullptr;
  std::size_t n = 0;
  bool owned = true;  // false: carved from an arena (moves: hugepage-backed value buckets)
  AVec() = default;
  explicit AVec(std::size_t n_) { resize(n_); }
  void adopt(T* q, std::size_t n_) {  // non-owning view of zeroed arena memory
    if (owned) std::free(p);
    p = q, n = n_, owned = false;
  }
  void resize(std::size_t n_) {
    if (owned) std::free(p);
    owned = true;
    n = n_;
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64 + 64;
    p = static_cast<T*>(std::aligned_alloc(64, bytes));
    std::memset(p, 0, bytes);
  }
  AVec(const AVec&) = delete;
  AVec(AVec&& o) noexcept : p(o.p), n(o.n), owned(o.owned) { o.p = nullptr; o.n = 0; o.owned = true; }
  AVec& operator=(AVec&& o) noexcept { std::swap(p, o.p); std::swap(n, o.n); std::swap(owned, o.owned); return *this; }
  ~AVec() { if (owned) std::free(p); }
  T& operator[](std::size_t i) { return p[i]; }
  const T& operator[](std::size_t i) const { return p[i]; }
  T* data() { return p; }
  const T* data() const { return p; }
};

inline float h2f(std::uint16_t h) { return _cvtsh_ss(h); }
inline std::uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// ---------------------------------------------------------------- logical (token-major) synthetic data
struct TokenSide {  // one side of one token
  int b;
  std::uint16_t lo, step;  // fp16 lo, step_max (step at width 8)
  std::uint8_t code[D];    // width-b codes (the value at outlier channels is irrelevant)
  std::uint16_t oval[2];
  std::uint8_t oidx[2];
};
struct StreamData {
  std::vector<TokenSide> k, v;  // [T]
};

inline int draw_width(std::mt19937& rng) {
  // P(1)=.25 P(2)=.60 P(3)=.09 P(4)=.02 P(5..8)=.01 each: mean 2.06
  static const double cdf[8] = {0.25, 0.85, 0.94, 0.96, 0.97, 0.98, 0.99, 1.0};
  const double u = std::uniform_real_distribution<double>(0, 1)(rng);
  for (int i = 0; i < 8; ++i)
    if (u < cdf[i]) return i + 1;
  return 8;
}

inline void make_side(TokenSide& s, std::mt19937& rng, bool key) {
  s.b = draw_width(rng);
  std::normal_distribution<float> nd;
  const float lo = key ? -3.0f + 0.5f * nd(rng) : -2.5f + 0.3f * nd(rng);
  const float range = std::uniform_real_distribution<float>(4.0f, 7.0f)(rng);
  s.lo = f2h(lo);
  s.step = f2h(range / 256.0f);
  std::uniform_int_distribution<int> cd(0, (1 << s.b) - 1);
  for (int c = 0; c < D; ++c) s.code[c] = std::uint8_t(cd(rng));
  std::uniform_int_distribution<int> ch(0, D - 1);
  s.oidx[0] = std::uint8_t(ch(rng));
  do s.oidx[1] = std::uint8_t(ch(rng)); while (s.oidx[1] == s.oidx[0]);
  for (int j = 0; j < 2; ++j) s.oval[j] = f2h((key ? 8.0f : 4.0f) * nd(rng));
}

// decoded value of channel c: midpoint affine, outliers replace their channels
inline double decoded(const TokenSide& s, int c) {
  for (int j = 0; j < 2; ++j)
    if (s.oidx[j] == c) return h2f(s.oval[j]);
  const double scale = double(h2f(s.step)) * double(1 << (8 - s.b));
  return double(h2f(s.lo)) + (double(s.code[c]) + 0.5) * scale;
}

// ---------------------------------------------------------------- blocked layout
struct Bucket {
  int n = 0, nblk = 0;
  int cap = 0;  // blocks allocated (moves: reserve_bucket / grow); 0 = nblk (as built)
  AVec<std::uint8_t> codes;  // nblk * 256 * b
  AVec<std::uint16_t> lo, step, id;  // nblk * 16
  AVec<std::uint16_t> oval;          // nblk * 2 * 16  ([blk][j][16])
  AVec<std::uint8_t> oidx;           // nblk * 2 * 16
};
struct Side {
  Bucket bk[8];
};
struct Stream {
  Side k, v;
  int T;
};

// components of width b: (w, offset)
struct Comp {
  int w, o;
};
constexpr int ncomp(int b) { return b == 3 || b == 5 || b == 6 ? 2 : b == 7 ? 3 : 1; }
constexpr Comp comp(int b, int i) {
  switch (b) {
    case 1: return {1, 0};
    case 2: return {2, 0};
    case 3: return i == 0 ? Comp{2, 0} : Comp{1, 2};
    case 4: return {4, 0};
    case 5: return i == 0 ? Comp{4, 0} : Comp{1, 4};
    case 6: return i == 0 ? Comp{4, 0} : Comp{2, 4};
    case 7: return i == 0 ? Comp{4, 0} : i == 1 ? Comp{2, 4} : Comp{1, 6};
    default: return {8, 0};
  }
}
// byte offset of component i within a block's codes
constexpr int comp_off(int b, int i) {
  int o = 0;
  for (int k = 0; k < i; ++k) o += 256 * comp(b, k).w;
  return o;
}
// GF2P8AFFINE matrix moving bits [m w, m w + w) of each byte to bits [o, o + w)
constexpr std::uint64_t gf_matrix(int w, int m, int o) {
  std::uint64_t a = 0;
  for (int i = 0; i < w; ++i) a |= std::uint64_t(1u << (m * w + i)) << (8 * (7 - (o + i)));
  return a;
}

// pack the 32 target vectors (tv[j][64] byte codes) of one block of width b into dst (256 b bytes)
inline void pack_block(int b, const std::uint8_t (*tv)[64], std::uint8_t* dst) {
  for (int ci = 0; ci < ncomp(b); ++ci) {
    const Comp c = comp(b, ci);
    std::uint8_t* base = dst + comp_off(b, ci);
    const int per = 8 / c.w;
    for (int j = 0; j < 32; ++j) {
      const int s = j / per, m = j % per;
      for (int p = 0; p < 64; ++p) {
        const unsigned f = (unsigned(tv[j][p]) >> c.o) & ((1u << c.w) - 1u);
        base[64 * s + p] |= std::uint8_t(f << (m * c.w));
      }
    }
  }
}

// build one side's buckets from token-major data; order: token ids per bucket (given)
inline void build_side(Side& side, const std::vector<TokenSide>& toks, bool key, std::mt19937& rng, int T) {
  std::vector<std::uint32_t> ids[8];
  for (int t = 0; t < (int)toks.size(); ++t) ids[toks[t].b - 1].push_back(std::uint32_t(t));
  for (int b = 1; b <= 8; ++b) {
    auto& v = ids[b - 1];
    if (key) {  // roughly in token order: local shuffles within windows of 8
      for (std::size_t i = 0; i + 8 <= v.size(); i += 8) std::shuffle(v.begin() + i, v.begin() + i + 8, rng);
    } else {
      std::shuffle(v.begin(), v.end(), rng);
    }
    Bucket& bk = side.bk[b - 1];
    bk.n = int(v.size());
    bk.nblk = (bk.n + BLK - 1) / BLK;
    bk.codes.resize(std::size_t(bk.nblk) * 256 * b);
    bk.lo.resize(std::size_t(bk.nblk) * BLK);
    bk.step.resize(std::size_t(bk.nblk) * BLK);
    bk.id.resize(std::size_t(bk.nblk) * BLK);
    bk.oval.resize(std::size_t(bk.nblk) * 2 * BLK);
    bk.oidx.resize(std::size_t(bk.nblk) * 2 * BLK);
    for (int blk = 0; blk < bk.nblk; ++blk) {
      std::uint8_t tv[32][64] = {};
      for (int t = 0; t < BLK; ++t) {
        const int i = blk * BLK + t;
        const std::size_t mi = std::size_t(blk) * BLK + t;
        if (i >= bk.n) {  // padding: zero metadata/codes, id = T (a dummy row whose probability is 0)
          bk.id[mi] = std::uint16_t(T);
          continue;
        }
        const TokenSide& s = toks[v[i]];
        bk.id[mi] = std::uint16_t(v[i]);
        bk.lo[mi] = s.lo;
        bk.step[mi] = s.step;
        for (int j = 0; j < 2; ++j) {
          bk.oval[std::size_t(blk) * 2 * BLK + j * BLK + t] = s.oval[j];
          bk.oidx[std::size_t(blk) * 2 * BLK + j * BLK + t] = s.oidx[j];
        }
        for (int c = 0; c < D; ++c) {
          const std::uint8_t code = (c == s.oidx[0] || c == s.oidx[1]) ? 0 : s.code[c];
          if (key) tv[c / 4][4 * t + c % 4] = code;
          else tv[4 * (c / 16) + t / 4][4 * (c % 16) + t % 4] = code;
        }
      }
      pack_block(b, tv, bk.codes.data() + std::size_t(blk) * 256 * b);
    }
  }
}

// ---------------------------------------------------------------- kernels
// target vector j of a width-B block (compile-time j for the constant matrices)
template <int B>
inline __m512i unpack(const std::uint8_t* cb, int j) {
  if constexpr (B == 8) {
    return _mm512_load_si512(cb + 64 * j);
  } else {
    __m512i r[3];
    constexpr int NC = ncomp(B);
    for (int ci = 0; ci < NC; ++ci) {
      const Comp c = comp(B, ci);
      const int per = 8 / c.w, s = j / per, m = j % per;
      const __m512i S = _mm512_load_si512(cb + comp_off(B, ci) + 64 * s);
      const std::uint64_t A = gf_matrix(c.w, m, c.o);
      if (c.w == 8 || (m == 0 && c.o == 0 && per == 1)) r[ci] = S;
      else r[ci] = _mm512_gf2p8affine_epi64_epi8(S, _mm512_set1_epi64((long long)A), 0);
    }
    if constexpr (NC == 1) return r[0];
    else if constexpr (NC == 2) return _mm512_or_si512(r[0], r[1]);
    else return _mm512_ternarylogic_epi32(r[0], r[1], r[2], 0xFE);
  }
}

struct QueryPrep {  // one stream's 4 heads
  alignas(64) std::int32_t qh[4][32], ql[4][32];  // 4 int8 per dword: channels 4j..4j+3
  alignas(64) float qf[4][D];                      // scaled float query (log2 domain)
  float qs[4], qsum[4];
};

inline void prep_query(const float* q /*[4][D]*/, QueryPrep& p) {
  const float sc = 1.4426950408889634f / std::sqrt(float(D));
  for (int h = 0; h < 4; ++h) {
    float mx = 0.0f, sum = 0.0f;
    for (int c = 0; c < D; ++c) {
      const float x = q[h * D + c] * sc;
      p.qf[h][c] = x;
      mx = std::max(mx, std::fabs(x));
      sum += x;
    }
    p.qsum[h] = sum;
    p.qs[h] = mx > 0 ? mx / 32639.0f : 0.0f;
    const float inv = mx > 0 ? 32639.0f / mx : 0.0f;
    for (int j = 0; j < 32; ++j) {
      std::uint32_t wh = 0, wl = 0;
      for (int i = 0; i < 4; ++i) {
        const int qi = std::clamp(int(std::lrintf(p.qf[h][4 * j + i] * inv)), -32639, 32639);
        const int lo = int(std::int8_t(std::uint8_t(qi & 255))), hi = (qi - lo) / 256;  // qi = 256 hi + lo, both int8
        wh |= std::uint32_t(std::uint8_t(std::int8_t(hi))) << (8 * i);
        wl |= std::uint32_t(std::uint8_t(lo)) << (8 * i);
      }
      p.qh[h][j] = std::int32_t(wh);
      p.ql[h][j] = std::int32_t(wl);
    }
  }
}

// acc += vpdpbusd(a, broadcast dword *p), the dword as the instruction's embedded {1to16} broadcast operand
// (GCC otherwise emits a separate vpbroadcastd per product)
inline __m512i dpbusd_bcst(__m512i acc, __m512i a, const std::int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
  return acc;
}

// 128-entry float lookup: tab[idx] for 16 indices in [0, 128)
inline __m512 lookup128(const float* tab, __m512i idx, __mmask16 m5, __mmask16 m6) {
  const __m512 r0 = _mm512_permutex2var_ps(_mm512_load_ps(tab), idx, _mm512_load_ps(tab + 16));
  const __m512 r1 = _mm512_permutex2var_ps(_mm512_load_ps(tab + 32), idx, _mm512_load_ps(tab + 48));
  const __m512 r2 = _mm512_permutex2var_ps(_mm512_load_ps(tab + 64), idx, _mm512_load_ps(tab + 80));
  const __m512 r3 = _mm512_permutex2var_ps(_mm512_load_ps(tab + 96), idx, _mm512_load_ps(tab + 112));
  const __m512 a = _mm512_mask_blend_ps(m5, r0, r1), b = _mm512_mask_blend_ps(m5, r2, r3);
  return _mm512_mask_blend_ps(m6, a, b);
}

// 4 x 16 (head-major) -> token-major: out vector r, 128-bit lane L = token 4 L + r, heads 0..3
inline void transpose4x16(const __m512 s[4], __m512 o[4]) {
  const __m512 t0 = _mm512_unpacklo_ps(s[0], s[1]), t1 = _mm512_unpackhi_ps(s[0], s[1]);
  const __m512 t2 = _mm512_unpacklo_ps(s[2], s[3]), t3 = _mm512_unpackhi_ps(s[2], s[3]);
  o[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
  o[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
  o[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
  o[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
}

// key pass over one width-B bucket: scores into s[T+1][4], running max per head
template <int B>
void key_bucket(const Bucket& bk, const QueryPrep& qp, float* __restrict s, __m512 mx[4]) {
  const float wmul = float(1 << (8 - B));
  for (int blk = 0; blk < bk.nblk; ++blk) {
    const std::uint8_t* cb = bk.codes.data() + std::size_t(blk) * 256 * B;
    if (blk + 4 < bk.nblk)  // every line of the block 4 ahead, and its metadata
      for (int l = 0; l < 4 * B; ++l) _mm_prefetch((const char*)(cb + 256 * B * 4 + 64 * l), _MM_HINT_T0);
    __m512i ah[4], al[4];
    for (int h = 0; h < 4; ++h) ah[h] = al[h] = _mm512_setzero_si512();
    // the query planes through one base register (else GCC hoists all 256 operand addresses and spills them)
    const std::int32_t* qb = &qp.qh[0][0];
    asm("" : "+r"(qb));
#pragma GCC unroll 32
    for (int j = 0; j < 32; ++j) {
      const __m512i K = unpack<B>(cb, j);
      for (int h = 0; h < 4; ++h) {
        ah[h] = dpbusd_bcst(ah[h], K, qb + 32 * h + j);
        al[h] = dpbusd_bcst(al[h], K, qb + 128 + 32 * h + j);
      }
    }
    const std::size_t mi = std::size_t(blk) * BLK;
    const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bk.step.data() + mi)));
    const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bk.lo.data() + mi)));
    const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(wmul));
    const __m512 zero = _mm512_fmadd_ps(scale, _mm512_set1_ps(0.5f), lo);
    const std::size_t oi = std::size_t(blk) * 2 * BLK;
    __m512i idx[2];
    __m512 corr[2];
    __mmask16 m5[2], m6[2];
    for (int j = 0; j < 2; ++j) {
      idx[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(bk.oidx.data() + oi + j * BLK)));
      corr[j] = _mm512_sub_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bk.oval.data() + oi + j * BLK))), zero);
      m5[j] = _mm512_test_epi32_mask(idx[j], _mm512_set1_epi32(32));
      m6[j] = _mm512_test_epi32_mask(idx[j], _mm512_set1_epi32(64));
    }
    __m512 sc[4];
    for (int h = 0; h < 4; ++h) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah[h], 8), al[h]));
      __m512 r = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(qp.qs[h])),
                                 _mm512_mul_ps(zero, _mm512_set1_ps(qp.qsum[h])));
      for (int j = 0; j < 2; ++j) r = _mm512_fmadd_ps(lookup128(qp.qf[h], idx[j], m5[j], m6[j]), corr[j], r);
      sc[h] = r;
    }
    const int nvalid = std::min(BLK, bk.n - blk * BLK);
    const __mmask16 valid = __mmask16((1u << nvalid) - 1u);
    for (int h = 0; h < 4; ++h) mx[h] = _mm512_mask_max_ps(mx[h], valid, mx[h], sc[h]);
    __m512 o[4];
    transpose4x16(sc, o);
    const std::uint16_t* id = bk.id.data() + mi;
    for (int L = 0; L < 4; ++L)
      for (int r = 0; r < 4; ++r) {
        const int t = 4 * L + r;
        __m128 x;
        switch (L) {
          case 0: x = _mm512_castps512_ps128(o[r]); break;
          case 1: x = _mm512_extractf32x4_ps(o[r], 1); break;
          case 2: x = _mm512_extractf32x4_ps(o[r], 2); break;
          default: x = _mm512_extractf32x4_ps(o[r], 3); break;
        }
        _mm_store_ps(s + std::size_t(id[t]) * 4, x);  // padded slots write the dummy row T
      }
  }
}

// exp2 of x <= 0 (Cephes exp2f polynomial, |rel err| ~ 2e-7)
inline __m512 exp2v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Scratch {
  AVec<float> s;   // [T + 1][4] (+ padding)
  AVec<float> ot;  // [D][4]
  alignas(64) float o[4][D];
  float sum[4], inv[4], mx[4];
};

// softmax part 1: e = exp2(s - m) in place over [T][4], sums; row T zeroed
inline void softmax_exp(Scratch& sc, int T) {
  float* s = sc.s.data();
  const __m512 mpat = _mm512_broadcast_f32x4(_mm_loadu_ps(sc.mx));
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  std::size_t i = 0, n = std::size_t(T) * 4;
  for (; i + 32 <= n; i += 32) {
    const __m512 e0 = exp2v(_mm512_sub_ps(_mm512_load_ps(s + i), mpat));
    const __m512 e1 = exp2v(_mm512_sub_ps(_mm512_load_ps(s + i + 16), mpat));
    _mm512_store_ps(s + i, e0);
    _mm512_store_ps(s + i + 16, e1);
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  for (; i < n; i += 16) {
    const __m512 e0 = exp2v(_mm512_sub_ps(_mm512_load_ps(s + i), mpat));
    _mm512_store_ps(s + i, e0);
    acc0 = _mm512_add_ps(acc0, e0);
  }
  alignas(64) float l[16];
  _mm512_store_ps(l, _mm512_add_ps(acc0, acc1));
  for (int h = 0; h < 4; ++h) {
    sc.sum[h] = l[h] + l[4 + h] + l[8 + h] + l[12 + h];
    sc.inv[h] = 1.0f / sc.sum[h];
  }
  _mm_store_ps(s + std::size_t(T) * 4, _mm_setzero_ps());
}

// pr[t] = max_h e[t][h] inv[h]
inline void token_max(const Scratch& sc, int T, float* __restrict pr) {
  const float* s = sc.s.data();
  const __m512 ipat = _mm512_broadcast_f32x4(_mm_loadu_ps(sc.inv));
  const __m512i sel = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  int t = 0;
  for (; t + 16 <= T; t += 16) {
    __m512 m[4];
    for (int k = 0; k < 4; ++k) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(s + std::size_t(t + 4 * k) * 4), ipat);
      x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
      x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
      m[k] = x;  // lanes 0, 4, 8, 12: tokens t + 4k + 0..3
    }
    // gather lanes 0,4,8,12 of the 4 vectors
    const __m512 a = _mm512_permutex2var_ps(m[0], _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0), m[1]);
    const __m512 b = _mm512_permutex2var_ps(m[2], _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0), m[3]);
    (void)sel;
    _mm512_storeu_ps(pr + t, _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  for (; t < T; ++t) {
    float m = 0;
    for (int h = 0; h < 4; ++h) m = std::max(m, s[std::size_t(t) * 4 + h] * sc.inv[h]);
    pr[t] = m;
  }
}

// value pass over one width-B bucket (GB blocks share one int14 weight scale)
template <int B, int GB>
void value_bucket(const Bucket& bk, Scratch& sc, __m512& zacc) {
  const float* e = sc.s.data();
  float* ot = sc.ot.data();
  const float wmul = float(1 << (8 - B));
  alignas(64) __m512 wf[GB][4];               // float weights [blk][k] in [t][h] layout
  alignas(64) std::uint32_t wq[GB][2][4][4];  // [blk][plane][k][h]: 4 tokens' int8 weights
  alignas(64) float ostage[2][4][16];         // outlier weights [j][k][16] ([t][h])
  const __m512i rep[4] = {
      _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
      _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
      _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
      _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
  const __m128i tr = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int g0 = 0; g0 < bk.nblk; g0 += GB) {
    const int ng = std::min(GB, bk.nblk - g0);
    __m512 wmax = _mm512_setzero_ps();
    // A: gather e by token id, float weights, zero terms, outliers
    for (int q = 0; q < ng; ++q) {
      const int blk = g0 + q;
      const std::size_t mi = std::size_t(blk) * BLK;
      const std::uint16_t* id = bk.id.data() + mi;
      if (blk + GB < bk.nblk) {  // the next group's codes and metadata
        const std::uint8_t* nb = bk.codes.data() + std::size_t(blk + GB) * 256 * B;
        for (int l = 0; l < 4 * B; ++l) _mm_prefetch((const char*)(nb + 64 * l), _MM_HINT_T0);
        _mm_prefetch((const char*)(id + GB * BLK), _MM_HINT_T0);
        _mm_prefetch((const char*)(bk.lo.data() + mi + GB * BLK), _MM_HINT_T0);
        _mm_prefetch((const char*)(bk.step.data() + mi + GB * BLK), _MM_HINT_T0);
        _mm_prefetch((const char*)(bk.oval.data() + 2 * (mi + GB * BLK)), _MM_HINT_T0);
        _mm_prefetch((const char*)(bk.oidx.data() + 2 * (mi + GB * BLK)), _MM_HINT_T0);
      }
      const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bk.step.data() + mi)));
      const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bk.lo.data() + mi)));
      const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(wmul));
      const __m512 zero = _mm512_fmadd_ps(scale, _mm512_set1_ps(0.5f), lo);
      const std::size_t oi = std::size_t(blk) * 2 * BLK;
      __m512 corr[2];
      for (int j = 0; j < 2; ++j)
        corr[j] = _mm512_sub_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bk.oval.data() + oi + j * BLK))), zero);
      for (int k = 0; k < 4; ++k) {
        __m512 E = _mm512_castps128_ps512(_mm_load_ps(e + std::size_t(id[4 * k]) * 4));
        E = _mm512_insertf32x4(E, _mm_load_ps(e + std::size_t(id[4 * k + 1]) * 4), 1);
        E = _mm512_insertf32x4(E, _mm_load_ps(e + std::size_t(id[4 * k + 2]) * 4), 2);
        E = _mm512_insertf32x4(E, _mm_load_ps(e + std::size_t(id[4 * k + 3]) * 4), 3);
        const __m512 W = _mm512_mul_ps(E, _mm512_permutexvar_ps(rep[k], scale));
        wf[q][k] = W;
        wmax = _mm512_max_ps(wmax, W);
        zacc = _mm512_fmadd_ps(E, _mm512_permutexvar_ps(rep[k], zero), zacc);
        for (int j = 0; j < 2; ++j) _mm512_store_ps(ostage[j][k], _mm512_mul_ps(E, _mm512_permutexvar_ps(rep[k], corr[j])));
      }
      const std::uint8_t* oix = bk.oidx.data() + oi;
      for (int j = 0; j < 2; ++j)
        for (int t = 0; t < BLK; ++t) {
          float* p = ot + std::size_t(oix[j * BLK + t]) * 4;
          _mm_store_ps(p, _mm_add_ps(_mm_load_ps(p), _mm_load_ps(&ostage[j][t / 4][4 * (t % 4)])));
        }
    }
    // B: per-head max over the group, int14 weights as two int8 planes
    wmax = _mm512_max_ps(wmax, _mm512_shuffle_f32x4(wmax, wmax, _MM_SHUFFLE(2, 3, 0, 1)));
    wmax = _mm512_max_ps(wmax, _mm512_shuffle_f32x4(wmax, wmax, _MM_SHUFFLE(1, 0, 3, 2)));
    const __mmask16 pos = _mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(32639.0f), wmax);
    alignas(16) float ws[4];
    _mm_store_ps(ws, _mm512_castps512_ps128(_mm512_div_ps(wmax, _mm512_set1_ps(32639.0f))));
    for (int q = 0; q < ng; ++q)
      for (int k = 0; k < 4; ++k) {
        // wi in [0, 32639] = 256 hi + lo, lo = the low byte as int8, hi = (wi - lo) / 256 in [0, 127]
        const __m512i wi = _mm512_cvtps_epi32(_mm512_mul_ps(wf[q][k], inv));
        const __m512i lo32 = _mm512_srai_epi32(_mm512_slli_epi32(wi, 24), 24);
        const __m128i hi = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(wi, lo32), 8)), tr);
        const __m128i lo = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(lo32), tr);
        _mm_store_si128((__m128i*)wq[q][0][k], hi);
        _mm_store_si128((__m128i*)wq[q][1][k], lo);
      }
    // C: products, 16 channels x 4 tokens per vpdpbusd, one flush per channel group and group of blocks
    const std::uint8_t* cb0 = bk.codes.data() + std::size_t(g0) * 256 * B;
#pragma GCC unroll 8
    for (int cg = 0; cg < 8; ++cg) {
      __m512i ah[4], al[4];
      for (int h = 0; h < 4; ++h) ah[h] = al[h] = _mm512_setzero_si512();
      for (int q = 0; q < ng; ++q) {
        const std::uint8_t* cb = cb0 + std::size_t(q) * 256 * B;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m512i V = unpack<B>(cb, 4 * cg + k);
          for (int h = 0; h < 4; ++h) {
            ah[h] = dpbusd_bcst(ah[h], V, reinterpret_cast<const std::int32_t*>(&wq[q][0][k][h]));
            al[h] = dpbusd_bcst(al[h], V, reinterpret_cast<const std::int32_t*>(&wq[q][1][k][h]));
          }
        }
      }
      for (int h = 0; h < 4; ++h) {
        float* o = sc.o[h] + 16 * cg;
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah[h], 8), al[h]));
        _mm512_store_ps(o, _mm512_fmadd_ps(f, _mm512_set1_ps(ws[h]), _mm512_load_ps(o)));
      }
    }
  }
}

template <class F>
inline void each_width(F&& f) {
  f.template operator()<1>();
  f.template operator()<2>();
  f.template operator()<3>();
  f.template operator()<4>();
  f.template operator()<5>();
  f.template operator()<6>();
  f.template operator()<7>();
  f.template operator()<8>();
}

#ifndef KGROUP
#define KGROUP 8
#endif
constexpr int kGroup = KGROUP;
static_assert(kGroup >= 1 && kGroup <= 8, "int32 bound: 16 kGroup 255 128 256 < 2^31");

struct PassTimes {
  double key = 0, smax = 0, val = 0;
};

// attention of one stream: out [4][D], pr [T]
inline void run_stream(const Stream& st, const float* q, float* out, float* pr, Scratch& sc, PassTimes* pt = nullptr) {
  using clk = std::chrono::steady_clock;
  const int T = st.T;
  QueryPrep qp;
  auto t0 = clk::now();
  prep_query(q, qp);
  __m512 mx[4];
  for (int h = 0; h < 4; ++h) mx[h] = _mm512_set1_ps(-INFINITY);
  each_width([&]<int B>() {
    if (st.k.bk[B - 1].n) key_bucket<B>(st.k.bk[B - 1], qp, sc.s.data(), mx);
  });
  for (int h = 0; h < 4; ++h) sc.mx[h] = _mm512_reduce_max_ps(mx[h]);
  auto t1 = clk::now();
  softmax_exp(sc, T);
  token_max(sc, T, pr);
  auto t2 = clk::now();
  std::memset(sc.o, 0, sizeof(sc.o));
  std::memset(sc.ot.data(), 0, sizeof(float) * D * 4);
  __m512 zacc = _mm512_setzero_ps();
  each_width([&]<int B>() {
    if (st.v.bk[B - 1].n) value_bucket<B, kGroup>(st.v.bk[B - 1], sc, zacc);
  });
  alignas(64) float z[16];
  _mm512_store_ps(z, zacc);
  for (int h = 0; h < 4; ++h) {
    const float zs = z[h] + z[4 + h] + z[8 + h] + z[12 + h];
    for (int c = 0; c < D; ++c) out[h * D + c] = (sc.o[h][c] + zs + sc.ot[std::size_t(c) * 4 + h]) * sc.inv[h];
  }
  auto t3 = clk::now();
  if (pt) {
    pt->key += std::chrono::duration<double>(t1 - t0).count();
    pt->smax += std::chrono::duration<double>(t2 - t1).count();
    pt->val += std::chrono::duration<double>(t3 - t2).count();
  }
}

// ---------------------------------------------------------------- reference (double, decoded values)
inline void reference(const StreamData& sd, const float* q, double* out, double* pr) {
  const int T = int(sd.k.size());
  const double sc = 1.0 / std::sqrt(double(D));
  std::vector<double> x(D), s(std::size_t(T) * 4);
  double mx[4] = {-1e300, -1e300, -1e300, -1e300};
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < D; ++c) x[c] = decoded(sd.k[t], c);
    for (int h = 0; h < 4; ++h) {
      double a = 0;
      for (int c = 0; c < D; ++c) a += double(q[h * D + c]) * x[c];
      s[std::size_t(t) * 4 + h] = a * sc;
      mx[h] = std::max(mx[h], a * sc);
    }
  }
  double sum[4] = {};
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < 4; ++h) sum[h] += (s[std::size_t(t) * 4 + h] = std::exp(s[std::size_t(t) * 4 + h] - mx[h]));
  std::fill(out, out + 4 * D, 0.0);
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < D; ++c) x[c] = decoded(sd.v[t], c);
    double m = 0;
    for (int h = 0; h < 4; ++h) {
      const double p = s[std::size_t(t) * 4 + h] / sum[h];
      m = std::max(m, p);
      for (int c = 0; c < D; ++c) out[h * D + c] += p * x[c];
    }
    pr[t] = m;
  }
}

// ---------------------------------------------------------------- width-update floor (SoA)
struct UpdState {
  AVec<std::uint8_t> hist;    // [5][T] probability codes
  AVec<std::uint16_t> stepk;  // [T] value-side step_max fp16 bits, token order
  AVec<std::uint8_t> width;   // [T] current value width
  AVec<std::uint32_t> movers; // [T]
  int pos = 0;
};
alignas(64) static std::int16_t g_limits[256][8];
static float g_log2c[7];  // log2(1 + f) ~ f * poly(f) on [0, 1), least-squares fit at startup (max err ~1e-6)
inline void fit_log2() {
  // normal equations for f * sum_k c_k f^(6-k) ~ log2(1 + f) on 2001 points (double)
  const int N = 2001, K = 7;
  double A[K][K] = {}, b[K] = {};
  for (int i = 0; i < N; ++i) {
    const double f = double(i) / (N - 1), y = std::log2(1.0 + f);
    double phi[K];
    for (int k = 0; k < K; ++k) phi[k] = std::pow(f, K - k);  // f^7 .. f^1
    for (int r = 0; r < K; ++r) {
      b[r] += phi[r] * y;
      for (int c = 0; c < K; ++c) A[r][c] += phi[r] * phi[c];
    }
  }
  for (int r = 0; r < K; ++r)  // Gaussian elimination
    for (int r2 = r + 1; r2 < K; ++r2) {
      const double m = A[r2][r] / A[r][r];
      for (int c = r; c < K; ++c) A[r2][c] -= m * A[r][c];
      b[r2] -= m * b[r];
    }
  double x[K];
  for (int r = K - 1; r >= 0; --r) {
    double v = b[r];
    for (int c = r + 1; c < K; ++c) v -= A[r][c] * x[c];
    x[r] = v / A[r][r];
  }
  for (int k = 0; k < K; ++k) g_log2c[k] = float(x[k]);
}  // per S^ code: 7 limits (+1 pad = INT16_MAX)

// one step for one stream: returns the number of movers
inline int update_widths(UpdState& u, const float* pr, int T) {
  std::uint8_t* plane = u.hist.data() + std::size_t(u.pos) * T;
  u.pos = (u.pos + 1) % 5;
  // code = floor(-8 log2 p) clamped to 255: from the float bits: -8 log2 p = -8 (e - 127 + log2(1 + m))
  // computed with getexp/getmant and a cheap log2 polynomial
  int t = 0;
  for (; t + 16 <= T; t += 16) {
    const __m512 p = _mm512_loadu_ps(pr + t);
    const __m512 ex = _mm512_getexp_ps(p);                                             // floor(log2 p)
    const __m512 m = _mm512_getmant_ps(p, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);      // [1, 2)
    // log2(m) on [1,2): cubic fit, max abs err ~ 1e-3 bits -> code error rare at the floor boundary
    const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
    __m512 l = _mm512_set1_ps(g_log2c[0]);
    for (int k = 1; k < 7; ++k) l = _mm512_fmadd_ps(l, f, _mm512_set1_ps(g_log2c[k]));
    l = _mm512_mul_ps(l, f);
    const __m512 v = _mm512_mul_ps(_mm512_add_ps(ex, l), _mm512_set1_ps(-8.0f));
    __m512i c = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(255.0f)));
    c = _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(p, _mm512_set1_ps(1e-30f), _CMP_LT_OQ), _mm512_set1_epi32(255));
    _mm_storeu_si128((__m128i*)(plane + t), _mm512_cvtepi32_epi8(c));
  }
  for (; t < T; ++t) {
    const float p = pr[t];
    plane[t] = p < 1e-30f ? 255 : std::uint8_t(std::min(255.0f, std::max(0.0f, std::floor(-8.0f * std::log2(p)))));
  }
  // S^ = min over the 5 planes; width = 1 + count(limits[S^] < step bits); movers where it changed
  const std::uint8_t* h = u.hist.data();
  int nm = 0;
  t = 0;
  for (; t + 64 <= T; t += 64) {
    __m512i smin = _mm512_loadu_si512(h + t);
    for (int k = 1; k < 5; ++k) smin = _mm512_min_epu8(smin, _mm512_loadu_si512(h + std::size_t(k) * T + t));
    alignas(64) std::uint8_t sm[64];
    _mm512_store_si512(sm, smin);
    alignas(64) std::uint8_t wnew[64];
    for (int i = 0; i < 64; i += 4) {  // 4 tokens a 128-bit... use 8 int16 lanes per token: one xmm compare
      // gather 4 tokens' limit rows into a zmm (4 x 16 bytes) and compare against the broadcast step bits
      __m512i lim = _mm512_castsi128_si512(_mm_load_si128((const __m128i*)g_limits[sm[i]]));
      lim = _mm512_inserti32x4(lim, _mm_load_si128((const __m128i*)g_limits[sm[i + 1]]), 1);
      lim = _mm512_inserti32x4(lim, _mm_load_si128((const __m128i*)g_limits[sm[i + 2]]), 2);
      lim = _mm512_inserti32x4(lim, _mm_load_si128((const __m128i*)g_limits[sm[i + 3]]), 3);
      const __m128i st4 = _mm_loadl_epi64((const __m128i*)(u.stepk.data() + t + i));
      const __m512i stb = _mm512_permutexvar_epi16(
          _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
          _mm512_castsi128_si512(st4));
      const __mmask32 below = _mm512_cmplt_epi16_mask(lim, stb);
      wnew[i] = std::uint8_t(1 + __builtin_popcount(below & 0xffu));
      wnew[i + 1] = std::uint8_t(1 + __builtin_popcount((below >> 8) & 0xffu));
      wnew[i + 2] = std::uint8_t(1 + __builtin_popcount((below >> 16) & 0xffu));
      wnew[i + 3] = std::uint8_t(1 + __builtin_popcount(below >> 24));
    }
    const __m512i wn = _mm512_load_si512(wnew);
    const __mmask64 ch = _mm512_cmpneq_epi8_mask(wn, _mm512_loadu_si512(u.width.data() + t));
    _mm512_storeu_si512(u.width.data() + t, wn);  // the new widths (the movers' re-encoding is not part of the floor)
    std::uint64_t mk = ch;
    while (mk) {
      u.movers[nm++] = std::uint32_t(t + __builtin_ctzll(mk));
      mk &= mk - 1;
    }
  }
  return nm;
}


// ---------------------------------------------------------------- moves (value side)
// Scheme: a bucket stays dense. Removing the token at slot x of width b's bucket moves the bucket's last token
// into slot x (its codes extracted from the last block and inserted at x, its metadata / id copied, its index
// entry updated) and turns the last slot into padding (id = T, metadata 0; stale code bits are left: the
// padding's weight is e[T] = 0 and an insert clears its bits before writing). The mover is then appended at
// slot n of its new width's bucket (a new block when the last is full; capacity doubles when exhausted).
// Index: loc[t] = (b - 1) << 24 | slot, 4 bytes per value token. Lowering narrows the codes by a shift;
// raising re-encodes from the fp16 mirror row (floor((x - lo) inv_step) clamped to [0, 255], >> (8 - nb)).

// the 128 codes of token t (0..15) of a width-B value block (outlier channels hold 0) -> out[128]
template <int B>
inline void extract_tok(const std::uint8_t* cb, int t, std::uint8_t* __restrict out) {
  const int k = t >> 2, i = t & 3;
  __m512i r0 = _mm512_setzero_si512(), r1 = r0;
  for (int ci = 0; ci < ncomp(B); ++ci) {
    const Comp c = comp(B, ci);
    const int per = 8 / c.w;
    const std::uint8_t* base = cb + comp_off(B, ci);
    alignas(64) std::uint8_t buf[128];
#pragma GCC unroll 8
    for (int cg = 0; cg < 8; ++cg) {
      const int j = 4 * cg + k, s = j / per, m = j % per;
      const __m512i V = _mm512_load_si512(base + 64 * s);
      _mm_store_si128((__m128i*)(buf + 16 * cg), _mm512_cvtepi32_epi8(_mm512_srl_epi32(V, _mm_cvtsi32_si128(8 * i + m * c.w))));
    }
    __m512i a0 = _mm512_load_si512(buf), a1 = _mm512_load_si512(buf + 64);
    if (c.w < 8) {
      const __m512i msk = _mm512_set1_epi8(char((1 << c.w) - 1));
      a0 = _mm512_and_si512(a0, msk), a1 = _mm512_and_si512(a1, msk);
      if (c.o) a0 = _mm512_slli_epi16(a0, c.o), a1 = _mm512_slli_epi16(a1, c.o);
    }
    r0 = _mm512_or_si512(r0, a0), r1 = _mm512_or_si512(r1, a1);
  }
  _mm512_storeu_si512(out, r0);
  _mm512_storeu_si512(out + 64, r1);
}

// writes codes in[128] (width-B codes) as token t of a width-B value block (clears the slot's old bits)
template <int B>
inline void insert_tok(std::uint8_t* cb, int t, const std::uint8_t* __restrict in) {
  const int k = t >> 2, i = t & 3;
  const __m512i in0 = _mm512_loadu_si512(in), in1 = _mm512_loadu_si512(in + 64);
  for (int ci = 0; ci < ncomp(B); ++ci) {
    const Comp c = comp(B, ci);
    const int per = 8 / c.w;
    std::uint8_t* base = cb + comp_off(B, ci);
    alignas(64) std::uint8_t f[128];
    __m512i f0 = in0, f1 = in1;
    if (c.w < 8) {
      if (c.o) f0 = _mm512_srli_epi16(f0, c.o), f1 = _mm512_srli_epi16(f1, c.o);
      const __m512i msk = _mm512_set1_epi8(char((1 << c.w) - 1));
      f0 = _mm512_and_si512(f0, msk), f1 = _mm512_and_si512(f1, msk);
    }
    _mm512_store_si512(f, f0);
    _mm512_store_si512(f + 64, f1);
#pragma GCC unroll 8
    for (int cg = 0; cg < 8; ++cg) {
      const int j = 4 * cg + k, s = j / per, m = j % per;
      const __m128i sh = _mm_cvtsi32_si128(8 * i + m * c.w);
      const __m512i Dv = _mm512_sll_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(f + 16 * cg))), sh);
      const __m512i M = _mm512_sll_epi32(_mm512_set1_epi32((1 << c.w) - 1), sh);
      std::uint8_t* p = base + 64 * s;
      _mm512_store_si512(p, _mm512_ternarylogic_epi32(_mm512_load_si512(p), M, Dv, 0xBA));  // (V & ~M) | D
    }
  }
}

using ExtractFn = void (*)(const std::uint8_t*, int, std::uint8_t*);
using InsertFn = void (*)(std::uint8_t*, int, const std::uint8_t*);
constexpr ExtractFn kExtract[8] = {extract_tok<1>, extract_tok<2>, extract_tok<3>, extract_tok<4>,
                                   extract_tok<5>, extract_tok<6>, extract_tok<7>, extract_tok<8>};
constexpr InsertFn kInsert[8] = {insert_tok<1>, insert_tok<2>, insert_tok<3>, insert_tok<4>,
                                 insert_tok<5>, insert_tok<6>, insert_tok<7>, insert_tok<8>};

// 2 MiB-aligned, MADV_HUGEPAGE
inline void* alloc_huge(std::size_t bytes) {
  const std::size_t H = std::size_t(2) << 20;
  bytes = (bytes + H - 1) / H * H;
  void* p = std::aligned_alloc(H, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return p;
}

struct Arena {  // bump allocator over one 2 MiB-aligned MADV_HUGEPAGE region (never freed in the prototype)
  char* base = nullptr;
  std::size_t used = 0, size = 0;
  void* take(std::size_t bytes) {
    bytes = (bytes + 63) / 64 * 64 + 64;
    if (!base || used + bytes > size) return nullptr;
    void* r = base + used;
    used += bytes;
    return r;
  }
};
struct MoveState {  // one stream's value side
  std::uint16_t* mirror = nullptr;  // [T][D] fp16 originals (2 MiB-aligned)
  std::uint8_t* mirror8 = nullptr;  // variant MIRROR8: [T][D] 8-bit codes (2 MiB-aligned)
  Arena arena;
  AVec<std::uint32_t> loc;          // [T] (b - 1) << 24 | slot
  int T = 0;
  long grows = 0;
};

// (re)allocate a bucket to cap blocks, keeping its contents; slots past the old allocation: padding (id = T)
inline void reserve_bucket(Bucket& bk, int b, int cap, int T, Arena* ar = nullptr) {
  const int old = bk.cap ? bk.cap : bk.nblk;
  if (cap <= old) return;
  auto grow = [&](auto& a, std::size_t per_blk) {
    using E = std::remove_reference_t<decltype(a[0])>;
    std::remove_reference_t<decltype(a)> n;
    void* q = ar ? ar->take(std::size_t(cap) * per_blk * sizeof(E)) : nullptr;
    if (q) n.adopt(static_cast<E*>(q), std::size_t(cap) * per_blk);
    else n.resize(std::size_t(cap) * per_blk);
    if (old) std::memcpy(n.data(), a.data(), std::size_t(old) * per_blk * sizeof(a[0]));
    a = std::move(n);
  };
  grow(bk.codes, 256 * std::size_t(b));
  grow(bk.lo, BLK), grow(bk.step, BLK), grow(bk.id, BLK), grow(bk.oval, 2 * BLK), grow(bk.oidx, 2 * BLK);
  for (std::size_t x = std::size_t(old) * BLK; x < std::size_t(cap) * BLK; ++x) bk.id[x] = std::uint16_t(T);
  bk.cap = cap;
}

// width-nb codes of a mirror row: floor((x - lo) inv) clamped to [0, 255], >> (8 - nb); outlier channels 0
inline void encode_row(const std::uint16_t* row, std::uint16_t lo_h, std::uint16_t step_h, int nb, std::uint8_t o0,
                       std::uint8_t o1, std::uint8_t* __restrict out) {
  const float st = h2f(step_h);
  const __m512 lo = _mm512_set1_ps(h2f(lo_h)), inv = _mm512_set1_ps(st > 0.0f ? 1.0f / st : 0.0f);
  const __m128i sh = _mm_cvtsi32_si128(8 - nb);
#pragma GCC unroll 8
  for (int g = 0; g < 8; ++g) {
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 16 * g)));
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(x, lo), inv), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), _mm512_set1_ps(255.0f));
    _mm_storeu_si128((__m128i*)(out + 16 * g), _mm512_cvtepi32_epi8(_mm512_srl_epi32(_mm512_cvttps_epi32(q), sh)));
  }
  out[o0] = 0;
  out[o1] = 0;
}

#ifndef HUGE_BUCKETS
#define HUGE_BUCKETS 1
#endif
constexpr bool kHugeBuckets = HUGE_BUCKETS;

struct Mover {
  std::uint32_t t;
  std::uint8_t nb;
  std::uint8_t raise;  // nb > old width (the update knows the old width): lets the mirror row be prefetched early
};

// move token `tid` of the value side to width nb
/// Removes slot x of width-b bucket src: the bucket's last token is moved into it (codes, metadata, outliers, id,
/// its index entry), and the last slot becomes padding (id T, zero metadata; its stale code bits carry weight 0).
inline void swap_remove(Bucket& src, MoveState& ms, int b, int x) {
  const int xb = x / BLK, xt = x % BLK;
  const std::size_t xo = std::size_t(xb) * 2 * BLK + xt;
  const int last = src.n - 1;
  const int lb = last / BLK, lt = last % BLK;
  const std::size_t lo_ = std::size_t(lb) * 2 * BLK + lt;
  if (x != last) {
    alignas(64) std::uint8_t lc[D];
    kExtract[b - 1](src.codes.data() + std::size_t(lb) * 256 * b, lt, lc);
    kInsert[b - 1](src.codes.data() + std::size_t(xb) * 256 * b, xt, lc);
    const std::uint16_t lid = src.id[last];
    src.lo[x] = src.lo[last], src.step[x] = src.step[last], src.id[x] = lid;
    src.oval[xo] = src.oval[lo_], src.oval[xo + BLK] = src.oval[lo_ + BLK];
    src.oidx[xo] = src.oidx[lo_], src.oidx[xo + BLK] = src.oidx[lo_ + BLK];
    ms.loc[lid] = std::uint32_t(b - 1) << 24 | std::uint32_t(x);
  }
  src.id[last] = std::uint16_t(ms.T);
  src.lo[last] = src.step[last] = 0;
  src.oval[lo_] = src.oval[lo_ + BLK] = 0;
  src.oidx[lo_] = src.oidx[lo_ + BLK] = 0;
  src.n = last;
  src.nblk = (last + BLK - 1) / BLK;
}

inline void move_token(Side& side, MoveState& ms, std::uint32_t tid, int nb) {
  const std::uint32_t L = ms.loc[tid];
  const int b = int(L >> 24) + 1, x = int(L & 0xFFFFFFu);
  Bucket& src = side.bk[b - 1];
  const int xb = x / BLK, xt = x % BLK;
  alignas(64) std::uint8_t code[D];
  // the mover's record
  const std::uint16_t lo = src.lo[x], step = src.step[x];
  const std::size_t xo = std::size_t(xb) * 2 * BLK + xt;
  const std::uint16_t ov0 = src.oval[xo], ov1 = src.oval[xo + BLK];
  const std::uint8_t oi0 = src.oidx[xo], oi1 = src.oidx[xo + BLK];
  if (nb < b) {  // lowering: narrow by a shift
    kExtract[b - 1](src.codes.data() + std::size_t(xb) * 256 * b, xt, code);
    const __m128i sh = _mm_cvtsi32_si128(b - nb);
    const __m512i msk = _mm512_set1_epi8(char(0xFF >> (b - nb)));
    _mm512_store_si512(code, _mm512_and_si512(_mm512_srl_epi16(_mm512_load_si512(code), sh), msk));
    _mm512_store_si512(code + 64, _mm512_and_si512(_mm512_srl_epi16(_mm512_load_si512(code + 64), sh), msk));
  } else {  // raising: re-encode from the mirror
#if defined(NO_MIRROR)
    std::memset(code, 0, D);  // diagnostic only: what the mirror read costs
#elif defined(MIRROR8)
    {  // variant: an 8-bit code mirror (128 B/token): the width-nb codes are code8 >> (8 - nb) (nesting)
      const std::uint8_t* r8 = ms.mirror8 + std::size_t(tid) * D;
      const __m128i sh = _mm_cvtsi32_si128(8 - nb);
      const __m512i msk = _mm512_set1_epi8(char(0xFF >> (8 - nb)));
      _mm512_store_si512(code, _mm512_and_si512(_mm512_srl_epi16(_mm512_load_si512(r8), sh), msk));
      _mm512_store_si512(code + 64, _mm512_and_si512(_mm512_srl_epi16(_mm512_load_si512(r8 + 64), sh), msk));
      code[oi0] = 0, code[oi1] = 0;
    }
#else
    encode_row(ms.mirror + std::size_t(tid) * D, lo, step, nb, oi0, oi1, code);
#endif
  }
  swap_remove(src, ms, b, x);  // from the source bucket
  // append to the destination bucket
  Bucket& dst = side.bk[nb - 1];
  const int y = dst.n, yb = y / BLK, yt = y % BLK;
  if (yb >= (dst.cap ? dst.cap : dst.nblk)) {
    reserve_bucket(dst, nb, std::max(8, 2 * (yb + 1)), ms.T, &ms.arena);
    ++ms.grows;
  }
  kInsert[nb - 1](dst.codes.data() + std::size_t(yb) * 256 * nb, yt, code);
  const std::size_t yo = std::size_t(yb) * 2 * BLK + yt;
  dst.lo[y] = lo, dst.step[y] = step, dst.id[y] = std::uint16_t(tid);
  dst.oval[yo] = ov0, dst.oval[yo + BLK] = ov1;
  dst.oidx[yo] = oi0, dst.oidx[yo + BLK] = oi1;
  ms.loc[tid] = std::uint32_t(nb - 1) << 24 | std::uint32_t(y);
  dst.n = y + 1;
  dst.nblk = yb + 1;
}

#ifndef MV_PFM
#define MV_PFM 24  // mirror rows of raisers this many movers ahead (0: with the slot, MV_PF2 ahead)
#endif
// prefetch (for writing) what moving token tid to nb will touch: its slot's code lines and metadata, and
// (raising) its mirror row; the source bucket's last slot's index entry (a guess: that bucket's tail may move
// before this mover's turn)
inline void prefetch_move(const Side& side, const MoveState& ms, std::uint32_t tid, int nb, bool tail) {
  const std::uint32_t L = ms.loc[tid];
  const int b = int(L >> 24) + 1, x = int(L & 0xFFFFFFu);
  const Bucket& bk = side.bk[b - 1];
  const int xb = x / BLK, xt = x % BLK, k = xt >> 2;
  const std::uint8_t* cb = bk.codes.data() + std::size_t(xb) * 256 * b;
  for (int ci = 0; ci < ncomp(b); ++ci) {
    const Comp c = comp(b, ci);
    const int per = 8 / c.w, off = comp_off(b, ci);
    if (per >= 4) {  // w <= 2: every vector of the component holds the token's fields
      for (int s = 0; s < 4 * c.w; ++s) __builtin_prefetch(cb + off + 64 * s, 1, 3);
    } else {
      for (int cg = 0; cg < 8; ++cg) __builtin_prefetch(cb + off + 64 * ((4 * cg + k) / per), 1, 3);
    }
  }
  __builtin_prefetch(bk.lo.data() + x, 1, 3);
  __builtin_prefetch(bk.step.data() + x, 1, 3);
  __builtin_prefetch(bk.id.data() + x, 1, 3);
  const std::size_t xo = std::size_t(xb) * 2 * BLK + xt;
  __builtin_prefetch(bk.oval.data() + xo, 1, 3);
  __builtin_prefetch(bk.oval.data() + xo + BLK, 1, 3);
  __builtin_prefetch(bk.oidx.data() + xo, 1, 3);
  if (nb > b && MV_PFM <= 0) {
#ifdef MIRROR8
    const char* row = reinterpret_cast<const char*>(ms.mirror8 + std::size_t(tid) * D);
    for (int l = 0; l < 2; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T0);
#else
    const char* row = reinterpret_cast<const char*>(ms.mirror + std::size_t(tid) * D);
    for (int l = 0; l < 4; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T0);
#endif
  }
  if (tail && bk.n > 0) __builtin_prefetch(ms.loc.data() + bk.id[bk.n - 1], 1, 3);
}

#ifndef MV_PF1
#define MV_PF1 16  // index entries this many movers ahead
#endif
#ifndef MV_PF2
#define MV_PF2 6   // slots / mirror rows this many movers ahead
#endif
#ifndef MV_PF3
#define MV_PF3 2   // the source bucket's tail index entry this many ahead
#endif
inline void pf_mirror_row(const MoveState& ms, std::uint32_t tid) {
#ifdef MIRROR8
  const char* row = reinterpret_cast<const char*>(ms.mirror8 + std::size_t(tid) * D);
  for (int l = 0; l < 2; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T0);
#else
  const char* row = reinterpret_cast<const char*>(ms.mirror + std::size_t(tid) * D);
  for (int l = 0; l < 4; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T0);
#endif
}
inline void move_stream(Stream& st, MoveState& ms, const Mover* mv, int n) {
  if (MV_PFM > 0)
    for (int i = 0; i < std::min(n, MV_PFM); ++i)
      if (mv[i].raise) pf_mirror_row(ms, mv[i].t);
  for (int i = 0; i < std::min(n, MV_PF1); ++i) __builtin_prefetch(ms.loc.data() + mv[i].t, 1, 3);
  for (int i = 0; i < std::min(n, MV_PF2); ++i) prefetch_move(st.v, ms, mv[i].t, mv[i].nb, false);
  for (int i = 0; i < n; ++i) {
    if (MV_PFM > 0 && i + MV_PFM < n && mv[i + MV_PFM].raise) pf_mirror_row(ms, mv[i + MV_PFM].t);
    if (i + MV_PF1 < n) __builtin_prefetch(ms.loc.data() + mv[i + MV_PF1].t, 1, 3);
    if (i + MV_PF2 < n) prefetch_move(st.v, ms, mv[i + MV_PF2].t, mv[i + MV_PF2].nb, false);
    if (MV_PF3 > 0 && i + MV_PF3 < n) {
      const std::uint32_t L = ms.loc[mv[i + MV_PF3].t];
      const Bucket& bk = st.v.bk[L >> 24];
      if (bk.n > 0) __builtin_prefetch(ms.loc.data() + bk.id[bk.n - 1], 1, 3);
    }
    move_token(st.v, ms, mv[i].t, mv[i].nb);
  }
}

// Batched variant: (0) gather the movers' slots from the index, sort them by (width, slot) descending; (1) remove
// them bucket by bucket from the highest slot down (the bucket's tail is then never a pending mover, so the
// gathered slots stay valid; the accesses sweep each bucket downwards: prefetchable, few random lines),
// staging each mover's record (metadata + its narrowed codes when lowering); (2) append them in the given order
// (raisers re-encoded from the mirror, prefetched ahead). Same layout invariants as move_token.
struct MoveScratch {
  std::vector<std::uint64_t> key;
  AVec<std::uint8_t> code;  // [n][D] staged codes (lowering)
  std::vector<std::uint8_t> ob;  // [n] old width
  std::vector<std::uint16_t> lo, step, oval;  // [n], [n], [2n]
  std::vector<std::uint8_t> oidx;             // [2n]
  void reserve(std::size_t n) {
    key.resize(n), code.resize(n * D), ob.resize(n), lo.resize(n), step.resize(n), oval.resize(2 * n), oidx.resize(2 * n);
  }
};

inline void move_stream_sorted(Stream& st, MoveState& ms, const Mover* mv, int n, MoveScratch& sc) {
  Side& side = st.v;
  if (sc.key.size() < std::size_t(n)) sc.reserve(std::size_t(n));
  // (0)
  for (int i = 0; i < std::min(n, 16); ++i) _mm_prefetch((const char*)(ms.loc.data() + mv[i].t), _MM_HINT_T0);
  for (int i = 0; i < n; ++i) {
    if (i + 16 < n) _mm_prefetch((const char*)(ms.loc.data() + mv[i + 16].t), _MM_HINT_T0);
    const std::uint32_t L = ms.loc[mv[i].t];
    sc.key[i] = std::uint64_t(L) << 16 | std::uint64_t(i);  // (b - 1) << 40 | slot << 16 | i
  }
  std::sort(sc.key.begin(), sc.key.begin() + n, std::greater<std::uint64_t>());
  // (1)
  auto pf_slot = [&](std::uint64_t kk) {
    const int b = int(kk >> 40) + 1, x = int((kk >> 16) & 0xFFFFFFu);
    const Bucket& bk = side.bk[b - 1];
    const int xb = x / BLK, xt = x % BLK;
    const std::uint8_t* cb = bk.codes.data() + std::size_t(xb) * 256 * b;
    for (int l = 0; l < 4 * b; ++l) __builtin_prefetch(cb + 64 * l, 1, 3);
    const std::size_t xo = std::size_t(xb) * 2 * BLK + xt;
    __builtin_prefetch(bk.lo.data() + x, 1, 3), __builtin_prefetch(bk.step.data() + x, 1, 3);
    __builtin_prefetch(bk.id.data() + x, 1, 3), __builtin_prefetch(bk.oval.data() + xo, 1, 3);
    __builtin_prefetch(bk.oidx.data() + xo, 1, 3);
  };
  constexpr int PF = 4;
  for (int r = 0; r < std::min(n, PF); ++r) pf_slot(sc.key[r]);
  for (int r = 0; r < n; ++r) {
    if (r + PF < n) pf_slot(sc.key[r + PF]);
    const std::uint64_t kk = sc.key[r];
    const int i = int(kk & 0xFFFFu), b = int(kk >> 40) + 1, x = int((kk >> 16) & 0xFFFFFFu);
    const int nb = mv[i].nb;
    Bucket& src = side.bk[b - 1];
    const int xb = x / BLK, xt = x % BLK;
    const std::size_t xo = std::size_t(xb) * 2 * BLK + xt;
    sc.ob[i] = std::uint8_t(b);
    sc.lo[i] = src.lo[x], sc.step[i] = src.step[x];
    sc.oval[2 * i] = src.oval[xo], sc.oval[2 * i + 1] = src.oval[xo + BLK];
    sc.oidx[2 * i] = src.oidx[xo], sc.oidx[2 * i + 1] = src.oidx[xo + BLK];
    if (nb < b) {
      std::uint8_t* code = sc.code.data() + std::size_t(i) * D;
      kExtract[b - 1](src.codes.data() + std::size_t(xb) * 256 * b, xt, code);
      const __m128i sh = _mm_cvtsi32_si128(b - nb);
      const __m512i msk = _mm512_set1_epi8(char(0xFF >> (b - nb)));
      _mm512_store_si512(code, _mm512_and_si512(_mm512_srl_epi16(_mm512_load_si512(code), sh), msk));
      _mm512_store_si512(code + 64, _mm512_and_si512(_mm512_srl_epi16(_mm512_load_si512(code + 64), sh), msk));
    }
    swap_remove(src, ms, b, x);
  }
  // (2)
  constexpr int PM = 8;
  auto pf_mirror = [&](int i) {
    if (mv[i].nb > sc.ob[i]) {
      const char* row = reinterpret_cast<const char*>(ms.mirror + std::size_t(mv[i].t) * D);
      for (int l = 0; l < 4; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T0);
    }
  };
  for (int i = 0; i < std::min(n, PM); ++i) pf_mirror(i);
  for (int i = 0; i < n; ++i) {
    if (i + PM < n) pf_mirror(i + PM);
    const std::uint32_t tid = mv[i].t;
    const int nb = mv[i].nb, b = sc.ob[i];
    std::uint8_t* code = sc.code.data() + std::size_t(i) * D;
    if (nb > b) encode_row(ms.mirror + std::size_t(tid) * D, sc.lo[i], sc.step[i], nb, sc.oidx[2 * i], sc.oidx[2 * i + 1], code);
    Bucket& dst = side.bk[nb - 1];
    const int y = dst.n, yb = y / BLK, yt = y % BLK;
    if (yb >= (dst.cap ? dst.cap : dst.nblk)) {
      reserve_bucket(dst, nb, std::max(8, 2 * (yb + 1)), ms.T, &ms.arena);
      ++ms.grows;
    }
    kInsert[nb - 1](dst.codes.data() + std::size_t(yb) * 256 * nb, yt, code);
    const std::size_t yo = std::size_t(yb) * 2 * BLK + yt;
    dst.lo[y] = sc.lo[i], dst.step[y] = sc.step[i], dst.id[y] = std::uint16_t(tid);
    dst.oval[yo] = sc.oval[2 * i], dst.oval[yo + BLK] = sc.oval[2 * i + 1];
    dst.oidx[yo] = sc.oidx[2 * i], dst.oidx[yo + BLK] = sc.oidx[2 * i + 1];
    ms.loc[tid] = std::uint32_t(nb - 1) << 24 | std::uint32_t(y);
    dst.n = y + 1;
    dst.nblk = yb + 1;
  }
}

// exact check of a value side against the logical data: every slot's id / metadata / outliers / codes, the index,
// padding ids; returns the number of mismatches
inline long validate_values(const Side& side, const std::vector<TokenSide>& toks, const MoveState& ms, int T) {
  long bad = 0, seen = 0;
  for (int b = 1; b <= 8; ++b) {
    const Bucket& bk = side.bk[b - 1];
    if (bk.nblk != (bk.n + BLK - 1) / BLK) ++bad;
    for (int x = 0; x < bk.nblk * BLK; ++x) {
      const int xb = x / BLK, xt = x % BLK;
      const std::uint16_t id = bk.id[x];
      if (x >= bk.n) { bad += id != T; continue; }
      ++seen;
      if (id >= T) { ++bad; continue; }
      const TokenSide& s = toks[id];
      const std::size_t xo = std::size_t(xb) * 2 * BLK + xt;
      bad += s.b != b;
      bad += ms.loc[id] != (std::uint32_t(b - 1) << 24 | std::uint32_t(x));
      bad += bk.lo[x] != s.lo || bk.step[x] != s.step;
      bad += bk.oval[xo] != s.oval[0] || bk.oval[xo + BLK] != s.oval[1] || bk.oidx[xo] != s.oidx[0] || bk.oidx[xo + BLK] != s.oidx[1];
      alignas(64) std::uint8_t c[D];
      kExtract[b - 1](bk.codes.data() + std::size_t(xb) * 256 * b, xt, c);
      for (int ch = 0; ch < D; ++ch) {
        const std::uint8_t want = (ch == s.oidx[0] || ch == s.oidx[1]) ? 0 : s.code[ch];
        bad += c[ch] != want;
      }
    }
  }
  bad += seen != T;
  return bad;
}

}  // namespace proto

using namespace proto;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
static double pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(p * double(v.size() - 1) + 0.5))];
}

int main(int argc, char** argv) {
  const int T = argc > 1 ? std::atoi(argv[1]) : 32768;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 40;
  const bool check_only = argc > 3 && std::string(argv[3]) == "check";
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vbmi") || !__builtin_cpu_supports("gfni")) {
    std::fprintf(stderr, "kvc_qaq_blocked_prototype: needs AVX-512 VNNI, VBMI and GFNI, which this CPU lacks\n");
    return 2;
  }
  const bool moves_only = argc > 3 && std::string(argv[3]) == "moves";  // skip the attention / floor timings
  std::printf("T=%d steps=%d threads(max)=%d\n", T, steps, omp_get_max_threads());
  // data
  std::vector<StreamData> sd(KVH);
  std::vector<Stream> st(KVH);
  double wsum[2] = {0, 0};
  long hist[2][9] = {};
  for (int s = 0; s < KVH; ++s) {
    std::mt19937 rng(1000 + s);
    sd[s].k.resize(T);
    sd[s].v.resize(T);
    for (int t = 0; t < T; ++t) {
      make_side(sd[s].k[t], rng, true);
      make_side(sd[s].v[t], rng, false);
      wsum[0] += sd[s].k[t].b, wsum[1] += sd[s].v[t].b;
      hist[0][sd[s].k[t].b]++, hist[1][sd[s].v[t].b]++;
    }
    st[s].T = T;
    build_side(st[s].k, sd[s].k, true, rng, T);
    build_side(st[s].v, sd[s].v, false, rng, T);
  }
  std::printf("mean width: keys %.3f values %.3f\n", wsum[0] / (double(T) * KVH), wsum[1] / (double(T) * KVH));
  for (int side = 0; side < 2; ++side) {
    std::printf("  %s width histogram:", side ? "values" : "keys");
    for (int b = 1; b <= 8; ++b) std::printf(" %d:%.4f", b, double(hist[side][b]) / (double(T) * KVH));
    std::printf("\n");
  }
  // bytes
  double rec_bytes = 0, blk_bytes = 0;
  for (int s = 0; s < KVH; ++s)
    for (int side = 0; side < 2; ++side) {
      const Side& sdd = side ? st[s].v : st[s].k;
      for (int b = 1; b <= 8; ++b) {
        const Bucket& bk = sdd.bk[b - 1];
        rec_bytes += double(bk.n) * (4 + 16 * b + 6 + 2);
        blk_bytes += double(bk.nblk) * (256.0 * b + BLK * (2 + 2 + 2 + 2 * 2 + 2));
      }
    }
  std::printf("bytes per token per side: record layout %.3f, blocked layout %.3f (incl. padding of partial blocks); "
              "blocked + value-side move index (loc, 4 B per value token): %.3f\n",
              rec_bytes / (2.0 * T * KVH), blk_bytes / (2.0 * T * KVH), (blk_bytes + 4.0 * T * KVH) / (2.0 * T * KVH));

  // query (same generator as the library's benchmark)
  const std::vector<float> q = kvc_bench::bench_query();  // [32][128], head 4 s + h = stream s head h
  std::vector<float> out(std::size_t(KVH) * 4 * D), pr(std::size_t(KVH) * T);
  const int nthr = omp_get_max_threads();
  std::vector<Scratch> scr(nthr);
  for (auto& sc : scr) {
    sc.s.resize(std::size_t(T + 1) * 4 + 16);
    sc.ot.resize(std::size_t(D) * 4);
  }
  auto attention = [&](PassTimes* pt = nullptr) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int s = 0; s < KVH; ++s)
      run_stream(st[s], q.data() + std::size_t(s) * 4 * D, out.data() + std::size_t(s) * 4 * D, pr.data() + std::size_t(s) * T,
                 scr[omp_get_thread_num()], pt);
  };

  // correctness: streams 0 and 5
  auto check = [&](const char* tag) {
  attention();
  for (int s : {0, 5}) {
    std::vector<double> ro(4 * D), rp(T);
    reference(sd[s], q.data() + std::size_t(s) * 4 * D, ro.data(), rp.data());
    double maxrel = 0, maxp = 0, pmax = 0;
    for (int h = 0; h < 4; ++h) {
      double nrm = 0, err = 0;
      for (int c = 0; c < D; ++c) {
        nrm = std::max(nrm, std::fabs(ro[h * D + c]));
        err = std::max(err, std::fabs(ro[h * D + c] - double(out[std::size_t(s) * 4 * D + h * D + c])));
      }
      double l2 = 0, l2e = 0;
      for (int c = 0; c < D; ++c) {
        l2 += ro[h * D + c] * ro[h * D + c];
        const double d_ = ro[h * D + c] - double(out[std::size_t(s) * 4 * D + h * D + c]);
        l2e += d_ * d_;
      }
      maxrel = std::max(maxrel, std::sqrt(l2e / l2));
      (void)nrm;
      (void)err;
    }
    double maxprel = 0;
    for (int t = 0; t < T; ++t) {
      const double d_ = std::fabs(rp[t] - double(pr[std::size_t(s) * T + t]));
      maxp = std::max(maxp, d_);
      pmax = std::max(pmax, rp[t]);
      if (rp[t] > 1e-6) maxprel = std::max(maxprel, d_ / rp[t]);
    }
    std::printf("stream %d: output max_h ||o - o_ref|| / ||o_ref|| = %.3e; token max prob: max abs err %.3e (largest p %.3e), "
                "max rel err (p > 1e-6) %.3e\n",
                s, maxrel, maxp, pmax, maxprel);
    std::printf("  [%s]\n", tag);
  }
  };
  check("as built");
  if (check_only) return 0;
  if (argc > 3 && std::string(argv[3]) == "prof") {  // just our attention, for perf
    for (int i = 0; i < steps; ++i) attention();
    return 0;
  }

  // KIVI-2 baseline
  const auto kivi = kvc_bench::build_cache<kvc::schemes::Kivi2>(T);
  std::vector<float> kout(q.size());
  const auto qv = kvc::QueryView::contiguous(q.data(), 1, 32, 128);
  const auto ov = kvc::OutputView::contiguous(kout.data(), 1, 32, 128);
  using clk = std::chrono::steady_clock;
  auto secs = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  const double per = 1e9 / (double(T) * KVH);  // seconds -> ns per (token, KV head)
  double att_ns[2] = {}, kivi_ns[2] = {}, floor_ms[2] = {};
  for (int cold = 0; cold < (moves_only ? 0 : 2); ++cold) {
    std::vector<double> a_ours, a_kivi, ratio;
    for (int i = 0; i < 3; ++i) attention(), kvc::decode_attention(*kivi, 0, qv, ov);  // warm-up
    for (int i = 0; i < steps; ++i) {
      if (cold) kvc_bench::flush_caches();
      auto t0 = clk::now();
      kvc::decode_attention(*kivi, 0, qv, ov);
      auto t1 = clk::now();
      benchmark::DoNotOptimize(kout.data());
      if (cold) kvc_bench::flush_caches();
      auto t2 = clk::now();
      attention();
      auto t3 = clk::now();
      benchmark::DoNotOptimize(out.data());
      a_kivi.push_back(secs(t0, t1) * per);
      a_ours.push_back(secs(t2, t3) * per);
      ratio.push_back(secs(t2, t3) / secs(t0, t1));
    }
    att_ns[cold] = median(a_ours), kivi_ns[cold] = median(a_kivi);
    std::printf("%s threads=%d: blocked QAQ %.2f ns/(tok,kvh) [p10 %.2f p90 %.2f] | KIVI-2 %.2f [p10 %.2f p90 %.2f] | "
                "ratio median %.3f [p10 %.3f p90 %.3f]\n",
                cold ? "cold" : "warm", nthr, median(a_ours), pct(a_ours, 0.1), pct(a_ours, 0.9), median(a_kivi),
                pct(a_kivi, 0.1), pct(a_kivi, 0.9), median(ratio), pct(ratio, 0.1), pct(ratio, 0.9));
  }
  // breakdown: single stream loop on this thread, warm
  if (nthr == 1 && !moves_only) {
    std::vector<double> kk, ss, vv;
    for (int i = 0; i < steps; ++i) {
      PassTimes pt;
      for (int s = 0; s < KVH; ++s)
        run_stream(st[s], q.data() + std::size_t(s) * 4 * D, out.data() + std::size_t(s) * 4 * D, pr.data() + std::size_t(s) * T,
                   scr[0], &pt);
      kk.push_back(pt.key * per), ss.push_back(pt.smax * per), vv.push_back(pt.val * per);
    }
    std::printf("breakdown (1 thread, warm) ns/(tok,kvh): key pass %.2f [p10 %.2f p90 %.2f], softmax+token max %.2f [%.2f %.2f], "
                "value pass %.2f [%.2f %.2f]\n",
                median(kk), pct(kk, .1), pct(kk, .9), median(ss), pct(ss, .1), pct(ss, .9), median(vv), pct(vv, .1), pct(vv, .9));
  }
  // width-update floor
  std::vector<UpdState> us(KVH);
  {
    for (int s = 0; s < 256; ++s) {
      for (int k = 0; k < 7; ++k) g_limits[s][k] = std::int16_t(std::min(32767, 0x1000 + 0x300 * k + 8 * s));
      g_limits[s][7] = 32767;
    }
    fit_log2();
    {  // check the codes against floor(-8 log2 p) on this step's probabilities
      long bad = 0;
      UpdState u1;
      u1.hist.resize(std::size_t(5) * T + 64);
      u1.stepk.resize(T + 64);
      u1.width.resize(T + 64);
      u1.movers.resize(T + 64);
      update_widths(u1, pr.data(), T);
      for (int t = 0; t < T; ++t) {
        const float p = pr[t];
        const int ref = p < 1e-30f ? 255 : int(std::min(255.0, std::max(0.0, std::floor(-8.0 * std::log2(double(p))))));
        bad += ref != u1.hist[t];
      }
      std::printf("probability codes differing from floor(-8 log2 p): %ld of %d\n", bad, T);
    }
    for (int s = 0; s < KVH; ++s) {
      us[s].hist.resize(std::size_t(5) * T + 64);
      std::memset(us[s].hist.data(), 255, std::size_t(5) * T);
      us[s].stepk.resize(T + 64);
      us[s].width.resize(T + 64);
      us[s].movers.resize(T + 64);
      for (int t = 0; t < T; ++t) {
        us[s].stepk[t] = sd[s].v[t].step;
        us[s].width[t] = std::uint8_t(sd[s].v[t].b);
      }
    }
    for (int cold = 0; cold < (moves_only ? 0 : 2); ++cold) {
      std::vector<double> tu;
      long moved = 0;
      for (int i = 0; i < steps; ++i) {
        if (cold) kvc_bench::flush_caches();
        auto t0 = clk::now();
        long m = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : m)
        for (int s = 0; s < KVH; ++s) m += update_widths(us[s], pr.data() + std::size_t(s) * T, T);
        auto t1 = clk::now();
        moved += m;
        tu.push_back(secs(t0, t1) * 1e3);
      }
      floor_ms[cold] = median(tu);
      std::printf("width-update floor %s threads=%d: %.4f ms/step [p10 %.4f p90 %.4f] (%.2f ns/(tok,kvh)); movers/step %.0f\n",
                  cold ? "cold" : "warm", nthr, median(tu), pct(tu, .1), pct(tu, .9), median(tu) * 1e6 / (double(T) * KVH),
                  double(moved) / steps);
    }
  }

  // ------------------------------------------------------------ moves (value side)
  {
    const double mover_frac = 0.07;
    std::vector<std::vector<std::uint8_t>> code8(KVH);  // [T][D] 8-bit codes nesting the width-b codes
    std::vector<MoveState> ms(KVH);
    long mirror_bad = 0;
    for (int s = 0; s < KVH; ++s) {
      std::mt19937 rng(5000 + s);
      code8[s].resize(std::size_t(T) * D);
      ms[s].T = T;
      ms[s].mirror = static_cast<std::uint16_t*>(alloc_huge(std::size_t(T) * D * 2));
      ms[s].loc.resize(T);
#ifdef MIRROR8
      ms[s].mirror8 = static_cast<std::uint8_t*>(alloc_huge(std::size_t(T) * D));
#endif
      if (kHugeBuckets) {  // value buckets (and their growth) from a hugepage arena: 2x the built size
        ms[s].arena.size = std::size_t(T) * 2 * 64 + (std::size_t(8) << 20);
        ms[s].arena.base = static_cast<char*>(alloc_huge(ms[s].arena.size));
        ms[s].loc.adopt(static_cast<std::uint32_t*>(ms[s].arena.take(std::size_t(T) * 4 + 64)), T);
      }
      for (int t = 0; t < T; ++t) {
        const TokenSide& v = sd[s].v[t];
        std::uint8_t* c8 = code8[s].data() + std::size_t(t) * D;
        const float lo = h2f(v.lo), step = h2f(v.step);
        for (int c = 0; c < D; ++c) {
          const unsigned low = (v.b < 8) ? unsigned(rng()) & ((1u << (8 - v.b)) - 1u) : 0u;
          c8[c] = std::uint8_t((unsigned(v.code[c]) << (8 - v.b)) | low);
          ms[s].mirror[std::size_t(t) * D + c] = f2h(lo + (float(c8[c]) + 0.5f) * step);
#ifdef MIRROR8
          ms[s].mirror8[std::size_t(t) * D + c] = c8[c];
#endif
        }
        for (int j = 0; j < 2; ++j) ms[s].mirror[std::size_t(t) * D + v.oidx[j]] = v.oval[j];
        alignas(64) std::uint8_t e[D];  // the mirror must re-encode to the codes
        encode_row(ms[s].mirror + std::size_t(t) * D, v.lo, v.step, 8, v.oidx[0], v.oidx[1], e);
        for (int c = 0; c < D; ++c)
          if (c != v.oidx[0] && c != v.oidx[1]) mirror_bad += e[c] != c8[c];
      }
      for (int b = 1; b <= 8; ++b) {
        Bucket& bk = st[s].v.bk[b - 1];
        for (int x = 0; x < bk.n; ++x) ms[s].loc[bk.id[x]] = std::uint32_t(b - 1) << 24 | std::uint32_t(x);
        reserve_bucket(bk, b, bk.nblk + bk.nblk / 4 + 4, T, kHugeBuckets ? &ms[s].arena : nullptr);
      }
    }
    long vbad = 0;
    for (int s = 0; s < KVH; ++s) vbad += validate_values(st[s].v, sd[s].v, ms[s], T);
    std::printf("moves: mirror re-encoding mismatches %ld; layout/index validation mismatches (as built) %ld\n", mirror_bad, vbad);

    // movers: pairs of random tokens of different widths swap widths (one lowered, one raised; the width
    // histogram stays exactly the same), fresh each step, 7 % of the tokens per stream
    std::vector<std::vector<Mover>> mv(KVH);
    std::vector<std::vector<std::uint32_t>> stamp(KVH, std::vector<std::uint32_t>(T, 0));
    std::vector<std::mt19937> mrng;
    for (int s = 0; s < KVH; ++s) mrng.emplace_back(7000 + s);
    std::uint32_t stepno = 0;
    long nlow = 0, nraise = 0;
    auto gen_movers = [&]() {
      ++stepno;
      for (int s = 0; s < KVH; ++s) {
        auto& m = mv[s];
        m.clear();
        const int want = int(mover_frac * T) / 2 * 2;
        std::uniform_int_distribution<int> td(0, T - 1);
        while (int(m.size()) < want) {
          const int a = td(mrng[s]), b = td(mrng[s]);
          if (stamp[s][a] == stepno || stamp[s][b] == stepno) continue;
          const int wa = sd[s].v[a].b, wb = sd[s].v[b].b;
          if (wa == wb) continue;
          stamp[s][a] = stamp[s][b] = stepno;
          m.push_back({std::uint32_t(a), std::uint8_t(wb), std::uint8_t(wb > wa)});
          m.push_back({std::uint32_t(b), std::uint8_t(wa), std::uint8_t(wa > wb)});
        }
        std::shuffle(m.begin(), m.end(), mrng[s]);
        // the logical data (the reference's) follows: width nb, codes = code8 >> (8 - nb)
        for (const Mover& x : m) {
          TokenSide& v = sd[s].v[x.t];
          (x.nb < v.b ? nlow : nraise)++;
          v.b = x.nb;
          const std::uint8_t* c8 = code8[s].data() + std::size_t(x.t) * D;
          for (int c = 0; c < D; ++c) v.code[c] = std::uint8_t(c8[c] >> (8 - x.nb));
        }
      }
    };
    std::vector<MoveScratch> msc(KVH);
    int scheme = 1;  // 0: per mover (move_token), 1: batched (move_stream_sorted)
    auto do_moves = [&]() {
#pragma omp parallel for schedule(dynamic, 1)
      for (int s = 0; s < KVH; ++s) {
        if (scheme) move_stream_sorted(st[s], ms[s], mv[s].data(), int(mv[s].size()), msc[s]);
        else move_stream(st[s], ms[s], mv[s].data(), int(mv[s].size()));
      }
    };
    auto bytes_report = [&]() {
      double blk_bytes = 0;
      for (int s = 0; s < KVH; ++s)
        for (int b = 1; b <= 8; ++b) blk_bytes += double(st[s].v.bk[b - 1].nblk) * (256.0 * b + BLK * (2 + 2 + 2 + 2 * 2 + 2));
      return blk_bytes / (double(T) * KVH);
    };
    // correctness after a few steps of moves (both schemes)
    for (int i = 0; i < 5; ++i) scheme = i & 1, gen_movers(), do_moves();
    vbad = 0;
    for (int s = 0; s < KVH; ++s) vbad += validate_values(st[s].v, sd[s].v, ms[s], T);
    std::printf("after 5 steps of moves: layout/index validation mismatches %ld (lowered %ld raised %ld)\n", vbad, nlow, nraise);
    check("after 5 steps of moves");
    // timing
    double mv_ms[2] = {}, mv_ms0[2] = {};
    for (int sch = 0; sch < 2; ++sch)
    for (int cold = 0; cold < (moves_only ? 1 : 2); ++cold) {
      scheme = sch;
      std::vector<double> tm, nsrec;
      long moved = 0, grows0 = 0;
      for (int s = 0; s < KVH; ++s) grows0 += ms[s].grows;
      for (int i = 0; i < steps; ++i) {
        gen_movers();  // untimed: the update's output
        long m = 0;
        for (int s = 0; s < KVH; ++s) m += long(mv[s].size());
        if (cold) kvc_bench::flush_caches();
        auto t0 = clk::now();
        do_moves();
        auto t1 = clk::now();
        moved += m;
        tm.push_back(secs(t0, t1) * 1e3);
        nsrec.push_back(secs(t0, t1) * 1e9 / double(m));
      }
      long grows = -grows0;
      for (int s = 0; s < KVH; ++s) grows += ms[s].grows;
      (sch ? mv_ms : mv_ms0)[cold] = median(tm);
      std::printf("moves [%s] %s threads=%d: %.4f ms/step [p10 %.4f p90 %.4f]; %.1f ns per moved record (wall) = %.1f ns per record "
                  "per thread; movers/step %.0f; bucket grows %ld\n",
                  sch ? "batched" : "per-mover", cold ? "cold" : "warm", nthr, median(tm), pct(tm, .1), pct(tm, .9), median(nsrec), median(nsrec) * nthr,
                  double(moved) / steps, grows);
    }
    vbad = 0;
    for (int s = 0; s < KVH; ++s) vbad += validate_values(st[s].v, sd[s].v, ms[s], T);
    std::printf("after %d steps of moves: layout/index validation mismatches %ld (lowered %ld raised %ld)\n", 5 + 4 * steps, vbad,
                nlow, nraise);
    check("after all steps of moves");
    {
      long hv[9] = {};
      for (int s = 0; s < KVH; ++s)
        for (int b = 1; b <= 8; ++b) hv[b] += st[s].v.bk[b - 1].n;
      std::printf("  values width histogram after moves:");
      for (int b = 1; b <= 8; ++b) std::printf(" %d:%.4f", b, double(hv[b]) / (double(T) * KVH));
      std::printf("\n");
    }
    std::printf("value-side bytes per token after moves: blocked %.3f + index 4 (+ fp16 mirror %d, kept by the library anyway)\n",
                bytes_report(), 2 * D);
    // attention after the moves (warm), against KIVI-2 again
    {
      std::vector<double> a_ours, a_kivi;
      for (int i = 0; i < 3; ++i) attention(), kvc::decode_attention(*kivi, 0, qv, ov);
      for (int i = 0; i < steps; ++i) {
        auto t0 = clk::now();
        kvc::decode_attention(*kivi, 0, qv, ov);
        auto t1 = clk::now();
        attention();
        auto t2 = clk::now();
        a_kivi.push_back(secs(t0, t1) * per), a_ours.push_back(secs(t1, t2) * per);
      }
      std::printf("attention after moves warm threads=%d: blocked QAQ %.2f ns/(tok,kvh) | KIVI-2 %.2f | ratio %.3f\n", nthr,
                  median(a_ours), median(a_kivi), median(a_ours) / median(a_kivi));
    }
    const double toms = double(T) * KVH * 1e-6;  // ns/(tok,kvh) -> ms per step
    for (int cold = 0; cold < 2 && !moves_only; ++cold) {  // "moves" times neither the attention nor the floor
      const double a = att_ns[cold] * toms, k = kivi_ns[cold] * toms;
      for (int sch = 0; sch < 2; ++sch) {
        const double m = sch ? mv_ms[cold] : mv_ms0[cold];
        std::printf("WHOLE STEP [%s] %s threads=%d: attention %.3f + floor %.3f + moves %.3f = %.3f ms vs KIVI-2 attention %.3f ms -> "
                    "%.3fx (moves alone %.3fx)\n",
                    sch ? "batched" : "per-mover", cold ? "cold" : "warm", nthr, a, floor_ms[cold], m, a + floor_ms[cold] + m, k,
                    (a + floor_ms[cold] + m) / k, m / k);
      }
    }
  }
  return 0;
}
