/// \file decode_attention.hpp
/// Fused CPU decode attention over a compressed cache: one query token per sequence, H query heads
/// over H_kv KV heads (GQA: query head h reads KV head h / (H / H_kv)), softmax(q.K^T * scale) . V
/// with an online softmax (base 2, log2(e) folded into the query). Packed codes are read block by
/// block; scales and zeros are folded into the dot products and never expanded into K/V:
///   keys, per-channel groups:  q.k_t = sum_c (q_c s_c) k^_tc + sum_c q_c z_c
///   keys, per-token groups:    q.k_t = sum_g s_tg (sum_{c in g} q_c k^_tc) + sum_g z_tg (sum_{c in g} q_c)
///   values, per-token groups:  o_c  += sum_t (p_t s_tg) v^_tc + sum_t p_t z_tg
///   values, per-channel:       o_c  += s_c sum_t p_t v^_tc + z_c sum_t p_t
/// Codes of <= 4 bits use integer dot products (VNNI `vpdpbusd` on AVX-512, its exact emulation on
/// AVX2 and in portable code), like llama.cpp's q8 activations: per block, the folded query is
/// rounded to int8 (127 levels per head) and the value weights p_t*s_t to uint8 (255 levels per head
/// and group). This adds at most, per score, (max_c |q'_c| / 254) * sum_c k^_tc, and per output,
/// (max_t w_t / 510) * sum_t v^_tc * (its scale); a centring correction removes the part that
/// meets the codes' mean. With strong key outlier channels (12x) the int8 query error can reach
/// ~0.85x the RMS of the 4-bit quantization error itself (tests/test_attention.cpp measures it).
/// 5..8-bit codes and uncompressed blocks use float FMAs. Parallel over (sequence, KV head, split of
/// blocks) with OpenMP; splits are merged flash-decoding style. Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/core/aligned_buffer.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/view.hpp>

#define KVC_ATTENTION_INTERNAL
#include <kvc/attention/detail/simd.hpp>
#undef KVC_ATTENTION_INTERNAL

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif
#if defined(__SSE__) || defined(__x86_64__)
#  include <xmmintrin.h>
#endif

KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
#ifndef KVC_PREFETCH_BYTES
#  define KVC_PREFETCH_BYTES 32768  ///< bytes of K+V blocks the CPU decode attention prefetches ahead (0: none)
#endif
#ifndef KVC_PREFETCH_LOCALITY
#  define KVC_PREFETCH_LOCALITY 1  ///< __builtin_prefetch locality of that prefetch (1: into L2, not L1)
#endif

namespace kvc {

struct AttentionOptions {
  float scale = 0.0f;   ///< softmax scale; 0 means 1/sqrt(head_dim)
  int num_threads = 0;  ///< 0 means all OpenMP threads
  int min_blocks_per_split = 16;  ///< flash-decoding split granularity when sequences x heads < threads
};

namespace detail {

inline constexpr float kLog2e = 1.4426950408889634f;

/// Sets flush-to-zero / denormals-are-zero for this thread's lifetime of the object (x86 only).
class FlushDenormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

/// Decode attention for one cache layout. Stateless apart from per-thread scratch.
template <class Layout>
class DecodeKernel {
  using P = typename Layout::Params;
  using KF = typename Layout::key_format;
  using VF = typename Layout::value_format;
  using W = typename Layout::window_t;
  using F = simd::VecF;
  using I = simd::VecI;
  static constexpr int B = Layout::kBlockTokens;
  static constexpr int N = F::N;
  static constexpr int JT = (B / N) >= 2 ? 2 : 1;  // token vectors per pass (ILP)
  static_assert(B % (N * JT) == 0);
  /// AVX-512 with single-plane 2/4-bit codes: unpack in registers inside the dot-product loops.
  template <class Fmt>
  static constexpr bool kFused = KVC_HAS_AVX512() && Fmt::kIntDot && (Fmt::kBits == 2 || Fmt::kBits == 4);
  template <class Fmt>
  static constexpr float kCodeMid = 0.5f * static_cast<float>((1 << Fmt::kBits) - 1);

 public:
  /// Online-softmax state and scratch of one work item.
  struct Item {
    float* m;    // [g] running max (log2 domain)
    float* l;    // [g] running sum
    float* acc;  // [g][d] unnormalised output
  };

  DecodeKernel(const P& p, int group) : p_(p), g_(group), d_(p.head_dim) {}

  /// Floats of scratch one thread needs.
  std::size_t scratch_floats() const {
    std::size_t used = 0;
    carve(nullptr, used);
    return used;
  }

  /// Runs blocks [b0, b1) of stream (seq, kvh), plus the sink (if `sink`) and the ring tail (if `tail`).
  void run(const float* q /*[g][d], pre-scaled*/, int seq, int kvh, int b0, int b1, bool sink, bool tail,
           float* scratch, Item it) const {
    std::size_t used = 0;
    Scratch s = carve(scratch, used);
    const int d = d_;
    std::memcpy(s.qf, q, sizeof(float) * std::size_t(g_) * d);
    for (int h = 0; h < g_; ++h) {
      it.m[h] = -std::numeric_limits<float>::infinity();
      it.l[h] = 0.0f;
    }
    std::memset(it.acc, 0, sizeof(float) * std::size_t(g_) * d);
    std::memset(s.lvec, 0, sizeof(float) * std::size_t(g_) * N);
    std::memset(s.zacc, 0, sizeof(float) * std::size_t(g_) * ncg_v() * N);
    if constexpr (KF::kIntDot && KF::kPerTokenScale) prepare_query_int8(s);

    const int n = p_.lengths[seq];
    if (sink)
      for (int t = 0; t < std::min(n, Layout::kSink); t += B) fp_tokens(s, it, seq, kvh, t, std::min({n, Layout::kSink, t + B}));
    const int ahead = prefetch_blocks();
    for (int b = b0; b < b1; ++b) {
      if (kPrefetchBytes > 0 && b + ahead < b1)
        s.pf.start(p_.key_block(seq, kvh, b + ahead), KF::block_bytes(d), p_.value_block(seq, kvh, b + ahead),
                   VF::block_bytes(d));
      if (kPrefetchBytes > 0 && b + 1 < b1)
        s.near.start(p_.key_block(seq, kvh, b + 1), KF::block_bytes(d), p_.value_block(seq, kvh, b + 1),
                     VF::block_bytes(d));
      block(s, it, p_.key_block(seq, kvh, b), p_.value_block(seq, kvh, b));
      s.pf.finish();
      s.near.finish();
    }
    if (tail) {
      const int first = Layout::kSink + p_.quantized_blocks(seq) * B;
      for (int t = first; t < n; t += B) fp_tokens(s, it, seq, kvh, t, std::min(n, t + B));
    }
    // Horizontal sums deferred out of the block loop: softmax denominators and value zero terms.
    const int ncg = ncg_v();
    for (int h = 0; h < g_; ++h) {
      it.l[h] = reduce_add(F::load(s.lvec + std::size_t(h) * N));
      if constexpr (!VF::kIdentity && VF::kPerTokenScale) {
        const int gc = d / ncg;
        for (int cg = 0; cg < ncg; ++cg) {
          const F z = F::set1(reduce_add(F::load(s.zacc + (std::size_t(h) * ncg + cg) * N)));
          float* o = it.acc + std::size_t(h) * d + cg * gc;
          for (int c = 0; c < gc; c += N) (F::load(o + c) + z).store(o + c);
        }
      }
    }
  }

