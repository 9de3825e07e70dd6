// Bad input: kvc::Error with the right code and a message naming the problem, and the cache left
// exactly as it was (lengths, dequantize() bytes, stored_bytes()).
#include "test_util.hpp"

namespace {

using namespace kvc_test;
using kvc::Errc;

using ErrorSchemes = ::testing::Types<sch::Fp16, sch::Fp32, sch::Kivi2, sch::Kivi1, sch::Sink, sch::Chan64>;

template <class Cache>
class Errors : public ::testing::Test {
 protected:
  static constexpr int S = Cache::selector::kSink, R = Cache::selector::kRecent, B = Cache::kBlockTokens;
  static constexpr int kLayers = 2, kBatch = 2, kH = 2, kD = 64;
  static constexpr int kCap = S + R + 2 * B + 10;
  static constexpr int kLen0 = S + R + B + 5;  // one quantized block and a window

  void SetUp() override {
    cache_ = std::make_unique<Cache>(kvc::CacheConfig{kLayers, kBatch, kH, kD, kCap});
    for (int l = 0; l < kLayers; ++l) {
      append_kv(*cache_, l, 0, random_kv(kLen0, kH, kD, 10 + l));
      append_kv(*cache_, l, 1, random_kv(7, kH, kD, 20 + l));
    }
    ASSERT_EQ(cache_->quantized_blocks(0, 0), 1);
    before_ = snapshot(*cache_);
  }
  ::testing::AssertionResult unchanged() const { return same_state(before_, snapshot(*cache_)); }
  /// A valid 5-token input for the cache.
  static KV input(std::uint64_t seed = 3) { return random_kv(5, kH, kD, seed); }

  std::unique_ptr<Cache> cache_;
  Snapshot<Cache> before_;
};
TYPED_TEST_SUITE(Errors, ErrorSchemes, SchemeNames);

TYPED_TEST(Errors, NonFiniteKeysAndValuesAreRejected) {
  auto& c = *this->cache_;
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), HUGE_VALF, -HUGE_VALF};
  for (float b : bad) {
    for (bool key : {true, false}) {
      KV x = this->input();
      (key ? x.k : x.v)[x.at(3, 1, 17)] = b;  // the 4th token: nothing before it may be written
      SCOPED_TRACE(std::string(key ? "key " : "value ") + std::to_string(b));
      KVC_EXPECT_ERROR(c.append(0, 0, x.kview(0, 5), x.vview(0, 5)), Errc::kNonFinite,
                       std::string(key ? "key" : "value") + " token 3 head 1 channel 17");
      KVC_EXPECT_ERROR(c.append(1, 1, x.kview(0, 5), x.vview(0, 5)), Errc::kNonFinite, "NaN/Inf rejected");
      EXPECT_TRUE(this->unchanged());
    }
  }
}

TYPED_TEST(Errors, ValuesBeyondTheStorageRangeAreRejected) {
  using Cache = TypeParam;
  auto& c = *this->cache_;
  const float limit = Cache::input_limit();
  if (limit < std::numeric_limits<float>::max()) {
    for (float v : {std::nextafter(limit, HUGE_VALF), -2.0f * limit, 1e30f}) {
      for (bool key : {true, false}) {
        KV x = this->input();
        (key ? x.k : x.v)[x.at(4, 0, 63)] = v;
        KVC_EXPECT_ERROR(c.append(0, 1, x.kview(0, 5), x.vview(0, 5)), Errc::kOutOfRange,
                         "exceeds the storable magnitude");
        EXPECT_TRUE(this->unchanged());
      }
    }
    // exactly the limit is fine
    Cache fresh(kvc::CacheConfig{1, 1, TestFixture::kH, TestFixture::kD, 8});
    KV x = this->input();
    x.k[0] = limit;
    x.v[1] = -limit;
    EXPECT_NO_THROW(append_kv(fresh, 0, 0, x));
  } else {
    Cache fresh(kvc::CacheConfig{1, 1, TestFixture::kH, TestFixture::kD, 8});
    KV x = this->input();
    x.k[0] = 1e30f;
    EXPECT_NO_THROW(append_kv(fresh, 0, 0, x)) << "an fp32 cache stores any finite float";
    EXPECT_EQ(dequantize(fresh, 0, 0).k[0], 1e30f);
  }
}

