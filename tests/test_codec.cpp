// Scalar quantizer conformance (quant/codec.hpp): typed over codec x bit width, so a new codec or
// width is one line in CodecTypes.
#include "test_util.hpp"

namespace {

using kvc::Affine;
using kvc::EndpointCodec;
using kvc::half_t;
using kvc::MidpointCodec;
using kvc::QuantMeta;

template <class C, int B>
struct CodecBits {
  using codec = C;
  static constexpr int kBits = B;
  /// Number of steps between lo and the top of the grid: endpoint 2^b - 1 levels apart, midpoint 2^b bins.
  static constexpr int kSteps = std::is_same_v<C, EndpointCodec> ? (1 << B) - 1 : (1 << B);
};

using CodecTypes = ::testing::Types<CodecBits<EndpointCodec, 1>, CodecBits<EndpointCodec, 2>, CodecBits<EndpointCodec, 3>,
                                    CodecBits<EndpointCodec, 4>, CodecBits<EndpointCodec, 8>, CodecBits<MidpointCodec, 1>,
                                    CodecBits<MidpointCodec, 2>, CodecBits<MidpointCodec, 3>, CodecBits<MidpointCodec, 4>,
                                    CodecBits<MidpointCodec, 8>>;
struct CodecNames {
  template <class T>
  static std::string GetName(int) {
    return std::string(T::codec::kName) + std::to_string(T::kBits);
  }
};

/// Result of quantizing one group through quantize_group.
struct Quantized {
  QuantMeta meta;
  std::vector<std::uint8_t> codes;
  std::vector<float> recon;
  int puts = 0;
};

template <class C>
Quantized quantize(const std::vector<float>& x, int rows, int cols, int bits) {
  Quantized q;
  q.codes.assign(x.size(), 0xFF);
  q.meta = kvc::quantize_group<C>(
      rows, cols, bits, [&](int r, int c) { return x[std::size_t(r) * cols + c]; },
      [&](int r, int c, std::uint8_t code) {
        q.codes[std::size_t(r) * cols + c] = code;
        ++q.puts;
      });
  const Affine a = C::affine(q.meta);
  for (auto code : q.codes) q.recon.push_back(a.zero + a.scale * static_cast<float>(code));
  return q;
}

/// Groups of several shapes and distributions: normal, outlier-heavy, one-sided, tiny ranges,
/// subnormal magnitudes, magnitudes near the fp16 limit (1-bit endpoint steps are the full range,
/// which must stay finite: |x| <= 32752 there, as the cache enforces).
std::vector<std::vector<float>> test_groups(int bits, int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float big = bits == 1 ? 32752.0f : 65504.0f;
  std::vector<std::vector<float>> groups;
  for (int rep = 0; rep < 8; ++rep) {
    std::vector<float> g(static_cast<std::size_t>(n));
    for (auto& x : g) x = n01(rng);
    groups.push_back(g);
    for (auto& x : g) x = 3.0f + 0.01f * n01(rng);  // narrow, offset
    groups.push_back(g);
    for (auto& x : g) x = (rng() % 16 == 0 ? 40.0f : 1.0f) * n01(rng);  // outliers
    groups.push_back(g);
    for (auto& x : g) x = -5.0f - std::fabs(n01(rng));  // all negative
    groups.push_back(g);
    for (auto& x : g) x = 1e-6f * u(rng);  // fp16 subnormal range
    groups.push_back(g);
    for (auto& x : g) x = big * u(rng);  // near the limit
    g[0] = big;
    g[1] = -big;
    groups.push_back(g);
    for (auto& x : g) x = 1000.0f + 1e-3f * u(rng);  // range far below the fp16 spacing of lo
    groups.push_back(g);
  }
  return groups;
}

template <class T>
class CodecConformance : public ::testing::Test {};
TYPED_TEST_SUITE(CodecConformance, CodecTypes, CodecNames);

TYPED_TEST(CodecConformance, ErrorWithinHalfStoredStep) {
  using C = typename TypeParam::codec;
  constexpr int b = TypeParam::kBits;
  for (auto [rows, cols] : {std::pair{32, 1}, std::pair{1, 32}, std::pair{1, 128}, std::pair{4, 16}}) {
    for (const auto& x : test_groups(b, rows * cols, 100 * rows + cols + b)) {
      const Quantized q = quantize<C>(x, rows, cols, b);
      const float step = q.meta.step.to_float(), lo = q.meta.lo.to_float();
      ASSERT_TRUE(std::isfinite(step) && std::isfinite(lo));
      EXPECT_FLOAT_EQ(C::max_error(q.meta), 0.5f * step);
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_TRUE(std::isfinite(q.recon[i]));
        ASSERT_LE(std::fabs(x[i] - q.recon[i]), 0.5f * step + kvc_test::recon_slack(x[i], lo, step, b))
            << "x = " << x[i] << " recon " << q.recon[i] << " lo " << lo << " step " << step << " code "
            << int(q.codes[i]);
      }
    }
  }
}

