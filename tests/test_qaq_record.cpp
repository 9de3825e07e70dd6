// QAQ (SPEC §2) below the cache: the width rule against hand-computed cases and its guards, the attention
// history, the per-token codec (outliers, exact width nesting, restore from the original), the record format
// (packing, lowering, raising) and the calibration file. Also built with -march=native (kvc_tests_native):
// the record format packs with BMI2 pext and re-encodes raises with AVX2 where the compiler targets them.
// calibration.hpp first: its kvc::qaq::detail must not hide kvc::detail from the QAQ headers after it
#include <kvc/qaq/calibration.hpp>
// the rest in order
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/qaq_cache.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>
#include <kvc/qaq/record_format.hpp>

#include "qaq_test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace kvc_test::qaq;

using kvc::qaq::WidthRange;

TEST(QaqWidth, CeilLog2OfTheRatioClampedToTheRange) {
  const WidthRange r{1, 8};
  EXPECT_EQ(kvc::qaq::width_for_ratio(0.0, r), 1);   // zero range / infinite sigma
  EXPECT_EQ(kvc::qaq::width_for_ratio(0.3, r), 1);   // below 2^1: clamped up to B_min
  EXPECT_EQ(kvc::qaq::width_for_ratio(2.0, r), 1);   // exactly 2^1
  EXPECT_EQ(kvc::qaq::width_for_ratio(2.0000001, r), 2);
  EXPECT_EQ(kvc::qaq::width_for_ratio(4.0, r), 2);
  EXPECT_EQ(kvc::qaq::width_for_ratio(100.0, r), 7);  // 64 < 100 <= 128
  EXPECT_EQ(kvc::qaq::width_for_ratio(256.0, r), 8);
  EXPECT_EQ(kvc::qaq::width_for_ratio(1e9, r), 8);  // clamped to B_max
  EXPECT_EQ(kvc::qaq::width_for_ratio(std::numeric_limits<double>::infinity(), r), 8);
  EXPECT_EQ(kvc::qaq::width_for_ratio(std::nan(""), r), 8);  // unknown: the safe side
  EXPECT_EQ(kvc::qaq::width_for_ratio(1.0, WidthRange{2, 6}), 2);
  EXPECT_EQ(kvc::qaq::width_for_ratio(100.0, WidthRange{2, 6}), 6);
}

// sigma_K^2 = log(T^3 / (T - 1) sigma_S^2 + 1) / ||Q||^2 with T = 3, sigma_S = 0.1, ||Q||^2 = 4:
// log(1.135) / 4 = 0.0316581627..., sigma_K = 0.177927408...; width 3 holds ranges <= 2 sqrt(3) sigma_K 2^3 = 4.93087.
TEST(QaqWidth, KeyBoundMatchesTheHandComputedCase) {
  EXPECT_NEAR(kvc::qaq::PaperBounds::key_sigma(3, 0.1, 4.0), 0.17792740860626702, 1e-15);
  const WidthRange r{1, 8};
  EXPECT_EQ(kvc::qaq::key_width(4.930, 3, 0.1, 4.0, r), 3);
  EXPECT_EQ(kvc::qaq::key_width(4.932, 3, 0.1, 4.0, r), 4);
  EXPECT_EQ(kvc::qaq::key_width(1.20, 3, 0.1, 4.0, r), 1);   // ratio 1.947
  EXPECT_EQ(kvc::qaq::key_width(1.24, 3, 0.1, 4.0, r), 2);   // ratio 2.012
  // The key bound is the same for every token: only the range changes the width.
  EXPECT_NEAR(kvc::qaq::PaperBounds::key_sigma(1000, 1e-4, 2.5), 0.06311970121936711, 1e-14);
  // A larger query norm or a tighter target needs more bits.
  EXPECT_GE(kvc::qaq::key_width(3.0, 1000, 1e-4, 25.0, r), kvc::qaq::key_width(3.0, 1000, 1e-4, 2.5, r));
  EXPECT_GE(kvc::qaq::key_width(3.0, 1000, 1e-5, 2.5, r), kvc::qaq::key_width(3.0, 1000, 1e-4, 2.5, r));
}

// sigma_V = sigma_X / (sqrt(T) S^_t) with T = 4, sigma_X = 0.5, S^ = 0.25: exactly 1, so width b holds ranges
// <= 2 sqrt(3) 2^b: 6.93 (1), 13.86 (2), 27.7 (3).
TEST(QaqWidth, ValueBoundMatchesTheHandComputedCase) {
  EXPECT_DOUBLE_EQ(kvc::qaq::PaperBounds::value_sigma(4, 0.5, 0.25), 1.0);
  const WidthRange r{1, 8};
  EXPECT_EQ(kvc::qaq::value_width(6.9, 4, 0.5, 0.25, r), 1);
  EXPECT_EQ(kvc::qaq::value_width(7.0, 4, 0.5, 0.25, r), 2);
  EXPECT_EQ(kvc::qaq::value_width(13.8, 4, 0.5, 0.25, r), 2);
  EXPECT_EQ(kvc::qaq::value_width(13.9, 4, 0.5, 0.25, r), 3);
  // Attention-aware: twice the attention, one more bit.
  EXPECT_EQ(kvc::qaq::value_width(13.8, 4, 0.5, 0.5, r), 3);
}

