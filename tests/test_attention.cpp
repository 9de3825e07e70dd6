// Fused decode attention (attention/decode_attention.hpp) against the double-precision oracle, for
// every scheme: (a) on the cache's own dequantize() output, (b) on the original data within a bound
// derived from the stored quantization steps.
//
// Tolerances of (a):
//  - identity blocks and 5..8-bit codes (float FMAs): float rounding, 1e-5 of max|V| (the output is
//    a convex combination of V; measured <= 8e-7 over 32 random cases on all three SIMD paths).
//  - <= 4-bit codes (integer dot products, Precision::kFast): the int8 query / uint8 weight rounding
//    adds an error that grows with the spread of the folded query q'_c = q_c s_c (key outlier
//    channels); the kernel adds a second int8 query plane where it would be large. (a) runs on data
//    with moderate (4x) outlier channels. Tolerances: 10% / 5% of max|o| / rms(o) (20% / 10% at 1
//    bit). A wrong scale, zero, group index or head mapping moves outputs by a good part of a step
//    and fails by far; test_attention_paths.cpp bounds the kernel's own error against the
//    quantization error on 100x outliers.
// Every test runs on every SIMD path this CPU supports (KVC_FOR_EACH_ISA).
#include "test_util.hpp"

namespace {

using namespace kvc_test;

struct Case {
  int d, kv_heads, q_heads;
  std::vector<int> lengths;
  int layers = 1, layer = 0;
};

const Case kCases[] = {
    {128, 2, 4, {1, 33, 200}, 2, 1},  // GQA 2, batch 3 of different lengths, second layer
    {64, 2, 2, {5, 127, 32}},         // MHA
    {256, 2, 6, {500}},               // GQA 3 (6 query heads over 2 KV heads), long
    {64, 1, 4, {31, 1000}},           // GQA 4 (MQA)
};

/// Key outlier channels 4x the others (test (a)); the default generator uses 12x (realistic).
GenOptions moderate() {
  GenOptions g;
  g.outlier_scale = 4.0f;
  return g;
}

template <class Cache>
class Attention : public ::testing::Test {
 protected:
  static constexpr bool kOneBit = Cache::key_format::kBits == 1 || Cache::value_format::kBits == 1;
  static constexpr double kMaxRel = kHasIntDot<Cache> ? (kOneBit ? 0.2 : 0.1) : 0.0;
  static constexpr double kRmsRel = kHasIntDot<Cache> ? (kOneBit ? 0.1 : 0.05) : 0.0;
  static constexpr double kFloatRel = 1e-5;

  /// Checks fused output `got` against the oracle `want` on the same (dequantized) data; maxv is
  /// max|V| of the attended values.
  static ::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want, double maxv) {
    if (!all_finite(got)) return ::testing::AssertionFailure() << "non-finite output";
    const double err = max_abs_diff(got, want), mo = max_abs(want);
    const double tol = kFloatRel * maxv + kMaxRel * mo;
    if (!(err <= tol))
      return ::testing::AssertionFailure() << "max|err| " << err << " > " << tol << " (max|o| " << mo << ")";
    const double r = rms_diff(got, want), ro = rms(want);
    if (kHasIntDot<Cache> && !(r <= kRmsRel * ro + kFloatRel * maxv))
      return ::testing::AssertionFailure() << "rms err " << r << " > " << kRmsRel << " * rms(o) " << ro;
    return ::testing::AssertionSuccess() << "max|err| " << err;
  }
  static double max_v(const Cache& c, int layer, int nseq) {
    double m = 0.0;
    for (int s = 0; s < nseq; ++s) m = std::max(m, max_abs(dequantize(c, layer, s).v));
    return m;
  }
};
TYPED_TEST_SUITE(Attention, AllSchemes, SchemeNames);

TYPED_TEST(Attention, MatchesOracleOnDequantizedCache) {
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    std::uint64_t seed = 1;
    for (const Case& cs : kCases) {
      auto f = make_filled<Cache>(cs.layers, cs.kv_heads, cs.d, cs.lengths, seed++, moderate());
      const int nseq = int(cs.lengths.size());
      const auto q = random_query(nseq, cs.q_heads, cs.d, seed++);
      const auto got = fused(*f.cache, cs.layer, q, nseq, cs.q_heads);
      const auto want = oracle_cache(*f.cache, cs.layer, q, nseq, cs.q_heads);
      EXPECT_TRUE(TestFixture::close(got, want, TestFixture::max_v(*f.cache, cs.layer, nseq)))
          << "d " << cs.d << " heads " << cs.q_heads << "/" << cs.kv_heads << " T0 " << cs.lengths[0];
      // another layer holds other data: attention must read the requested one
      if (cs.layers > 1) {
        const auto other = oracle_cache(*f.cache, 0, q, nseq, cs.q_heads);
        EXPECT_GT(max_abs_diff(got, other), 0.3 * max_abs(want)) << "layer 1 read like layer 0";
      }
    }
  }
}

