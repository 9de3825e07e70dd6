// Cache-level quantizer conformance, typed over every scheme: what dequantize() returns is within
// step/2 of each element's stored group (plus the fp16 rounding of the window the quantizer reads),
// window/sink tokens are exactly the storage rounding, and the stored metadata is exactly the
// codec's metadata of each group's min/max.
#include "test_util.hpp"

namespace {

using namespace kvc_test;

template <class Cache>
class CacheQuant : public ::testing::Test {
 protected:
  static constexpr int kLayers = 2, kH = 2, kD = 64;
  static constexpr int S = Cache::selector::kSink, R = Cache::selector::kRecent, B = Cache::kBlockTokens;
  /// Sequence 0: three quantized blocks plus a partial one beyond the window; sequence 1: one block.
  static std::vector<int> lengths() { return {S + R + 3 * B + 7, S + R + B + 5}; }
  using W = typename Cache::window_t;
};
TYPED_TEST_SUITE(CacheQuant, AllSchemes, SchemeNames);

TYPED_TEST(CacheQuant, ErrorWithinGroupBoundAndWindowExact) {
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  auto f = make_filled<Cache>(TestFixture::kLayers, TestFixture::kH, TestFixture::kD, TestFixture::lengths(), 1);
  for (int l = 0; l < TestFixture::kLayers; ++l)
    for (int s = 0; s < 2; ++s) {
      const KV& x = f.data[l][s];
      ASSERT_EQ(f.cache->length(l, s), x.T);
      ASSERT_EQ(f.cache->quantized_blocks(l, s), s == 0 ? 3 : 1);
      const auto dq = dequantize(*f.cache, l, s);
      const auto info = element_info(*f.cache, l, s);
      const auto bound = error_bounds(*f.cache, l, s, x);
      double worst = 0.0;
      for (std::size_t i = 0; i < x.k.size(); ++i) {
        if (!info.quantized[i]) {
          ASSERT_EQ(dq.k[i], storage_round<W>(x.k[i])) << "full-precision key " << i << " not exact";
          ASSERT_EQ(dq.v[i], storage_round<W>(x.v[i])) << "full-precision value " << i << " not exact";
          continue;
        }
        ASSERT_LE(std::fabs(dq.k[i] - x.k[i]), bound.k[i])
            << "key element " << i << " layer " << l << " seq " << s << " step " << info.k_step[i];
        ASSERT_LE(std::fabs(dq.v[i] - x.v[i]), bound.v[i])
            << "value element " << i << " layer " << l << " seq " << s << " step " << info.v_step[i];
        // against what the quantizer read (the window's rounding): step/2 alone
        const float wk = storage_round<W>(x.k[i]), wv = storage_round<W>(x.v[i]);
        ASSERT_LE(std::fabs(dq.k[i] - wk), bound.k[i] - std::fabs(x.k[i] - wk) + 1e-30f);
        ASSERT_LE(std::fabs(dq.v[i] - wv), bound.v[i] - std::fabs(x.v[i] - wv) + 1e-30f);
        worst = std::max(worst, double(std::fabs(dq.k[i] - x.k[i])));
      }
      if constexpr (!Cache::key_format::kIdentity) {
        EXPECT_GT(worst, 0.0) << "keys were not quantized at all";
      }
    }
}

/// Independent re-implementation of a block's quantization from the quantizer's group semantics.
template <class Cache, class Fmt>
void expect_block_matches_reference(const std::byte* blk, const std::vector<float>& w /*[B][d] window values*/, int d,
                                    const char* side) {
  constexpr int B = Cache::kBlockTokens;
  const std::vector<float> got = [&] {
    std::vector<float> r(std::size_t(B) * d);
    for (int t = 0; t < B; ++t)
      for (int c = 0; c < d; ++c) r[std::size_t(t) * d + c] = Fmt::decode(blk, t, c, d);
    return r;
  }();
  if constexpr (Fmt::kIdentity) {
    using E = typename Fmt::element;
    for (std::size_t i = 0; i < w.size(); ++i) ASSERT_EQ(got[i], storage_round<E>(w[i])) << side << " element " << i;
  } else {
    using Q = typename Fmt::quantizer;
    using C = typename Q::codec;
    const int gt = Q::kGroupTokens == 0 ? B : Q::kGroupTokens;
    const int gc = Q::kGroupChannels == 0 ? d : Q::kGroupChannels;
    std::vector<int> seen(std::size_t(Fmt::groups(d)), 0);
    ASSERT_EQ(Fmt::groups(d), (B / gt) * (d / gc));
    for (int t0 = 0; t0 < B; t0 += gt)
      for (int c0 = 0; c0 < d; c0 += gc) {
        float mn = w[std::size_t(t0) * d + c0], mx = mn;
        for (int t = t0; t < t0 + gt; ++t)
          for (int c = c0; c < c0 + gc; ++c) {
            mn = std::min(mn, w[std::size_t(t) * d + c]);
            mx = std::max(mx, w[std::size_t(t) * d + c]);
          }
        const kvc::QuantMeta m = C::make_meta(mn, mx, Q::kBits);
        const int g = Fmt::group_of(t0, c0, d);
        ASSERT_GE(g, 0);
        ASSERT_LT(g, Fmt::groups(d));
        ++seen[std::size_t(g)];
        ASSERT_EQ(Fmt::lo_plane(blk, d)[g].bits, m.lo.bits) << side << " group (" << t0 << "," << c0 << ") lo";
        ASSERT_EQ(Fmt::step_plane(blk, d)[g].bits, m.step.bits) << side << " group (" << t0 << "," << c0 << ") step";
        const float step = m.step.to_float(), inv = step > 0.0f ? 1.0f / step : 0.0f;
        const kvc::Affine a = C::affine(m);
        for (int t = t0; t < t0 + gt; ++t)
          for (int c = c0; c < c0 + gc; ++c) {
            ASSERT_EQ(Fmt::group_of(t, c, d), g);
            const std::uint8_t code = C::encode(w[std::size_t(t) * d + c], m, inv, Q::kBits);
            const std::uint8_t stored = kvc::packed_code_at(reinterpret_cast<const std::uint8_t*>(blk),
                                                            std::size_t(B) * d, Q::kBits, Fmt::index(t, c, d));
            ASSERT_EQ(stored, code) << side << " code of (" << t << "," << c << ")";
            const float want = a.zero + a.scale * float(code);
            ASSERT_NEAR(got[std::size_t(t) * d + c], want, 2e-7f * (std::fabs(a.zero) + a.scale * float(code)));
          }
      }
    for (int x : seen) ASSERT_EQ(x, 1) << side << ": group_of is not a bijection onto the metadata planes";
  }
}

TYPED_TEST(CacheQuant, BlocksMatchReferenceQuantization) {
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  constexpr int B = Cache::kBlockTokens, S = TestFixture::S, d = TestFixture::kD, H = TestFixture::kH;
  auto f = make_filled<Cache>(1, H, d, {TestFixture::lengths()[0]}, 2);
  const KV& x = f.data[0][0];
  const auto p = f.cache->params(0);
  // Distinct, correctly placed blocks: block k of head h holds tokens S + kB .. (FullPrecisionWindow;
  // AlignedSinkWindow: kB .., block 0's masked rows copies of its first token), as positions() says.
  using Sel = typename Cache::selector;
  const int n = x.T, masked = kvc::detail::masked_rows<Sel>();
  std::vector<int> pos(std::size_t(kvc::detail::stored_rows<Sel>(n, B)));
  Sel::positions(n, B, pos.data());
  std::vector<float> wk(std::size_t(B) * d), wv(std::size_t(B) * d);
  for (int blk = 0; blk < f.cache->quantized_blocks(0, 0); ++blk)
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < B; ++t) {
        const int src = pos[std::size_t(blk * B + (pos[std::size_t(blk * B + t)] < 0 ? masked : t))];
        if (masked == 0) {
          ASSERT_EQ(src, S + blk * B + t);
        }
        for (int c = 0; c < d; ++c) {
          wk[std::size_t(t) * d + c] = storage_round<W>(x.k[x.at(src, h, c)]);
          wv[std::size_t(t) * d + c] = storage_round<W>(x.v[x.at(src, h, c)]);
        }
      }
      SCOPED_TRACE("block " + std::to_string(blk) + " head " + std::to_string(h));
      expect_block_matches_reference<Cache, typename Cache::key_format>(p.key_block(0, h, blk), wk, d, "key");
      expect_block_matches_reference<Cache, typename Cache::value_format>(p.value_block(0, h, blk), wv, d, "value");
    }
}