TEST(QaqWidth, GuardsOfSpec26) {
  const WidthRange r{2, 7};
  // T <= 1: the key formula divides by T - 1; keep the widest.
  EXPECT_EQ(kvc::qaq::key_width(1.0, 1, 0.1, 4.0, r), 7);
  EXPECT_EQ(kvc::qaq::key_width(1.0, 0, 0.1, 4.0, r), 7);
  EXPECT_EQ(kvc::qaq::value_width(1.0, 1, 0.1, 0.5, r), 7);
  // S^_t == 0: infinite sigma_V -> B_min.
  EXPECT_EQ(kvc::qaq::value_width(50.0, 100, 0.1, 0.0, r), 2);
  // Zero range -> B_min on both sides.
  EXPECT_EQ(kvc::qaq::key_width(0.0, 100, 1e-9, 4.0, r), 2);
  EXPECT_EQ(kvc::qaq::value_width(0.0, 100, 1e-9, 1.0, r), 2);
  // ||Q||^2 == 0: no key error reaches the scores -> B_min.
  EXPECT_EQ(kvc::qaq::key_width(50.0, 100, 1e-9, 0.0, r), 2);
  // A zero target: sigma 0 -> B_max.
  EXPECT_EQ(kvc::qaq::key_width(1.0, 100, 0.0, 4.0, r), 7);
  EXPECT_EQ(kvc::qaq::value_width(1.0, 100, 0.0, 1.0, r), 7);
}

// The per-step rule with the token-independent parts evaluated once gives exactly the per-token formulas.
TEST(QaqWidth, StepWidthsEqualThePerTokenFormulas) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> log_range(-12.0, 6.0);
  for (int T : {1, 2, 3, 100, 4097, 1 << 20})
    for (double qn2 : {0.0, 0.37, 5.0})
      for (double sigma : {1e-4, 3e-3, 0.2}) {
        const kvc::qaq::StepWidths<> rule(T, sigma, qn2, 10 * sigma, {1, 8});
        for (int i = 0; i < 200; ++i) {
          const double range = i == 0 ? 0.0 : std::exp2(log_range(rng));
          ASSERT_EQ(rule.key(range), kvc::qaq::key_width(range, T, sigma, qn2, {1, 8})) << T << " " << range;
          for (int code = 0; code < 256; code += i % 7 + 1) {
            const double s_hat = kvc::qaq::ProbCode::decode(std::uint8_t(code));
            ASSERT_EQ(rule.value(range, std::uint8_t(code)), kvc::qaq::value_width(range, T, 10 * sigma, s_hat, {1, 8}))
                << T << " " << range << " " << code;
          }
        }
      }
}

// The limits on step_max's fp16 bits give the rule's width for every fp16 step (finite, infinite, NaN, negative)
// and every probability code: at the T <= 1 and ||Q||^2 == 0 guards, and at targets that put the crossings
// inside the finite range, at its ends and outside it.
template <int BMin, int BMax>
void expect_limits_equal_the_rule() {
  using Q = kvc::QaqQuantizer<BMin, BMax>;
  for (int T : {1, 2, 300, 32768, 1 << 20})
    for (double qn2 : {0.0, 0.37, 5.0})
      for (double sigma : {1e-9, 3e-3, 0.2, 1e6}) {
        const kvc::qaq::StepWidths<> rule(T, sigma, qn2, 10 * sigma, Q::widths());
        typename Q::StepLimits limits(rule);
        for (int code = 0; code < 256; code += T == 32768 ? 11 : 51)
          for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
            const kvc::half_t step{std::uint16_t(bits)};
            const double range = Q::range_bound(step.to_float());
            if (code == 0) {
              ASSERT_EQ(limits.key(step.bits), rule.key(range)) << T << " " << qn2 << " " << sigma << " " << bits;
            }
            ASSERT_EQ(limits.value(step.bits, std::uint8_t(code)), rule.value(range, std::uint8_t(code)))
                << T << " " << qn2 << " " << sigma << " " << code << " " << bits;
          }
      }
}
TEST(QaqWidth, StepLimitsEqualTheRuleForEveryFp16Step) {
  expect_limits_equal_the_rule<1, 8>();
  expect_limits_equal_the_rule<2, 6>();
}

TEST(QaqHistory, ProbabilityCodesRoundTowardLargerProbabilities) {
  using kvc::qaq::ProbCode;
  EXPECT_EQ(ProbCode::encode(1.0f), 0);
  EXPECT_EQ(ProbCode::encode(0.5f), 8);
  EXPECT_EQ(ProbCode::encode(0.0f), ProbCode::kZero);
  EXPECT_EQ(ProbCode::encode(1e-12f), ProbCode::kZero);
  EXPECT_EQ(ProbCode::decode(ProbCode::kZero), 0.0f);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> e(0.0f, 31.0f);
  for (int i = 0; i < 2000; ++i) {
    const float p = std::exp2(-e(rng));
    const std::uint8_t c = ProbCode::encode(p);
    const float back = ProbCode::decode(c);
    EXPECT_GE(back, p) << p;  // the tightest code whose probability is >= p
    if (c < 254) {
      EXPECT_LT(ProbCode::decode(std::uint8_t(c + 1)), p) << p;
    }
    EXPECT_LE(back, p * std::exp2(1.0f / 8.0f) * (1.0f + 1e-6f)) << p;
  }
  // at and next to every code's own probability
  for (int c = 0; c < 255; ++c) {
    const float p = ProbCode::decode(std::uint8_t(c));
    EXPECT_EQ(ProbCode::encode(p), c);
    EXPECT_EQ(ProbCode::encode(std::nextafter(p, 0.0f)), c);
    if (c > 0) {
      EXPECT_EQ(ProbCode::encode(std::nextafter(p, 1.0f)), c - 1);
    }
  }
}