 private:
  /// Software prefetch of one K+V block, spread over the compute loops one line per step() so
  /// the requests never fill the core's miss buffers at once (a burst stalls the pipeline until
  /// most lines have arrived, which serialises memory and compute). Two run per block: the block
  /// kPrefetchBytes ahead into L2 (DRAM latency) and the next block into L1 (so the metadata
  /// loads that start each block's dependent chain hit L1).
  template <int Locality>
  struct Prefetcher {
    const std::byte* p = nullptr;  // next line of the first range
    const std::byte* e = nullptr;
    const std::byte* p2 = nullptr;  // the second range
    const std::byte* e2 = nullptr;
    void start(const std::byte* a, std::size_t na, const std::byte* b, std::size_t nb) noexcept {
      p = a, e = a + na, p2 = b, e2 = b + nb;
    }
    void step() noexcept {
      if (p < e) {
        __builtin_prefetch(p, 0, Locality);
        p += 64;
        if (p >= e) p = p2, e = e2, p2 = e2 = nullptr;
      }
    }
    void finish() noexcept {
      while (p < e) step();
    }
  };

  struct Scratch {
    Prefetcher<KVC_PREFETCH_LOCALITY> pf;  // the block kPrefetchBytes ahead, into L2
    Prefetcher<3> near;                    // the next block, into L1
    void prefetch_step() noexcept {
      pf.step();
      near.step();
    }
    float* qf;      // [g][d]
    float* fold;    // [g][d]
    float* sc;      // [g][B]
    std::int8_t* q8;  // [g][d]
    float* qscale;  // [g]
    float* bias;    // [g]
    float* psum;    // [g]
    float* perr;    // [g]
    float* pmax;    // [g] largest probability of the current block
    float* lvec;    // [g][N] softmax denominators, lane-wise
    float* zacc;    // [g][ncg_v][N] value zero terms (and rounding corrections), lane-wise
    float* smax;    // [ncg_v] largest value scale of the current block per channel group
    float* qsum;    // [g][d/gc_k]
    float* wscale;  // [g][d/gc_v]
    float* wf;      // [g][d/gc_v][B] float weights
    std::uint8_t* w8;  // [g][d/gc_v][B]
    std::uint8_t* ktile;  // [B*d]
    const std::uint8_t* kpacked;  // current key block's packed codes
    std::uint8_t* vtile;  // [B*d]
    float* wrow;          // [B][d] full-precision key rows of the sink / ring, as float
    float* kzero;  // [groups_k]
    float* kscale;
    float* vzero;  // [groups_v]
    float* vscale;
  };

  /// Lays the scratch out from `base` (64-byte aligned pieces); with base == nullptr only counts.
  Scratch carve(float* base, std::size_t& used) const {
    const std::size_t g = g_, d = d_;
    auto take = [&](std::size_t floats) {
      float* r = base ? base + used : nullptr;
      used += (floats + 15) / 16 * 16;
      return r;
    };
    const std::size_t ncg_k = KF::kIdentity ? 1 : d / KF::group_channels(d_);
    const std::size_t ncg_v = VF::kIdentity ? 1 : d / VF::group_channels(d_);
    Scratch s{};
    s.qf = take(g * d);
    s.fold = take(g * d);
    s.sc = take(g * B);
    s.q8 = reinterpret_cast<std::int8_t*>(take(g * d / 4 + 1));
    s.qscale = take(g);
    s.bias = take(g);
    s.psum = take(g);
    s.perr = take(g);
    s.pmax = take(g);
    s.lvec = take(g * N);
    s.zacc = take(g * ncg_v * N);
    s.smax = take(ncg_v);
    s.qsum = take(g * ncg_k);
    s.wscale = take(g * ncg_v);
    s.wf = take(g * ncg_v * B);
    s.w8 = reinterpret_cast<std::uint8_t*>(take(g * ncg_v * B / 4 + 1));
    s.ktile = reinterpret_cast<std::uint8_t*>(take(std::size_t(B) * d / 4));
    s.vtile = reinterpret_cast<std::uint8_t*>(take(std::size_t(B) * d / 4));
    s.wrow = take(std::size_t(B) * d);
    const std::size_t gk = std::max(KF::groups(d_), 1), gv = std::max(VF::groups(d_), 1);
    s.kzero = take(gk);
    s.kscale = take(gk);
    s.vzero = take(gv);
    s.vscale = take(gv);
    return s;
  }

  // ---------------------------------------------------------------- helpers
  int ncg_v() const noexcept { return VF::kIdentity ? 1 : d_ / VF::group_channels(d_); }
  /// Software prefetch distance: the hardware prefetchers alone leave DRAM bandwidth unused with
  /// two streams (keys, values) per core. Prefetch the block that starts kPrefetchBytes ahead.
  static constexpr std::size_t kPrefetchBytes = KVC_PREFETCH_BYTES;
  int prefetch_blocks() const noexcept {
    const std::size_t per_block = KF::block_bytes(d_) + VF::block_bytes(d_);
    return static_cast<int>(std::max<std::size_t>(1, kPrefetchBytes / per_block));
  }

  template <class Fn>
  static void for_head_chunks(int g, Fn&& fn) {
    for (int h0 = 0; h0 < g; h0 += 4) {
      switch (std::min(4, g - h0)) {
        case 1: fn.template operator()<1>(h0); break;
        case 2: fn.template operator()<2>(h0); break;
        case 3: fn.template operator()<3>(h0); break;
        default: fn.template operator()<4>(h0); break;
      }
    }
  }

