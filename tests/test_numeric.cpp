// fp16 / bf16 storage types (core/numeric.hpp): rounding against independent references; the host allocator
// for large random-read buffers (core/huge_page_allocator.hpp).
#include "test_util.hpp"

#include <kvc/core/huge_page_allocator.hpp>

#include <cstdint>
#include <vector>

#if defined(__F16C__)
#  include <immintrin.h>
#endif

namespace {

using kvc::bfloat16_t;
using kvc::half_t;

std::uint32_t fbits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bitsf(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Value of a binary16 bit pattern from its definition (double arithmetic).
double half_value(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  double v;
  if (e == 0x1F) v = m ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL;
  else if (e == 0) v = std::ldexp(double(m), -24);
  else v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return s ? -v : v;
}

// Positive finite halfs 0x0000..0x7BFF plus 0x7C00 standing in as "65536" (IEEE overflow rounding:
// a value rounds to Inf iff it rounds past 65504 with unbounded exponent).
const std::vector<double>& positive_grid() {
  static const std::vector<double> g = [] {
    std::vector<double> r;
    for (std::uint32_t b = 0; b <= 0x7BFF; ++b) r.push_back(half_value(static_cast<std::uint16_t>(b)));
    r.push_back(65536.0);
    return r;
  }();
  return g;
}

// Reference float -> half, round to nearest, ties to the even bit pattern.
std::uint16_t ref_half(float f) {
  if (std::isnan(f)) return 0x7E00;
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (std::isinf(f) || a >= 65536.0) return sign | 0x7C00;
  const auto& g = positive_grid();
  const auto it = std::lower_bound(g.begin(), g.end(), a);  // first >= a
  std::size_t hi = std::size_t(it - g.begin());
  if (g[hi] == a) return static_cast<std::uint16_t>(sign | hi);
  const std::size_t lo = hi - 1;
  const double dl = a - g[lo], dh = g[hi] - a;
  const std::size_t pick = dl < dh ? lo : (dh < dl ? hi : ((lo & 1) ? hi : lo));
  return static_cast<std::uint16_t>(sign | pick);
}

// Dense float set: a stride over all bit patterns plus every half, its float neighbours, the exact
// midpoints between adjacent halfs and their float neighbours (the tie cases), both signs.
std::vector<float> dense_floats() {
  std::vector<float> r;
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4093) r.push_back(bitsf(static_cast<std::uint32_t>(u)));
  for (std::uint32_t b = 0; b < 0x7C00; ++b) {
    const float h = static_cast<float>(half_value(static_cast<std::uint16_t>(b)));
    const float next = b + 1 < 0x7C00 ? static_cast<float>(half_value(static_cast<std::uint16_t>(b + 1))) : 65536.0f;
    const float mid = 0.5f * (h + next);  // exact: 12 significant bits
    for (float x : {h, std::nextafter(h, 0.0f), std::nextafter(h, HUGE_VALF), mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, HUGE_VALF)}) {
      r.push_back(x);
      r.push_back(-x);
    }
  }
  return r;
}

TEST(Half, ToFloatExhaustiveMatchesDefinition) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const half_t h{static_cast<std::uint16_t>(b)};
    const double want = half_value(h.bits);
    const float got = h.to_float();
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << b;
    } else {
      ASSERT_EQ(double(got), want) << std::hex << b;
      ASSERT_EQ(std::signbit(got), bool(b & 0x8000)) << std::hex << b;
      ASSERT_EQ(half_t::from_float(got).bits, h.bits) << "round trip of " << std::hex << b;
    }
  }
}

TEST(Half, FromFloatRoundsToNearestEvenDense) {
  const auto xs = dense_floats();
  std::size_t checked = 0;
  for (float x : xs) {
    const std::uint16_t got = half_t::from_float(x).bits, want = ref_half(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(half_t{got}.to_float())) << "NaN must stay NaN";
      continue;
    }
    ASSERT_EQ(got, want) << "x = " << x << " (0x" << std::hex << fbits(x) << ")";
    ++checked;
  }
  EXPECT_GT(checked, 1000000u);
}

#if defined(__F16C__)
TEST(Half, FromFloatMatchesHardwareF16C) {
  for (float x : dense_floats()) {
    const std::uint16_t hw = static_cast<std::uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
    const std::uint16_t sw = half_t::from_float(x).bits;
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(half_t{sw}.to_float()));
    } else {
      ASSERT_EQ(sw, hw) << "x = " << x;
    }
  }
}
#endif