#if KVC_QAQ_SSE2_
// encode4 (4 probabilities at a time, SSE2) gives encode's code for every float: a strided sweep over all bit
// patterns (signs, NaNs, infinities, subnormals included), the special values, and every code's threshold.
TEST(QaqHistory, FourAtATimeEncodingEqualsEncode) {
  using kvc::qaq::ProbCode;
  std::vector<float> x;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4093) x.push_back(std::bit_cast<float>(std::uint32_t(u)));
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(), std::nextafter(1.0f, 0.0f), std::exp2(-31.75f),
                  std::nextafter(std::exp2(-31.75f), 0.0f), std::nextafter(std::exp2(-31.75f), 1.0f)})
    x.push_back(v);
  for (int c = 0; c < 255; ++c) {
    const float p = ProbCode::decode(std::uint8_t(c));
    x.insert(x.end(), {p, std::nextafter(p, 0.0f), std::nextafter(p, 1.0f)});
  }
  while (x.size() % 4 != 0) x.push_back(0.5f);
  for (std::size_t i = 0; i < x.size(); i += 4) {
    std::uint8_t c[4];
    ProbCode::encode4(x.data() + i, c);
    for (std::size_t k = 0; k < 4; ++k)
      ASSERT_EQ(c[k], ProbCode::encode(x[i + k])) << "bits 0x" << std::hex << std::bit_cast<std::uint32_t>(x[i + k]);
  }
}
#endif

// ceil(log2(ratio)) clamped: exact at and next to powers of two, and at the extremes.
TEST(QaqWidth, WidthForRatioIsTheClampedCeilLog2) {
  using kvc::qaq::width_for_ratio;
  for (int k = -3; k <= 11; ++k) {
    const double p = std::ldexp(1.0, k);
    const int at = std::clamp(k, 1, 8), above = std::clamp(k + 1, 1, 8);
    EXPECT_EQ(width_for_ratio(p, {1, 8}), at) << k;
    EXPECT_EQ(width_for_ratio(std::nextafter(p, 1e300), {1, 8}), above) << k;
    EXPECT_EQ(width_for_ratio(std::nextafter(p, 0.0), {1, 8}), at) << k;
  }
  EXPECT_EQ(width_for_ratio(5.0, {3, 6}), 3);
  EXPECT_EQ(width_for_ratio(100.0, {3, 6}), 6);
  EXPECT_EQ(width_for_ratio(4.9e-324, {1, 8}), 1);
  EXPECT_EQ(width_for_ratio(std::numeric_limits<double>::infinity(), {1, 8}), 8);
  EXPECT_EQ(width_for_ratio(std::numeric_limits<double>::quiet_NaN(), {2, 7}), 7);
  EXPECT_EQ(width_for_ratio(0.0, {2, 7}), 2);
  EXPECT_EQ(width_for_ratio(-1.0, {2, 7}), 2);
}

TEST(QaqHistory, MaxOfTheLastNObservations) {
  kvc::qaq::AttentionHistory<3> h;
  h.reset();
  EXPECT_FALSE(h.full());
  EXPECT_EQ(h.s_hat(), 0.0f);
  h.push(0.25f);
  h.push(0.5f);
  EXPECT_FALSE(h.full());
  EXPECT_EQ(h.s_hat(), 0.5f);
  h.push(0.125f);
  EXPECT_TRUE(h.full());
  EXPECT_EQ(h.s_hat(), 0.5f);
  h.push(0.0625f);  // drops 0.25
  EXPECT_EQ(h.s_hat(), 0.5f);
  h.push(0.0625f);  // drops 0.5
  EXPECT_EQ(h.s_hat(), 0.125f);
  h.push(0.0f);
  h.push(0.0f);
  h.push(0.0f);
  EXPECT_EQ(h.s_hat(), 0.0f);  // n consecutive zeros: S^ = 0
}

