/// \file decode_kernel.hpp
/// Private: the fused CPU decode-attention kernel of one SIMD path. Included once per path by
/// decode_attention.hpp inside that path's target region (see detail/simd.hpp); no include guard.
#if !defined(KVC_ATTENTION_INTERNAL) || !defined(KVC_ISA_LEVEL_) || !defined(KVC_ISA_NS)
#  error "kvc/attention/detail/decode_kernel.hpp is private: include <kvc/attention/decode_attention.hpp>"
#endif

#include <kvc/attention/detail/simd.hpp>

namespace kvc::detail::KVC_ISA_NS {

/// Decode attention for one cache layout. Stateless apart from per-thread scratch.
/// Exact == false (Precision::kFast): <= 4-bit codes go through the integer dot products.
/// Exact == true (Precision::kExact): every dot product is float FMAs over the decoded codes.
template <class Layout, bool Exact>
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
  static constexpr int kMaskedRows = detail::masked_rows<typename Layout::selector>();  // rows of block 0
  static_assert(B % (N * JT) == 0);
  /// Integer dot products for this side (fast precision and <= 4-bit codes).
  template <class Fmt>
  static constexpr bool kInt = Fmt::kIntDot && !Exact;
  /// The side's codes are in the integer kernel order (4 per 32-bit lane; see cache_layout.hpp),
  /// whichever dot product reads them.
  template <class Fmt>
  static constexpr bool kQuads = Fmt::kIntDot;
  /// AVX-512 with single-plane 2/4-bit codes: unpack in registers inside the dot-product loops.
  template <class Fmt>
  static constexpr bool kFused = KVC_ISA_LEVEL_ == 2 && kInt<Fmt> && (Fmt::kBits == 2 || Fmt::kBits == 4);
  template <class Fmt>
  static constexpr float kCodeMid = 0.5f * static_cast<float>((1 << Fmt::kBits) - 1);

 public:
  /// Online-softmax state and scratch of one work item.
  struct Item {
    float* m;    // [g] running max (log2 domain)
    float* l;    // [g] running sum
    float* acc;  // [g][d] unnormalised output
    aligned::ReadStats* read = nullptr;  // Layout::kAlignedWindow: what aligned_window read (added to)
  };

  DecodeKernel(const P& p, int group) : p_(p), g_(group), d_(p.head_dim) {}

  /// Floats of scratch one thread needs.
  std::size_t scratch_floats() const {
    std::size_t used = 0;
    carve(nullptr, used);
    return used;
  }