TEST(Half, SpecialValues) {
  // subnormals
  EXPECT_EQ(half_t::from_float(std::ldexp(1.0f, -24)).bits, 0x0001);
  EXPECT_EQ(half_t::from_float(std::ldexp(1.0f, -25)).bits, 0x0000) << "tie at 2^-25 goes to even (zero)";
  EXPECT_EQ(half_t::from_float(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits, 0x0001);
  EXPECT_EQ(half_t::from_float(3.0f * std::ldexp(1.0f, -25)).bits, 0x0002) << "1.5 ulp ties to even 2";
  EXPECT_EQ(half_t::from_float(-std::ldexp(1.0f, -25)).bits, 0x8000) << "negative underflow keeps the sign";
  EXPECT_EQ(half_t::from_float(std::ldexp(1023.0f, -24)).bits, 0x03FF) << "largest subnormal";
  EXPECT_EQ(half_t::from_float(std::ldexp(1.0f, -14)).bits, 0x0400) << "smallest normal";
  EXPECT_EQ(half_t::from_float(std::ldexp(1023.5f, -24)).bits, 0x0400) << "subnormal rounding into the normals";
  EXPECT_EQ(half_t::from_float(1e-10f).bits, 0x0000);
  EXPECT_EQ(half_t::from_float(-0.0f).bits, 0x8000);
  // overflow
  EXPECT_EQ(half_t::from_float(65504.0f).bits, 0x7BFF);
  EXPECT_EQ(half_t::from_float(65519.996f).bits, 0x7BFF);
  EXPECT_EQ(half_t::from_float(65520.0f).bits, 0x7C00) << "65520 rounds to Inf";
  EXPECT_EQ(half_t::from_float(-65520.0f).bits, 0xFC00);
  EXPECT_EQ(half_t::from_float(1e30f).bits, 0x7C00);
  EXPECT_EQ(half_t::from_float(HUGE_VALF).bits, 0x7C00);
  EXPECT_EQ(half_t::from_float(-HUGE_VALF).bits, 0xFC00);
  // NaN stays NaN, sign kept
  const half_t n = half_t::from_float(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(n.to_float()));
  EXPECT_TRUE(std::isnan(half_t::from_float(bitsf(0x7F800001u)).to_float())) << "signalling NaN must not become Inf";
  EXPECT_TRUE(std::isnan(half_t::from_float(bitsf(0xFFC00000u)).to_float()));
  EXPECT_TRUE(std::signbit(half_t::from_float(bitsf(0xFFC00000u)).to_float()));
  EXPECT_EQ(half_t::kMax, 65504.0f);
}

// ------------------------------------------------------------------------------------------------ bf16
double bf16_value(std::uint16_t b) { return double(bitsf(std::uint32_t(b) << 16)); }

std::uint16_t ref_bf16(float f) {
  const std::uint32_t u = fbits(f);
  const std::uint16_t trunc = static_cast<std::uint16_t>(u >> 16);
  if ((u & 0x7FFFFFFFu) == 0x7F800000u || (u & 0xFFFFu) == 0) return trunc;
  const double a = std::fabs(double(f));
  const double lo = std::fabs(bf16_value(trunc));
  const std::uint16_t up = static_cast<std::uint16_t>(trunc + 1);
  const double hi = (up & 0x7FFF) == 0x7F80 ? std::ldexp(1.0, 128) : std::fabs(bf16_value(up));
  if (a - lo < hi - a) return trunc;
  if (hi - a < a - lo) return up;
  return (trunc & 1) ? up : trunc;
}

TEST(BFloat16, FromFloatRoundsToNearestEvenDense) {
  std::mt19937_64 rng(5);
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull; u += 2039) {
    const std::uint32_t b = static_cast<std::uint32_t>(u) ^ static_cast<std::uint32_t>(rng() & 0xFFFF);
    const float x = bitsf(b);
    const bfloat16_t got = bfloat16_t::from_float(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(got.to_float())) << std::hex << b;
      continue;
    }
    ASSERT_EQ(got.bits, ref_bf16(x)) << "x = " << x << " 0x" << std::hex << b;
  }
  // ties
  EXPECT_EQ(bfloat16_t::from_float(bitsf(0x3F808000u)).bits, 0x3F80) << "tie to even (down)";
  EXPECT_EQ(bfloat16_t::from_float(bitsf(0x3F818000u)).bits, 0x3F82) << "tie to even (up)";
  EXPECT_EQ(bfloat16_t::from_float(std::numeric_limits<float>::max()).bits, 0x7F80) << "FLT_MAX rounds to Inf";
  EXPECT_EQ(bfloat16_t::from_float(HUGE_VALF).bits, 0x7F80);
  EXPECT_TRUE(std::isnan(bfloat16_t::from_float(bitsf(0x7F800001u)).to_float())) << "sNaN must not become Inf";
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const bfloat16_t h{static_cast<std::uint16_t>(b)};
    if (!std::isnan(h.to_float())) {
      ASSERT_EQ(bfloat16_t::from_float(h.to_float()).bits, h.bits);
    }
  }
}

