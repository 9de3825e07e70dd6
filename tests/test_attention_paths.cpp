// The fused decode attention on every SIMD path this CPU runs, from one binary:
//  - every head dim the cache accepts (64, 80, 96, 112, 128, 256), fast and exact precision, against
//    the double oracle on the dequantized cache, and the paths against each other;
//  - the fast path's own error next to the scheme's quantization error on KV with up to 100x key
//    outlier channels and logit spreads up to 16 (the kernel must not add a second, comparable error);
//  - run-time path selection (Isa, KVC_FORCE_ISA), AttentionOptions validation, overflowing scores.
#include "test_util.hpp"

#include <cstdlib>
#include <string>

namespace {

using namespace kvc_test;

using PathSchemes = ::testing::Types<sch::Fp32, sch::Fp16, sch::Int8, sch::Kivi4, sch::Kivi2, sch::Kivi3, sch::Kivi1,
                                     sch::Kivi8, sch::Tensor4, sch::MidTok4, sch::MidKivi, sch::Chan64, sch::Sink,
                                     sch::Mixed56, sch::Kivi4G16, sch::Kivi2G16, sch::Kivi4B128, sch::Kivi2B128>;

template <class Cache>
class AttentionPaths : public ::testing::Test {};
TYPED_TEST_SUITE(AttentionPaths, PathSchemes, SchemeNames);

kvc::AttentionOptions exact_options() {
  kvc::AttentionOptions o;
  o.precision = kvc::Precision::kExact;
  return o;
}

TYPED_TEST(AttentionPaths, EveryHeadDimOnEveryPath) {
  // Lengths cross block, window and sink boundaries; GQA 3; two sequences of different lengths.
  using Cache = TypeParam;
  constexpr int B = Cache::kBlockTokens, R = Cache::selector::kRecent, S = Cache::selector::kSink;
  const std::vector<int> lengths = {S + R + 5 * B + 7, S + R + 2 * B};
  int dims = 0;
  std::uint64_t seed = 300;
  for (int d : {64, 80, 96, 112, 128, 256}) {
    try {
      Cache probe(kvc::CacheConfig{1, 1, 1, d, 1});
    } catch (const kvc::Error&) {
      continue;  // the layout's group sizes do not divide d (the cache says so at construction)
    }
    ++dims;
    SCOPED_TRACE("head dim " + std::to_string(d));
    GenOptions gen;
    gen.outlier_scale = 4.0f;  // as test_attention.cpp's tolerances assume; 100x: the test below
    auto f = make_filled<Cache>(1, 2, d, lengths, seed++, gen);
    const auto q = random_query(2, 6, d, seed++);
    const auto want = oracle_cache(*f.cache, 0, q, 2, 6);
    double maxv = 0.0;
    for (int s = 0; s < 2; ++s) maxv = std::max(maxv, max_abs(dequantize(*f.cache, 0, s).v));
    const double mo = max_abs(want), ro = rms(want);
    std::vector<float> first;
    KVC_FOR_EACH_ISA(isa) {
      SCOPED_TRACE(kvc::isa_name(isa));
      // Exact precision: float rounding only, on every scheme.
      const auto exact = fused(*f.cache, 0, q, 2, 6, exact_options());
      ASSERT_TRUE(all_finite(exact));
      EXPECT_LE(max_abs_diff(exact, want), 1e-5 * maxv) << "exact precision";
      // Fast precision: float schemes as exact; <= 4-bit ones within the int-dot tolerance of
      // test_attention.cpp (10% / 5%, 1-bit codes 20% / 10%).
      const auto fast = fused(*f.cache, 0, q, 2, 6);
      ASSERT_TRUE(all_finite(fast));
      if constexpr (kHasIntDot<Cache>) {
        constexpr bool one_bit = Cache::key_format::kBits == 1 || Cache::value_format::kBits == 1;
        EXPECT_LE(max_abs_diff(fast, want), 1e-5 * maxv + (one_bit ? 0.2 : 0.1) * mo) << "fast precision";
        EXPECT_LE(rms_diff(fast, want), 1e-5 * maxv + (one_bit ? 0.1 : 0.05) * ro) << "fast precision";
      } else {
        EXPECT_LE(max_abs_diff(fast, want), 1e-5 * maxv) << "fast precision";
      }
      // The paths agree closely: the same integer dot products up to float order (and, at a
      // rounding tie, one uint8 weight level), except where AVX2 computes a key block in float
      // instead of adding a second int8 query plane (both well inside the tolerance above).
      if (first.empty()) first = fast;
      else EXPECT_LE(max_abs_diff(fast, first), kHasIntDot<Cache> ? 1e-2 * mo : 1e-5 * maxv) << "differs from the portable path";
    }
  }
  EXPECT_GE(dims, 3) << "the scheme accepts too few head dims to test";
}

/// Scales each query head so that its scores over the original keys span `spread` nats.
void set_logit_spread(std::vector<float>& q, const std::vector<KV>& data, int Hq, float spread) {
  for (std::size_t s = 0; s < data.size(); ++s) {
    const KV& x = data[s];
    const int g = Hq / x.H;
    for (int h = 0; h < Hq; ++h) {
      float* qh = q.data() + (s * Hq + std::size_t(h)) * x.d;
      double lo = HUGE_VAL, hi = -HUGE_VAL;
      for (int t = 0; t < x.T; ++t) {
        double dot = 0.0;
        for (int c = 0; c < x.d; ++c) dot += double(qh[c]) * x.k[x.at(t, h / g, c)];
        dot /= std::sqrt(double(x.d));
        lo = std::min(lo, dot), hi = std::max(hi, dot);
      }
      for (int c = 0; c < x.d; ++c) qh[c] = float(qh[c] * spread / (hi - lo));
    }
  }
}

TYPED_TEST(AttentionPaths, KernelErrorIsSmallNextToQuantization) {
  // The fast path's own error (fused fast vs the oracle on the dequantized cache) is at most 0.25x
  // the scheme's quantization error (oracle on the dequantized cache vs on the original data), rms
  // over all outputs, for key outlier channels of 1x (none), 12x and 100x and logit spreads of 4
  // and 16 nats. Exact precision adds nothing measurable.
  using Cache = TypeParam;
  constexpr int d = 128, Hkv = 2, Hq = 8;
  for (float outlier : {1.0f, 12.0f, 100.0f}) {
    for (float spread : {4.0f, 16.0f}) {
      SCOPED_TRACE("outliers " + std::to_string(outlier) + "x, logit spread " + std::to_string(spread));
      GenOptions gen;
      gen.outlier_scale = outlier;
      auto f = make_filled<Cache>(1, Hkv, d, {700, 333}, 71 + std::uint64_t(outlier), gen);
      auto q = random_query(2, Hq, d, 72);
      set_logit_spread(q, f.data[0], Hq, spread);
      const auto deq = oracle_cache(*f.cache, 0, q, 2, Hq);
      const auto org = oracle_data(f.data[0], q, 2, Hq);
      const double quant = rms_diff(deq, org);
      KVC_FOR_EACH_ISA(isa) {
        SCOPED_TRACE(kvc::isa_name(isa));
        const double fast = rms_diff(fused(*f.cache, 0, q, 2, Hq), deq);
        const double exact = rms_diff(fused(*f.cache, 0, q, 2, Hq, exact_options()), deq);
        if constexpr (kHasIntDot<Cache>) {
          EXPECT_LE(fast, 0.25 * quant) << "fast kernel rms error " << fast << " vs quantization " << quant;
          ::testing::Test::RecordProperty(std::string("ratio_") + kvc::isa_name(isa) + "_" + std::to_string(int(outlier)) + "x_" +
                             std::to_string(int(spread)),
                         std::to_string(fast / quant));
        } else {
          EXPECT_LE(fast, 1e-5 * rms(deq) + 1e-3 * quant);
        }
        EXPECT_LE(exact, 1e-5 * rms(deq) + 1e-3 * quant) << "exact kernel rms error " << exact;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Path selection
// ------------------------------------------------------------------------------------------------
TEST(IsaDispatch, ReportsThePathItRuns) {
  report_unrunnable_isas();
  const kvc::Isa best = runnable_isas().back();
  const char* forced = std::getenv("KVC_FORCE_ISA");
  const kvc::Isa resolved = kvc::resolve_isa(kvc::Isa::kAuto);
  EXPECT_STREQ(kvc::simd_path_name(), kvc::isa_name(resolved));
  if (forced == nullptr || *forced == '\0') {
    EXPECT_EQ(resolved, best) << "without KVC_FORCE_ISA the best path the CPU runs is chosen";
  }
  if (const char* expect = std::getenv("KVC_EXPECT_ISA")) {
    EXPECT_STREQ(kvc::simd_path_name(), expect) << "KVC_FORCE_ISA=" << (forced ? forced : "");
  }
  std::printf("[kvc] attention path: %s (best this CPU runs: %s)\n", kvc::simd_path_name(), kvc::isa_name(best));
}

TEST(IsaDispatch, ParsesForcedPathNames) {
  kvc::Isa i{};
  EXPECT_TRUE(kvc::detail::parse_isa("portable", i) && i == kvc::Isa::kPortable);
  EXPECT_TRUE(kvc::detail::parse_isa("avx2", i) && i == kvc::Isa::kAvx2);
  EXPECT_TRUE(kvc::detail::parse_isa("avx512", i) && i == kvc::Isa::kAvx512);
  EXPECT_TRUE(kvc::detail::parse_isa("", i) && i == kvc::Isa::kAuto);
  EXPECT_FALSE(kvc::detail::parse_isa("avx3", i));
  EXPECT_FALSE(kvc::detail::parse_isa("AVX2", i));
}

TEST(IsaDispatch, PathsThisCpuCannotRunThrow) {
  using Cache = sch::Kivi4;
  auto f = make_filled<Cache>(1, 1, 64, {100}, 5);
  const auto q = random_query(1, 2, 64, 6);
  for (kvc::Isa isa : {kvc::Isa::kPortable, kvc::Isa::kAvx2, kvc::Isa::kAvx512}) {
    kvc::AttentionOptions o;
    o.isa = isa;
    if (kvc::isa_supported(isa)) {
      EXPECT_NO_THROW(fused(*f.cache, 0, q, 1, 2, o)) << kvc::isa_name(isa);
      continue;
    }
    try {
      fused(*f.cache, 0, q, 1, 2, o);
      ADD_FAILURE() << kvc::isa_name(isa) << " ran on a CPU or build without it";
    } catch (const kvc::Error& e) {
      EXPECT_EQ(e.code(), kvc::Errc::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(kvc::isa_name(isa)), std::string::npos) << e.what();
    }
  }
  kvc::AttentionOptions bad;
  bad.isa = static_cast<kvc::Isa>(42);
  EXPECT_THROW(fused(*f.cache, 0, q, 1, 2, bad), kvc::Error);
}

// ------------------------------------------------------------------------------------------------
// Options and overflow
// ------------------------------------------------------------------------------------------------
TEST(AttentionOptionsCheck, InvalidOptionsThrowBeforeWriting) {
  auto f = make_filled<sch::Kivi2>(1, 1, 64, {100}, 7);
  const auto q = random_query(1, 2, 64, 8);
  auto expect_rejected = [&](kvc::AttentionOptions o, const char* field) {
    std::vector<float> out(q.size(), -3.0f);
    try {
      kvc::decode_attention(*f.cache, 0, kvc::QueryView::contiguous(q.data(), 1, 2, 64),
                            kvc::OutputView::contiguous(out.data(), 1, 2, 64), o);
      ADD_FAILURE() << field << " accepted";
    } catch (const kvc::Error& e) {
      EXPECT_EQ(e.code(), kvc::Errc::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -3.0f; })) << field;
  };
  for (float s : {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    kvc::AttentionOptions o;
    o.scale = s;
    expect_rejected(o, "scale");
  }
  kvc::AttentionOptions o;
  o.num_threads = -2;
  expect_rejected(o, "num_threads");
  o = {};
  o.min_blocks_per_split = 0;
  expect_rejected(o, "min_blocks_per_split");
  o = {};
  o.precision = static_cast<kvc::Precision>(9);
  expect_rejected(o, "precision");
}

TEST(AttentionOverflow, ScoresBeyondFloatAreReportedNotNaN) {
  // Keys near fp16's limit and a query so large that q.k overflows float: a clear error on every
  // path and precision, not NaN. A query 1e4x smaller still works (a one-hot-like, finite output).
  constexpr int d = 64, T = 200;
  KV x = random_kv(T, 1, d, 9);
  for (auto& k : x.k) k = k > 0 ? 60000.0f : -60000.0f;
  auto run = [&]<class Cache>(float qmag) {
    Cache c(kvc::CacheConfig{1, 1, 1, d, T});
    append_kv(c, 0, 0, x);
    std::vector<float> q(d);
    for (int i = 0; i < d; ++i) q[std::size_t(i)] = x.k[x.at(T / 2, 0, i)] > 0 ? qmag : -qmag;
    KVC_FOR_EACH_ISA(isa) {
      for (auto prec : {kvc::Precision::kFast, kvc::Precision::kExact}) {
        kvc::AttentionOptions o;
        o.precision = prec;
        SCOPED_TRACE(std::string(kvc::isa_name(isa)) + (prec == kvc::Precision::kFast ? " fast" : " exact"));
        if (qmag > 1e32f) {
          try {
            fused(c, 0, q, 1, 1, o);
            ADD_FAILURE() << "overflowing scores accepted";
          } catch (const kvc::Error& e) {
            EXPECT_EQ(e.code(), kvc::Errc::kOutOfRange);
            EXPECT_NE(std::string(e.what()).find("overflow"), std::string::npos) << e.what();
          }
        } else {
          const auto out = fused(c, 0, q, 1, 1, o);
          EXPECT_TRUE(all_finite(out));
        }
      }
    }
  };
  run.template operator()<sch::Fp16>(1e34f);
  run.template operator()<sch::Fp16>(1e30f);
  run.template operator()<sch::Kivi4>(1e34f);
  run.template operator()<sch::Kivi4>(1e30f);
}

TEST(ErrorMessages, PrintOffendingValuesExactly) {
  // 65504.0039 (the float above fp16's largest finite value) must not print as "65504".
  sch::Fp16 c(kvc::CacheConfig{1, 1, 1, 64, 8});
  KV x(1, 1, 64);
  x.k[5] = 65504.004f;
  try {
    append_kv(c, 0, 0, x);
    ADD_FAILURE() << "65504.004 accepted into fp16";
  } catch (const kvc::Error& e) {
    EXPECT_NE(std::string(e.what()).find("65504.0039"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.length(0, 0), 0);
}

}  // namespace
