// AlignedSinkWindow (select/full_precision_window.hpp): a sink kept exact without moving the block grid.
// Block k holds tokens [kB, (k+1)B); block 0's sink rows hold no token (quantized from copies of token
// Sink, masked out of the softmax). Checked: when blocks are quantized and that each token is quantized
// once, that block 0's statistics ignore the sink, the bytes at every length (the aligned grid leaves no
// fp16 tail at multiples of B), prefill = decode, that masked rows get no probability on every path,
// rotation on top, and that the GQA/ragged/head-dim attention suites pass (sch::SinkGrid is in AllSchemes).
#include "test_util.hpp"

#include <kvc/rotate/rotation.hpp>

namespace {

using namespace kvc_test;
using kvc::Axis;
using kvc::GroupQuantizer;

/// KIVI-4 on 64-token groups with a 4-token sink and no window: the issue-17 configuration.
using Grid64 = kvc::CompressedKVCache<kvc::keys<GroupQuantizer<4, 64, Axis::kChannel>>,
                                      kvc::values<GroupQuantizer<4, 64, Axis::kToken>>, kvc::BlockTokens<64>,
                                      kvc::AlignedSinkWindow<0, 4>>;
/// Window not a multiple of the block, odd sink, 2-bit (int-dot paths), rotated.
using GridRot = kvc::CompressedKVCache<kvc::keys<GroupQuantizer<2, 32, Axis::kChannel>>,
                                       kvc::values<GroupQuantizer<2, 32, Axis::kToken>>,
                                       kvc::AlignedSinkWindow<40, 3>, kvc::Rotation<kvc::Hadamard<>>>;
/// Float-FMA paths (6-bit per-token keys), fp32 storage for the full-precision rows.
using GridF32 = kvc::CompressedKVCache<kvc::keys<kvc::UniformQuantizer<6>>,
                                       kvc::values<GroupQuantizer<5, 32, Axis::kChannel>>,
                                       kvc::AlignedSinkWindow<8, 1, float>>;
}  // namespace
namespace kvc_test {
template <> inline constexpr const char* scheme_name<Grid64> = "Grid64";
template <> inline constexpr const char* scheme_name<GridRot> = "GridRot";
template <> inline constexpr const char* scheme_name<GridF32> = "GridF32";
}  // namespace kvc_test

namespace {

using GridSchemes = ::testing::Types<sch::SinkGrid, Grid64, GridRot, GridF32>;

template <class Cache>
class AlignedSink : public ::testing::Test {
 protected:
  static constexpr int S = Cache::selector::kSink, R = Cache::selector::kRecent, B = Cache::kBlockTokens;
  static constexpr int kH = 2, kD = 64;
  static constexpr int kN = R + 3 * B + 5;
  using W = typename Cache::window_t;
  /// Written out independently of the selector: block k needs n - (k+1)B >= R.
  static int expected_blocks(int n) { return n - R >= B ? (n - R) / B : 0; }
  /// Full-precision rows come back as stored: exact, or (rotated) R^T round(R x), within 2^-10 of the
  /// row's norm per element.
  static double exact_tol(const std::vector<float>& x, int row, int d) {
    if constexpr (!Cache::layout::kRotated) return 0.0;
    double s = 0.0;
    for (int c = 0; c < d; ++c) s += double(x[std::size_t(row) * d + c]) * x[std::size_t(row) * d + c];
    return std::sqrt(s) / 1024.0;
  }
  static int expected_fp(int n) {
    const int nb = expected_blocks(n);
    return nb == 0 ? n : S + (n - nb * B);
  }
};
TYPED_TEST_SUITE(AlignedSink, GridSchemes, SchemeNames);

TYPED_TEST(AlignedSink, BlocksOnTheGridSinkExactTokensQuantizedOnce) {
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  constexpr int S = TestFixture::S, R = TestFixture::R, B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 41);
  Cache c(kvc::CacheConfig{1, 1, H, d, N});
  std::vector<int> quantized_at(std::size_t(N), -1);
  Dequant<Cache> prev;
  for (int n = 1; n <= N; ++n) {
    c.append(0, 0, x.kview(n - 1, 1), x.vview(n - 1, 1));
    const int nb = c.quantized_blocks(0, 0);
    ASSERT_EQ(nb, TestFixture::expected_blocks(n)) << "n = " << n;
    ASSERT_EQ(c.params(0).fp_count(0), TestFixture::expected_fp(n)) << "n = " << n;
    const auto dq = dequantize(c, 0, 0);
    for (int pos = 0; pos < n; ++pos) {
      const bool fp = pos < S || pos >= nb * B;
      for (int i = 0; i < H * d; ++i) {
        const std::size_t e = std::size_t(pos) * H * d + i;
        if (fp) {
          const int row = (pos * H * d + i) / d;
          ASSERT_NEAR(dq.k[e], storage_round<W>(x.k[e]), TestFixture::exact_tol(x.k, row, d)) << "token " << pos;
          ASSERT_NEAR(dq.v[e], storage_round<W>(x.v[e]), TestFixture::exact_tol(x.v, row, d)) << "token " << pos;
        }
        if (pos < n - 1 && quantized_at[std::size_t(pos)] >= 0) {
          ASSERT_EQ(dq.k[e], prev.k[e]) << "token " << pos << " re-quantized at n " << n;
          ASSERT_EQ(dq.v[e], prev.v[e]) << "token " << pos << " re-quantized at n " << n;
        }
      }
      if (!fp && quantized_at[std::size_t(pos)] < 0) quantized_at[std::size_t(pos)] = n;
    }
    prev = dq;
  }
  for (int pos = S; pos < TestFixture::expected_blocks(N) * B; ++pos)
    ASSERT_EQ(quantized_at[std::size_t(pos)], R + (pos / B + 1) * B) << "token " << pos;
  for (int pos = 0; pos < S; ++pos) ASSERT_EQ(quantized_at[std::size_t(pos)], -1) << "sink tokens are never quantized";
}