// ------------------------------------------------------------------------------------------------ directed rounding
TEST(HalfDirected, RoundDownIsLargestHalfNotAbove) {
  const auto& g = positive_grid();
  for (float x : dense_floats()) {
    if (!std::isfinite(x) || std::fabs(x) > 65504.0f) continue;
    const half_t h = kvc::half_round_down(x);
    const double v = h.to_float();
    ASSERT_LE(v, double(x)) << "x = " << x;
    // no half strictly between v and x
    const double next_up = v >= 0 ? g[std::size_t(std::upper_bound(g.begin(), g.end(), v) - g.begin())]
                                  : -g[std::size_t(std::lower_bound(g.begin(), g.end(), -v) - g.begin()) - 1];
    ASSERT_GT(next_up, double(x)) << "x = " << x << " rounded down to " << v << " but " << next_up << " fits";
  }
  EXPECT_EQ(kvc::half_round_down(1e-10f).bits, 0x0000);
  EXPECT_EQ(kvc::half_round_down(-1e-10f).bits, 0x8001) << "tiny negatives round down to -2^-24";
  EXPECT_EQ(kvc::half_round_down(3.0f).bits, half_t::from_float(3.0f).bits) << "representable values are kept";
  EXPECT_EQ(kvc::half_round_down(-65504.0f).bits, 0xFBFF);
  EXPECT_EQ(kvc::half_round_down(65510.0f).bits, 0x7BFF);
}

TEST(HalfDirected, RoundUpNonnegIsSmallestHalfNotBelow) {
  const auto& g = positive_grid();
  for (float x : dense_floats()) {
    if (!std::isfinite(x) || x < 0.0f || x > 65504.0f) continue;
    const half_t h = kvc::half_round_up_nonneg(x);
    const double v = h.to_float();
    ASSERT_GE(v, double(x)) << "x = " << x;
    const std::size_t i = std::size_t(std::lower_bound(g.begin(), g.end(), v) - g.begin());
    if (i > 0) {
      ASSERT_LT(g[i - 1], double(x)) << "x = " << x << " rounded up to " << v;
    }
  }
  EXPECT_EQ(kvc::half_round_up_nonneg(0.0f).bits, 0x0000);
  EXPECT_EQ(kvc::half_round_up_nonneg(1e-10f).bits, 0x0001) << "tiny positives round up to 2^-24";
  EXPECT_EQ(kvc::half_round_up_nonneg(65504.0f).bits, 0x7BFF);
  EXPECT_EQ(kvc::half_round_up_nonneg(65505.0f).bits, 0x7C00) << "past the largest half rounds up to Inf";
  EXPECT_EQ(kvc::half_round_up_nonneg(1.0f / 3.0f).to_float() >= 1.0f / 3.0f, true);
}

// ------------------------------------------------------------------------------------------------ batch conversion
std::vector<float> conversion_inputs(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(n + 1);  // never empty: data() is not null even for n == 0
  const float specials[] = {0.0f, -0.0f, 65504.0f, 65520.0f, -1e9f, HUGE_VALF, -HUGE_VALF,
                            std::numeric_limits<float>::quiet_NaN(), std::ldexp(1.0f, -25), 1e-30f,
                            std::ldexp(1023.0f, -24), 2049.0f};
  for (std::size_t i = 0; i < n; ++i) {
    if (rng() % 5 == 0) x[i] = specials[rng() % std::size(specials)];
    else x[i] = bitsf(static_cast<std::uint32_t>(rng()) & 0xC7FFFFFFu);  // mostly |x| < 2^17: in fp16 range
  }
  return x;
}