TYPED_TEST(Attention, MatchesOracleOnOriginalDataWithinQuantizationBound) {
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    std::uint64_t seed = 50;
    for (const Case& cs : {kCases[0], kCases[2]}) {
      auto f = make_filled<Cache>(cs.layers, cs.kv_heads, cs.d, cs.lengths, seed++, moderate());
      const int nseq = int(cs.lengths.size());
      const auto q = random_query(nseq, cs.q_heads, cs.d, seed++);
      const auto got = fused(*f.cache, cs.layer, q, nseq, cs.q_heads);
      ASSERT_TRUE(all_finite(got));
      const auto& data = f.data[std::size_t(cs.layer)];
      const auto want = oracle_data(data, q, nseq, cs.q_heads);
      // kernel-side slack: the tolerance of (a) (float rounding; integer-dot rounding)
      const double slack = TestFixture::kFloatRel * TestFixture::max_v(*f.cache, cs.layer, nseq) +
                           TestFixture::kMaxRel * max_abs(want);
      double worst = 0.0;
      for (int s = 0; s < nseq; ++s) {
        const auto eb = error_bounds(*f.cache, cs.layer, s, data[std::size_t(s)]);
        const auto bound = attention_error_bound(q.data() + std::size_t(s) * cs.q_heads * cs.d, cs.q_heads,
                                                 data[std::size_t(s)], eb.k, eb.v);
        for (std::size_t i = 0; i < bound.size(); ++i) {
          const std::size_t j = std::size_t(s) * cs.q_heads * cs.d + i;
          const double err = std::fabs(double(got[j]) - want[j]);
          worst = std::max(worst, err);
          ASSERT_LE(err, bound[i] + slack) << "seq " << s << " element " << i << " bound " << bound[i];
        }
      }
      if constexpr (std::is_same_v<Cache, sch::Fp32>) {
        EXPECT_LE(worst, TestFixture::kFloatRel * TestFixture::max_v(*f.cache, cs.layer, nseq)) << "fp32 is exact";
      }
    }
  }
}

TYPED_TEST(Attention, IntDotErrorIsSmallNextToQuantizationError) {
  // The integer-dot rounding is small next to the codes' own step/2 error. On data with moderate
  // key outliers: rms(fused - oracle(dequantized)) <= 1/2 rms(oracle(dequantized) - oracle(original)).
  // (The 0.25 bound on 100x outliers: test_attention_paths.cpp.) Float paths: the kernel adds
  // nothing measurable.
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    auto f = make_filled<Cache>(1, 2, 128, {300, 500}, 61, moderate());
    const auto q = random_query(2, 4, 128, 62);
    const auto got = fused(*f.cache, 0, q, 2, 4);
    const auto deq = oracle_cache(*f.cache, 0, q, 2, 4);
    const auto org = oracle_data(f.data[0], q, 2, 4);
    const double kernel = rms_diff(got, deq), quant = rms_diff(deq, org);
    if constexpr (kHasIntDot<Cache>) {
      EXPECT_LE(kernel, 0.5 * quant) << "int-dot rms error " << kernel << " vs quantization rms error " << quant;
    } else {
      EXPECT_LE(kernel, 1e-5 * rms(deq) + 1e-3 * quant);
    }
  }
}

TYPED_TEST(Attention, ThreadsAndSplitsDoNotChangeTheResult) {
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    auto f = make_filled<Cache>(1, 2, 64, {1000, 300}, 7);
    const auto q = random_query(2, 4, 64, 8);
    kvc::AttentionOptions one{}, two{};
    one.num_threads = 1;
    two.num_threads = 2;
    one.min_blocks_per_split = two.min_blocks_per_split = 1 << 20;  // no splits
    const auto a = fused(*f.cache, 0, q, 2, 4, one);
    const auto b = fused(*f.cache, 0, q, 2, 4, two);
    ASSERT_TRUE(all_finite(a));
    EXPECT_TRUE(bytes_equal(a, b)) << "the thread count changed an unsplit result";
    ASSERT_GT(f.cache->quantized_blocks(0, 0), 8);
    // Splits change only the float summation order (and, for <= 4-bit values, the uint8 weight
    // rounding of blocks whose running maximum differs): a small multiple of the float tolerance.
    const double tol = (kHasIntDot<Cache> ? 2e-3 : 1e-5) * max_abs(a);  // measured <= 5.4e-4 / 2.6e-6
    for (int threads : {1, 2}) {
      for (int split : {1, 3}) {
        kvc::AttentionOptions o{};
        o.num_threads = threads;
        o.min_blocks_per_split = split;
        const auto c = fused(*f.cache, 0, q, 2, 4, o);
        EXPECT_LE(max_abs_diff(a, c), tol) << "threads " << threads << " min_blocks_per_split " << split;
      }
    }
    EXPECT_LE(max_abs_diff(a, fused(*f.cache, 0, q, 2, 4)), tol) << "default options";
  }
}