TYPED_TEST(CacheQuant, ConstantInputsReconstructExactly) {
  using Cache = TypeParam;
  const int n = TestFixture::lengths()[0], H = TestFixture::kH, d = TestFixture::kD;
  for (float v : {0.0f, 3.0f, -1.5f, 1000.0f}) {
    Cache c(kvc::CacheConfig{1, 1, H, d, n});
    KV x(n, H, d);
    std::fill(x.k.begin(), x.k.end(), v);
    std::fill(x.v.begin(), x.v.end(), -v);
    append_kv(c, 0, 0, x);
    ASSERT_GT(c.quantized_blocks(0, 0), 0);
    const auto dq = dequantize(c, 0, 0);
    for (std::size_t i = 0; i < dq.k.size(); ++i) {
      ASSERT_EQ(dq.k[i], v) << "constant key " << v << " element " << i;
      ASSERT_EQ(dq.v[i], -v) << "constant value " << -v << " element " << i;
    }
  }
}

TYPED_TEST(CacheQuant, ZeroRangeGroupsAmongOthersAreExact) {
  // Keys constant along tokens (zero-range per-channel groups), values constant along channels
  // (zero-range per-token groups); whichever groups end up with range 0 must be exact.
  using Cache = TypeParam;
  using W = typename TestFixture::W;
  const int n = TestFixture::lengths()[0], H = TestFixture::kH, d = TestFixture::kD;
  Cache c(kvc::CacheConfig{1, 1, H, d, n});
  KV x(n, H, d);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      for (int cc = 0; cc < d; ++cc) {
        x.k[x.at(t, h, cc)] = 0.37f * float(cc - 20) + float(h);
        x.v[x.at(t, h, cc)] = 0.011f * float(t) - 0.5f * float(h);
      }
  append_kv(c, 0, 0, x);
  const auto dq = dequantize(c, 0, 0);
  const auto info = element_info(c, 0, 0);
  const auto bound = error_bounds(c, 0, 0, x);
  std::size_t exact_k = 0, exact_v = 0;
  for (std::size_t i = 0; i < dq.k.size(); ++i) {
    ASSERT_LE(std::fabs(dq.k[i] - x.k[i]), bound.k[i]);
    ASSERT_LE(std::fabs(dq.v[i] - x.v[i]), bound.v[i]);
    if (info.quantized[i] && info.k_step[i] == 0.0f) {
      ASSERT_EQ(dq.k[i], storage_round<W>(x.k[i]));
      ++exact_k;
    }
    if (info.quantized[i] && info.v_step[i] == 0.0f) {
      ASSERT_EQ(dq.v[i], storage_round<W>(x.v[i]));
      ++exact_v;
    }
  }
  if constexpr (!Cache::key_format::kIdentity && Cache::key_format::kGroupTokens > 1 &&
                Cache::key_quantizer::kGroupChannels == 1) {
    EXPECT_GT(exact_k, 0u) << "per-channel key groups of a token-constant input have range 0";
  }
  if constexpr (!Cache::value_format::kIdentity && Cache::value_format::kPerTokenScale) {
    EXPECT_GT(exact_v, 0u) << "per-token value groups of a channel-constant input have range 0";
  }
}