  /// Runs blocks [b0, b1) of stream (seq, kvh), plus its full-precision tokens (if `fp`).
  void run(const float* q /*[g][d], pre-scaled*/, int seq, int kvh, int b0, int b1, bool fp, float* scratch,
           Item it) const {
    KVC_PHASE_BEGIN();
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
    if constexpr (kInt<KF> && KF::kPerTokenScale) prepare_query_int8(s);

    if (fp) {
      KVC_PHASE(kOther);
      if constexpr (Layout::kAlignedWindow) {
        aligned_window(s, it, seq, kvh);
      } else {
        const int nfp = p_.fp_count(seq);
        for (int i = 0; i < nfp; i += B) fp_tokens(s, it, seq, kvh, i, std::min(nfp, i + B));
      }
      KVC_PHASE(kFpTokens);
    }
    const int ahead = prefetch_blocks();
    for (int b = b0; b < b1; ++b) {
      if (kPrefetchBytes > 0 && b + ahead < b1)
        s.pf.start(p_.key_block(seq, kvh, b + ahead), KF::block_bytes(d), p_.value_block(seq, kvh, b + ahead),
                   VF::block_bytes(d));
      if (kPrefetchBytes > 0 && b + 1 < b1)
        s.near.start(p_.key_block(seq, kvh, b + 1), KF::block_bytes(d), p_.value_block(seq, kvh, b + 1),
                     VF::block_bytes(d));
      block(s, it, seq, kvh, b);
      s.pf.finish();
      s.near.finish();
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
    KVC_PHASE(kOther);
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
    KVC_ALWAYS_INLINE void step() noexcept {
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
    KVC_ALWAYS_INLINE void prefetch_step() noexcept {
      pf.step();
      near.step();
    }
    float* qf;      // [g][d]
    float* fold;    // [g][d]
    float* sc;      // [g][B]
    std::int8_t* q8;  // [g][d]
    float* qscale;  // [g]
    std::int8_t* q8lo;  // [g][d] second query plane (see add_query_lo_plane)
    float* qscale_lo;   // [g]
    float* ecorr;       // [g][d/gc_k] per-token keys: centring term per channel group
    float* kres;        // [g] block-constant keys: centring term of the int8 rounding
    bool lo_item = false;  // per-token keys: the item's query has a second plane
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
    float* wrow;          // [B][d] full-precision key rows, as float
    float* vrowf;         // [B][d] PartialLogWindow: full-precision tokens' values, as float
    // AlignedLoader over the full-precision slots (aligned_window; null otherwise)
    half_t* abits;        // [B * d] a chunk's keys [d][B], then its value rows [B][d], at their tiers
    std::uint8_t* alive;  // [kFpStride] 0xFF for a live slot
    std::uint8_t* ameta;  // [3][d] key tiers, Kmax, Vmax (fp16 exponent fields)
    int* arows;           // [B] the chunk's live slots
    int* aref;            // [g] Rule 2's reference per query head
    float* aprob;         // [g][B] the chunk's probabilities, normalised over the chunk
    float* aest;          // [d] Rule 2's output estimate
    float* kzero;  // [groups_k]
    float* kscale;
    float* vzero;  // [groups_v]
    float* cwork;  // the corrections' epilogue scratch (gear/block_correction.hpp)
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
    s.q8lo = reinterpret_cast<std::int8_t*>(take(g * d / 4 + 1));
    s.qscale_lo = take(g);
    s.ecorr = take(g * ncg_k);
    s.kres = take(g);
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
    s.vrowf = take(Layout::kQuantizedFpValues ? std::size_t(B) * d : 0);
    if constexpr (Layout::kAlignedWindow) {
      s.abits = reinterpret_cast<half_t*>(take(std::size_t(B) * d / 2));
      s.alive = reinterpret_cast<std::uint8_t*>(take(std::size_t(Layout::kFpStride) / 4 + 1));
      s.ameta = reinterpret_cast<std::uint8_t*>(take(3 * d / 4 + 1));
      s.arows = reinterpret_cast<int*>(take(std::size_t(B)));
      s.aref = reinterpret_cast<int*>(take(g));
      s.aprob = take(g * B);
      s.aest = take(d);
    }
    const std::size_t gk = std::max(KF::groups(d_), 1), gv = std::max(VF::groups(d_), 1);
    s.kzero = take(gk);
    s.kscale = take(gk);
    s.vzero = take(gv);
    s.vscale = take(gv);
    // A block's share of stream-scope outliers is at most all of its B * d entries.
    const std::size_t stream_share = Layout::kStreamOutliers ? std::size_t(B) * d : 0;
    s.cwork = take(std::max({KF::correction::work_floats(B, d_), VF::correction::work_floats(B, d_), stream_share}) + 1);
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

  /// Per-token key groups: the int8 query is fixed for the whole item. Per group: qsum = sum_c q_c and the centring term ecorr = mid * sum_c (q_c - qscale q8_c), which
  /// the per-token scale multiplies like the integer sum; then the second plane if it is needed.
  void prepare_query_int8(Scratch& s) const {
    const int d = d_, gc = KF::group_channels(d_), ncg = d / gc;
    for (int h = 0; h < g_; ++h) {
      const float* q = s.qf + std::size_t(h) * d;
      std::int8_t* q8 = s.q8 + std::size_t(h) * d;
      quantize_row_i8(q, q8, s.qscale[h]);
      const F qs = F::set1(s.qscale[h]);
      for (int cg = 0; cg < ncg; ++cg) {
        F a = F::zero(), r = F::zero();
        for (int c = cg * gc; c < (cg + 1) * gc; c += N) {
          a = a + F::load(q + c);
          r = r + (F::load(q + c) - qs * F::load(q8 + c));
        }
        s.qsum[h * ncg + cg] = reduce_add(a);
        s.ecorr[h * ncg + cg] = kCodeMid<KF> * reduce_add(r);
      }
    }
    s.lo_item = lo_plane_needed(s, s.qf);
    if (s.lo_item && !kLoPlaneAsFloat) add_lo_plane(s, s.qf, s.ecorr, gc);
  }

  /// Predicted (kernel / quantisation) error ratio above which the fast path's int8 query gets a
  /// second int8 plane. One plane rounds x_c (the folded query q_c s_c, or q_c for per-token scales)
  /// with step qscale = max|x| / 127; against the codes the error is sum_c e_c (k^_c - mid), with
  /// variance qscale^2 / 12 * E_c * d (E_c = ((2^b)^2 - 1) / 12, uniform codes), while the codes' own
  /// step/2 error sum_c x_c u_c has variance sum_c x_c^2 / 12. So ratio^2 = qscale^2 E_c d / sum x^2:
  /// ~0.1 for 4-bit codes and a Gaussian query, ~0.4 with a 100x outlier channel, never above
  /// sqrt(E_c d) / 127 (< 0.1 for 2-bit codes at d <= 128: no check there).
  static constexpr float kLoPlaneRatio = KVC_LO_PLANE_RATIO;

  /// Where one plane is not enough, AVX2 computes the key scores with float FMAs over the codes
  /// (exact) instead of a second integer pass: without VNNI its emulated `vpdpbusd` (vpmaddubsw +
  /// vpmaddwd + vpaddd) costs more than the float dot (kvc_bench on Zen 1: kivi4 29.9 ms with two
  /// integer passes, 18.0 ms all-float, 22.0 ms with one pass). AVX-512 VNNI and the portable path
  /// (which mirrors VNNI's arithmetic) run the second integer pass.
  static constexpr bool kLoPlaneAsFloat = KVC_ISA_LEVEL_ == 1;

  /// Whether any head's predicted ratio (see kLoPlaneRatio) exceeds kLoPlaneRatio for the int8
  /// planes s.q8 / s.qscale of x [g][d].
  bool lo_plane_needed(const Scratch& s, const float* x) const {
    const int d = d_;
    constexpr float levels = static_cast<float>(1 << KF::kBits);
    constexpr float ec = (levels * levels - 1.0f) / 12.0f;
    constexpr float r2 = kLoPlaneRatio * kLoPlaneRatio;
    if (ec * static_cast<float>(d) <= r2 * 127.0f * 127.0f) return false;
    for (int h = 0; h < g_; ++h) {
      F ss = F::zero();
      for (int c = 0; c < d; c += N) ss = fma(F::load(x + std::size_t(h) * d + c), F::load(x + std::size_t(h) * d + c), ss);
      if (s.qscale[h] * s.qscale[h] * ec * static_cast<float>(d) > r2 * reduce_add(ss)) return true;
    }
    return false;
  }

  /// The second plane, for every head: r_c = x_c - qscale q8_c (|r_c| <= qscale / 2) rounded to
  /// q8lo with step qscale_lo = qscale / 254, which leaves a rounding 254x smaller (the key dot then
  /// runs twice). corr[h][cg] (the centring term of each group of gc channels: the bias, gc = d, or
  /// ecorr) becomes mid * sum_c (r_c - qscale_lo q8lo_c).
  void add_lo_plane(Scratch& s, const float* x, float* corr, int gc) const {
    const int d = d_, ncg = d / gc;
    for (int h = 0; h < g_; ++h) {
      const float* xh = x + std::size_t(h) * d;
      const std::int8_t* q8 = s.q8 + std::size_t(h) * d;
      const F qs = F::set1(s.qscale[h]);
      for (int cg = 0; cg < ncg; ++cg) {
        const int c0 = cg * gc;
        F rs = F::zero();
        auto resid = [&](int i) {
          const F r = F::load(xh + c0 + i) - qs * F::load(q8 + c0 + i);
          rs = rs + r;
          return r;
        };
        const F left = round_to_bytes(gc, 0.5f * s.qscale[h], 127.0f, s.q8lo + std::size_t(h) * d + c0, s.qscale_lo[h], resid);
        corr[h * ncg + cg] += kCodeMid<KF> * reduce_add(left - rs);
      }
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
  /// Full-precision tokens [first, last) in the selector's storage order (rows token-major, not
  /// contiguous: a ring wraps, a log set is followed by its staging rows).
  /// Scores: the rows are widened to float once into s.wrow, then N tokens at a time each head keeps
  /// one accumulator per token and sums their lanes together (simd::hsum_lanes); values share each
  /// row load across the heads like identity value blocks. PartialLogWindow: values that left their
  /// window are quantized rows, decoded into s.vrowf (with the exact ones) before the value sum.
  void fp_tokens(Scratch& s, Item& it, int seq, int kvh, int first, int last) const {
    const int n = last - first, d = d_;
    if (n <= 0) return;
    const W* vrow[B];
    for (int t = 0; t < n; ++t) {
      const W* k = p_.fp_row_at(Side::kKey, seq, kvh, first + t);
      for (int c = 0; c < d; c += N) F::load(k + c).store(s.wrow + std::size_t(t) * d + c);
      vrow[t] = p_.fp_row_at(Side::kValue, seq, kvh, first + t);
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
    if constexpr (Layout::kQuantizedFpValues) {
      using RF = typename Layout::value_row_format;
      for (int t = 0; t < n; ++t) {
        float* out = s.vrowf + std::size_t(t) * d;
        if (p_.fp_value_quantized(seq, first + t)) {
          RF::decode_row(p_.value_row_at(seq, kvh, first + t), d, out);
        } else {
          for (int c = 0; c < d; c += N) F::load(vrow[t] + c).store(out + c);
        }
      }
      float_value_dot(s, it, n, [&](int t) { return static_cast<const float*>(s.vrowf + std::size_t(t) * d); });
    } else {
      float_value_dot(s, it, n, [&](int t) { return vrow[t]; });
    }
  }

  // ---------------------------------------------------------------- AlignedLoader over the full-precision slots
  /// The selector's full-precision slots stored as AlignedKV bit planes (Layout::kAlignedWindow,
  /// aligned/slot_planes.hpp), attended in chunks of B slots in slot order, live slots only:
  ///  - keys: Rule 1 per channel (AlignedLoader::key_tiers) from the group's queries as this kernel holds them
  ///    (softmax-scaled, rotated with the cache: a common factor moves a binade difference by at most one, at a
  ///    boundary) and Kmax[c], the largest exponent field of the live slots' keys (read from their hi8 bytes,
  ///    which every tier loads); a chunk's keys are put together at their tiers (aligned::assemble_run) into an
  ///    fp16 [d][B] tile and scored like an fp16 key block;
  ///  - values: each chunk is its own softmax partition (the online softmax merges it with the rest, scaling
  ///    its output and that output's error alike), so Rule 2 runs on the chunk: its probabilities normalised
  ///    over the chunk, the estimate from its TopK candidates' hi8 rows (AlignedLoader::estimate_reference),
  ///    Vmax over the live slots; every live row is put together at its tier (AlignedLoader::value_tier) and
  ///    summed like the fp16 window's rows.
  /// Only the planes a tier asks for are read; hi8 of every live element always. it.read (non-null): the planes'
  /// bytes this read are added to it, each byte once.
  void aligned_window(Scratch& s, Item& it, int seq, int kvh) const {
    using Loader = typename Layout::loader;
    constexpr int S = Layout::kFpStride;
    const int d = d_, n = p_.lengths[seq], nfp = p_.fp_count(seq);
    if (nfp <= 0) return;
    const aligned::SlotPlanes kp = p_.fp_planes(Side::kKey, seq, kvh), vp = p_.fp_planes(Side::kValue, seq, kvh);
    std::uint8_t* live = s.alive;
    std::memset(live, 0, S);
    for (int i = 0; i < nfp; ++i) live[Layout::selector::fp_slot(n, i, B)] = 0xFF;
    // Kmax / Vmax: an fp16's exponent field is bits 6..2 of its hi8 byte.
    std::uint8_t *ktier = s.ameta, *kmax = ktier + d, *vmax = kmax + d;
    for (int c = 0; c < d; ++c) {
      const std::uint8_t* hi = kp.hi() + std::size_t(c) * S;
      std::uint8_t m = 0;
      for (int j = 0; j < S; ++j) m = std::max(m, std::uint8_t(hi[j] & live[j] & 0x7C));
      kmax[c] = std::uint8_t(m >> 2);
    }
    std::memset(vmax, 0, std::size_t(d));
    for (int j = 0; j < S; ++j)
      if (live[j]) {
        const std::uint8_t* hi = vp.hi() + std::size_t(j) * d;
        for (int c = 0; c < d; ++c) vmax[c] = std::max(vmax[c], std::uint8_t(hi[c] & 0x7C));
      }
    for (int c = 0; c < d; ++c) vmax[c] = std::uint8_t(vmax[c] >> 2);
    Loader::key_tiers(s.qf, g_, d, kmax, ktier);
    aligned::ReadStats* rd = it.read;
    if (rd) rd->key_bytes += std::size_t(d) * S, rd->value_bytes += std::size_t(nfp) * d;  // the hi8 scans above
    for (int h = 0; h < g_; ++h) s.bias[h] = 0.0f;

    for (int j0 = 0; j0 < S; j0 += B) {
      int m = 0;
      for (int j = 0; j < B; ++j)
        if (live[j0 + j]) s.arows[m++] = j0 + j;
      if (m == 0) continue;
      for (int c = 0; c < d; ++c) {
        const std::size_t at = std::size_t(c) * S + j0;
        aligned::assemble_run(ktier[c], kp.hi() + at, kp.mid() + at / 2, kp.lo() + at / 2, B, s.abits + std::size_t(c) * B);
        if (rd) rd->count_keys(ktier[c], std::size_t(B));  // the chunk's B slots of channel c, dead ones too
      }
      float_key_dot(s, static_cast<const half_t*>(s.abits), s.qf, 0, d, nullptr, nullptr, true);
      for (int h = 0; h < g_; ++h)  // the live slots' scores to the front (in place: arows[k] - j0 >= k)
        for (int k = 0; k < m; ++k) s.sc[std::size_t(h) * B + k] = s.sc[std::size_t(h) * B + s.arows[k] - j0];
      softmax_update(s, it, m);
      // The live rows at tier 8 as |float| (s.wrow [m][d], converted once for every head), then per head the
      // estimate over its TopK candidates (AlignedLoader::estimate_reference's sum, vectorised) and its reference.
      for (int k = 0; k < m; ++k) {
        const std::size_t at = std::size_t(s.arows[k]) * d;
        aligned::assemble_run<8>(vp.hi() + at, nullptr, nullptr, d, s.abits + std::size_t(k) * d);
        for (int c = 0; c < d; c += N)
          abs(F::load(s.abits + std::size_t(k) * d + c)).store(s.wrow + std::size_t(k) * d + c);
      }
      for (int h = 0; h < g_; ++h) {
        const float* w = s.sc + std::size_t(h) * B;
        float* p = s.aprob + std::size_t(h) * B;
        float sum = 0.0f;
        for (int k = 0; k < m; ++k) sum += w[k];
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // all underflowed: every row adds nothing (tier 8)
        for (int k = 0; k < m; ++k) p[k] = w[k] * inv;
        int cand[Loader::kTopK];
        const int nc = Loader::top_candidates(p, m, cand);
        for (int c = 0; c < d; c += N) {
          F e = F::zero();
          for (int i = 0; i < nc; ++i) e = fma(F::set1(p[cand[i]]), F::load(s.wrow + std::size_t(cand[i]) * d + c), e);
          e.store(s.aest + c);
        }
        s.aref[h] = Loader::value_reference(s.aest, d, vmax);
      }
      for (int k = 0; k < m; ++k) {
        const std::size_t at = std::size_t(s.arows[k]) * d;
        const int tier = Loader::value_tier(s.aprob + k, B, g_, s.aref);
        aligned::assemble_run(tier, vp.hi() + at, vp.mid() + at / 2, vp.lo() + at / 2, d, s.abits + std::size_t(k) * d);
        if (rd) rd->count_values(tier, std::size_t(d));  // its hi8 counted with the Vmax scan
      }
      float_value_dot(s, it, m, [&](int k) { return static_cast<const half_t*>(s.abits + std::size_t(k) * d); });
    }
  }

  // ---------------------------------------------------------------- one block
  /// The policies' per-block corrections (GEAR's outliers and low-rank factors, in the block or in
  /// the stream's outlier table) run as epilogues of the scores (before the softmax) and of the value
  /// accumulation (same probabilities).
  void block(Scratch& s, Item& it, int seq, int kvh, int b) const {
    const std::byte* kb = p_.key_block(seq, kvh, b);
    const std::byte* vb = p_.value_block(seq, kvh, b);
    KVC_PHASE(kOther);
    KVC_PHASE_BLOCK();
    key_scores(s, kb);  // marks kKeyPrep where the dot products start
    KVC_PHASE(kKeyDot);
    if constexpr (KF::kCorrected)
      KF::correction::add_scores(KF::correction_region(kb, d_), widen_correction<KF>(s, kb), B, d_, s.qf, g_, s.sc, B);
    if constexpr (Layout::kKeyStreamOutliers) {
      const OutlierSlice o = p_.outliers(Side::kKey, seq, kvh, b);
      Layout::stream_outliers::add_scores(o.idx, widen(s, o.val, o.n), o.n, d_, s.qf, g_, s.sc, B);
    }
    if constexpr (KF::kCorrected || Layout::kKeyStreamOutliers) KVC_PHASE(kCorrections);
    // AlignedSinkWindow: block 0's first rows hold no token; probability exactly 0 (exp2(-inf)), so the
    // value pass adds nothing for them (their codes are finite copies of a real row).
    if constexpr (kMaskedRows > 0)
      if (b == 0)
        for (int h = 0; h < g_; ++h)
          for (int r = 0; r < kMaskedRows; ++r) s.sc[std::size_t(h) * B + r] = -std::numeric_limits<float>::infinity();
    softmax_update(s, it, B);
    KVC_PHASE(kSoftmax);
    if constexpr (VF::kCorrected)
      VF::correction::add_output(VF::correction_region(vb, d_), widen_correction<VF>(s, vb), B, d_, s.sc, g_, B,
                                 it.acc);
    if constexpr (Layout::kValueStreamOutliers) {
      const OutlierSlice o = p_.outliers(Side::kValue, seq, kvh, b);
      Layout::stream_outliers::add_output(o.idx, widen(s, o.val, o.n), o.n, d_, s.sc, g_, B, it.acc);
    }
    if constexpr (VF::kCorrected || Layout::kValueStreamOutliers) KVC_PHASE(kCorrections);
    value_accumulate(s, it, vb);  // marks kValuePrep where the dot products start
    KVC_PHASE(kValueDot);
  }

  /// A block's correction payload (fp16) widened to float into s.cwork with this path's conversion.
  template <class Fmt>
  const float* widen_correction(Scratch& s, const std::byte* blk) const {
    using C = typename Fmt::correction;
    return widen(s, C::halves(Fmt::correction_region(blk, d_), B, d_), C::half_count(B, d_));
  }
  /// n fp16 values widened into s.cwork (n <= the scratch's correction capacity).
  const float* widen(Scratch& s, const half_t* h, int n) const {
    int i = 0;
    for (; i + N <= n; i += N) F::load(h + i).store(s.cwork + i);
    for (; i < n; ++i) s.cwork[i] = h[i].to_float();
    return s.cwork;
  }

  /// s.sc[h][t] = q_h . k_t for the B tokens of a key block.
  void key_scores(Scratch& s, const std::byte* kb) const {
    const int d = d_;
    if constexpr (KF::kIdentity) {
      for (int h = 0; h < g_; ++h) s.bias[h] = 0.0f;
      KVC_PHASE(kKeyPrep);
      float_key_dot(s, reinterpret_cast<const typename KF::element*>(kb), s.qf, 0, d, nullptr, nullptr, true);
    } else {
      s.kpacked = reinterpret_cast<const std::uint8_t*>(kb);
      if constexpr (!kFused<KF>) simd::unpack_codes<KF::kBits>(s.kpacked, std::size_t(B) * d, s.ktile);
      load_meta<KF>(kb, s.kzero, s.kscale);
      if constexpr (!KF::kPerTokenScale) {
        // Scales and zeros constant over the block's tokens: fold them into the query.
        const int gc = KF::group_channels(d);
        const bool fast_fold = fold_query_fast(s);
        if (!fast_fold) {  // the generic fold, unless the AVX-512 one applied
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
            s.bias[h] = reduce_add(bias);  // sum_c q_c z_c; the int8 rounding's centring term apart:
            if constexpr (kInt<KF>)
              s.kres[h] = kCodeMid<KF> * reduce_add(round_to_bytes(f, d, reduce_max(mx), 127.0f,
                                                                    s.q8 + std::size_t(h) * d, s.qscale[h]));
          }
        }
        if constexpr (kInt<KF>) {
          const bool lo = lo_plane_needed(s, s.fold);
          if (kLoPlaneAsFloat && lo) {  // exact float scores for this block
            KVC_PHASE(kKeyPrep);
            float_key_dot<kQuads<KF>>(s, s.ktile, s.fold, 0, d, nullptr, nullptr, true);
            return;
          }
          if (!fast_fold)
            for (int h = 0; h < g_; ++h) s.bias[h] += s.kres[h];
          if (lo) add_lo_plane(s, s.fold, s.bias, d);
          KVC_PHASE(kKeyPrep);
          int_key_dot(s, 0, d, s.q8, [&](int h, int t, F dot) {
            (dot * F::set1(s.qscale[h]) + F::set1(s.bias[h])).store(s.sc + std::size_t(h) * B + t);
          });
          if (lo)
            int_key_dot(s, 0, d, s.q8lo, [&](int h, int t, F dot) {
              float* o = s.sc + std::size_t(h) * B + t;
              fma(dot, F::set1(s.qscale_lo[h]), F::load(o)).store(o);
            });
        } else {
          KVC_PHASE(kKeyPrep);
          float_key_dot<kQuads<KF>>(s, s.ktile, s.fold, 0, d, nullptr, nullptr, true);
        }
      } else {
        const int gc = KF::group_channels(d), ncg = d / gc;
        for (int h = 0; h < g_; ++h)
          std::memset(s.sc + std::size_t(h) * B, 0, sizeof(float) * B);
        KVC_PHASE(kKeyPrep);
        for (int cg = 0; cg < ncg; ++cg) {
          const float* zrow = s.kzero + std::size_t(cg) * B;
          const float* srow = s.kscale + std::size_t(cg) * B;
          bool int_dot = false;
          if constexpr (kInt<KF>) int_dot = !(kLoPlaneAsFloat && s.lo_item);
          if (int_dot) {
            if constexpr (kInt<KF>) {
              // score += s_t (qscale dot + centring) + z_t qsum, per channel group.
              int_key_dot(s, cg * gc, (cg + 1) * gc, s.q8, [&](int h, int t, F dot) {
                float* o = s.sc + std::size_t(h) * B + t;
                const std::size_t i = std::size_t(h) * ncg + cg;
                fma(fma(dot, F::set1(s.qscale[h]), F::set1(s.ecorr[i])), F::load(srow + t),
                    fma(F::set1(s.qsum[i]), F::load(zrow + t), F::load(o)))
                    .store(o);
              });
              if (s.lo_item)
                int_key_dot(s, cg * gc, (cg + 1) * gc, s.q8lo, [&](int h, int t, F dot) {
                  float* o = s.sc + std::size_t(h) * B + t;
                  fma(dot * F::set1(s.qscale_lo[h]), F::load(srow + t), F::load(o)).store(o);
                });
            }
          } else {
            float_key_dot<kQuads<KF>>(s, s.ktile, s.qf, cg * gc, (cg + 1) * gc, srow, zrow, false, cg, ncg);
          }
        }
      }
    }
  }

  /// Channels [c0, c1) of the score of every token, float FMAs over a [c][t] tile of element type T
  /// (Quads: a byte tile in the integer kernel order [c/4][t][c%4], c0 and c1 multiples of 4).
  /// fold: sc = dot + bias[h]. Otherwise sc += dot * rowscale[t] + qsum[h][cg] * rowzero[t].
  template <bool Quads = false, class T>
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
      // Even and odd channels accumulate separately (E = 2 sets of NH*JT independent FMA chains: with
      // NH*JT = 8, one set leaves the FMA latency exposed) where the registers hold both sets, the JT loaded
      // vectors and the broadcast query; otherwise one set (AVX2 with 4 heads: 19 > 16 registers would spill
      // accumulators on every channel).
      constexpr int E = simd::fits_regs(2 * NH * JT, JT) ? 2 : 1;
      for (int j = 0; j < B; j += N * JT) {
        F a[E][NH][JT];
        for (int e = 0; e < E; ++e)
          for (int h = 0; h < NH; ++h)
            for (int jj = 0; jj < JT; ++jj) a[e][h][jj] = F::zero();
        // One prefetch step (a line of each prefetch range) per 64 bytes this loop reads: issued faster than
        // the loop consumes lines, the requests queue up and stall it (AVX2 fp16: every other channel).
        constexpr int kLineC = std::max<int>(1, 64 / int(JT * N * sizeof(T)));
        auto step = [&](int c, F (&acc)[NH][JT]) KVC_INLINE_LAMBDA {
          if (kLineC == 1 || c % kLineC == 0) s.prefetch_step();
          F kv[JT];
          for (int jj = 0; jj < JT; ++jj) kv[jj] = F::load(tile + std::size_t(c) * B + j + jj * N);
          for (int h = 0; h < NH; ++h) {
            const F qb = F::set1(q[std::size_t(h0 + h) * d + c]);
            for (int jj = 0; jj < JT; ++jj) acc[h][jj] = fma(qb, kv[jj], acc[h][jj]);
          }
        };
        if constexpr (Quads) {
          auto lanes = [&]<int L>(int c, const I (&x)[JT], F (&acc)[NH][JT]) KVC_INLINE_LAMBDA {
            for (int h = 0; h < NH; ++h) {
              const F qb = F::set1(q[std::size_t(h0 + h) * d + c + L]);
              for (int jj = 0; jj < JT; ++jj) acc[h][jj] = fma(qb, x[jj].template byte_lane<L>(), acc[h][jj]);
            }
          };
          for (int c = c0; c < c1; c += 4) {
            s.prefetch_step();
            I x[JT];
            for (int jj = 0; jj < JT; ++jj) x[jj] = I::load(tile + (std::size_t(c >> 2) * B + j + jj * N) * 4);
            lanes.template operator()<0>(c, x, a[0]);
            lanes.template operator()<1>(c, x, a[E - 1]);
            lanes.template operator()<2>(c, x, a[0]);
            lanes.template operator()<3>(c, x, a[E - 1]);
          }
        } else {
          int c = c0;
          for (; c + 2 <= c1; c += 2) {
            step(c, a[0]);
            step(c + 1, a[E - 1]);
          }
          if (c < c1) step(c, a[0]);
        }
        if constexpr (E == 2)
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
  /// and scale as the generic path; the bias differs only in float summation order. Needs d % 64 == 0.
  /// Returns false (doing nothing) where it does not apply: the caller runs the generic fold.
  bool fold_query_fast(Scratch& s) const {
#if KVC_ISA_LEVEL_ == 2
    if constexpr (!kFused<KF>) {
      return false;
    } else {
      if (d_ % 64 != 0) return false;  // 64 channels per packing step below
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

  /// Token vectors per pass of the fused AVX-512 key loop over nh heads and cq token vectors of a block, per
  /// codes in a packed byte: all cq where nh x cq accumulators leave room in the 32 registers for the loaded,
  /// unpacked and broadcast vectors (nh x cq <= 16), else the largest divisor of cq that is a multiple of per
  /// (each packed vector then belongs to one pass) with nh x it <= 16, at least per.
  static constexpr int fused_key_pass(int nh, int cq, int per) {
    if (nh * cq <= 16) return cq;
    int js = per;
    for (int j = per; j <= cq; j += per)
      if (cq % j == 0 && nh * j <= 16) js = j;
    return js;
  }

  /// Integer version over the [c/4][t][c%4] code tile with the int8 query s.q8.
  /// Channels [c0, c1): epi(h, t, dot) gets, for query head h and tokens [t, t + N) (16 on the fused
  /// path), the integer sums sum_c q8[h][c] k^_tc as floats.
  template <class Epi>
  void int_key_dot(Scratch& s, int c0, int c1, const std::int8_t* q8, Epi&& epi) const {
    const int d = d_;
#if KVC_ISA_LEVEL_ == 2
    if constexpr (kFused<KF>) {
      // Chunks of 64 codes = 16 tokens x 4 channels; chunk k = quad * CQ + token vector; packed vector m holds
      // the kPer chunks k = m * kPer + i (code i at bits i * w of each byte).
      constexpr int w = KF::kBits, kPer = 8 / w, CQ = B / 16;
      const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << w) - 1));
      auto code = [&](__m512i x, int i) KVC_INLINE_LAMBDA {
        return _mm512_and_si512(_mm512_srli_epi16(x, i * w), mask);
      };
      for_head_chunks(g_, [&]<int NH>(int h0) {
        // Each head's int8 query quad is broadcast once per channel quad (and pass) into a register.
        auto broadcast = [&](int quad, __m512i (&qb)[NH]) KVC_INLINE_LAMBDA {
          for (int h = 0; h < NH; ++h) {
            std::int32_t qq;
            std::memcpy(&qq, q8 + std::size_t(h0 + h) * d + quad * 4, 4);
            qb[h] = _mm512_set1_epi32(qq);
          }
        };
        // JS token vectors per pass (fused_key_pass): all CQ for blocks of <= 64 tokens, passes over fewer for
        // longer ones (GEAR-KIVI's 128 tokens: 4 x 8 accumulators would spill). Exact int32 sums: the same
        // scores in any order.
        constexpr int JS = fused_key_pass(NH, CQ, kPer);
        static_assert(CQ % JS == 0 && (kPer > CQ ? JS == CQ : JS % kPer == 0));
        for (int j0 = 0; j0 < CQ; j0 += JS) {
          __m512i a[NH][JS], qb[NH];
          for (int h = 0; h < NH; ++h)
            for (int j = 0; j < JS; ++j) a[h][j] = _mm512_setzero_si512();
          if constexpr (kPer <= CQ) {  // a packed vector inside one quad: per quad, the pass's JS / kPer vectors
            for (int quad = c0 / 4; quad < c1 / 4; ++quad) {
              broadcast(quad, qb);
              for (int v = 0; v < JS / kPer; ++v) {
                const std::size_t m = (std::size_t(quad) * CQ + j0) / kPer + v;
                const __m512i x = _mm512_loadu_si512(s.kpacked + m * 64);
                s.prefetch_step();
                for (int i = 0; i < kPer; ++i) {
                  const __m512i c = code(x, i);
                  for (int h = 0; h < NH; ++h) a[h][v * kPer + i] = _mm512_dpbusd_epi32(a[h][v * kPer + i], c, qb[h]);
                }
              }
            }
          } else {  // a packed vector spans kPer / CQ quads (2-bit codes, 32-token blocks); one pass (JS == CQ)
            for (int m = (c0 / 4) * CQ / kPer; m < (c1 / 4) * CQ / kPer; ++m) {
              const __m512i x = _mm512_loadu_si512(s.kpacked + std::size_t(m) * 64);
              s.prefetch_step();
              for (int qi = 0; qi < kPer / CQ; ++qi) {
                broadcast(m * (kPer / CQ) + qi, qb);
                for (int j = 0; j < CQ; ++j) {
                  const __m512i c = code(x, qi * CQ + j);
                  for (int h = 0; h < NH; ++h) a[h][j] = _mm512_dpbusd_epi32(a[h][j], c, qb[h]);
                }
              }
            }
          }
          for (int h = 0; h < NH; ++h)
            for (int j = 0; j < JS; ++j) epi(h0 + h, (j0 + j) * 16, F{_mm512_cvtepi32_ps(a[h][j])});
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
          s.prefetch_step();  // spread the block's prefetches over the loop (a burst between blocks stalls)
          I code[JT];
          for (int jj = 0; jj < JT; ++jj) code[jj] = I::load(s.ktile + (std::size_t(c >> 2) * B + j + jj * N) * 4);
          for (int h = 0; h < NH; ++h) {
            std::int32_t quad;
            std::memcpy(&quad, q8 + std::size_t(h0 + h) * d + c, 4);
            const I qb = I::set1(quad);
            for (int jj = 0; jj < JT; ++jj) a[h][jj] = dpbusd(a[h][jj], code[jj], qb);
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int jj = 0; jj < JT; ++jj) epi(h0 + h, j + jj * N, a[h][jj].to_float());
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
      if constexpr (VF::kPerTokenScale && kInt<VF>) {
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
              if constexpr (kInt<VF>) {
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
            if constexpr (kInt<VF>)
              s.perr[h] = kCodeMid<VF> * reduce_add(round_to_bytes(pr, B, reduce_max(mx), 255.0f, s.w8 + std::size_t(h) * B, s.wscale[h]));
          }
        }
      }
      KVC_PHASE(kValuePrep);
#if KVC_ISA_LEVEL_ == 2
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
          s.prefetch_step();  // one line per channel vector (the key loop issued most of the block's lines)
          const int cg = c / gc;
          F dot[NH];
          if constexpr (kInt<VF>) {
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
            auto token = [&](int t, F code) {
              for (int h = 0; h < NH; ++h) {
                const float w = VF::kPerTokenScale ? s.wf[(std::size_t(h0 + h) * ncg + cg) * B + t]
                                                   : s.sc[std::size_t(h0 + h) * B + t];
                dot[h] = fma(F::set1(w), code, dot[h]);
              }
            };
            if constexpr (kQuads<VF>) {  // exact precision over the integer kernel order [t/4][c][t%4]
              for (int t = 0; t < B; t += 4) {
                const I x = I::load(s.vtile + (std::size_t(t >> 2) * d + c) * 4);
                token(t, x.template byte_lane<0>());
                token(t + 1, x.template byte_lane<1>());
                token(t + 2, x.template byte_lane<2>());
                token(t + 3, x.template byte_lane<3>());
              }
            } else {
              for (int t = 0; t < B; ++t) token(t, F::load(s.vtile + std::size_t(t) * d + c));
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
              if constexpr (kInt<VF>) dh = dh + F::set1(s.perr[h0 + h]);
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
#if KVC_ISA_LEVEL_ == 2
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
  /// chains in flight (the latency, not the port count, bounds a single chain): the most (8, 4 or 2) whose
  /// accumulators, row vectors and broadcast probability fit the registers (AVX2, 4 heads: 2).
  template <class Row>
  void float_value_dot(Scratch& s, Item& it, int n, Row&& row) const {
    const int d = d_;
    for_head_chunks(g_, [&]<int NH>(int h0) {
      auto pass = [&]<int CT>(int c) KVC_INLINE_LAMBDA {
        F a[NH][CT];
        for (int h = 0; h < NH; ++h)
          for (int k = 0; k < CT; ++k) a[h][k] = F::load(it.acc + std::size_t(h0 + h) * d + c + k * N);
        // One prefetch step per 64 bytes read (see float_key_dot): a token's kRowBytes may be less than a line
        // (AVX2 fp16: 32 bytes), then every kLineT-th token steps.
        using Elem = std::remove_cvref_t<decltype(*row(0))>;
        constexpr int kRowBytes = int(CT * N * sizeof(Elem));
        constexpr int kLineSteps = std::max(1, kRowBytes / 64), kLineT = std::max(1, 64 / kRowBytes);
        for (int t = 0; t < n; ++t) {
          if (kLineT == 1 || t % kLineT == 0)
            for (int k = 0; k < kLineSteps; ++k) s.prefetch_step();
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
      constexpr int kCT = simd::fits_regs(NH * 8, 8) ? 8 : simd::fits_regs(NH * 4, 4) ? 4 : 2;
      int c = 0;
      for (; c + kCT * N <= d; c += kCT * N) pass.template operator()<kCT>(c);
      for (; c < d; c += N) pass.template operator()<1>(c);
    });
  }

  P p_;
  int g_;
  int d_;
};

/// The entry points kvc::detail::kernel_fns hands out (compiled for this path; kernel_fns_for below).
template <class Layout, bool Exact>
struct Entry {
  using P = typename Layout::Params;
  static std::size_t scratch_floats(const P& p, int group) { return DecodeKernel<Layout, Exact>(p, group).scratch_floats(); }
  static void run(const P& p, int group, const float* q, const WorkItem& w, float* scratch, float* result) {
    typename DecodeKernel<Layout, Exact>::Item it{result, result + group, result + 2 * group};
    if constexpr (Layout::kAlignedWindow) {
      aligned::ReadStats read{};
      it.read = &read;
      DecodeKernel<Layout, Exact>(p, group).run(q, w.seq, w.kvh, w.b0, w.b1, w.fp, scratch, it);
      std::memcpy(result + item_stats_offset(group, p.head_dim), &read, sizeof read);
    } else {
      DecodeKernel<Layout, Exact>(p, group).run(q, w.seq, w.kvh, w.b0, w.b1, w.fp, scratch, it);
    }
  }
};
/// This path's entry points, found through its IsaTag by kvc::detail::kernel_fns (select_isa.hpp).
template <class Layout, bool Exact>
KernelFns<Layout> kernel_fns_for(IsaTag) noexcept {
  return {&Entry<Layout, Exact>::scratch_floats, &Entry<Layout, Exact>::run};
}
}  // namespace kvc::detail::KVC_ISA_NS