  /// zero = lo + offset*step and scale = step for every group of a block, as floats.
  template <class Fmt>
  void load_meta(const std::byte* blk, float* zero, float* scale) const {
    using Codec = typename Fmt::quantizer::codec;
    const int G = Fmt::groups(d_);
    const half_t* lo = Fmt::lo_plane(blk, d_);
    const half_t* st = Fmt::step_plane(blk, d_);
    constexpr float off = Codec::kZeroOffset;  // zero = lo + off * step (0 endpoint, 0.5 midpoint)
    int i = 0;
    for (; i + N <= G; i += N) {
      const F sv = F::load(st + i);
      fma(sv, F::set1(off), F::load(lo + i)).store(zero + i);
      sv.store(scale + i);
    }
    for (; i < G; ++i) {
      scale[i] = st[i].to_float();
      zero[i] = lo[i].to_float() + off * scale[i];
    }
  }

  /// Per-token key groups: the int8 query is fixed for the whole item.
  void prepare_query_int8(Scratch& s) const {
    const int d = d_, gc = KF::group_channels(d_), ncg = d / gc;
    for (int h = 0; h < g_; ++h) {
      quantize_row_i8(s.qf + std::size_t(h) * d, s.q8 + std::size_t(h) * d, s.qscale[h]);
      for (int cg = 0; cg < ncg; ++cg) {
        F a = F::zero();
        for (int c = cg * gc; c < (cg + 1) * gc; c += N) a = a + F::load(s.qf + std::size_t(h) * d + c);
        s.qsum[h * ncg + cg] = reduce_add(a);
      }
      // Per-token scales vary along tokens, so the centring correction is not used here.
    }
  }

  /// Rounds x[0..n) (|x| <= mx) to bytes, int8 in [-levels, levels] or uint8 in [0, levels], with
  /// scale = mx / levels (0 when mx == 0), stored through `scale`. Returns the lane-wise residual
  /// sum_i (x_i - scale*q_i): callers add mid * its sum (mid = the codes' centre) to their constant
  /// term, so the rounding error only meets the centred codes.
  template <class Byte>
  F round_to_bytes(const float* x, int n, float mx, float levels, Byte* out, float& scale) const {
    return round_to_bytes(n, mx, levels, out, scale, [x](int i) { return F::load(x + i); });
  }
  /// The same over values produced by `at(i)` (one vector of N at element i).
  template <class Byte, class At>
  F round_to_bytes(int n, float mx, float levels, Byte* out, float& scale, At&& at) const {
    const F inv = F::set1(simd::byte_scale(mx, levels, scale)), sc = F::set1(scale);
    F err = F::zero();
    for (int i = 0; i < n; i += N) {
      const F xv = at(i), qv = round_nearest(xv * inv);
      if constexpr (std::is_signed_v<Byte>) qv.store_i8(out + i);
      else qv.store_u8(out + i);
      err = fma(qv, F::set1(-1.0f) * sc, err + xv);
    }
    return err;
  }

  /// int8 query row with one scale (max|x| / 127); returns the residual sum (see round_to_bytes).
  float quantize_row_i8(const float* x, std::int8_t* out, float& scale) const {
    F mx = F::zero();
    for (int c = 0; c < d_; c += N) mx = max(mx, abs(F::load(x + c)));
    return reduce_add(round_to_bytes(x, d_, reduce_max(mx), 127.0f, out, scale));
  }

  /// Online softmax over scores sc[h][0..n): sc becomes probabilities, m/l/acc are rescaled.
  void softmax_update(Scratch& s, Item& it, int n) const {
    for (int h = 0; h < g_; ++h) {
      float* r = s.sc + std::size_t(h) * B;
      float mx = -std::numeric_limits<float>::infinity();
      int t = 0;
      if (n == B) {
        F v = F::load(r);
        for (t = N; t < B; t += N) v = max(v, F::load(r + t));
        mx = reduce_max(v);
      } else {
        for (; t < n; ++t) mx = std::max(mx, r[t]);
      }
      const float mnew = std::max(it.m[h], mx);
      const float corr = mnew == it.m[h] ? 1.0f : simd::exp2_scalar(it.m[h] - mnew);  // ~0 on the first chunk
      F sum = F::zero();
      float tail_sum = 0.0f;
      t = 0;
      for (; t + N <= n; t += N) {
        const F e = exp2(F::load(r + t) - F::set1(mnew));
        e.store(r + t);
        sum = sum + e;
      }
      for (; t < n; ++t) {
        r[t] = std::exp2(r[t] - mnew);
        tail_sum += r[t];
      }
      float* lv = s.lvec + std::size_t(h) * N;
      fma(F::load(lv), F::set1(corr), sum).store(lv);
      lv[0] += tail_sum;
      s.pmax[h] = mx == mnew ? 1.0f : simd::exp2_scalar(mx - mnew);
      if (corr != 1.0f) {
        float* a = it.acc + std::size_t(h) * d_;
        const F cv = F::set1(corr);
        for (int c = 0; c < d_; c += N) (F::load(a + c) * cv).store(a + c);
        if constexpr (!VF::kIdentity && VF::kPerTokenScale) {
          float* z = s.zacc + std::size_t(h) * ncg_v() * N;
          for (int i = 0; i < ncg_v() * N; i += N) (F::load(z + i) * cv).store(z + i);
        }
      }
      it.m[h] = mnew;
    }
  }

  // ---------------------------------------------------------------- full-precision tokens
  /// Sink and ring tokens (full-precision rows, token-major, not contiguous across the ring's wrap).
  /// Scores: the rows are widened to float once into s.wrow, then N tokens at a time each head keeps
  /// one accumulator per token and sums their lanes together (simd::hsum_lanes); values share each
  /// row load across the heads like identity value blocks.
  void fp_tokens(Scratch& s, Item& it, int seq, int kvh, int first, int last) const {
    const int n = last - first, d = d_;
    if (n <= 0) return;
    const W* vrow[B];
    for (int t = 0; t < n; ++t) {
      const W* k = p_.fp_row(Side::kKey, seq, kvh, first + t);
      for (int c = 0; c < d; c += N) F::load(k + c).store(s.wrow + std::size_t(t) * d + c);
      vrow[t] = p_.fp_row(Side::kValue, seq, kvh, first + t);
    }
    for (int t0 = 0; t0 < n; t0 += N) {
      const int m = std::min(N, n - t0);
      const float* rows = s.wrow + std::size_t(t0) * d;
      for (int h = 0; h < g_; ++h) {
        const float* q = s.qf + std::size_t(h) * d;
        F a[N];
        for (int i = 0; i < N; ++i) a[i] = F::zero();
        for (int c = 0; c < d; c += N) {
          const F qv = F::load(q + c);
          for (int i = 0; i < m; ++i) a[i] = fma(qv, F::load(rows + std::size_t(i) * d + c), a[i]);
        }
        alignas(64) float sums[N];
        simd::hsum_lanes(a, sums);
        std::memcpy(s.sc + std::size_t(h) * B + t0, sums, sizeof(float) * m);
      }
    }
    softmax_update(s, it, n);
    float_value_dot(s, it, n, [&](int t) { return vrow[t]; });
  }