// The update's scan for the records whose width changes: every index with w[i] != b, in order, whatever the
// length (vector blocks of 16 and the scalar tail) and however many differ.
TEST(QaqCache, WidthScanVisitsExactlyTheChangedRecordsInOrder) {
  std::mt19937 rng(11);
  for (std::size_t n : {0u, 1u, 15u, 16u, 17u, 31u, 32u, 33u, 100u, 1000u})
    for (double share : {0.0, 0.03, 0.5, 1.0}) {
      std::bernoulli_distribution moves(share);
      std::uniform_int_distribution<int> other(1, 7);
      const std::uint8_t b = 5;
      std::vector<std::uint8_t> w(n + 16, b);  // a tail beyond n that differs must not be visited
      std::vector<std::size_t> want, got;
      for (std::size_t i = 0; i < w.size(); ++i) {
        if (i >= n || moves(rng)) {
          const int o = other(rng);  // widths 1..4 and 6..8
          w[i] = std::uint8_t(o <= 4 ? b - o : b + o - 4);
        }
        if (i < n && w[i] != b) want.push_back(i);
      }
      kvc::qaq::detail::for_each_differing(w.data(), n, b, [&](std::size_t i) { got.push_back(i); });
      EXPECT_EQ(got, want) << "n " << n << " share " << share;
    }
}

TEST(QaqCalibrateTarget, FindsTheCheapestTargetForTheRequestedBits) {
  // Average bits 8 - log2(t), clamped to [1, 8]: 3 bits at t = 32.
  auto bits = [](double t) { return std::clamp(8.0 - std::log2(t), 1.0, 8.0); };
  const double t = kvc::qaq::calibrate_target(bits, 3.0, 1e-3, 1e6);
  EXPECT_NEAR(t, 32.0, 1e-6);
  EXPECT_GE(bits(t), 3.0);
  EXPECT_EQ(kvc::qaq::calibrate_target(bits, 0.5, 1e-3, 1e6), 1e6);  // even the loosest spends more
  EXPECT_EQ(kvc::qaq::calibrate_target(bits, 9.0, 1e-3, 1e6), 1e-3);  // unreachable: the tightest
}

// ---------------------------------------------------------------------------------------------------------
// The per-token codec
// ---------------------------------------------------------------------------------------------------------




TEST(QaqQuantizer, OutlierCountIsAlphaOverBothEnds) {
  using Q = kvc::QaqQuantizer<>;
  EXPECT_EQ(Q::outliers_per_end(64), 1);   // ceil(0.005 * 64)
  EXPECT_EQ(Q::outliers_per_end(128), 1);  // ceil(0.64)
  EXPECT_EQ(Q::outliers_per_end(256), 2);  // ceil(1.28)
  EXPECT_EQ((kvc::QaqQuantizer<1, 8, 0>::outliers(128)), 0);
  EXPECT_EQ((kvc::QaqQuantizer<1, 8, 50>::outliers_per_end(64)), 2);  // 5 %: ceil(1.6)
}

TEST(QaqQuantizer, OutliersAreTheExtremesAndStayExact) {
  using Q = kvc::QaqQuantizer<1, 8, 50>;  // k = 2 per end at d = 64
  std::mt19937 rng(11);
  std::vector<float> x = fp16_row(rng, 64, 1.0f);
  x[3] = -40.0f, x[17] = 33.0f, x[40] = -35.0f, x[41] = 31.0f;
  const Coded c = code<Q>(x);
  ASSERT_EQ(c.idx.size(), 4u);
  EXPECT_EQ(c.idx[0], 3);
  EXPECT_EQ(c.idx[1], 40);
  EXPECT_EQ(c.idx[2], 17);
  EXPECT_EQ(c.idx[3], 41);
  std::vector<float> back(64);
  for (int b = 1; b <= 8; ++b) {
    std::vector<std::uint8_t> cb(64);
    for (int i = 0; i < 64; ++i) cb[std::size_t(i)] = Q::narrow(c.codes[std::size_t(i)], b);
    Q::decode_token(c.m, b, cb.data(), c.idx.data(), c.val.data(), 64, back.data());
    for (int i : {3, 17, 40, 41}) EXPECT_EQ(back[std::size_t(i)], x[std::size_t(i)]);
  }
  // The inliers' range excludes them: far below the outliers' spread.
  EXPECT_LT(Q::range_bound(c.m), 10.0);
}

// Every width's code is the B_max code shifted; it is the midpoint code at that width (x in its bin), so
// lowering by a shift equals quantizing at the lower width, and the error is <= step_b / 2.
template <class Q>
void lowering_is_a_shift_and_equals_quantizing_at_the_lower_width() {
  std::mt19937 rng(3);
  for (int d : {16, 64, 128, 256})
    for (float scale : {1e-6f, 3e-3f, 1.0f, 200.0f}) {  // 1e-6: fp16-subnormal steps
      const std::vector<float> x = fp16_row(rng, d, scale);
      const Coded c = code<Q>(x);
      std::vector<bool> outlier(std::size_t(d), false);
      for (auto i : c.idx) outlier[i] = true;
      for (int b = 1; b <= 8; ++b) {
        const double step = Q::step(c.m, b), lo = c.m.lo.to_float();
        EXPECT_EQ(step, double(c.m.step.to_float()) * std::ldexp(1.0, 8 - b));
        for (int i = 0; i < d; ++i) {
          if (outlier[std::size_t(i)]) continue;
          const std::uint8_t q = Q::narrow(c.codes[std::size_t(i)], b);
          ASSERT_LT(int(q), 1 << b);
          if (b > 1) {
            EXPECT_EQ(Q::narrow(q, b - 1, b), Q::narrow(c.codes[std::size_t(i)], b - 1));  // one more shift
          }
          if (step > 0.0) {
            const double z = (double(x[std::size_t(i)]) - lo) / step;  // the exact bin
            if (std::fabs(z - std::round(z)) > 1e-4 && z < double(1 << b)) {
              EXPECT_EQ(int(q), int(std::floor(z))) << "d " << d << " scale " << scale << " b " << b << " i " << i;
            }
          }
          const double err = std::fabs(double(Q::decode(c.m, b, q)) - x[std::size_t(i)]);
          EXPECT_LE(err, 0.5 * step * (1.0 + 1e-5) + 1e-7 * std::fabs(x[std::size_t(i)]))
              << "d " << d << " scale " << scale << " b " << b << " i " << i;
        }
      }
    }
}
TEST(QaqQuantizer, LoweringIsAShiftAndEqualsQuantizingAtTheLowerWidth) {
  lowering_is_a_shift_and_equals_quantizing_at_the_lower_width<kvc::QaqQuantizer<>>();
  lowering_is_a_shift_and_equals_quantizing_at_the_lower_width<LogQ<>>();
  lowering_is_a_shift_and_equals_quantizing_at_the_lower_width<LogQ<1, 8, 0>>();
}