TEST(Convert, BatchMatchesScalarAllTails) {
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 70; ++n) sizes.push_back(n);
  sizes.push_back(1000);
  for (std::size_t n : sizes) {
    const auto x = conversion_inputs(n, 100 + n);
    // float -> half
    std::vector<half_t> h(n + 1, half_t{0x1234});
    kvc::convert(x.data(), h.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const half_t s = half_t::from_float(x[i]);
      if (std::isnan(x[i])) {
        ASSERT_TRUE(std::isnan(h[i].to_float()));
      } else {
        ASSERT_EQ(h[i].bits, s.bits) << "n " << n << " i " << i << " x " << x[i];
      }
    }
    EXPECT_EQ(h[n].bits, 0x1234) << "convert wrote past n";
    // half -> float
    std::vector<float> back(n + 1, 7.0f);
    kvc::convert(h.data(), back.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      if (std::isnan(h[i].to_float())) {
        ASSERT_TRUE(std::isnan(back[i]));
      } else {
        ASSERT_EQ(fbits(back[i]), fbits(h[i].to_float())) << "n " << n << " i " << i;
      }
    }
    EXPECT_EQ(back[n], 7.0f);
    // bf16 both ways
    std::vector<bfloat16_t> b(n + 1);
    kvc::convert(x.data(), b.data(), n);
    std::vector<float> bb(n + 1);
    kvc::convert(b.data(), bb.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) continue;
      ASSERT_EQ(b[i].bits, bfloat16_t::from_float(x[i]).bits);
      ASSERT_EQ(fbits(bb[i]), fbits(b[i].to_float()));
    }
    // float -> float is a copy
    std::vector<float> f(n + 1);
    kvc::convert(x.data(), f.data(), n);
    EXPECT_TRUE(n == 0 || std::memcmp(f.data(), x.data(), n * 4) == 0);
  }
}

TEST(Convert, EmptyRangesMayBeNull) {
  // An empty range is a no-op whatever its pointers (e.g. std::vector<float>{}.data() == nullptr).
  // std::memcpy(nullptr, nullptr, 0) is undefined behaviour: UBSan reports it.
  kvc::convert(static_cast<const float*>(nullptr), static_cast<float*>(nullptr), 0);
  kvc::convert(static_cast<const float*>(nullptr), static_cast<half_t*>(nullptr), 0);
  kvc::convert(static_cast<const half_t*>(nullptr), static_cast<float*>(nullptr), 0);
  kvc::convert(static_cast<const float*>(nullptr), static_cast<bfloat16_t*>(nullptr), 0);
  kvc::convert(static_cast<const bfloat16_t*>(nullptr), static_cast<float*>(nullptr), 0);
  SUCCEED();
}

}  // namespace

// HugePageAllocator: >= 2 MiB allocations are 2 MiB aligned (and advised for huge pages), smaller ones are
// ordinary; both hold and keep their contents across growth.
TEST(HugePageAllocator, LargeBuffersAreHugePageAlignedAndHoldTheirContents) {
  using Vec = std::vector<std::uint16_t, kvc::HugePageAllocator<std::uint16_t>>;
  Vec small(1000);
  for (std::size_t i = 0; i < small.size(); ++i) small[i] = std::uint16_t(i);
  Vec big;
  for (std::size_t i = 0; i < (std::size_t(3) << 20); ++i) big.push_back(std::uint16_t(i * 7));  // grows past 2 MiB
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big.data()) % kvc::HugePageAllocator<std::uint16_t>::kHugePage, 0u);
  for (std::size_t i = 0; i < big.size(); ++i) ASSERT_EQ(big[i], std::uint16_t(i * 7)) << i;
  for (std::size_t i = 0; i < small.size(); ++i) ASSERT_EQ(small[i], std::uint16_t(i)) << i;
  Vec moved = std::move(big);
  EXPECT_EQ(moved.size(), std::size_t(3) << 20);
  EXPECT_EQ(moved[12345], std::uint16_t(12345 * 7));
}