TYPED_TEST(Errors, ShapeMismatchesAreRejected) {
  auto& c = *this->cache_;
  constexpr int H = TestFixture::kH, d = TestFixture::kD;
  const KV x = this->input();
  const KV wide = random_kv(5, H + 1, d, 4), narrow = random_kv(5, H, d / 2, 5), shorter = random_kv(4, H, d, 6);
  KVC_EXPECT_ERROR(c.append(0, 0, wide.kview(0, 5), x.vview(0, 5)), Errc::kInvalidArgument, "keys have shape [5][3][64]");
  KVC_EXPECT_ERROR(c.append(0, 0, narrow.kview(0, 5), x.vview(0, 5)), Errc::kInvalidArgument, "expected [tokens][2][64]");
  KVC_EXPECT_ERROR(c.append(0, 0, x.kview(0, 5), wide.vview(0, 5)), Errc::kInvalidArgument, "values have shape");
  KVC_EXPECT_ERROR(c.append(0, 0, x.kview(0, 5), narrow.vview(0, 5)), Errc::kInvalidArgument, "values have shape");
  KVC_EXPECT_ERROR(c.append(0, 0, x.kview(0, 5), shorter.vview(0, 4)), Errc::kInvalidArgument,
                   "keys hold 5 tokens but values hold 4");
  KVC_EXPECT_ERROR(c.append(0, 0, kvc::KVView{x.k.data(), -1, H, d, H * d, d}, kvc::KVView{x.v.data(), -1, H, d, H * d, d}),
                   Errc::kInvalidArgument, "negative token count");
  KVC_EXPECT_ERROR(c.append(0, 0, kvc::KVView::contiguous(nullptr, 5, H, d), x.vview(0, 5)), Errc::kInvalidArgument,
                   "null");
  EXPECT_TRUE(this->unchanged());
  // zero tokens is a no-op, not an error
  EXPECT_NO_THROW(c.append(0, 0, x.kview(0, 0), x.vview(0, 0)));
  EXPECT_TRUE(this->unchanged());
}

TYPED_TEST(Errors, CapacityIsNeverExceeded) {
  using Cache = TypeParam;
  auto& c = *this->cache_;
  constexpr int cap = TestFixture::kCap, H = TestFixture::kH, d = TestFixture::kD;
  const int room = cap - TestFixture::kLen0;
  // a prefill that would overflow part-way appends nothing
  const KV big = random_kv(room + 3, H, d, 7);
  KVC_EXPECT_ERROR(append_kv(c, 0, 0, big), Errc::kCapacityExceeded, "exceeds the capacity of " + std::to_string(cap));
  KVC_EXPECT_ERROR(append_kv(c, 1, 0, big), Errc::kCapacityExceeded, "layer 1 sequence 0 holding");
  EXPECT_TRUE(this->unchanged());
  // exactly to capacity works, one more token does not
  EXPECT_NO_THROW(append_kv(c, 0, 0, big.prefix(room)));
  EXPECT_EQ(c.length(0, 0), cap);
  const auto full = snapshot(c);
  const KV one = random_kv(1, H, d, 8);
  KVC_EXPECT_ERROR(append_kv(c, 0, 0, one), Errc::kCapacityExceeded, "appending 1 tokens");
  EXPECT_NO_THROW(c.append(0, 0, one.kview(0, 0), one.vview(0, 0)));
  EXPECT_TRUE(same_state(full, snapshot(c)));
  // other streams keep their own room
  EXPECT_NO_THROW(append_kv(c, 0, 1, one));
  Cache tiny(kvc::CacheConfig{1, 1, H, d, 1});
  EXPECT_NO_THROW(append_kv(tiny, 0, 0, one));
  KVC_EXPECT_ERROR(append_kv(tiny, 0, 0, one), Errc::kCapacityExceeded, "capacity of 1 tokens");
}