template <class Q>
void requantizing_the_original_restores_every_width_exactly() {
  std::mt19937 rng(8);
  const std::vector<float> x = fp16_row(rng, 128, 2.0f);
  const Coded a = code<Q>(x), b = code<Q>(x);  // the mirror is the same fp16 row
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.idx, b.idx);
  EXPECT_EQ(a.m.lo, b.m.lo);
  EXPECT_EQ(a.m.step, b.m.step);
  // Lower to 2 bits, then raise to 5 from the mirror: the same as never having lowered.
  for (int i = 0; i < 128; ++i) {
    const std::uint8_t low = Q::narrow(a.codes[std::size_t(i)], 2);
    EXPECT_EQ(low, Q::narrow(b.codes[std::size_t(i)], 2));
    EXPECT_EQ(Q::narrow(b.codes[std::size_t(i)], 5), a.codes[std::size_t(i)] >> 1);
  }
}
TEST(QaqQuantizer, RequantizingTheOriginalRestoresEveryWidthExactly) {
  requantizing_the_original_restores_every_width_exactly<kvc::QaqQuantizer<2, 6>>();
  requantizing_the_original_restores_every_width_exactly<LogQ<2, 6>>();
}

// LogMeta (2 bytes): every (e, n) that make_meta can write (n step_max <= 65504: it caps n so lo stays finite)
// loads to a (lo, step_max) that stores back to the same bytes (e = 0 is step 0 with lo 0 whatever n); the grid
// doubles every 8 codes and increases strictly.
TEST(QaqMeta, LogMetaStoresEveryCodeBackToItsBytes) {
  using M = kvc::qaq::LogMeta;
  for (int e = 0; e <= M::kMaxCode; ++e) {
    if (e > 1) {
      ASSERT_GT(M::step_of(e).to_float(), M::step_of(e - 1).to_float()) << e;
    }
    if (e > 8) {
      ASSERT_EQ(M::step_of(e).to_float(), 2.0f * M::step_of(e - 8).to_float()) << e;
    }
    for (int n = 0; n < 256; ++n) {
      if (double(n) * M::step_of(e).to_float() > 65504.0) break;
      const std::byte in[2] = {std::byte(e), std::byte(n)};
      const kvc::QuantMeta m = M::load(in);
      std::byte out[2];
      M::store(out, m);
      ASSERT_EQ(std::to_integer<int>(out[0]), e);
      ASSERT_EQ(std::to_integer<int>(out[1]), e == 0 ? 0 : n) << e;
      const kvc::QuantMeta back = M::load(out);
      ASSERT_EQ(back.lo, m.lo);
      ASSERT_EQ(back.step, m.step);
      // the bit-operation paths: lo is -n step rounded down to fp16, and the kernels' floats are load's
      if (e > 0) {
        ASSERT_EQ(m.lo, kvc::half_round_down(-float(n) * m.step.to_float())) << e << " " << n;
      }
      float lo = 1.0f, step = 1.0f;
      M::load_floats(in, [](kvc::half_t) { return -1.0f; }, lo, step);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(lo), std::bit_cast<std::uint32_t>(m.lo.to_float())) << e << " " << n;
      ASSERT_EQ(step, m.step.to_float()) << e;
    }
  }
  EXPECT_EQ(M::step_of(1).to_float(), std::ldexp(1.0f, -14));
  EXPECT_EQ(M::step_of(M::kMaxCode).to_float(), std::ldexp(1.0f + 855.0f / 1024.0f, 15));
  for (int j = 1; j < M::kPerBinade; ++j) {  // each rounded up, by less than one fp16 ulp
    const double v = std::exp2(j / 8.0);
    EXPECT_GE(1.0 + M::mantissa(j) / 1024.0, v) << j;
    EXPECT_LT(1.0 + (M::mantissa(j) - 1) / 1024.0, v) << j;
  }
}