  // ---------------------------------------------------------------- one block
  void block(Scratch& s, Item& it, const std::byte* kb, const std::byte* vb) const {
    key_scores(s, kb);
    softmax_update(s, it, B);
    value_accumulate(s, it, vb);
  }

  /// s.sc[h][t] = q_h . k_t for the B tokens of a key block.
  void key_scores(Scratch& s, const std::byte* kb) const {
    const int d = d_;
    if constexpr (KF::kIdentity) {
      for (int h = 0; h < g_; ++h) s.bias[h] = 0.0f;
      float_key_dot(s, reinterpret_cast<const typename KF::element*>(kb), s.qf, 0, d, nullptr, nullptr, true);
    } else {
      s.kpacked = reinterpret_cast<const std::uint8_t*>(kb);
      if constexpr (!kFused<KF>) simd::unpack_codes<KF::kBits>(s.kpacked, std::size_t(B) * d, s.ktile);
      load_meta<KF>(kb, s.kzero, s.kscale);
      if constexpr (!KF::kPerTokenScale) {
        // Scales and zeros constant over the block's tokens: fold them into the query.
        const int gc = KF::group_channels(d);
        if (!fold_query_fast(s)) {  // the generic fold, unless the AVX-512 one applied
          for (int h = 0; h < g_; ++h) {
            const float* q = s.qf + std::size_t(h) * d;
            float* f = s.fold + std::size_t(h) * d;
            F bias = F::zero(), mx = F::zero();
            for (int c = 0; c < d; c += N) {
              const F sc = gc == 1 ? F::load(s.kscale + c) : F::set1(s.kscale[c / gc]);
              const F zc = gc == 1 ? F::load(s.kzero + c) : F::set1(s.kzero[c / gc]);
              const F qv = F::load(q + c), fv = qv * sc;
              fv.store(f + c);
              bias = fma(qv, zc, bias);
              mx = max(mx, abs(fv));
            }
            if constexpr (KF::kIntDot)
              bias = fma(round_to_bytes(f, d, reduce_max(mx), 127.0f, s.q8 + std::size_t(h) * d, s.qscale[h]),
                         F::set1(kCodeMid<KF>), bias);
            s.bias[h] = reduce_add(bias);
          }
        }
        if constexpr (KF::kIntDot) int_key_dot(s, 0, d, nullptr, nullptr, true);
        else float_key_dot(s, s.ktile, s.fold, 0, d, nullptr, nullptr, true);
      } else {
        const int gc = KF::group_channels(d), ncg = d / gc;
        for (int h = 0; h < g_; ++h)
          std::memset(s.sc + std::size_t(h) * B, 0, sizeof(float) * B);
        for (int cg = 0; cg < ncg; ++cg) {
          const float* zrow = s.kzero + std::size_t(cg) * B;
          const float* srow = s.kscale + std::size_t(cg) * B;
          if constexpr (KF::kIntDot) int_key_dot(s, cg * gc, (cg + 1) * gc, srow, zrow, false, cg, ncg);
          else float_key_dot(s, s.ktile, s.qf, cg * gc, (cg + 1) * gc, srow, zrow, false, cg, ncg);
        }
      }
    }
  }

  /// Channels [c0, c1) of the score of every token, float FMAs over a [c][t] tile of element type T.
  /// fold: sc = dot + bias[h]. Otherwise sc += dot * rowscale[t] + qsum[h][cg] * rowzero[t].
  template <class T>
  void float_key_dot(Scratch& s, const T* tile, const float* q, int c0, int c1, const float* rowscale,
                     const float* rowzero, bool fold, int cg = 0, int ncg = 1) const {
    const int d = d_;
    for_head_chunks(g_, [&]<int NH>(int h0) {
      if (!fold) {
        for (int h = 0; h < NH; ++h) {
          F a = F::zero();
          for (int c = c0; c < c1; c += N) a = a + F::load(q + std::size_t(h0 + h) * d + c);
          s.qsum[(h0 + h) * ncg + cg] = reduce_add(a);
        }
      }
      // Even and odd channels accumulate separately (2*NH*JT independent FMA chains: with NH*JT = 8,
      // one set leaves the FMA latency exposed).
      for (int j = 0; j < B; j += N * JT) {
        F a[2][NH][JT];
        for (int e = 0; e < 2; ++e)
          for (int h = 0; h < NH; ++h)
            for (int jj = 0; jj < JT; ++jj) a[e][h][jj] = F::zero();
        auto step = [&](int c, F (&acc)[NH][JT]) {
          s.prefetch_step();
          F kv[JT];
          for (int jj = 0; jj < JT; ++jj) kv[jj] = F::load(tile + std::size_t(c) * B + j + jj * N);
          for (int h = 0; h < NH; ++h) {
            const F qb = F::set1(q[std::size_t(h0 + h) * d + c]);
            for (int jj = 0; jj < JT; ++jj) acc[h][jj] = fma(qb, kv[jj], acc[h][jj]);
          }
        };
        int c = c0;
        for (; c + 2 <= c1; c += 2) {
          step(c, a[0]);
          step(c + 1, a[1]);
        }
        if (c < c1) step(c, a[0]);
        for (int h = 0; h < NH; ++h)
          for (int jj = 0; jj < JT; ++jj) a[0][h][jj] = a[0][h][jj] + a[1][h][jj];
        for (int h = 0; h < NH; ++h)
          for (int jj = 0; jj < JT; ++jj) {
            float* out = s.sc + std::size_t(h0 + h) * B + j + jj * N;
            if (fold) {
              (a[0][h][jj] + F::set1(s.bias[h0 + h])).store(out);
            } else {
              const int t = j + jj * N;
              fma(a[0][h][jj], F::load(rowscale + t),
                  fma(F::set1(s.qsum[(h0 + h) * ncg + cg]), F::load(rowzero + t), F::load(out)))
                  .store(out);
            }
          }
      }
    });
  }