TYPED_TEST(AlignedSink, Block0StatisticsIgnoreTheSink) {
  // Two caches whose data differ only in the sink tokens (one with huge values): every quantized row
  // reconstructs bit for bit the same, i.e. no block's grid saw the sink.
  using Cache = TypeParam;
  constexpr int S = TestFixture::S, H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 42);
  KV y = x;
  for (int t = 0; t < S; ++t)
    for (int i = 0; i < H * d; ++i) {
      y.k[std::size_t(t) * H * d + i] = (i % 2 ? 1.0f : -1.0f) * 900.0f;
      y.v[std::size_t(t) * H * d + i] = 500.0f;
    }
  Cache a(kvc::CacheConfig{1, 1, H, d, N}), b(kvc::CacheConfig{1, 1, H, d, N});
  append_kv(a, 0, 0, x);
  append_kv(b, 0, 0, y);
  ASSERT_GT(a.quantized_blocks(0, 0), 0);
  const auto da = dequantize(a, 0, 0), db = dequantize(b, 0, 0);
  const std::size_t first = std::size_t(S) * H * d;
  EXPECT_TRUE(std::equal(da.k.begin() + std::ptrdiff_t(first), da.k.end(), db.k.begin() + std::ptrdiff_t(first)));
  EXPECT_TRUE(std::equal(da.v.begin() + std::ptrdiff_t(first), da.v.end(), db.v.begin() + std::ptrdiff_t(first)));
  // ... and the sink itself comes back exact.
  for (std::size_t i = 0; i < first; ++i)
    ASSERT_NEAR(db.k[i], storage_round<typename TestFixture::W>(y.k[i]), TestFixture::exact_tol(y.k, int(i) / d, d));
}

TYPED_TEST(AlignedSink, StoredBytesAtEveryLength) {
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  constexpr int H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 43);
  Cache c(kvc::CacheConfig{1, 1, H, d, N});
  const std::size_t kb = Cache::key_format::block_bytes(d), vb = Cache::value_format::block_bytes(d);
  const std::size_t rot = Cache::layout::rotation_bytes(H, d);
  for (int n = 1; n <= N; ++n) {
    c.append(0, 0, x.kview(n - 1, 1), x.vview(n - 1, 1));
    const int nb = TestFixture::expected_blocks(n), fp = TestFixture::expected_fp(n);
    const std::size_t want = rot + std::size_t(H) * (nb * (kb + vb) + std::size_t(fp) * 2 * d * sizeof(W));
    ASSERT_EQ(c.stored_bytes(), want) << "n = " << n;
    ASSERT_EQ(c.decode_read_bytes(0), want) << "n = " << n;
    ASSERT_DOUBLE_EQ(c.bits_per_element(), 8.0 * double(want) / (double(n) * 2 * H * d));
  }
}