// LogMeta's codec: the grid covers [min(lo, 0), max(hi, 0)] with 2^bits levels (lo16 <= lo, lo16 + 2^bits step
// >= hi), lo16 is the stored -n step rounded down, and the step is the grid's smallest with 2^bits - 1.5 steps
// over the range (at 1 bit ranges above 0.5 x the largest step, ~30,000, are past the grid: not checked); an
// all-zero token gets step 0.
TEST(QaqMeta, LogMetaCodecCoversTheRangeWithTheSmallestGridStep) {
  using M = kvc::qaq::LogMeta;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), e(-20.0f, 15.0f);
  for (int i = 0; i < 20000; ++i)
    for (int bits : {1, 3, 8}) {
      const float scale = std::exp2(e(rng));
      float lo = kvc::half_t::from_float(u(rng) * scale).to_float(), hi = kvc::half_t::from_float(u(rng) * scale).to_float();
      if (i % 4 == 0) lo = std::min(lo, 0.0f), hi = std::max(hi, 0.0f);
      if (lo > hi) std::swap(lo, hi);
      const kvc::QuantMeta m = M::codec::make_meta(lo, hi, bits);
      const double l = std::min(double(lo), 0.0), h = std::max(double(hi), 0.0), step = m.step.to_float();
      std::byte st[2];
      M::store(st, m);
      const kvc::QuantMeta back = M::load(st);
      ASSERT_EQ(back.lo, m.lo);
      ASSERT_EQ(back.step, m.step);
      if (h == l) {
        ASSERT_EQ(step, 0.0);
        continue;
      }
      if (h - l > double(M::step_of(M::kMaxCode).to_float()) * (std::ldexp(1.0, bits) - 1.5)) {
        ASSERT_EQ(bits, 1);
        continue;
      }
      ASSERT_LE(double(m.lo.to_float()), l) << lo << " " << hi << " " << bits;
      ASSERT_GE(double(m.lo.to_float()) + std::ldexp(step, bits), h) << lo << " " << hi << " " << bits;
      const int code = std::to_integer<int>(st[0]);
      ASSERT_GE(step * (std::ldexp(1.0, bits) - 1.5), h - l);
      if (code > 1) {
        ASSERT_LT(double(M::step_of(code - 1).to_float()) * (std::ldexp(1.0, bits) - 1.5), h - l) << lo << " " << hi;
      }
    }
  EXPECT_EQ(M::codec::make_meta(0.0f, 0.0f, 8).step.to_float(), 0.0f);
  EXPECT_EQ(M::codec::make_meta(0.0f, 0.0f, 8).lo.to_float(), 0.0f);
}

// The device kernels fill the rule in parallel (set_scalars, then value_denom_at per code): the same rule.
TEST(QaqWidth, ParallelFillEqualsTheConstructor) {
  for (int T : {1, 2, 77, 1 << 16})
    for (double qn2 : {0.0, 2.5}) {
      const kvc::qaq::StepWidths<> want(T, 1e-3, qn2, 2e-2, {2, 7});
      kvc::qaq::StepWidths<> got;
      got.set_scalars(T, 1e-3, qn2, {2, 7});
      for (int c = 0; c < 255; ++c) got.value_denom[c] = T > 1 ? kvc::qaq::StepWidths<>::value_denom_at(T, 2e-2, c) : 1.0;
      EXPECT_EQ(got.T, want.T);
      EXPECT_EQ(got.key_min, want.key_min);
      EXPECT_EQ(got.key_denom, want.key_denom);
      if (T <= 1) continue;  // the rule ignores value_denom then
      for (int c = 0; c < 256; ++c) ASSERT_EQ(got.value_denom[c], want.value_denom[c]) << T << " " << c;
    }
}

template <class Q>
void packed_codes_read_back_at_every_width() {
  using R = kvc::qaq::RecordFormat<Q>;
  std::mt19937 rng(21);
  for (int d : {16, 64, 128, 256})
    for (int b = 1; b <= 8; ++b)
      for (int id_bytes : {2, 4}) {
        std::vector<std::uint8_t> c8(static_cast<std::size_t>(d)), idx(std::size_t(Q::outliers(d)));
        std::vector<kvc::half_t> val(idx.size());
        for (auto& c : c8) c = std::uint8_t(rng());
        for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = std::uint8_t(j * 3), val[j] = kvc::half_t::from_float(float(j) - 0.5f);
        std::vector<std::byte> rec(R::bytes(d, b, id_bytes));
        const kvc::QuantMeta m = Q::codec::make_meta(-1.0f, 1.55f, 8);
        const std::uint32_t id = id_bytes == 2 ? 40000u : 0xC0DE9C40u;  // every id byte nonzero, the top bit set
        R::write(rec.data(), d, b, id_bytes, m, c8.data(), 8, val.data(), idx.data(), id);
        std::vector<float> un(static_cast<std::size_t>(d));
        R::unpack(rec.data(), d, b, un.data());
        for (int c = 0; c < d; ++c) {
          ASSERT_EQ(R::code_at(rec.data(), c, b), c8[std::size_t(c)] >> (8 - b)) << "d " << d << " b " << b;
          ASSERT_EQ(un[std::size_t(c)], float(c8[std::size_t(c)] >> (8 - b)));
        }
        EXPECT_EQ(R::token(rec.data(), d, b, id_bytes), id);
        EXPECT_EQ(R::token(rec.data(), rec.size(), id_bytes), id);
        EXPECT_EQ(R::meta(rec.data()).step, m.step);
        EXPECT_EQ(R::meta(rec.data()).lo, m.lo);
        for (std::size_t j = 0; j < idx.size(); ++j) {
          EXPECT_EQ(R::outlier_channels(rec.data(), d, b)[j], idx[j]);
          EXPECT_EQ(R::outlier_values(rec.data(), d, b)[j], val[j]);
        }
        if (b > 1) {  // lowering a record by one bit
          std::vector<std::byte> low(R::bytes(d, b - 1, id_bytes));
          R::lower(rec.data(), b, low.data(), b - 1, d, id_bytes);
          for (int c = 0; c < d; ++c) ASSERT_EQ(R::code_at(low.data(), c, b - 1), c8[std::size_t(c)] >> (9 - b));
          EXPECT_EQ(R::token(low.data(), d, b - 1, id_bytes), R::token(rec.data(), d, b, id_bytes));
          EXPECT_EQ(R::meta(low.data()).lo, m.lo);
        }
      }
}
TEST(QaqRecord, PackedCodesReadBackAtEveryWidth) {
  packed_codes_read_back_at_every_width<kvc::QaqQuantizer<>>();
  packed_codes_read_back_at_every_width<LogQ<>>();
  static_assert(kvc::qaq::RecordFormat<LogQ<>>::bytes(64, 3, 2) + 2 == kvc::qaq::RecordFormat<kvc::QaqQuantizer<>>::bytes(64, 3, 2));
}