  /// The generic fold + round_to_bytes of key_scores for AVX-512 and fused (2/4-bit) keys, with fewer
  /// vector operations: the max |q_c s_c| by vrangeps, codes packed 64 at a time, and the rounding
  /// residual sum_c (x_c - scale q_c) taken as sum x - scale * sum q (an integer sum). The same codes
  /// and scale as the generic path; the bias differs only in float summation order. d % 64 == 0.
  /// Returns false (doing nothing) where it does not apply: the caller runs the generic fold.
  bool fold_query_fast(Scratch& s) const {
#if KVC_HAS_AVX512()
    if constexpr (!kFused<KF>) {
      return false;
    } else {
      const int d = d_, gc = KF::group_channels(d);
      for (int h = 0; h < g_; ++h) {
        const float* q = s.qf + std::size_t(h) * d;
        float* f = s.fold + std::size_t(h) * d;
        __m512 bias = _mm512_setzero_ps(), xs = bias, mx = bias;
        for (int c = 0; c < d; c += 16) {
          const __m512 sc = gc == 1 ? _mm512_loadu_ps(s.kscale + c) : _mm512_set1_ps(s.kscale[c / gc]);
          const __m512 zc = gc == 1 ? _mm512_loadu_ps(s.kzero + c) : _mm512_set1_ps(s.kzero[c / gc]);
          const __m512 qv = _mm512_loadu_ps(q + c), fv = _mm512_mul_ps(qv, sc);
          _mm512_storeu_ps(f + c, fv);
          bias = _mm512_fmadd_ps(qv, zc, bias);
          xs = _mm512_add_ps(xs, fv);
          mx = _mm512_range_ps(mx, fv, 0x0B);  // max(|mx|, |fv|)
        }
        float scale;
        const __m512 inv = _mm512_set1_ps(simd::byte_scale(_mm512_reduce_max_ps(mx), 127.0f, scale));
        __m512i qs = _mm512_setzero_si512();
        for (int c = 0; c < d; c += 64) {
          __m512i i[4];
          for (int k = 0; k < 4; ++k)
            i[k] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(f + c + 16 * k), inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qs = _mm512_add_epi32(qs, _mm512_add_epi32(_mm512_add_epi32(i[0], i[1]), _mm512_add_epi32(i[2], i[3])));
          simd::store_i8x64(i, s.q8 + std::size_t(h) * d + c);
        }
        const __m512 resid = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qs), _mm512_set1_ps(scale), xs);
        s.qscale[h] = scale;
        s.bias[h] = _mm512_reduce_add_ps(_mm512_fmadd_ps(resid, _mm512_set1_ps(kCodeMid<KF>), bias));
      }
      return true;
    }
#else
    (void)s;
    return false;
#endif
  }

  /// Integer version over the [c/4][t][c%4] code tile with the int8 query s.q8.
  void int_key_dot(Scratch& s, int c0, int c1, const float* rowscale, const float* rowzero, bool fold, int cg = 0,
                   int ncg = 1) const {
    const int d = d_;
#if KVC_HAS_AVX512()
    if constexpr (kFused<KF>) {
      // Chunks of 64 codes = 16 tokens x 4 channels; chunk k = quad * CQ + token vector; a packed
      // vector holds kPer consecutive chunks.
      constexpr int w = KF::kBits, kPer = 8 / w, CQ = B / 16;
      const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << w) - 1));
      for_head_chunks(g_, [&]<int NH>(int h0) {
        __m512i a[NH][CQ];
        for (int h = 0; h < NH; ++h)
          for (int j = 0; j < CQ; ++j) a[h][j] = _mm512_setzero_si512();
        const int m0 = (c0 / 4) * CQ / kPer, m1 = (c1 / 4) * CQ / kPer;
        for (int m = m0; m < m1; ++m) {
          const __m512i x = _mm512_loadu_si512(s.kpacked + std::size_t(m) * 64);
          s.prefetch_step();
#  pragma GCC unroll 4
          for (int i = 0; i < kPer; ++i) {
            const __m512i code = _mm512_and_si512(_mm512_srli_epi16(x, i * w), mask);
            const int k = m * kPer + i, quad = k / CQ, j = k % CQ;
            for (int h = 0; h < NH; ++h) {
              std::int32_t qq;
              std::memcpy(&qq, s.q8 + std::size_t(h0 + h) * d + quad * 4, 4);
              a[h][j] = _mm512_dpbusd_epi32(a[h][j], code, _mm512_set1_epi32(qq));
            }
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int j = 0; j < CQ; ++j) {
            float* out = s.sc + std::size_t(h0 + h) * B + j * 16;
            const F dot = F{_mm512_cvtepi32_ps(a[h][j])} * F::set1(s.qscale[h0 + h]);
            if (fold) (dot + F::set1(s.bias[h0 + h])).store(out);
            else
              fma(dot, F::load(rowscale + j * 16),
                  fma(F::set1(s.qsum[(h0 + h) * ncg + cg]), F::load(rowzero + j * 16), F::load(out)))
                  .store(out);
          }
      });
      return;
    }
