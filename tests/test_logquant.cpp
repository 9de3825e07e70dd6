// LogQuant (SPEC §4). The selection rule (LogWindow<W>) against a literal simulation of Algorithm 1
// after every append, for W 1/2/4/42, and the paper's example. In the cache: which rows are full precision and which are
// quantized after every append, against a literal simulation of Algorithm 1 with a staging buffer;
// each token quantized exactly once (blocks never rewritten); prefill-then-decode equals decode-only;
// fused attention against the double oracle on the reconstructed cache (GQA 1/3/4, head dims 64/128,
// ragged batches, lengths around every eviction and block boundary); accounting; bad input.
// PartialLogQuant: values leave a plain window of W into quantized token rows, each quantized once.
#include "test_util.hpp"

#include <set>
#include <string>

namespace {

using namespace kvc_test;

// LogWindow with W > B is PartialW40's key side; the PartialLogQuant schemes add quantized value rows.
using LogSchemes = ::testing::Types<sch::LogQuant2, sch::LogQuant4, sch::LogW3, sch::PartialW40, sch::PartialLogQuant2,
                                    sch::LogGear>;

template <class Sel>
constexpr bool kPartial = kvc::detail::selector_quantizes_values<Sel>();

template <class Cache>
class LogQuantCache : public ::testing::Test {
 protected:
  using Sel = typename Cache::selector;
  static constexpr int W = Sel::kWindow, B = Cache::kBlockTokens;
  /// Lengths around the selector's boundaries: the first eviction (3W), later evictions (3W + kW), and
  /// the lengths at which the staged rows fill a block.
  static std::vector<int> boundary_lengths(int max_len) {
    std::set<int> s{1, 2, 3 * W - 1, 3 * W, 3 * W + 1};
    for (int n = 3 * W; n <= max_len; n += W) s.insert({n, n + 1});
    for (int n = 1; n <= max_len; ++n)
      if (Sel::quantized_blocks(n, B) != Sel::quantized_blocks(n - 1, B)) s.insert({n - 1, n, n + 1});
    std::vector<int> out;
    for (int n : s)
      if (n >= 1 && n <= max_len) out.push_back(n);
    return out;
  }
};
TYPED_TEST_SUITE(LogQuantCache, LogSchemes, SchemeNames);

/// Algorithm 1 as written, plus the staging buffer: evicted tokens in eviction order, the first
/// floor(evicted / B) * B of them in blocks.
struct Literal {
  int w;
  std::vector<int> fp, evicted;
  void append(int t) {
    if (int(fp.size()) < 3 * w) {
      fp.push_back(t);
      return;
    }
    std::vector<int> keep;
    for (int i = 0; i < 2 * w; i += 2) keep.push_back(fp[i]);
    for (int i = 1; i < 2 * w; i += 2) evicted.push_back(fp[i]);
    for (int i = 2 * w; i < 3 * w; ++i) keep.push_back(fp[i]);
    keep.push_back(t);
    fp = keep;
  }
};

template <int W>
void expect_matches_algorithm_1(int tokens) {
  using LW = kvc::LogWindow<W>;
  typename LW::State s;
  Literal lit{W, {}, {}};
  std::vector<int> evicted, seen(static_cast<std::size_t>(tokens), 0);
  int buf[W];
  for (int t = 0; t < tokens; ++t) {
    const int e = LW::append(s, t, buf);
    evicted.insert(evicted.end(), buf, buf + e);
    lit.append(t);
    ASSERT_EQ(std::vector<int>(s.pos, s.pos + s.size), lit.fp) << "W " << W << " after token " << t;
    ASSERT_EQ(evicted, lit.evicted) << "W " << W << " after token " << t;
    ASSERT_EQ(int(evicted.size()), LW::evicted_count(t + 1));
    ASSERT_EQ(s.size, LW::kept_count(t + 1));
    ASSERT_LE(s.size, LW::kCapacity);
    ASSERT_EQ(s.pos[0], 0) << "position 0 is never evicted";
  }
  for (int p : evicted) ASSERT_EQ(seen[std::size_t(p)]++, 0) << "token " << p << " evicted twice";
}

TEST(LogWindow, EqualsAlgorithm1AfterEveryAppend) {
  expect_matches_algorithm_1<1>(300);
  expect_matches_algorithm_1<2>(500);
  expect_matches_algorithm_1<4>(1000);
  expect_matches_algorithm_1<42>(2100);
}

TEST(LogWindow, PaperExampleW4At100) {
  // SPEC §4.2: W = 4, t = 100: FP = {0, 84, 88, 90, 92, 93, ..., 99} (the list before token 100).
  kvc::LogWindow<4>::State s;
  int buf[4];
  for (int t = 0; t < 100; ++t) kvc::LogWindow<4>::append(s, t, buf);
  std::vector<int> want{0, 84, 88, 90, 92};
  for (int t = 93; t <= 99; ++t) want.push_back(t);
  EXPECT_EQ(std::vector<int>(s.pos, s.pos + s.size), want);
}
TYPED_TEST(LogQuantCache, StorageFollowsAlgorithm1AndEachTokenIsQuantizedOnce) {
  using Cache = TypeParam;
  using Sel = typename Cache::selector;
  constexpr int W = TestFixture::W, B = TestFixture::B;
  const int H = 2, d = 64, T = 3 * W + 3 * B + 2 * W + 5;
  const KV x = random_kv(T, H, d, 11);
  Cache cache(kvc::CacheConfig{1, 1, H, d, T});
  Literal lit{W, {}, {}};
  std::vector<std::vector<std::byte>> blocks;  // every block's bytes when it was written
  const auto p = cache.params(0);
  const std::size_t kbb = Cache::key_format::block_bytes(d), vbb = Cache::value_format::block_bytes(d);
  auto block_bytes = [&](int blk) {
    std::vector<std::byte> b;
    for (int h = 0; h < H; ++h) {
      b.insert(b.end(), p.key_block(0, h, blk), p.key_block(0, h, blk) + kbb);
      b.insert(b.end(), p.value_block(0, h, blk), p.value_block(0, h, blk) + vbb);
    }
    return b;
  };
  for (int t = 0; t < T; ++t) {
    cache.append(0, 0, x.kview(t, 1), x.vview(t, 1));
    lit.append(t);
    const int n = t + 1, nb = cache.quantized_blocks(0, 0);
    ASSERT_EQ(nb, int(lit.evicted.size()) / B) << "blocks after token " << t;
    ASSERT_EQ(cache.params(0).fp_count(0), n - nb * B);
    // Stored order: block rows = the first nb * B evicted tokens; then the set, then the staged rest.
    std::vector<int> want(lit.evicted.begin(), lit.evicted.begin() + std::ptrdiff_t(nb) * B);
    want.insert(want.end(), lit.fp.begin(), lit.fp.end());
    want.insert(want.end(), lit.evicted.begin() + std::ptrdiff_t(nb) * B, lit.evicted.end());
    std::vector<int> got(static_cast<std::size_t>(n));
    Sel::positions(n, B, got.data());
    ASSERT_EQ(got, want) << "after token " << t;
    // Every full-precision row holds its token exactly (storage rounding), every quantized one lies
    // within its group's bound (GEAR's corrections move quantized elements off that bound: skipped).
    const auto dq = dequantize(cache, 0, 0);
    const auto bound = error_bounds(cache, 0, 0, x.prefix(n));
    const auto info = element_info(cache, 0, 0);
    const KV orig = x.prefix(n);
    for (std::size_t i = 0; i < dq.k.size(); ++i) {
      if (Cache::key_format::kCorrected && info.quantized[i]) continue;
      ASSERT_LE(std::fabs(dq.k[i] - orig.k[i]), bound.k[i]) << "key element " << i << " after token " << t;
      ASSERT_LE(std::fabs(dq.v[i] - orig.v[i]), bound.v[i]) << "value element " << i << " after token " << t;
    }
    ASSERT_EQ(dq.k[0], storage_round<typename Cache::window_t>(x.k[0])) << "position 0 stays full precision";
    if constexpr (kPartial<Sel>) {  // the newest ValueWindow values exact, every older one quantized
      for (int pos = 0; pos < n; ++pos)
        for (int h = 0; h < H; ++h) {
          const std::size_t i = (std::size_t(pos) * H + h) * d;
          ASSERT_EQ(bool(info.v_quantized[i]), pos < n - Sel::kValueWindow) << "value " << pos << " after token " << t;
          if (!info.v_quantized[i]) {
            ASSERT_EQ(dq.v[i], storage_round<typename Cache::window_t>(orig.v[i])) << "value " << pos;
          }
        }
    }
    while (int(blocks.size()) < nb) blocks.push_back(block_bytes(int(blocks.size())));
    for (int b = 0; b < nb; ++b) ASSERT_EQ(block_bytes(b), blocks[std::size_t(b)]) << "block " << b << " rewritten";
  }
  ASSERT_GE(int(blocks.size()), 3);
  std::vector<int> seen(static_cast<std::size_t>(T), 0);
  for (int pos : lit.evicted) ASSERT_EQ(seen[std::size_t(pos)]++, 0) << "token " << pos << " evicted twice";
}

TYPED_TEST(LogQuantCache, PrefillThenDecodeEqualsDecodeOnly) {
  using Cache = TypeParam;
  constexpr int W = TestFixture::W, B = TestFixture::B;
  const int H = 2, d = 64, T = 3 * W + 2 * B + W + 3;
  const KV x = random_kv(T, H, d, 21);
  Cache ref(kvc::CacheConfig{1, 1, H, d, T});
  append_kv(ref, 0, 0, x, 1);
  const auto want = dequantize(ref, 0, 0);
  const auto q = random_query(1, 2 * H, d, 22);
  const auto out_ref = fused(ref, 0, q, 1, 2 * H);
  for (int prefill : {0, 1, 3 * W - 1, 3 * W, 3 * W + 1, 5 * W + 2, B + 3 * W, T}) {
    SCOPED_TRACE("prefill " + std::to_string(prefill));
    Cache c(kvc::CacheConfig{1, 1, H, d, T});
    c.append(0, 0, x.kview(0, prefill), x.vview(0, prefill));
    for (int t = prefill; t < T; ++t) c.append(0, 0, x.kview(t, 1), x.vview(t, 1));
    const auto got = dequantize(c, 0, 0);
    EXPECT_TRUE(bytes_equal(got.k, want.k) && bytes_equal(got.v, want.v));
    EXPECT_EQ(c.stored_bytes(), ref.stored_bytes());
    EXPECT_TRUE(bytes_equal(fused(c, 0, q, 1, 2 * H), out_ref));
  }
}

TYPED_TEST(LogQuantCache, AttentionMatchesOracleAroundEveryBoundary) {
  using Cache = TypeParam;
  const int max_len = 3 * TestFixture::W + 3 * TestFixture::B + 2 * TestFixture::W;
  const std::vector<int> all = TestFixture::boundary_lengths(max_len);
  std::uint64_t seed = 500;
  for (int d : {64, 128})
    for (int g : {1, 3, 4}) {
      SCOPED_TRACE("head dim " + std::to_string(d) + ", GQA " + std::to_string(g));
      // Ragged batches of up to 6 boundary lengths at a time.
      for (std::size_t i0 = 0; i0 < all.size(); i0 += 6) {
        const std::vector<int> lengths(all.begin() + std::ptrdiff_t(i0),
                                       all.begin() + std::ptrdiff_t(std::min(all.size(), i0 + 6)));
        const int nseq = int(lengths.size()), H = 2, Hq = H * g;
        GenOptions gen;
        gen.outlier_scale = 4.0f;
        auto f = make_filled<Cache>(1, H, d, lengths, seed++, gen);
        const auto q = random_query(nseq, Hq, d, seed++);
        expect_fused_matches_oracle(*f.cache, 0, q, nseq, Hq, 1e-5);
      }
    }
}

TYPED_TEST(LogQuantCache, AccountingCountsBlocksSetAndStaging) {
  using Cache = TypeParam;
  using Sel = typename Cache::selector;
  constexpr int B = TestFixture::B;
  const int H = 3, d = 64;
  const std::vector<int> lengths = {5, 3 * TestFixture::W + 2 * B + 7, 700};
  const auto f = make_filled<Cache>(1, H, d, lengths, 31);
  std::size_t want = 0;
  for (int n : lengths) {
    const int nb = Sel::quantized_blocks(n, B);
    const std::size_t fp = std::size_t(Sel::kept_count(n)) + std::size_t(Sel::evicted_count(n) - nb * B);
    ASSERT_EQ(fp, std::size_t(n - nb * B));
    // PartialLogQuant: fp16 keys, fp16 values for the newest W only, the other values as token rows of
    // d * bits codes and an fp16 (lo, step) per value group, padded to 4 bytes.
    std::size_t exact = fp, row = 0;
    if constexpr (kPartial<Sel>) {
      using VQ = typename Cache::value_quantizer;
      exact = std::min<std::size_t>(fp, std::size_t(Sel::kValueWindow));
      row = (std::size_t(d) * VQ::kBits / 8 + 4 * std::size_t(d / VQ::kGroupChannels) + 3) / 4 * 4;
    }
    want += std::size_t(H) * (nb * (Cache::key_format::block_bytes(d) + Cache::value_format::block_bytes(d)) +
                              (fp + exact) * d * sizeof(typename Cache::window_t) + (fp - exact) * row);
  }
  EXPECT_EQ(f.cache->stored_bytes(), want);
  EXPECT_EQ(f.cache->decode_read_bytes(0), want);
  const std::size_t elems = std::size_t(5 + lengths[1] + 700) * 2 * H * d;
  EXPECT_DOUBLE_EQ(f.cache->bits_per_element(), 8.0 * double(want) / double(elems));
}

TYPED_TEST(LogQuantCache, BadInputLeavesTheCacheUnchanged) {
  using Cache = TypeParam;
  constexpr int W = TestFixture::W;
  const int H = 2, d = 64, T = 3 * W + 2 * TestFixture::B + 4;
  KV x = random_kv(T, H, d, 41);
  Cache c(kvc::CacheConfig{1, 1, H, d, T});
  c.append(0, 0, x.kview(0, 3 * W - 1), x.vview(0, 3 * W - 1));
  const auto before = snapshot(c);
  // A NaN in the last token of a prefill that would evict (and fill blocks) before reaching it.
  KV bad = x;
  bad.v[bad.at(T - 1, 1, 5)] = std::nanf("");
  KVC_EXPECT_ERROR(c.append(0, 0, bad.kview(3 * W - 1, T - 3 * W + 1), bad.vview(3 * W - 1, T - 3 * W + 1)),
                   kvc::Errc::kNonFinite, "value token");
  EXPECT_TRUE(same_state(before, snapshot(c)));
  KVC_EXPECT_ERROR(c.append(0, 0, x.kview(0, T), x.vview(0, T)), kvc::Errc::kCapacityExceeded, "exceeds the capacity");
  EXPECT_TRUE(same_state(before, snapshot(c)));
  c.append(0, 0, x.kview(3 * W - 1, T - 3 * W + 1), x.vview(3 * W - 1, T - 3 * W + 1));  // still usable
  EXPECT_EQ(c.length(0, 0), T);
}

/// PartialLogQuant: once a value leaves its window its reconstruction never changes again (quantized
/// once: the row's codes, then the block's identical ones), while its key stays full precision as long
/// as LogWindow keeps it; keys and values of the same token live in the same stored row.
template <class Cache>
void expect_values_quantized_once() {
  using Sel = typename Cache::selector;
  constexpr int W = Sel::kWindow, B = Cache::kBlockTokens;
  for (int prefill : {0, 1, W + 1, 3 * W + 2}) {
  const int H = 2, d = 64, T = 3 * W + 3 * B + W + 7;
  const KV x = random_kv(T, H, d, 61);
  Cache c(kvc::CacheConfig{1, 1, H, d, T});
  std::vector<std::vector<float>> frozen(static_cast<std::size_t>(T));  // value rows as first quantized
  c.append(0, 0, x.kview(0, prefill), x.vview(0, prefill));
  for (int n = prefill; n <= T; ++n) {
    if (n > prefill) c.append(0, 0, x.kview(n - 1, 1), x.vview(n - 1, 1));
    const auto dq = dequantize(c, 0, 0);
    const auto info = element_info(c, 0, 0);
    for (int pos = 0; pos < n - Sel::kValueWindow; ++pos) {
      const std::size_t i = std::size_t(pos) * H * d;
      ASSERT_TRUE(info.v_quantized[i]);
      std::vector<float> row(dq.v.begin() + std::ptrdiff_t(i), dq.v.begin() + std::ptrdiff_t(i + std::size_t(H) * d));
      auto& f = frozen[std::size_t(pos)];
      if (f.empty()) f = row;
      ASSERT_TRUE(bytes_equal(row, f)) << "value " << pos << " changed after " << n << " tokens (prefill " << prefill << ")";
    }
  }
  }
}
TEST(PartialLogQuant, EachValueIsQuantizedOnceWhenItLeavesItsWindow) {
  expect_values_quantized_once<sch::PartialW40>();
  expect_values_quantized_once<kvc::schemes::PartialLogQuant<2, 3, 32>>();
  expect_values_quantized_once<kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, 32, kvc::Axis::kChannel>>,
                                                      kvc::values<kvc::UniformQuantizer<3, kvc::Scope::kToken>>,
                                                      kvc::PartialLogWindow<5, 0>>>();  // no value window
}

TEST(PartialLogQuant, PaperBudgetAndBits) {
  // W = floor(R / 2) = 64 for R = 128: at most 3W = 192 fp16 keys and W = 64 fp16 values, i.e. no more
  // fp16 rows than KIVI's 2R; at 2048 tokens (head dim 64) that is exactly as many bytes as KIVI-2 with
  // the 126-token budget and LogQuant2 (192 + 64 fp16 rows + 128 value rows vs 2 x 128 fp16 rows, one
  // block fewer).
  using PL = kvc::schemes::PartialLogQuant2;
  static_assert(PL::selector::kValueWindow == 64 && PL::selector::kCapacity == 192);
  static_assert(PL::layout::exact_fp_values(2048) == 64 && PL::selector::kept_count(2048) == 192);
  const auto a = make_filled<PL>(1, 3, 64, {2048}, 71);
  const auto b = make_filled<kvc::schemes::Kivi2Budget126>(1, 3, 64, {2048}, 71);
  EXPECT_GT(a.cache->bits_per_element(), 2.0);
  EXPECT_LE(a.cache->bits_per_element(), b.cache->bits_per_element());
}

TEST(LogQuantSchemes, SameQuantizerAndBudgetAsTheKiviBaseline) {
  // At 2048 tokens and head dim 64 (SmolLM2), LogQuant2 and KIVI-2 with the same group and a 126-token
  // window store the same kind of blocks; LogQuant's full-precision count oscillates lower (85..126
  // in the set plus 0..63 staged vs 126 + 0..63), so it uses no more bits.
  using LQ = kvc::schemes::LogQuant2;
  using KV2 = kvc::schemes::Kivi2Budget126;
  static_assert(std::is_same_v<LQ::key_format, KV2::key_format> && std::is_same_v<LQ::value_format, KV2::value_format>);
  const auto a = make_filled<LQ>(1, 3, 64, {2048}, 51);
  const auto b = make_filled<KV2>(1, 3, 64, {2048}, 51);
  EXPECT_LE(a.cache->bits_per_element(), b.cache->bits_per_element());
  EXPECT_GT(a.cache->bits_per_element(), 2.0);
  EXPECT_EQ(LQ::selector::kept_count(2048) <= 126, true);
}
}  // namespace