// Raising re-encodes only the codes from the mirror row, with the record's metadata and outliers: it must equal
// quantizing the row afresh at the new width, byte for byte, for every (b, nb), including zero-range rows,
// fp16-subnormal steps, ties among the extremes, and values at the fp16 limits.
template <class Q>
void raise_equals_write_row_from_the_mirror() {
  using R = kvc::qaq::RecordFormat<Q>;
  std::mt19937 rng(33);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int d : {16, 64, 80, 128, 256})
    for (int kind = 0; kind < 5; ++kind) {
      std::vector<kvc::half_t> row(static_cast<std::size_t>(d));
      for (int c = 0; c < d; ++c) {
        float x = g(rng);
        if (kind == 1) x = 1.25f;                       // zero range
        if (kind == 2) x = 1e-6f * x;                   // subnormal step
        if (kind == 3) x = float(int(x * 2.0f)) / 2.0f;  // many ties
        if (kind == 4) x = (c % 3 == 0 ? 65504.0f : -65504.0f) * (c % 5 == 0 ? 1.0f : 0.5f);
        row[std::size_t(c)] = kvc::half_t::from_float(x);
      }
      for (int id_bytes : {2, 4})
        for (int b = 1; b < 8; ++b) {
          std::vector<std::byte> low(R::bytes(d, b, id_bytes));
          R::write_row(low.data(), d, b, id_bytes, row.data(), 1234u);
          for (int nb = b + 1; nb <= 8; ++nb) {
            std::vector<std::byte> raised(R::bytes(d, nb, id_bytes)), fresh(raised.size());
            R::raise(low.data(), b, raised.data(), nb, d, id_bytes, row.data());
            R::write_row(fresh.data(), d, nb, id_bytes, row.data(), 1234u);
            ASSERT_EQ(raised, fresh) << "d " << d << " kind " << kind << " b " << b << " -> " << nb;
          }
        }
    }
}
TEST(QaqRecord, RaiseEqualsWriteRowFromTheMirror) {
  raise_equals_write_row_from_the_mirror<kvc::QaqQuantizer<>>();
  raise_equals_write_row_from_the_mirror<LogQ<>>();
}

TEST(QaqQuantizer, ZeroRangeTokensReconstructExactly) {
  using Q = kvc::QaqQuantizer<>;
  std::vector<float> x(64, 1.5f);
  x[9] = -7.0f;
  x[20] = 9.0f;  // the two outliers; the other 62 share one value
  const Coded c = code<Q>(x);
  EXPECT_EQ(c.m.step.to_float(), 0.0f);
  EXPECT_EQ(Q::range_bound(c.m), 0.0);
  EXPECT_EQ(kvc::qaq::key_width(Q::range_bound(c.m), 10, 1e-6, 4.0, Q::widths()), 1);
  std::vector<float> back(64);
  std::vector<std::uint8_t> cb(64);
  for (int i = 0; i < 64; ++i) cb[std::size_t(i)] = Q::narrow(c.codes[std::size_t(i)], 1);
  Q::decode_token(c.m, 1, cb.data(), c.idx.data(), c.val.data(), 64, back.data());
  EXPECT_EQ(back, x);
}

// ---------------------------------------------------------------------------------------------------------
// The calibration file
// ---------------------------------------------------------------------------------------------------------

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("kvc_qaq_") + name + "_" +
                                                    std::to_string(::testing::UnitTest::GetInstance()->random_seed())))
      .string();
}