#endif
    for_head_chunks(g_, [&]<int NH>(int h0) {
      for (int j = 0; j < B; j += N * JT) {
        I a[NH][JT];
        for (int h = 0; h < NH; ++h)
          for (int jj = 0; jj < JT; ++jj) a[h][jj] = I::zero();
        for (int c = c0; c < c1; c += 4) {
          I code[JT];
          for (int jj = 0; jj < JT; ++jj) code[jj] = I::load(s.ktile + (std::size_t(c >> 2) * B + j + jj * N) * 4);
          for (int h = 0; h < NH; ++h) {
            std::int32_t quad;
            std::memcpy(&quad, s.q8 + std::size_t(h0 + h) * d + c, 4);
            const I qb = I::set1(quad);
            for (int jj = 0; jj < JT; ++jj) a[h][jj] = dpbusd(a[h][jj], code[jj], qb);
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int jj = 0; jj < JT; ++jj) {
            float* out = s.sc + std::size_t(h0 + h) * B + j + jj * N;
            const F dot = a[h][jj].to_float() * F::set1(s.qscale[h0 + h]);
            if (fold) {
              (dot + F::set1(s.bias[h0 + h])).store(out);
            } else {
              const int t = j + jj * N;
              fma(dot, F::load(rowscale + t), fma(F::set1(s.qsum[(h0 + h) * ncg + cg]), F::load(rowzero + t), F::load(out)))
                  .store(out);
            }
          }
      }
    });
  }

  /// acc[h] += sum_t p[h][t] v_t for one value block.
  void value_accumulate(Scratch& s, Item& it, const std::byte* vb) const {
    const int d = d_;
    if constexpr (VF::kIdentity) {
      const auto* tile = reinterpret_cast<const typename VF::element*>(vb);
      float_value_dot(s, it, B, [tile, d](int t) { return tile + std::size_t(t) * d; });
      return;
    } else {
      constexpr int kVPer = kFused<VF> ? 8 / VF::kBits : 1;
      const bool fused_v = kFused<VF> && (d / 16) % kVPer == 0;
      if (!fused_v) simd::unpack_codes<VF::kBits>(reinterpret_cast<const std::uint8_t*>(vb), std::size_t(B) * d, s.vtile);
      load_meta<VF>(vb, s.vzero, s.vscale);
      const int gc = VF::group_channels(d), ncg = d / gc;
      // Weights per (head, channel group, token) and the zero terms. Per-token scales: the uint8 weight
      // scale of (head, group) is pmax_h * smax_g / 255, a bound on max_t p_t s_t that costs one
      // reduction per group instead of one per (head, group); zero terms (and the centring correction of
      // the weight rounding) accumulate lane-wise in zacc and are reduced once per work item.
      if constexpr (VF::kPerTokenScale && VF::kIntDot) {
        for (int cg = 0; cg < ncg; ++cg) {
          F mx = F::load(s.vscale + std::size_t(cg) * B);
          for (int t = N; t < B; t += N) mx = max(mx, F::load(s.vscale + std::size_t(cg) * B + t));
          s.smax[cg] = reduce_max(mx);
        }
      }
      if (!(fused_v && value_weights_fast(s, ncg))) {  // the generic weights, unless the AVX-512 ones applied
        for (int h = 0; h < g_; ++h) {
          const float* pr = s.sc + std::size_t(h) * B;
          if constexpr (VF::kPerTokenScale) {
            for (int cg = 0; cg < ncg; ++cg) {
              const float* sr = s.vscale + std::size_t(cg) * B;
              const float* zr = s.vzero + std::size_t(cg) * B;
              float* zacc = s.zacc + (std::size_t(h) * ncg + cg) * N;
              F zv = F::load(zacc);
              for (int t = 0; t < B; t += N) zv = fma(F::load(pr + t), F::load(zr + t), zv);
              if constexpr (VF::kIntDot) {
                zv = fma(round_to_bytes(B, s.pmax[h] * s.smax[cg], 255.0f, s.w8 + (std::size_t(h) * ncg + cg) * B,
                                        s.wscale[h * ncg + cg],
                                        [&](int t) { return F::load(pr + t) * F::load(sr + t); }),
                         F::set1(kCodeMid<VF>), zv);
              } else {
                float* w = s.wf + (std::size_t(h) * ncg + cg) * B;
                for (int t = 0; t < B; t += N) (F::load(pr + t) * F::load(sr + t)).store(w + t);
              }
              zv.store(zacc);
            }
          } else {
            F mx = F::zero(), ps = F::zero();
            for (int t = 0; t < B; t += N) {
              const F pv = F::load(pr + t);
              mx = max(mx, pv);
              ps = ps + pv;
            }
            s.psum[h] = reduce_add(ps);
            // The centring correction needs the per-channel scale, applied below as psum_err * mid * s_c.
            if constexpr (VF::kIntDot)
              s.perr[h] = kCodeMid<VF> * reduce_add(round_to_bytes(pr, B, reduce_max(mx), 255.0f, s.w8 + std::size_t(h) * B, s.wscale[h]));
          }
        }
      }
#if KVC_HAS_AVX512()
      if constexpr (kFused<VF>) {
        if (fused_v) {
          // Chunks of 64 codes = 16 channels x 4 tokens; chunk k = token quad * CV + channel vector; a
          // packed vector holds kVPer channel vectors of one token quad.
          constexpr int w = VF::kBits;
          const int CV = d / 16;
          const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << w) - 1));
          const auto* packed = reinterpret_cast<const std::uint8_t*>(vb);
          for_head_chunks(g_, [&]<int NH>(int h0) {
            for (int cv0 = 0; cv0 < CV; cv0 += kVPer) {
              __m512i a[NH][kVPer];
              for (int h = 0; h < NH; ++h)
                for (int i = 0; i < kVPer; ++i) a[h][i] = _mm512_setzero_si512();
              for (int tq = 0; tq < B / 4; ++tq) {
                const __m512i x = _mm512_loadu_si512(packed + (std::size_t(tq) * CV + cv0) / kVPer * 64);
                s.prefetch_step();
#  pragma GCC unroll 4
                for (int i = 0; i < kVPer; ++i) {
                  const __m512i code = _mm512_and_si512(_mm512_srli_epi16(x, i * w), mask);
                  const int cg = (cv0 + i) * 16 / gc;
                  for (int h = 0; h < NH; ++h) {
                    const std::size_t row =
                        VF::kPerTokenScale ? (std::size_t(h0 + h) * ncg + cg) * B : std::size_t(h0 + h) * B;
                    std::int32_t ww;
                    std::memcpy(&ww, s.w8 + row + tq * 4, 4);
                    a[h][i] = _mm512_dpbusd_epi32(a[h][i], _mm512_set1_epi32(ww), code);
                  }
                }
              }
              for (int i = 0; i < kVPer; ++i) {
                const int c = (cv0 + i) * 16, cg = c / gc;
                for (int h = 0; h < NH; ++h) {
                  float* o = it.acc + std::size_t(h0 + h) * d + c;
                  if constexpr (VF::kPerTokenScale) {
                    fma(F{_mm512_cvtepi32_ps(a[h][i])}, F::set1(s.wscale[(h0 + h) * ncg + cg]), F::load(o)).store(o);
                  } else {
                    const F sc = gc == 1 ? F::load(s.vscale + c) : F::set1(s.vscale[cg]);
                    const F zc = gc == 1 ? F::load(s.vzero + c) : F::set1(s.vzero[cg]);
                    const F dh = F{_mm512_cvtepi32_ps(a[h][i])} * F::set1(s.wscale[h0 + h]) + F::set1(s.perr[h0 + h]);
                    fma(dh, sc, fma(zc, F::set1(s.psum[h0 + h]), F::load(o))).store(o);
                  }
                }
              }
            }
          });
          return;
        }
      }
