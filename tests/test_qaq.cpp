// QAQ (SPEC §2): the width rule against hand-computed cases and its guards, the attention history, the
// per-token codec (outliers, exact width nesting, restore from the original), and the calibration file.
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/calibration.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

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
    const float back = ProbCode::decode(ProbCode::encode(p));
    EXPECT_GE(back, p * (1.0f - 1e-6f)) << p;
    EXPECT_LE(back, p * std::exp2(1.0f / 8.0f) * (1.0f + 1e-6f)) << p;
  }
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

std::vector<float> fp16_row(std::mt19937& rng, int d, float scale) {
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> x(static_cast<std::size_t>(d));
  for (float& v : x) v = kvc::half_t::from_float(n(rng)).to_float();
  return x;
}

struct Coded {
  std::vector<std::uint8_t> codes, idx;
  std::vector<kvc::half_t> val;
  kvc::QuantMeta m;
};

template <class Q>
Coded code(const std::vector<float>& x) {
  const int d = int(x.size());
  Coded c;
  c.codes.resize(std::size_t(d));
  c.idx.resize(std::size_t(Q::outliers(d)));
  c.val.resize(std::size_t(Q::outliers(d)));
  c.m = Q::quantize(x.data(), d, c.codes.data(), c.idx.data(), c.val.data());
  return c;
}

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
TEST(QaqQuantizer, LoweringIsAShiftAndEqualsQuantizingAtTheLowerWidth) {
  using Q = kvc::QaqQuantizer<>;
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

TEST(QaqQuantizer, RequantizingTheOriginalRestoresEveryWidthExactly) {
  using Q = kvc::QaqQuantizer<2, 6>;
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

kvc::Errc error_of(const std::function<void()>& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const kvc::Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  ADD_FAILURE() << "no kvc::Error thrown";
  return kvc::Errc::kInvalidArgument;
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