TYPED_TEST(AlignedSink, PrefillChunksMatchTokenByTokenDecode) {
  using Cache = TypeParam;
  constexpr int B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 44);
  Cache ref(kvc::CacheConfig{1, 1, H, d, N});
  append_kv(ref, 0, 0, x, 1);
  const auto want = dequantize(ref, 0, 0);
  for (int chunk : {2, 3, B - 1, B, B + 1, N}) {
    Cache c(kvc::CacheConfig{1, 1, H, d, N});
    append_kv(c, 0, 0, x, chunk);
    const auto got = dequantize(c, 0, 0);
    EXPECT_TRUE(bytes_equal(got.k, want.k) && bytes_equal(got.v, want.v)) << "chunk " << chunk;
    EXPECT_EQ(c.stored_bytes(), ref.stored_bytes());
  }
}

TYPED_TEST(AlignedSink, MaskedRowsGetNoProbability) {
  // Token S (whose copies fill block 0's masked rows) dominates the scores: counted S + 1 times, the
  // output would lean towards its value by far more than the tolerance. Every length around the first
  // block boundary, GQA 4, both precisions on every path, splits forced.
  using Cache = TypeParam;
  constexpr int S = TestFixture::S, R = TestFixture::R, B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  const int g = 4, Hq = H * g;
  for (int T : {R + B - 1, R + B, R + B + 1, R + 2 * B + 3}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    KV x = random_kv(T, H, d, 45 + std::uint64_t(T));
    const std::vector<float> q = random_query(1, Hq, d, 46);
    for (int h = 0; h < H; ++h)
      for (int ch = 0; ch < d; ++ch) x.k[x.at(S, h, ch)] = 0.6f * q[std::size_t(h * g) * d + ch];
    Cache c(kvc::CacheConfig{1, 1, H, d, T});
    append_kv(c, 0, 0, x);
    expect_fused_matches_oracle(c, 0, q, 1, Hq, 1e-4);
  }
}

TEST(AlignedSinkWindow, SelectorFormulas) {
  using Sel = kvc::AlignedSinkWindow<16, 4>;
  constexpr int B = 32;
  static_assert(Sel::quantized_blocks(47, B) == 0 && Sel::quantized_blocks(48, B) == 1 &&
                Sel::quantized_blocks(79, B) == 1 && Sel::quantized_blocks(80, B) == 2);
  static_assert(kvc::detail::masked_rows<Sel>() == 4 && kvc::detail::masked_rows<kvc::FullPrecisionWindow<16, 4>>() == 0);
  static_assert(kvc::detail::fp_tokens<Sel>(47, B) == 47 && kvc::detail::fp_tokens<Sel>(48, B) == 4 + 16 &&
                kvc::detail::stored_rows<Sel>(48, B) == 32 + 20);
  // The same sink on FullPrecisionWindow at 2048 tokens and 64-token blocks leaves 60 tokens waiting.
  static_assert(kvc::detail::fp_tokens<kvc::AlignedSinkWindow<0, 4>>(2048, 64) == 4 &&
                kvc::detail::fp_tokens<kvc::FullPrecisionWindow<0, 4>>(2048, 64) == 64);
  std::vector<int> pos(std::size_t(kvc::detail::stored_rows<Sel>(90, B)));
  Sel::positions(90, B, pos.data());
  // 2 blocks: rows 0..3 masked, 4..63 the tokens; then the sink and tokens 64..89.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(pos[std::size_t(i)], -1);
  for (int i = 4; i < 64; ++i) EXPECT_EQ(pos[std::size_t(i)], i);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(pos[std::size_t(64 + i)], i);
  for (int i = 0; i < 26; ++i) EXPECT_EQ(pos[std::size_t(68 + i)], 64 + i);
  // Ring slots of the live full-precision tokens are distinct.
  std::vector<int> slots;
  for (int i = 0; i < kvc::detail::fp_tokens<Sel>(90, B); ++i) slots.push_back(Sel::fp_slot(90, i, B));
  std::sort(slots.begin(), slots.end());
  EXPECT_TRUE(std::adjacent_find(slots.begin(), slots.end()) == slots.end());
  EXPECT_LT(slots.back(), Sel::fp_slots(B));
}

}  // namespace