#endif
      for_head_chunks(g_, [&]<int NH>(int h0) {
        for (int c = 0; c < d; c += N) {
          const int cg = c / gc;
          F dot[NH];
          if constexpr (VF::kIntDot) {
            I a[NH];
            for (int h = 0; h < NH; ++h) a[h] = I::zero();
            for (int t = 0; t < B; t += 4) {
              const I code = I::load(s.vtile + (std::size_t(t >> 2) * d + c) * 4);
              for (int h = 0; h < NH; ++h) {
                std::int32_t quad;
                const std::size_t row = VF::kPerTokenScale ? (std::size_t(h0 + h) * ncg + cg) * B : std::size_t(h0 + h) * B;
                std::memcpy(&quad, s.w8 + row + t, 4);
                a[h] = dpbusd(a[h], I::set1(quad), code);
              }
            }
            for (int h = 0; h < NH; ++h)
              dot[h] = a[h].to_float() *
                       F::set1(VF::kPerTokenScale ? s.wscale[(h0 + h) * ncg + cg] : s.wscale[h0 + h]);
          } else {
            for (int h = 0; h < NH; ++h) dot[h] = F::zero();
            for (int t = 0; t < B; ++t) {
              const F code = F::load(s.vtile + std::size_t(t) * d + c);
              for (int h = 0; h < NH; ++h) {
                const float w = VF::kPerTokenScale ? s.wf[(std::size_t(h0 + h) * ncg + cg) * B + t]
                                                   : s.sc[std::size_t(h0 + h) * B + t];
                dot[h] = fma(F::set1(w), code, dot[h]);
              }
            }
          }
          for (int h = 0; h < NH; ++h) {
            float* o = it.acc + std::size_t(h0 + h) * d + c;
            if constexpr (VF::kPerTokenScale) {
              (F::load(o) + dot[h]).store(o);
            } else {
              const F sc = gc == 1 ? F::load(s.vscale + c) : F::set1(s.vscale[cg]);
              const F zc = gc == 1 ? F::load(s.vzero + c) : F::set1(s.vzero[cg]);
              F dh = dot[h];
              if constexpr (VF::kIntDot) dh = dh + F::set1(s.perr[h0 + h]);
              fma(dh, sc, fma(zc, F::set1(s.psum[h0 + h]), F::load(o))).store(o);
            }
          }
        }
      });
    }
  }

  /// The generic per-token value weights of value_accumulate for AVX-512 and fused codes, with fewer
  /// vector operations: w8[h][cg][t] = round(p_t s_t / wscale) computed as round((p_t / pmax_h) *
  /// (s_t * 255 / smax_cg)) with wscale = pmax_h smax_cg / 255 (the same bound as the generic path),
  /// and the centring residual sum_t (p_t s_t - wscale w8) as wscale * (u_t - round(u_t)). B % 32 == 0.
  /// Returns false (doing nothing) where it does not apply: the caller computes the generic weights.
  bool value_weights_fast(Scratch& s, int ncg) const {
#if KVC_HAS_AVX512()
    if constexpr (!(kFused<VF> && VF::kPerTokenScale && B % 32 == 0)) {
      return false;
    } else {
      float* sn = s.wf;  // [ncg][B] s_t * 255 / smax_cg
      for (int cg = 0; cg < ncg; ++cg) {
        const float* sr = s.vscale + std::size_t(cg) * B;
        float unused;
        const __m512 k = _mm512_set1_ps(simd::byte_scale(s.smax[cg], 255.0f, unused));
        for (int t = 0; t < B; t += 16) _mm512_storeu_ps(sn + std::size_t(cg) * B + t, _mm512_mul_ps(_mm512_loadu_ps(sr + t), k));
      }
      constexpr float mid = kCodeMid<VF>;
      for (int h = 0; h < g_; ++h) {
        const float* pr = s.sc + std::size_t(h) * B;
        // Probabilities lie in [0, pmax_h], pmax_h in (0, 1] (the block's largest, <= 1 after the max shift).
        const __m512 ip = _mm512_set1_ps(1.0f / s.pmax[h]);
        for (int cg = 0; cg < ncg; ++cg) {
          const float* zr = s.vzero + std::size_t(cg) * B;
          const float* sr = sn + std::size_t(cg) * B;
          float* zacc = s.zacc + (std::size_t(h) * ncg + cg) * 16;
          const float wscale = s.pmax[h] * s.smax[cg] * (1.0f / 255.0f);
          __m512 zv = _mm512_loadu_ps(zacc), res = _mm512_setzero_ps();
          for (int t = 0; t < B; t += 32) {
            const __m512 p0 = _mm512_loadu_ps(pr + t), p1 = _mm512_loadu_ps(pr + t + 16);
            zv = _mm512_fmadd_ps(p0, _mm512_loadu_ps(zr + t), zv);
            zv = _mm512_fmadd_ps(p1, _mm512_loadu_ps(zr + t + 16), zv);
            const __m512 u0 = _mm512_mul_ps(_mm512_mul_ps(p0, ip), _mm512_loadu_ps(sr + t));
            const __m512 u1 = _mm512_mul_ps(_mm512_mul_ps(p1, ip), _mm512_loadu_ps(sr + t + 16));
            constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512 r0 = _mm512_roundscale_ps(u0, kRn), r1 = _mm512_roundscale_ps(u1, kRn);
            res = _mm512_add_ps(res, _mm512_add_ps(_mm512_sub_ps(u0, r0), _mm512_sub_ps(u1, r1)));
            simd::store_u8x32(_mm512_cvttps_epi32(r0), _mm512_cvttps_epi32(r1), s.w8 + (std::size_t(h) * ncg + cg) * B + t);
          }
          s.wscale[h * ncg + cg] = wscale;
          _mm512_storeu_ps(zacc, _mm512_fmadd_ps(res, _mm512_set1_ps(wscale * mid), zv));
        }
      }
      return true;
    }
#else
    (void)s, (void)ncg;
    return false;
#endif
  }

  /// Uncompressed value block [t][c] of T. CT channel vectors per pass keep NH*CT independent FMA
  /// chains in flight (the latency, not the port count, bounds a single chain).
  template <class Row>
  void float_value_dot(Scratch& s, Item& it, int n, Row&& row) const {
    const int d = d_;
    for_head_chunks(g_, [&]<int NH>(int h0) {
      auto pass = [&]<int CT>(int c) {
        F a[NH][CT];
        for (int h = 0; h < NH; ++h)
          for (int k = 0; k < CT; ++k) a[h][k] = F::load(it.acc + std::size_t(h0 + h) * d + c + k * N);
        for (int t = 0; t < n; ++t) {
          s.prefetch_step();
          s.prefetch_step();
          F v[CT];
          for (int k = 0; k < CT; ++k) v[k] = F::load(row(t) + c + k * N);
          for (int h = 0; h < NH; ++h) {
            const F p = F::set1(s.sc[std::size_t(h0 + h) * B + t]);
            for (int k = 0; k < CT; ++k) a[h][k] = fma(p, v[k], a[h][k]);
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int k = 0; k < CT; ++k) a[h][k].store(it.acc + std::size_t(h0 + h) * d + c + k * N);
      };
      constexpr int kCT = NH <= 2 ? 8 : 4;
      int c = 0;
      for (; c + kCT * N <= d; c += kCT * N) pass.template operator()<kCT>(c);
      for (; c < d; c += N) pass.template operator()<1>(c);
    });
  }

  P p_;
  int g_;
  int d_;
};

}  // namespace detail