TYPED_TEST(CodecConformance, CodesFitAndEveryElementIsWrittenOnce) {
  using C = typename TypeParam::codec;
  constexpr int b = TypeParam::kBits;
  for (const auto& x : test_groups(b, 64, 7 + b)) {
    const Quantized q = quantize<C>(x, 8, 8, b);
    EXPECT_EQ(q.puts, 64);
    for (auto code : q.codes) ASSERT_LT(int(code), 1 << b);
  }
  // Every code value is used on a dense ramp (no level is lost).
  std::vector<float> ramp(1024);
  for (std::size_t i = 0; i < ramp.size(); ++i) ramp[i] = -4.0f + 8.0f * float(i) / float(ramp.size() - 1);
  const Quantized q = quantize<C>(ramp, 1, int(ramp.size()), b);
  std::vector<int> used(1 << b, 0);
  for (auto code : q.codes) used[code] = 1;
  EXPECT_EQ(std::count(used.begin(), used.end(), 1), 1 << b);
}

TYPED_TEST(CodecConformance, StoredGridIsTight) {
  // The stored step is the ideal one rounded up to fp16 (relative 2^-10), not anything coarser;
  // lo is the group minimum rounded down to fp16.
  using C = typename TypeParam::codec;
  constexpr int b = TypeParam::kBits;
  for (const auto& x : test_groups(b, 32, 99 + b)) {
    const QuantMeta m = quantize<C>(x, 1, 32, b).meta;
    const float mn = *std::min_element(x.begin(), x.end()), mx = *std::max_element(x.begin(), x.end());
    const float lo = m.lo.to_float(), step = m.step.to_float();
    EXPECT_EQ(m.lo.bits, kvc::half_round_down(mn).bits);
    EXPECT_LE(lo, mn);
    const double ideal = (double(mx) - lo) / TypeParam::kSteps;
    EXPECT_GE(double(step) * (1.0 + 1e-6), ideal) << "grid does not cover the group";
    EXPECT_LE(double(step), ideal * (1.0 + 1.0 / 1024.0) + std::ldexp(1.0, -24)) << "step coarser than needed";
  }
}

TYPED_TEST(CodecConformance, ConstantGroupsReconstructExactly) {
  using C = typename TypeParam::codec;
  constexpr int b = TypeParam::kBits;
  const float limit = b == 1 ? 32752.0f : 65504.0f;
  for (float v : {0.0f, -0.0f, 3.0f, -2.5f, 1.0f / 1024.0f, std::ldexp(1.0f, -20), -limit, limit, 1000.0f}) {
    ASSERT_EQ(kvc_test::fp16_round(v), v);
    const std::vector<float> x(32, v);
    const Quantized q = quantize<C>(x, 1, 32, b);
    EXPECT_EQ(q.meta.step.to_float(), 0.0f) << "zero-range group must store step 0 (v = " << v << ")";
    for (float r : q.recon) ASSERT_EQ(r, v) << "constant " << v << " must reconstruct exactly";
  }
}

TYPED_TEST(CodecConformance, ConstantNonRepresentableGroupsStayFiniteAndBounded) {
  using C = typename TypeParam::codec;
  constexpr int b = TypeParam::kBits;
  for (float v : {3.0001f, 1.0f / 3.0f, -1e-5f, 1e-9f, -777.77f, 12345.678f}) {
    ASSERT_NE(kvc_test::fp16_round(v), v);
    const std::vector<float> x(32, v);
    const Quantized q = quantize<C>(x, 32, 1, b);
    const float step = q.meta.step.to_float();
    // lo is v rounded down to fp16, so the range is below one fp16 spacing of v.
    EXPECT_LE(double(step) * TypeParam::kSteps, std::fabs(double(v)) / 512.0 + TypeParam::kSteps * std::ldexp(1.0, -24));
    for (float r : q.recon) {
      ASSERT_TRUE(std::isfinite(r));
      ASSERT_LE(std::fabs(r - v), 0.5f * step + kvc_test::recon_slack(v, q.meta.lo.to_float(), step, b));
    }
  }
}

TYPED_TEST(CodecConformance, AffineFormMatchesTheCodecDefinition) {
  using C = typename TypeParam::codec;
  constexpr int b = TypeParam::kBits;
  const QuantMeta m = C::make_meta(-1.3f, 2.9f, b);
  const Affine a = C::affine(m);
  const float lo = m.lo.to_float(), step = m.step.to_float();
  EXPECT_EQ(a.scale, step);
  if constexpr (std::is_same_v<C, EndpointCodec>) {
    EXPECT_EQ(a.zero, lo) << "endpoint: x^ = lo + q*step";
  } else {
    EXPECT_EQ(a.zero, lo + 0.5f * step) << "midpoint: x^ = lo + (q + 1/2)*w";
  }
}