TYPED_TEST(Attention, GqaHeadMapping) {
  // Three KV heads with values around +20, -20 and +40: query head h must read KV head h / 2.
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    constexpr int Hkv = 3, Hq = 6, d = 64, T = 260;
    const float centre[Hkv] = {20.0f, -20.0f, 40.0f};
    KV x = random_kv(T, Hkv, d, 12, moderate());
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < Hkv; ++h)
        for (int c = 0; c < d; ++c) x.v[x.at(t, h, c)] = centre[h] + 0.1f * x.v[x.at(t, h, c)];
    Cache c(kvc::CacheConfig{1, 1, Hkv, d, T});
    append_kv(c, 0, 0, x);
    const auto q = random_query(1, Hq, d, 13);
    const auto got = fused(c, 0, q, 1, Hq);
    const auto want = oracle_cache(c, 0, q, 1, Hq);
    EXPECT_TRUE(TestFixture::close(got, want, 40.5));
    for (int h = 0; h < Hq; ++h)
      for (int ch = 0; ch < d; ++ch)
        ASSERT_NEAR(got[std::size_t(h) * d + ch], centre[h / 2], 1.5f) << "query head " << h << " channel " << ch;
  }
}

TYPED_TEST(Attention, HugeScoresAreSoftmaxStable) {
  // One key aligned with the query so that q.k*scale ~ 1e4 dominates every other score by thousands:
  // the output is that token's value. The winner sits in a quantized block, the full-precision tail
  // and (if any) the sink. Every other block then has probabilities below 2^-126.
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    constexpr int H = 1, d = 64;
    constexpr int S = Cache::selector::kSink, R = Cache::selector::kRecent, B = Cache::kBlockTokens;
    const int T = S + R + 3 * B + 9;
    GenOptions g;
    g.outlier_channels = 0;
    g.key_offset = 0.5f;
    KV x = random_kv(T, H, d, 14, g);
    for (auto& k : x.k) k *= 5.0f;
    const std::vector<float> q = random_query(1, 1, d, 15, 100.0f);
    Cache c(kvc::CacheConfig{1, 1, H, d, T});
    std::vector<int> winners = {S + B + 3, T - 1};
    if (S > 0) winners.push_back(1);
    for (int win : winners) {
      KV y = x;
      for (int ch = 0; ch < d; ++ch) y.k[y.at(win, 0, ch)] = q[std::size_t(ch)] > 0 ? 20.0f : -20.0f;
      c.clear(0);
      append_kv(c, 0, 0, y);
      const auto got = fused(c, 0, q, 1, 1);
      const auto want = oracle_cache(c, 0, q, 1, 1);
      const auto dq = dequantize(c, 0, 0);
      double score = 0.0;
      for (int ch = 0; ch < d; ++ch) score += double(q[std::size_t(ch)]) * dq.k[std::size_t(win) * d + ch] / 8.0;
      ASSERT_GT(score, 8000.0);
      for (int ch = 0; ch < d; ++ch) ASSERT_NEAR(want[std::size_t(ch)], dq.v[std::size_t(win) * d + ch], 1e-5);
      ASSERT_TRUE(all_finite(got)) << "winner token " << win << ": non-finite output";
      EXPECT_TRUE(TestFixture::close(got, want, max_abs(dq.v))) << "winner token " << win;
    }
    // All keys equal and huge: near-ties at scores ~1e4. The output stays a convex combination of the
    // values; float paths match the oracle. (The int8 query rounding moves scores by ~1e-2 of their
    // size, i.e. by ~100 here, so integer-dot schemes may weight the tied groups differently.)
    KV z = x;
    for (int t = 0; t < T; ++t)
      for (int ch = 0; ch < d; ++ch) z.k[z.at(t, 0, ch)] = q[std::size_t(ch)] > 0 ? 20.0f : -20.0f;
    c.clear(0);
    append_kv(c, 0, 0, z);
    const auto got = fused(c, 0, q, 1, 1);
    const auto want = oracle_cache(c, 0, q, 1, 1);
    const auto dq = dequantize(c, 0, 0);
    ASSERT_TRUE(all_finite(got)) << "all keys tied";
    for (int ch = 0; ch < d; ++ch) {
      float lo = HUGE_VALF, hi = -HUGE_VALF;
      for (int t = 0; t < T; ++t) {
        lo = std::min(lo, dq.v[std::size_t(t) * d + ch]);
        hi = std::max(hi, dq.v[std::size_t(t) * d + ch]);
      }
      EXPECT_GE(got[std::size_t(ch)], lo - 1e-4f) << "channel " << ch;
      EXPECT_LE(got[std::size_t(ch)], hi + 1e-4f) << "channel " << ch;
    }
    if constexpr (!kHasIntDot<Cache>) {
      EXPECT_TRUE(TestFixture::close(got, want, max_abs(dq.v)));
    }
  }
}