TYPED_TEST(CacheQuant, ExtremeMagnitudesStayFiniteAndBounded) {
  using Cache = TypeParam;
  const int n = TestFixture::lengths()[0], H = TestFixture::kH, d = TestFixture::kD;
  const float lim = std::min(Cache::input_limit(), 65504.0f);
  Cache c(kvc::CacheConfig{1, 1, H, d, n});
  KV x(n, H, d);
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < x.k.size(); ++i) {
    const int r = int(rng() % 4);
    x.k[i] = r == 0 ? lim : r == 1 ? -lim : lim * u(rng);
    x.v[i] = r == 2 ? lim : r == 3 ? -lim : lim * u(rng);
  }
  ASSERT_NO_THROW(append_kv(c, 0, 0, x));
  const auto dq = dequantize(c, 0, 0);
  const auto bound = error_bounds(c, 0, 0, x);
  ASSERT_TRUE(all_finite(dq.k) && all_finite(dq.v));
  for (std::size_t i = 0; i < dq.k.size(); ++i) {
    ASSERT_LE(std::fabs(dq.k[i] - x.k[i]), bound.k[i]) << i;
    ASSERT_LE(std::fabs(dq.v[i] - x.v[i]), bound.v[i]) << i;
  }
}

TYPED_TEST(CacheQuant, StoredBytesAndBitsPerElementFollowTheFormula) {
  using Cache = TypeParam;
  using KF = typename Cache::key_format;
  using VF = typename Cache::value_format;
  using W = typename TestFixture::W;
  constexpr int B = Cache::kBlockTokens, H = TestFixture::kH, d = TestFixture::kD;
  // Block sizes: codes (n*bits/8, or raw elements) plus fp16 lo and step per group, padded to 64.
  for (auto* fmt_name : {"key", "value"}) {
    const bool key = std::string(fmt_name) == "key";
    const std::size_t code = key ? KF::code_bytes(d) : VF::code_bytes(d);
    const int groups = key ? KF::groups(d) : VF::groups(d);
    const bool identity = key ? KF::kIdentity : VF::kIdentity;
    const int bits = key ? KF::kBits : VF::kBits;
    EXPECT_EQ(code, identity ? std::size_t(B) * d * (bits / 8) : std::size_t(B) * d * bits / 8) << fmt_name;
    const std::size_t bb = key ? KF::block_bytes(d) : VF::block_bytes(d);
    EXPECT_EQ(bb % 64, 0u);
    EXPECT_GE(bb, code + 4u * groups);
    EXPECT_LT(bb, code + 4u * groups + 64u);
  }
  auto f = make_filled<Cache>(2, H, d, TestFixture::lengths(), 3);
  auto& c = *f.cache;
  // grow layer 1 / sequence 1 a bit more so layers differ
  const KV extra = random_kv(B + 3, H, d, 77);
  Cache big(kvc::CacheConfig{2, 2, H, d, TestFixture::lengths()[0] + B + 3});
  for (int l = 0; l < 2; ++l)
    for (int s = 0; s < 2; ++s) append_kv(big, l, s, f.data[l][s]);
  append_kv(big, 1, 1, extra);
  for (const Cache* cache : {&c, &big}) {
    std::size_t total = 0, elements = 0;
    for (int l = 0; l < 2; ++l) {
      std::size_t layer = 0;
      for (int s = 0; s < 2; ++s) {
        const int n = cache->length(l, s), nb = cache->quantized_blocks(l, s);
        EXPECT_EQ(nb, Cache::selector::quantized_blocks(n, B));
        layer += std::size_t(H) * (std::size_t(nb) * (KF::block_bytes(d) + VF::block_bytes(d)) +
                                   std::size_t(kvc::detail::fp_tokens<typename Cache::selector>(n, B)) * 2 * d * sizeof(W));
        elements += std::size_t(n) * 2 * H * d;
      }
      EXPECT_EQ(cache->stored_bytes(l), layer) << "layer " << l;
      EXPECT_EQ(cache->decode_read_bytes(l), layer);
      total += layer;
    }
    EXPECT_EQ(cache->stored_bytes(), total);
    EXPECT_EQ(cache->elements(), elements);
    EXPECT_DOUBLE_EQ(cache->bits_per_element(), 8.0 * double(total) / double(elements));
    EXPECT_GE(cache->allocated_bytes(), cache->stored_bytes());
  }
  EXPECT_NE(c.stored_bytes(1), big.stored_bytes(1));
  Cache empty(kvc::CacheConfig{1, 1, H, d, 10});
  EXPECT_EQ(empty.bits_per_element(), 0.0);
  EXPECT_EQ(empty.stored_bytes(), 0u);
}