TYPED_TEST(Errors, LayerAndSequenceOutOfRange) {
  auto& c = *this->cache_;
  const KV x = this->input();
  std::vector<float> k(1 << 16), v(1 << 16);
  for (int layer : {-1, 2}) {
    const std::string msg = "layer " + std::to_string(layer) + " out of range [0, 2)";
    KVC_EXPECT_ERROR(c.append(layer, 0, x.kview(0, 5), x.vview(0, 5)), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR((void)c.length(layer, 0), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR((void)c.quantized_blocks(layer, 0), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR((void)c.params(layer), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR((void)c.stored_bytes(layer), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR(c.dequantize(layer, 0, k.data(), v.data()), Errc::kInvalidArgument, msg);
  }
  for (int seq : {-1, 2}) {
    const std::string msg = "sequence " + std::to_string(seq) + " out of range [0, 2)";
    KVC_EXPECT_ERROR(c.append(0, seq, x.kview(0, 5), x.vview(0, 5)), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR((void)c.length(1, seq), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR(c.dequantize(0, seq, k.data(), v.data()), Errc::kInvalidArgument, msg);
    KVC_EXPECT_ERROR(c.clear(seq), Errc::kInvalidArgument, msg);
  }
  EXPECT_TRUE(this->unchanged());
}

TYPED_TEST(Errors, DecodeAttentionRejectsBadQueries) {
  auto& c = *this->cache_;
  constexpr int H = TestFixture::kH, d = TestFixture::kD, Hq = 2 * H;
  const auto q = random_query(2, Hq, d, 9);
  std::vector<float> out(q.size() * 2, -3.0f);
  const std::vector<float> sentinel = out;
  auto run = [&](kvc::QueryView qv, kvc::OutputView ov) { kvc::decode_attention(c, 0, qv, ov); };
  using QV = kvc::QueryView;
  using OV = kvc::OutputView;
  std::vector<float> q3(3 * Hq * d, 0.5f);
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 0, Hq, d), OV::contiguous(out.data(), 0, Hq, d)),
                   Errc::kInvalidArgument, "query holds 0 sequences; the cache has 2");
  KVC_EXPECT_ERROR(run(QV::contiguous(q3.data(), 3, Hq, d), OV::contiguous(out.data(), 3, Hq, d)),
                   Errc::kInvalidArgument, "query holds 3 sequences");
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 2, Hq, d / 2), OV::contiguous(out.data(), 2, Hq, d / 2)),
                   Errc::kInvalidArgument, "query head_dim 32 != cache head_dim 64");
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 2, 3, d), OV::contiguous(out.data(), 2, 3, d)), Errc::kInvalidArgument,
                   "query heads 3 are not a positive multiple of the cache's 2 KV heads");
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 2, 1, d), OV::contiguous(out.data(), 2, 1, d)), Errc::kInvalidArgument,
                   "query heads 1 are not a positive multiple");
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 2, Hq, d), OV::contiguous(out.data(), 1, Hq, d)),
                   Errc::kInvalidArgument, "output shape [1][4][64] != query shape [2][4][64]");
  KVC_EXPECT_ERROR(run(QV::contiguous(nullptr, 2, Hq, d), OV::contiguous(out.data(), 2, Hq, d)), Errc::kInvalidArgument,
                   "null query or output");
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 2, Hq, d), OV::contiguous(nullptr, 2, Hq, d)), Errc::kInvalidArgument,
                   "null query or output");
  for (float b : {std::numeric_limits<float>::quiet_NaN(), HUGE_VALF, -HUGE_VALF}) {
    auto bad = q;
    bad[(std::size_t(1) * Hq + 3) * d + 5] = b;
    KVC_EXPECT_ERROR(run(QV::contiguous(bad.data(), 2, Hq, d), OV::contiguous(out.data(), 2, Hq, d)), Errc::kNonFinite,
                     "query sequence 1 head 3 channel 5 is not finite");
  }
  EXPECT_TRUE(bytes_equal(out, sentinel)) << "a rejected call wrote its output";
  // an empty sequence
  c.clear(1);
  KVC_EXPECT_ERROR(run(QV::contiguous(q.data(), 2, Hq, d), OV::contiguous(out.data(), 2, Hq, d)), Errc::kInvalidArgument,
                   "sequence 1 is empty");
  EXPECT_TRUE(bytes_equal(out, sentinel));
  // ... which is fine when only sequence 0 is asked for
  EXPECT_NO_THROW(run(QV::contiguous(q.data(), 1, Hq, d), OV::contiguous(out.data(), 1, Hq, d)));
  EXPECT_TRUE(all_finite(std::vector<float>(out.begin(), out.begin() + Hq * d)));
  KVC_EXPECT_ERROR(kvc::decode_attention(c, 2, QV::contiguous(q.data(), 1, Hq, d), OV::contiguous(out.data(), 1, Hq, d)),
                   Errc::kInvalidArgument, "layer 2 out of range");
}