kvc::qaq::QueryNormCalibration small_calibration() {
  // 2 layers, 2 KV heads, 4 query heads (groups of 2), d = 4, 10 tokens. Query head h at token t is
  // (t + 1 + h) * (1, 1, 1, 1): ||q / sqrt(4)||^2 = (t + 1 + h)^2; the 90th percentile (nearest rank 9 of 10)
  // is (9 + h)^2; the group max is head 1's 100 for KV head 0 and head 3's 144 for KV head 1.
  kvc::qaq::QueryNormCalibration c(2, 2, 4);
  std::vector<float> q(10 * 4 * 4);
  for (int t = 0; t < 10; ++t)
    for (int h = 0; h < 4; ++h)
      for (int i = 0; i < 4; ++i) q[std::size_t((t * 4 + h) * 4 + i)] = float(t + 1 + h);
  c.set_layer(0, q.data(), 10, 4);
  for (float& v : q) v *= 2.0f;
  c.set_layer(1, q.data(), 10, 4);
  return c;
}

TEST(QaqCalibration, PercentileOfTheScaledQueryNormAndGroupMax) {
  const auto c = small_calibration();
  EXPECT_EQ(c.at(0, 0), 100.0f);
  EXPECT_EQ(c.at(0, 1), 144.0f);
  EXPECT_EQ(c.at(1, 0), 400.0f);
  EXPECT_EQ(c.at(1, 1), 576.0f);
  EXPECT_EQ(c.queries, 10u);
}

TEST(QaqCalibration, SaveLoadRoundTrip) {
  const auto c = small_calibration();
  const std::string path = temp_path("roundtrip");
  kvc::qaq::save_calibration(c, path);
  const auto r = kvc::qaq::load_calibration(path);
  EXPECT_EQ(r.layers, 2);
  EXPECT_EQ(r.kv_heads, 2);
  EXPECT_EQ(r.head_dim, 4);
  EXPECT_EQ(r.percentile, 90.0f);
  EXPECT_EQ(r.queries, 10u);
  EXPECT_EQ(r.qnorm2, c.qnorm2);
  EXPECT_NO_THROW(r.check_shape(2, 2, 4));
  std::filesystem::remove(path);
}


TEST(QaqCalibration, BadFilesAndShapesAreRejectedClearly) {
  const auto c = small_calibration();
  const std::string path = temp_path("bad");
  kvc::qaq::save_calibration(c, path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto write = [&](const std::string& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), std::streamsize(b.size()));
  };
  auto load = [&] { (void)kvc::qaq::load_calibration(path); };
  std::string what;

  std::string flipped = bytes;
  flipped[34] ^= 0x10;  // inside the first entry
  write(flipped);
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kCorruptFile);
  EXPECT_NE(what.find("checksum"), std::string::npos) << what;

  write(bytes.substr(0, bytes.size() - 3));
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kCorruptFile);
  EXPECT_NE(what.find("truncated"), std::string::npos) << what;

  write(bytes + "x");
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kCorruptFile);
  EXPECT_NE(what.find("longer"), std::string::npos) << what;

  std::string magic = bytes;
  magic[0] = 'X';
  write(magic);
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kCorruptFile);
  EXPECT_NE(what.find("magic"), std::string::npos) << what;

  std::string version = bytes;
  version[8] = 2;
  write(version);
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kCorruptFile);
  EXPECT_NE(what.find("version 2"), std::string::npos) << what;

  std::string shape = bytes;
  shape[12] = 0;  // zero layers
  write(shape);
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kCorruptFile);
  EXPECT_NE(what.find("shape"), std::string::npos) << what;

  std::filesystem::remove(path);
  EXPECT_EQ(error_of(load, &what), kvc::Errc::kIo);

  // A calibration of another model.
  EXPECT_EQ(error_of([&] { c.check_shape(30, 3, 64); }, &what), kvc::Errc::kInvalidArgument);
  EXPECT_NE(what.find("30 x 3 x 64"), std::string::npos) << what;
}

TEST(QaqCalibration, BadInputsLeaveTheCalibrationUnchanged) {
  auto c = small_calibration();
  const auto before = c.qnorm2;
  std::vector<float> q(10 * 4 * 4, 1.0f);
  q[37] = std::nanf("");
  EXPECT_EQ(error_of([&] { c.set_layer(0, q.data(), 10, 4); }), kvc::Errc::kNonFinite);
  EXPECT_EQ(error_of([&] { c.set_layer(0, q.data(), 10, 3); }), kvc::Errc::kInvalidArgument);  // 3 % 2 != 0
  EXPECT_EQ(error_of([&] { c.set_layer(2, q.data(), 10, 4); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { c.set_layer(0, q.data(), 9, 4); }), kvc::Errc::kInvalidArgument);  // 10 before
  EXPECT_EQ(c.qnorm2, before);
  kvc::qaq::QueryNormCalibration incomplete(2, 2, 4);
  std::vector<float> ok(10 * 4 * 4, 1.0f);
  incomplete.set_layer(0, ok.data(), 10, 4);
  const std::string path = temp_path("incomplete");
  EXPECT_EQ(error_of([&] { kvc::qaq::save_calibration(incomplete, path); }), kvc::Errc::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(error_of([] { kvc::qaq::QueryNormCalibration(2, 2, 4, 0.0f); }), kvc::Errc::kInvalidArgument);
}

}  // namespace