// ------------------------------------------------------------------------------------------------ fixed numbers
TEST(CacheFootprint, Kivi2HandComputed) {
  // head_dim 128, group 32: a key block holds 32x128 2-bit codes (1024 B) + 128 channel groups x 4 B
  // (512 B) = 1536 B; a value block 1024 B + 32 tokens x 4 groups x 4 B = 1536 B. After 192 tokens:
  // 2 blocks quantized, 128 tokens in the fp16 window (128 x 2 x 128 x 2 B = 65536 B) per head.
  using C = kvc_test::sch::Kivi2;
  EXPECT_EQ(C::key_format::block_bytes(128), 1536u);
  EXPECT_EQ(C::value_format::block_bytes(128), 1536u);
  C c(kvc::CacheConfig{1, 1, 2, 128, 4096});
  kvc_test::append_kv(c, 0, 0, kvc_test::random_kv(192, 2, 128, 5));
  EXPECT_EQ(c.quantized_blocks(0, 0), 2);
  EXPECT_EQ(c.stored_bytes(), 2u * (2u * 3072u + 65536u));
  // long sequences approach 2 bits + 1 bit of metadata per element
  C l(kvc::CacheConfig{1, 1, 1, 128, 4096});
  kvc_test::append_kv(l, 0, 0, kvc_test::random_kv(128 + 32 * 100, 1, 128, 6));
  EXPECT_NEAR(l.bits_per_element(), 3.0 + (128.0 * 16.0 - 3.0 * 128.0) / (128.0 + 3200.0), 1e-9);
}