// ------------------------------------------------------------------------------------------------ config
template <class Cache>
void expect_bad_config(kvc::CacheConfig cfg, const std::string& msg) {
  KVC_EXPECT_ERROR(Cache{cfg}, Errc::kInvalidArgument, msg);
}

TEST(CacheConfig, NonPositiveSizesAreRejected) {
  const kvc::CacheConfig good{2, 2, 2, 64, 100};
  EXPECT_NO_THROW(sch::Kivi2{good});
  for (int field = 0; field < 5; ++field)
    for (int bad : {0, -3}) {
      kvc::CacheConfig cfg = good;
      int* f[] = {&cfg.layers, &cfg.batch, &cfg.kv_heads, &cfg.head_dim, &cfg.capacity};
      *f[field] = bad;
      SCOPED_TRACE("field " + std::to_string(field) + " = " + std::to_string(bad));
      expect_bad_config<sch::Kivi2>(cfg, "cache config needs positive layers, batch, kv_heads, head_dim and capacity");
      expect_bad_config<sch::Fp16>(cfg, "needs positive");
    }
  expect_bad_config<sch::Fp16>(kvc::CacheConfig{}, "(got 1, 1, 0, 0, 0)");
}

TEST(CacheConfig, HeadDimMustBeAMultipleOf16) {
  for (int d : {8, 40, 72, 100}) {
    expect_bad_config<sch::Fp16>(kvc::CacheConfig{1, 1, 1, d, 10}, "head_dim " + std::to_string(d) + " is not a multiple of 16");
    expect_bad_config<sch::Int8>(kvc::CacheConfig{1, 1, 1, d, 10}, "is not a multiple of 16");
  }
  EXPECT_NO_THROW(sch::Int8(kvc::CacheConfig{1, 1, 1, 48, 10}));
}

TEST(CacheConfig, QuantizerGroupsMustDivideHeadDim) {
  // KIVI values: per-token groups of 32 channels
  expect_bad_config<sch::Kivi2>(kvc::CacheConfig{1, 1, 1, 48, 200}, "value quantizer groups of 32 channels do not divide head_dim 48");
  EXPECT_NO_THROW(sch::Kivi2(kvc::CacheConfig{1, 1, 1, 96, 200}));
  using Keys64 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 64, kvc::Axis::kToken>>>;
  expect_bad_config<Keys64>(kvc::CacheConfig{1, 1, 1, 96, 200}, "key quantizer groups of 64 channels do not divide head_dim 96");
  EXPECT_NO_THROW(Keys64(kvc::CacheConfig{1, 1, 1, 128, 200}));
}

TEST(ErrorType, IsAnInvalidArgumentWithAPrefixedMessage) {
  try {
    sch::Fp16 c(kvc::CacheConfig{1, 1, 1, 40, 10});
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("kvc: ", 0), 0u) << e.what();
    const auto* k = dynamic_cast<const kvc::Error*>(&e);
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->code(), Errc::kInvalidArgument);
  }
}

}  // namespace