TYPED_TEST(Attention, TinyQueriesStayFinite) {
  // Finite, normal queries of magnitude ~1e-37: all scores ~0, the output is the mean of the values.
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    auto f = make_filled<Cache>(1, 2, 64, {300}, 19, moderate());
    for (float mag : {1e-38f, 5e-38f, 1e-37f, 3e-37f, 1e-30f}) {
      const auto q = random_query(1, 2, 64, 20, mag);
      const auto got = fused(*f.cache, 0, q, 1, 2);
      const auto want = oracle_cache(*f.cache, 0, q, 1, 2);
      ASSERT_TRUE(all_finite(got)) << "query magnitude " << mag;
      EXPECT_TRUE(TestFixture::close(got, want, TestFixture::max_v(*f.cache, 0, 1))) << "query magnitude " << mag;
    }
  }
}

TYPED_TEST(Attention, ConstantCachesGiveExactFiniteOutputs) {
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    constexpr int H = 2, d = 64, T = 300;
    for (float v : {0.0f, 3.0f}) {
      KV x(T, H, d);
      std::fill(x.k.begin(), x.k.end(), v);
      std::fill(x.v.begin(), x.v.end(), -v);
      Cache c(kvc::CacheConfig{1, 2, H, d, T});
      append_kv(c, 0, 0, x);
      append_kv(c, 0, 1, x.prefix(45));
      const auto q = random_query(2, 2 * H, d, 16);
      const auto got = fused(c, 0, q, 2, 2 * H);
      const auto want = oracle_cache(c, 0, q, 2, 2 * H);
      ASSERT_TRUE(all_finite(got)) << "constant " << v;
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], -v, 1e-5f) << "constant " << v << " element " << i;
        ASSERT_NEAR(want[i], -v, 1e-6f);
      }
    }
  }
}

TYPED_TEST(Attention, ScaleOptionStridedViewsAndSequenceSubsets) {
  using Cache = TypeParam;
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    constexpr int Hkv = 2, Hq = 4, d = 64;
    auto f = make_filled<Cache>(1, Hkv, d, {90, 230, 17}, 17, moderate());
    const auto q = random_query(3, Hq, d, 18);
    const double maxv = TestFixture::max_v(*f.cache, 0, 3);
    // custom scale
    kvc::AttentionOptions o{};
    o.scale = 0.03f;
    o.isa = isa;  // the strided call below goes to decode_attention directly
    const auto got = fused(*f.cache, 0, q, 3, Hq, o);
    const auto want = oracle_cache(*f.cache, 0, q, 3, Hq, 0.03);
    EXPECT_TRUE(TestFixture::close(got, want, maxv));
    EXPECT_GT(max_abs_diff(got, oracle_cache(*f.cache, 0, q, 3, Hq)), 0.1 * max_abs(want)) << "scale ignored";
    // padded (strided) query and output views give the same numbers as contiguous ones
    const std::ptrdiff_t s1 = d + 16, s0 = Hq * s1 + 32;
    std::vector<float> qpad(static_cast<std::size_t>(3 * s0), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> opad(static_cast<std::size_t>(3 * s0), -7.0f);
    for (int s = 0; s < 3; ++s)
      for (int h = 0; h < Hq; ++h)
        std::copy_n(q.data() + (std::size_t(s) * Hq + h) * d, d, qpad.data() + s * s0 + h * s1);
    kvc::decode_attention(*f.cache, 0, kvc::QueryView{qpad.data(), 3, Hq, d, s0, s1},
                          kvc::OutputView{opad.data(), 3, Hq, d, s0, s1}, o);
    for (int s = 0; s < 3; ++s)
      for (int h = 0; h < Hq; ++h) {
        for (int c = 0; c < d; ++c)
          ASSERT_EQ(opad[std::size_t(s * s0 + h * s1 + c)], got[(std::size_t(s) * Hq + h) * d + c]);
        for (std::ptrdiff_t c = d; c < s1; ++c)
          ASSERT_EQ(opad[std::size_t(s * s0 + h * s1 + c)], -7.0f) << "padding written";
      }
    // the first two sequences only
    const std::vector<float> q2(q.begin(), q.begin() + 2 * Hq * d);
    const auto sub = fused(*f.cache, 0, q2, 2, Hq, o);
    const std::vector<float> got2(got.begin(), got.begin() + 2 * Hq * d);
    EXPECT_LE(max_abs_diff(sub, got2), (kHasIntDot<Cache> ? 2e-3 : 1e-5) * max_abs(got2));
  }
}

}  // namespace