TEST(CacheBf16, StoresTheBf16RoundingOfTheInput) {
  // NoQuantizer: "stores elements as T ... exact up to T's rounding". A bf16 cache must keep bf16's
  // range and round once (to bf16), in its full-precision tail as in its blocks.
  using C = kvc::CompressedKVCache<kvc::NoQuantizer<kvc::bfloat16_t>>;
  constexpr int T = 40, d = 16;  // one 32-token block plus an 8-token tail
  kvc_test::KV x(T, 1, d);
  for (std::size_t i = 0; i < x.k.size(); ++i) {
    const float mag = i % 3 == 0 ? 1e-6f : (i % 3 == 1 ? 1.2345f : 1e5f);
    x.k[i] = mag * (1.0f + 1e-3f * float(i));
    x.v[i] = -x.k[i];
  }
  C c(kvc::CacheConfig{1, 1, 1, d, T});
  ASSERT_NO_THROW(kvc_test::append_kv(c, 0, 0, x)) << "1e5 is well inside bf16's range";
  ASSERT_EQ(c.quantized_blocks(0, 0), 1);
  const auto dq = kvc_test::dequantize(c, 0, 0);
  for (std::size_t i = 0; i < x.k.size(); ++i) {
    ASSERT_EQ(dq.k[i], kvc_test::storage_round<kvc::bfloat16_t>(x.k[i])) << "element " << i << " x " << x.k[i];
    ASSERT_EQ(dq.v[i], kvc_test::storage_round<kvc::bfloat16_t>(x.v[i])) << "element " << i;
  }
}

TEST(CacheFootprint, InputLimits) {
  EXPECT_EQ(kvc_test::sch::Fp16::input_limit(), 65504.0f);
  EXPECT_EQ(kvc_test::sch::Kivi2::input_limit(), 65504.0f);
  EXPECT_EQ(kvc_test::sch::Kivi1::input_limit(), 32752.0f) << "1-bit endpoint steps span the whole range";
  EXPECT_EQ(kvc_test::sch::Fp32::input_limit(), std::numeric_limits<float>::max());
  EXPECT_EQ(kvc_test::sch::Mixed56::input_limit(), 65504.0f) << "quantized sides keep fp16 metadata";
}

}  // namespace
