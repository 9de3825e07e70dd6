// Sliding full-precision window (select/full_precision_window.hpp) as the cache applies it (KIVI
// semantics): when blocks get quantized, that each token is quantized exactly once, that prefill in
// chunks and token-by-token decode reach the same state, and the storage accounting.
#include "test_util.hpp"

namespace kvc_test {
namespace sch {
/// Window not a multiple of the block, odd sink, 64-token blocks of a per-token quantizer.
using OddWindow = kvc::CompressedKVCache<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>, kvc::FullPrecisionWindow<40, 3>,
                                         kvc::BlockTokens<64>>;
/// Sink only, no recent window.
using SinkOnly = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, 32, kvc::Axis::kChannel>>,
                                        kvc::values<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>>,
                                        kvc::FullPrecisionWindow<0, 8>>;
}  // namespace sch
template <> inline constexpr const char* scheme_name<sch::OddWindow> = "OddWindow";
template <> inline constexpr const char* scheme_name<sch::SinkOnly> = "SinkOnly";
}  // namespace kvc_test

namespace {

using namespace kvc_test;

using WindowSchemes = ::testing::Types<sch::Kivi2, sch::Sink, sch::Chan64, sch::OddWindow, sch::SinkOnly, sch::Mixed56,
                                       sch::Fp16, sch::MidTok4>;

template <class Cache>
class Window : public ::testing::Test {
 protected:
  static constexpr int S = Cache::selector::kSink, R = Cache::selector::kRecent, B = Cache::kBlockTokens;
  static constexpr int kH = 2, kD = 32;
  static constexpr int kN = S + R + 3 * B + 5;
  using W = typename Cache::window_t;
  static int expected_blocks(int n) { return std::max(0, n - S - R) / B; }
};
TYPED_TEST_SUITE(Window, WindowSchemes, SchemeNames);

TYPED_TEST(Window, QuantizedBlocksFollowKiviFormulaAndTokensAreQuantizedOnce) {
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  constexpr int S = TestFixture::S, R = TestFixture::R, B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 21);
  Cache c(kvc::CacheConfig{1, 1, H, d, N});
  std::vector<int> quantized_at(std::size_t(N), -1);  // length at which each token was first seen quantized
  Dequant<Cache> prev;
  for (int n = 1; n <= N; ++n) {
    c.append(0, 0, x.kview(n - 1, 1), x.vview(n - 1, 1));
    ASSERT_EQ(c.length(0, 0), n);
    const int nb = c.quantized_blocks(0, 0);
    ASSERT_EQ(nb, TestFixture::expected_blocks(n)) << "n = " << n;
    ASSERT_EQ(c.params(0).quantized_blocks(0), nb);
    ASSERT_EQ(Cache::selector::quantized_blocks(n, B), nb);
    if (n > S) {
      const int tail = n - S - nb * B;  // full-precision tokens after the sink
      ASSERT_GE(tail, std::min(n - S, R)) << "the newest R tokens must stay exact";
      ASSERT_LE(tail, R + B - 1) << "a complete block older than the window was not quantized";
    }
    const auto dq = dequantize(c, 0, 0);
    for (int pos = 0; pos < n; ++pos) {
      const bool fp = pos < S || pos >= S + nb * B;
      for (int i = 0; i < H * d; ++i) {
        const std::size_t e = std::size_t(pos) * H * d + i;
        if (fp) {
          ASSERT_EQ(dq.k[e], storage_round<W>(x.k[e])) << "token " << pos << " at n " << n;
          ASSERT_EQ(dq.v[e], storage_round<W>(x.v[e])) << "token " << pos << " at n " << n;
        }
        if (pos < n - 1 && quantized_at[pos] >= 0) {  // once quantized, never touched again
          ASSERT_EQ(dq.k[e], prev.k[e]) << "token " << pos << " re-quantized at n " << n;
          ASSERT_EQ(dq.v[e], prev.v[e]) << "token " << pos << " re-quantized at n " << n;
        }
      }
      if (!fp && quantized_at[pos] < 0) quantized_at[pos] = n;
    }
    prev = dq;
  }
  // Every token of block k was quantized at the same moment, the first n with k < quantized_blocks(n).
  for (int pos = S; pos < S + TestFixture::expected_blocks(N) * B; ++pos) {
    const int k = (pos - S) / B;
    ASSERT_EQ(quantized_at[pos], S + R + (k + 1) * B) << "token " << pos;
  }
  for (int pos = 0; pos < S; ++pos) ASSERT_EQ(quantized_at[pos], -1) << "sink tokens are never quantized";
}