/// Decode attention over one layer of a cache's Params (the low-level entry point).
/// q, out: [sequences][query_heads][head_dim], sequences <= batch; query_heads a multiple of kv_heads.
/// Sequence i attends to the cache's sequence i, which must hold at least one token.
template <class Layout>
void decode_attention(const typename Layout::Params& p, QueryView q, OutputView out, const AttentionOptions& opt = {}) {
  KVC_CHECK(q.dim0 >= 1 && q.dim0 <= p.batch, Errc::kInvalidArgument, "query holds ", q.dim0,
            " sequences; the cache has ", p.batch);
  KVC_CHECK(q.dim2 == p.head_dim, Errc::kInvalidArgument, "query head_dim ", q.dim2, " != cache head_dim ",
            p.head_dim);
  KVC_CHECK(q.dim1 >= p.kv_heads && q.dim1 % p.kv_heads == 0, Errc::kInvalidArgument, "query heads ", q.dim1,
            " are not a positive multiple of the cache's ", p.kv_heads, " KV heads");
  KVC_CHECK(out.dim0 == q.dim0 && out.dim1 == q.dim1 && out.dim2 == q.dim2, Errc::kInvalidArgument,
            "output shape [", out.dim0, "][", out.dim1, "][", out.dim2, "] != query shape [", q.dim0, "][", q.dim1,
            "][", q.dim2, "]");
  KVC_CHECK(q.data != nullptr && out.data != nullptr, Errc::kInvalidArgument, "null query or output");
  for (int s = 0; s < q.dim0; ++s)
    KVC_CHECK(p.lengths[s] > 0, Errc::kInvalidArgument, "sequence ", s, " is empty: nothing to attend to");
  for (int s = 0; s < q.dim0; ++s)
    for (int h = 0; h < q.dim1; ++h)
      for (int c = 0; c < q.dim2; ++c)
        KVC_CHECK(std::isfinite(q.row(s, h)[c]), Errc::kNonFinite, "query sequence ", s, " head ", h, " channel ", c,
                  " is not finite");

  const int g = q.dim1 / p.kv_heads, d = p.head_dim, nseq = q.dim0;
  const float scale = (opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d))) * detail::kLog2e;
#if KVC_HAS_OPENMP()
  const int threads = opt.num_threads > 0 ? opt.num_threads : omp_get_max_threads();
#else
  const int threads = 1;
#endif
  // Work items: (sequence, KV head, split). Split a stream's blocks only when there are fewer streams
  // than ~4x threads, so each thread still gets whole streams when it can.
  struct Work {
    int seq, kvh, b0, b1;
    bool sink, tail;
  };
  std::vector<Work> work;
  std::vector<int> first_item(std::size_t(nseq) * p.kv_heads + 1, 0);
  const int streams = nseq * p.kv_heads;
  for (int s = 0; s < nseq; ++s) {
    const int nb = p.quantized_blocks(s);
    const int want = streams >= 4 * threads ? 1 : (4 * threads + streams - 1) / streams;
    const int splits = std::max(1, std::min(want, nb / std::max(1, opt.min_blocks_per_split)));
    for (int h = 0; h < p.kv_heads; ++h) {
      first_item[std::size_t(s) * p.kv_heads + h] = static_cast<int>(work.size());
      for (int i = 0; i < splits; ++i)
        work.push_back({s, h, nb * i / splits, nb * (i + 1) / splits, i == 0, i == splits - 1});
    }
  }
  first_item.back() = static_cast<int>(work.size());

  const detail::DecodeKernel<Layout> kernel(p, g);
  const std::size_t item_floats = std::size_t(g) * (d + 2);
  AlignedBuffer<float> results(work.size() * item_floats);
  AlignedBuffer<float> qscaled(std::size_t(nseq) * q.dim1 * d);
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < q.dim1; ++h)
      for (int c = 0; c < d; ++c) qscaled[(std::size_t(s) * q.dim1 + h) * d + c] = q.row(s, h)[c] * scale;
  const std::size_t scratch_floats = kernel.scratch_floats();
  const int nwork = static_cast<int>(work.size());

#if KVC_HAS_OPENMP()
#  pragma omp parallel num_threads(threads)
#endif
  {
    // Probabilities far below the running max underflow; denormal operands cost ~100-cycle assists on
    // x86, and flushing them to zero changes results by < 2^-126 relative. Restored on exit.
    const detail::FlushDenormals ftz;
    AlignedBuffer<float> scratch(scratch_floats);
#if KVC_HAS_OPENMP()
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int i = 0; i < nwork; ++i) {
      const Work& w = work[std::size_t(i)];
      float* r = results.data() + std::size_t(i) * item_floats;
      typename detail::DecodeKernel<Layout>::Item it{r, r + g, r + 2 * g};
      kernel.run(qscaled.data() + (std::size_t(w.seq) * q.dim1 + std::size_t(w.kvh) * g) * d, w.seq, w.kvh, w.b0,
                 w.b1, w.sink, w.tail, scratch.data(), it);
    }
  }

  // Merge the splits of each stream: O = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i.
  for (int s = 0; s < nseq; ++s)
    for (int kh = 0; kh < p.kv_heads; ++kh) {
      const int i0 = first_item[std::size_t(s) * p.kv_heads + kh], i1 = first_item[std::size_t(s) * p.kv_heads + kh + 1];
      for (int h = 0; h < g; ++h) {
        float M = -std::numeric_limits<float>::infinity();
        for (int i = i0; i < i1; ++i) M = std::max(M, results[std::size_t(i) * item_floats + h]);
        float L = 0.0f;
        float* o = out.row(s, kh * g + h);
        std::fill(o, o + d, 0.0f);
        for (int i = i0; i < i1; ++i) {
          const float* r = results.data() + std::size_t(i) * item_floats;
          const float wgt = std::exp2(r[h] - M);
          L += wgt * r[g + h];
          const float* acc = r + 2 * g + std::size_t(h) * d;
          for (int c = 0; c < d; ++c) o[c] += wgt * acc[c];
        }
        const float inv = 1.0f / L;
        for (int c = 0; c < d; ++c) o[c] *= inv;
      }
    }
}

/// Decode attention over `layer` of a CompressedKVCache (or anything with `params(layer)` and `layout`).
template <class Cache>
void decode_attention(const Cache& cache, int layer, QueryView q, OutputView out, const AttentionOptions& opt = {}) {
  decode_attention<typename Cache::layout>(cache.params(layer), q, out, opt);
}
}  // namespace kvc
KVC_SUPPRESS_INTRINSIC_WARNINGS_END