// ------------------------------------------------------------------------------------------------ codec-specific
TEST(EndpointCodec, EndpointsAreRepresentable) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n01;
  for (int b : {1, 2, 3, 4, 5, 8}) {
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<float> x(32);
      for (auto& v : x) v = 2.0f * n01(rng) + float(rep % 7) - 3.0f;
      const Quantized q = quantize<EndpointCodec>(x, 1, 32, b);
      const auto imin = std::size_t(std::min_element(x.begin(), x.end()) - x.begin());
      const auto imax = std::size_t(std::max_element(x.begin(), x.end()) - x.begin());
      EXPECT_EQ(q.codes[imin], 0);
      EXPECT_EQ(q.codes[imax], (1 << b) - 1);
      EXPECT_EQ(q.recon[imin], q.meta.lo.to_float()) << "the minimum decodes to lo";
      // lo and hi within fp16 rounding of the metadata (relative 2^-10 of the values / the range)
      EXPECT_LE(std::fabs(q.recon[imin] - x[imin]), std::fabs(x[imin]) / 1024.0f + 1e-7f);
      const float range = x[imax] - x[imin];
      EXPECT_LE(std::fabs(q.recon[imax] - x[imax]), (range + std::fabs(x[imin])) / 1024.0f * 1.01f + 1e-6f)
          << "bits " << b;
    }
  }
}

TEST(MidpointCodec, NestingWithExactSteps) {
  // With a power-of-two range the steps are exact in fp16, and a B-bit code shifted right by B - B'
  // is exactly the B'-bit code of the same value.
  std::mt19937_64 rng(11);
  for (auto [lo, hi] : {std::pair{-1.0f, 3.0f}, std::pair{0.0f, 1.0f}, std::pair{-64.0f, 64.0f},
                        std::pair{2.5f, 2.5f + 1.0f / 64.0f}}) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> xs = {lo, hi, 0.5f * (lo + hi)};
    for (int i = 0; i < 2000; ++i) xs.push_back(u(rng));
    for (int B = 2; B <= 8; ++B) {
      const QuantMeta mb = MidpointCodec::make_meta(lo, hi, B);
      ASSERT_EQ(double(mb.step.to_float()), (double(hi) - lo) / (1 << B)) << "step not exact";
      for (int Bp = 1; Bp < B; ++Bp) {
        const QuantMeta mp = MidpointCodec::make_meta(lo, hi, Bp);
        for (float x : xs) {
          const auto qb = MidpointCodec::encode(x, mb, 1.0f / mb.step.to_float(), B);
          const auto qp = MidpointCodec::encode(x, mp, 1.0f / mp.step.to_float(), Bp);
          ASSERT_EQ(qb >> (B - Bp), qp) << "x " << x << " B " << B << " B' " << Bp;
        }
      }
    }
  }
}

TEST(MidpointCodec, NestingWithinOneCodeForArbitraryRanges) {
  // fp16 rounding of the step may move bin edges slightly; never by more than one code.
  std::mt19937_64 rng(12);
  std::normal_distribution<float> n01;
  for (int rep = 0; rep < 20; ++rep) {
    const float lo = 3.0f * n01(rng), hi = lo + 0.1f + std::fabs(5.0f * n01(rng));
    std::uniform_real_distribution<float> u(lo, hi);
    for (int B = 2; B <= 8; ++B)
      for (int Bp = 1; Bp < B; ++Bp) {
        const QuantMeta mb = MidpointCodec::make_meta(lo, hi, B), mp = MidpointCodec::make_meta(lo, hi, Bp);
        for (int i = 0; i < 200; ++i) {
          const float x = u(rng);
          const int qb = MidpointCodec::encode(x, mb, 1.0f / mb.step.to_float(), B) >> (B - Bp);
          const int qp = MidpointCodec::encode(x, mp, 1.0f / mp.step.to_float(), Bp);
          ASSERT_LE(std::abs(qb - qp), 1);
        }
      }
  }
}

TEST(Codecs, MidpointHalvesEndpointErrorAtOneBit) {
  // Q-A at 1 bit has step = range (error up to range/2); Q-B has w = range/2 (error up to range/4).
  const QuantMeta a = EndpointCodec::make_meta(0.0f, 8.0f, 1), b = MidpointCodec::make_meta(0.0f, 8.0f, 1);
  EXPECT_EQ(EndpointCodec::max_error(a), 4.0f);
  EXPECT_EQ(MidpointCodec::max_error(b), 2.0f);
  EXPECT_EQ(MidpointCodec::encode(1.9f, b, 0.25f, 1), 0);
  EXPECT_EQ(MidpointCodec::encode(4.1f, b, 0.25f, 1), 1);
  EXPECT_EQ(EndpointCodec::encode(3.9f, a, 0.125f, 1), 0);
  EXPECT_EQ(EndpointCodec::encode(4.1f, a, 0.125f, 1), 1);
}

}  // namespace