TYPED_TEST(Window, PrefillChunksMatchTokenByTokenDecode) {
  using Cache = TypeParam;
  constexpr int B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 22);
  Cache ref(kvc::CacheConfig{1, 1, H, d, N});
  append_kv(ref, 0, 0, x, 1);
  const auto want = dequantize(ref, 0, 0);
  for (int chunk : {2, 3, B - 1, B, B + 1, 100, N}) {
    Cache c(kvc::CacheConfig{1, 1, H, d, N});
    append_kv(c, 0, 0, x, chunk);
    const auto got = dequantize(c, 0, 0);
    EXPECT_TRUE(bytes_equal(got.k, want.k) && bytes_equal(got.v, want.v)) << "chunk " << chunk;
    EXPECT_EQ(c.stored_bytes(), ref.stored_bytes());
    EXPECT_EQ(c.quantized_blocks(0, 0), ref.quantized_blocks(0, 0));
  }
  // irregular schedule, including empty appends
  Cache c(kvc::CacheConfig{1, 1, H, d, N});
  std::mt19937_64 rng(4);
  for (int t = 0; t < N;) {
    const int n = std::min(N - t, int(rng() % 50));
    c.append(0, 0, x.kview(t, n), x.vview(t, n));
    t += n;
  }
  const auto got = dequantize(c, 0, 0);
  EXPECT_TRUE(bytes_equal(got.k, want.k) && bytes_equal(got.v, want.v));
}

TYPED_TEST(Window, StoredBytesAtEveryLength) {
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  constexpr int B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  const KV x = random_kv(N, H, d, 23);
  Cache c(kvc::CacheConfig{1, 1, H, d, N});
  const std::size_t kb = Cache::key_format::block_bytes(d), vb = Cache::value_format::block_bytes(d);
  for (int n = 1; n <= N; ++n) {
    c.append(0, 0, x.kview(n - 1, 1), x.vview(n - 1, 1));
    const int nb = TestFixture::expected_blocks(n);
    const std::size_t want = std::size_t(H) * (nb * (kb + vb) + std::size_t(n - nb * B) * 2 * d * sizeof(W));
    ASSERT_EQ(c.stored_bytes(), want) << "n = " << n;
    ASSERT_DOUBLE_EQ(c.bits_per_element(), 8.0 * double(want) / (double(n) * 2 * H * d));
  }
}

TYPED_TEST(Window, StreamsAreIndependentAndClearReusesStorage) {
  using Cache = TypeParam;
  constexpr int H = TestFixture::kH, d = TestFixture::kD;
  const int N = TestFixture::kN;
  Cache c(kvc::CacheConfig{2, 3, H, d, N});
  std::vector<KV> data;
  for (int l = 0; l < 2; ++l)
    for (int s = 0; s < 3; ++s) {
      data.push_back(random_kv(N - 7 * s - l, H, d, 100 + 10 * l + s));
      append_kv(c, l, s, data.back(), 13);
    }
  // each stream equals a single-stream cache with the same data
  for (int l = 0; l < 2; ++l)
    for (int s = 0; s < 3; ++s) {
      Cache one(kvc::CacheConfig{1, 1, H, d, N});
      append_kv(one, 0, 0, data[std::size_t(l * 3 + s)]);
      const auto a = dequantize(c, l, s), b = dequantize(one, 0, 0);
      EXPECT_TRUE(bytes_equal(a.k, b.k) && bytes_equal(a.v, b.v)) << "layer " << l << " seq " << s;
    }
  // clear sequence 1 (all layers), refill it with other data: the others are untouched and the
  // refilled stream equals a fresh cache
  auto before = snapshot(c);
  c.clear(1);
  EXPECT_EQ(c.length(0, 1), 0);
  EXPECT_EQ(c.length(1, 1), 0);
  EXPECT_EQ(c.length(0, 0), data[0].T);
  const KV fresh = random_kv(N / 2 + 3, H, d, 999);
  append_kv(c, 1, 1, fresh);
  EXPECT_EQ(c.length(0, 1), 0);
  Cache one(kvc::CacheConfig{1, 1, H, d, N});
  append_kv(one, 0, 0, fresh);
  const auto a = dequantize(c, 1, 1), b = dequantize(one, 0, 0);
  EXPECT_TRUE(bytes_equal(a.k, b.k) && bytes_equal(a.v, b.v));
  for (int l = 0; l < 2; ++l)
    for (int s : {0, 2}) {
      const auto now = dequantize(c, l, s);
      EXPECT_TRUE(bytes_equal(now.k, before.k[std::size_t(l * 3 + s)]) &&
                  bytes_equal(now.v, before.v[std::size_t(l * 3 + s)]))
          << "layer " << l << " seq " << s << " changed";
    }
}

TYPED_TEST(Window, FillsExactlyToCapacity) {
  using Cache = TypeParam;
  constexpr int S = TestFixture::S, R = TestFixture::R, B = TestFixture::B, H = TestFixture::kH, d = TestFixture::kD;
  for (int cap : {1, S + R + B - 1, S + R + B, S + R + 2 * B + 1}) {
    if (cap < 1) continue;
    Cache c(kvc::CacheConfig{1, 2, H, d, cap});
    const KV x = random_kv(cap, H, d, 31 + cap);
    append_kv(c, 0, 1, x, 7);
    EXPECT_EQ(c.length(0, 1), cap);
    EXPECT_EQ(c.quantized_blocks(0, 1), std::max(0, cap - S - R) / B);
    Cache ref(kvc::CacheConfig{1, 1, H, d, cap + 3 * B});
    append_kv(ref, 0, 0, x);
    const auto a = dequantize(c, 0, 1), b = dequantize(ref, 0, 0);
    EXPECT_TRUE(bytes_equal(a.k, b.k) && bytes_equal(a.v, b.v)) << "cap " << cap;
  }
}

}  // namespace
