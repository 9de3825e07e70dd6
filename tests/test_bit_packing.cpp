// Plane packing of 1..8-bit codes (core/bit_packing.hpp) and the SIMD unpacker of the attention.
#include "test_util.hpp"

#include <kvc/attention/decode_attention.hpp>  // brings in the private detail/simd.hpp

#include <type_traits>

namespace {

std::vector<std::uint8_t> random_codes(std::size_t n, int bits, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> c(n);
  for (auto& x : c) x = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1u));
  return c;
}

constexpr std::uint8_t kGuard = 0xA5;
constexpr std::size_t kGuardBytes = 64;

// Packs into a buffer with guard bytes on both sides and checks they are untouched.
std::vector<std::uint8_t> pack_checked(const std::vector<std::uint8_t>& codes, int bits) {
  const std::size_t bytes = kvc::packed_bytes(codes.size(), bits);
  std::vector<std::uint8_t> buf(bytes + 2 * kGuardBytes, kGuard);
  kvc::pack_codes(codes.data(), codes.size(), bits, buf.data() + kGuardBytes);
  for (std::size_t i = 0; i < kGuardBytes; ++i) {
    EXPECT_EQ(buf[i], kGuard) << "pack_codes wrote before its output";
    EXPECT_EQ(buf[kGuardBytes + bytes + i], kGuard) << "pack_codes wrote past packed_bytes(n, " << bits << ")";
  }
  return {buf.begin() + kGuardBytes, buf.begin() + kGuardBytes + bytes};
}

// Out of line: inlined next to the SIMD unpacker, GCC 12 -O3 reports a bogus -Wstringop-overflow
// for the portable unpacker's zero fill.
[[gnu::noinline]] void portable_unpack(const std::uint8_t* packed, std::size_t n, int bits, std::uint8_t* out) {
  kvc::unpack_codes(packed, n, bits, out);
}

template <int B>
using Bits = std::integral_constant<int, B>;
using AllBits = ::testing::Types<Bits<1>, Bits<2>, Bits<3>, Bits<4>, Bits<5>, Bits<6>, Bits<7>, Bits<8>>;
struct BitsNames {
  template <class T>
  static std::string GetName(int) {
    return "b" + std::to_string(T::value);
  }
};

template <class T>
class Packing : public ::testing::Test {};
TYPED_TEST_SUITE(Packing, AllBits, BitsNames);

TYPED_TEST(Packing, PackedSizeIsExactlyNBitsOver8) {
  constexpr int b = TypeParam::value;
  for (std::size_t n : {std::size_t(512), std::size_t(1024), std::size_t(4096)}) {
    EXPECT_EQ(kvc::packed_bytes(n, b), n * b / 8);
    int planes_bits = 0;
    for (int p = 0; p < kvc::plane_count(b); ++p) planes_bits += kvc::plane_width(b, p);
    EXPECT_EQ(planes_bits, b) << "planes must add up to the code width";
  }
}

TYPED_TEST(Packing, RoundTripAndRandomAccess) {
  constexpr int b = TypeParam::value;
  for (std::size_t n : {std::size_t(512), std::size_t(1536), std::size_t(4096)}) {
    const auto codes = random_codes(n, b, 17 * n + b);
    const auto packed = pack_checked(codes, b);
    ASSERT_EQ(packed.size(), n * b / 8);
    std::vector<std::uint8_t> back(n, 0xFF);
    kvc::unpack_codes(packed.data(), n, b, back.data());
    EXPECT_EQ(back, codes) << "bits " << b << " n " << n;
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(kvc::packed_code_at(packed.data(), n, b, i), codes[i]) << "bits " << b << " index " << i;
  }
}

TYPED_TEST(Packing, ExtremePatterns) {
  constexpr int b = TypeParam::value;
  const std::size_t n = 1024;
  const std::uint8_t top = static_cast<std::uint8_t>((1u << b) - 1u);
  std::vector<std::vector<std::uint8_t>> patterns(3, std::vector<std::uint8_t>(n));
  for (std::size_t i = 0; i < n; ++i) {
    patterns[0][i] = top;                                    // all ones
    patterns[1][i] = (i % 2) ? top : 0;                      // alternating
    patterns[2][i] = static_cast<std::uint8_t>(i % (top + 1u));  // ramp
  }
  for (const auto& codes : patterns) {
    const auto packed = pack_checked(codes, b);
    std::vector<std::uint8_t> back(n);
    kvc::unpack_codes(packed.data(), n, b, back.data());
    EXPECT_EQ(back, codes);
  }
  // All-ones codes pack to all-ones bytes, zeros to zeros: no bit is wasted or shared.
  const auto ones = pack_checked(patterns[0], b);
  EXPECT_TRUE(std::all_of(ones.begin(), ones.end(), [](std::uint8_t x) { return x == 0xFF; }));
}

TYPED_TEST(Packing, SimdUnpackMatchesPortable) {
  constexpr int b = TypeParam::value;
  for (std::size_t n : {std::size_t(512), std::size_t(2048), std::size_t(8192)}) {
    const auto codes = random_codes(n, b, 1234 + n + b);
    const auto packed = pack_checked(codes, b);
    std::vector<std::uint8_t> portable(n);
    portable_unpack(packed.data(), n, b, portable.data());
    KVC_FOR_EACH_ISA(isa) {
      SCOPED_TRACE(kvc::isa_name(isa));
      std::vector<std::uint8_t> simd(n + 64, 0xEE);  // garbage in: the unpacker must not OR into it
      switch (isa) {  // the paths this build contains (KVC_DISABLE_SIMD, KVC_DISPATCH_TARGET_ONLY)
#if KVC_HAS_AVX512_PATH()
        case kvc::Isa::kAvx512: kvc::detail::isa_avx512::simd::unpack_codes<b>(packed.data(), n, simd.data()); break;
#endif
#if KVC_HAS_AVX2_PATH()
        case kvc::Isa::kAvx2: kvc::detail::isa_avx2::simd::unpack_codes<b>(packed.data(), n, simd.data()); break;
#endif
#if KVC_HAS_PORTABLE_PATH()
        case kvc::Isa::kPortable: kvc::detail::isa_portable::simd::unpack_codes<b>(packed.data(), n, simd.data()); break;
#endif
        default: ADD_FAILURE() << "runnable_isas() gave a path this build lacks"; break;
      }
      EXPECT_TRUE(std::equal(portable.begin(), portable.end(), simd.begin())) << "bits " << b << " n " << n;
      EXPECT_TRUE(std::equal(codes.begin(), codes.end(), simd.begin()));
      for (std::size_t i = n; i < n + 64; ++i) ASSERT_EQ(simd[i], 0xEE) << "SIMD unpack wrote past n codes";
    }
  }
}

// The documented layout (CUDA kernels depend on it): in a plane of width w, byte j of vector m holds
// in bits [i*w, i*w+w) the plane's bits of code (m*(8/w) + i)*64 + j; planes low bits first.
TEST(PackingLayout, PlaneSplitFollowsBinaryDigits) {
  EXPECT_EQ(kvc::plane_count(8), 1);
  EXPECT_EQ(kvc::plane_width(8, 0), 8);
  const int expect[9][3] = {{0, 0, 0}, {1, 0, 0}, {2, 0, 0}, {2, 1, 0}, {4, 0, 0},
                            {4, 1, 0}, {4, 2, 0}, {4, 2, 1}, {8, 0, 0}};
  for (int b = 1; b <= 8; ++b) {
    int off = 0;
    for (int p = 0; p < 3; ++p) {
      EXPECT_EQ(kvc::plane_width(b, p), expect[b][p]) << "bits " << b << " plane " << p;
      if (expect[b][p]) {
        EXPECT_EQ(kvc::plane_offset(b, p), off);
        off += expect[b][p];
      }
    }
  }
}

TEST(PackingLayout, ExplicitBytePositions) {
  const std::size_t n = 512;
  // 8 bits: identity layout.
  {
    auto codes = random_codes(n, 8, 1);
    std::vector<std::uint8_t> packed(n);
    kvc::pack_codes(codes.data(), n, 8, packed.data());
    EXPECT_EQ(packed, codes);
  }
  // 4 bits: byte j of vector m = code (2m)*64+j in the low nibble, code (2m+1)*64+j in the high one.
  {
    std::vector<std::uint8_t> codes(n, 0);
    codes[0 * 64 + 5] = 0x3;
    codes[1 * 64 + 5] = 0xC;
    codes[2 * 64 + 7] = 0x9;
    std::vector<std::uint8_t> packed(n / 2);
    kvc::pack_codes(codes.data(), n, 4, packed.data());
    EXPECT_EQ(packed[5], 0xC3);
    EXPECT_EQ(packed[64 + 7], 0x09);
    EXPECT_EQ(std::count(packed.begin(), packed.end(), 0), std::ptrdiff_t(n / 2 - 2));
  }
  // 3 bits = 2-bit plane (n/4 bytes) then 1-bit plane (n/8 bytes).
  {
    std::vector<std::uint8_t> codes(n, 0);
    codes[3 * 64 + 10] = 0x6;  // low plane bits 10b, high plane bit 1
    std::vector<std::uint8_t> packed(n * 3 / 8);
    kvc::pack_codes(codes.data(), n, 3, packed.data());
    // 2-bit plane: 4 chunks per vector, chunk 3 -> vector 0, field 3 (bits 6..7).
    EXPECT_EQ(packed[10], 0x2 << 6);
    // 1-bit plane after n/4 bytes: 8 chunks per vector, chunk 3 -> bit 3.
    EXPECT_EQ(packed[n / 4 + 10], 1 << 3);
    EXPECT_EQ(std::count(packed.begin(), packed.end(), 0), std::ptrdiff_t(n * 3 / 8 - 2));
  }
}

}  // namespace
