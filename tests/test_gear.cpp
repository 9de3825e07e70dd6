// GEAR (gear/*.hpp): outlier selection, the power-iteration low-rank fit, the corrected cache's
// reconstruction error and accounting, and the fused attention's epilogues against the oracle on the
// reconstructed cache.
#include "test_util.hpp"

#include <kvc/gear/host_linalg.hpp>

#include <Eigen/Dense>

namespace {

using namespace kvc_test;
using kvc::Axis;
using kvc::GroupQuantizer;
using kvc::LowRankResidual;
using kvc::OutlierFilter;
using kvc::Rank;
using kvc::schemes::KiviWith;

// KIVI-2 backbone, 2 % outliers, rank 2 (keys) / 1 (values): the 2-bit integer kernels plus both epilogues.
using GearKivi2 = KiviWith<2, 64, 64, 0, OutlierFilter<200>, LowRankResidual<Rank<2>, Rank<1>>>;
// The paper's configuration (per-block 4-bit, s = rho = 2 %).
using Gear4 = kvc::schemes::Gear4;
// 32-token blocks, a 64-token window, warm-started power iteration, 32-channel value groups.
using GearWarm = KiviWith<4, 32, 32, 64, OutlierFilter<100>, LowRankResidual<Rank<1>, Rank<1>, 3, kvc::LowRankInit::kWarm>>;
using OutlierQuant4 = kvc::schemes::OutlierQuant4;
using LowRankQuant4 = kvc::schemes::LowRankQuant4;
// Literal mode (Algorithm 1): block-scope outliers, and the paper mode with stream-scope outliers.
using Gear4Literal = kvc::schemes::Gear4Literal;
using Gear4Paper = kvc::schemes::Gear4Paper;
// Paper mode on a KIVI-2 backbone with a window: the 2-bit kernels, the stream outlier tables (2 % of
// keys, 1 % of values), rank 1.
using GearKivi2Paper = KiviWith<2, 32, 32, 64, OutlierFilter<200, kvc::OutlierScope::kStream, 100>,
                                LowRankResidual<Rank<1>>, kvc::LiteralMode>;

// ---------------------------------------------------------------------------------------------- outliers
TEST(OutlierSelect, TopAndBottomBySignedValue) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(1000);
  for (auto& v : x) v = nd(rng);
  x[10] = -50.0f;  // the most negative: a bottom outlier, not a top one (signed selection)
  x[20] = 40.0f;
  const auto idx = kvc::select_outliers(x.data(), x.size(), 7);
  ASSERT_EQ(idx.size(), 14u);
  EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
  std::vector<float> sorted = x;
  std::sort(sorted.begin(), sorted.end());
  const float lo = sorted[6], hi = sorted[sorted.size() - 7];
  int top = 0, bottom = 0;
  for (auto i : idx) {
    if (x[i] >= hi) ++top;
    if (x[i] <= lo) ++bottom;
  }
  EXPECT_EQ(top, 7);
  EXPECT_EQ(bottom, 7);
  EXPECT_NE(std::find(idx.begin(), idx.end(), 10u), idx.end());
  EXPECT_NE(std::find(idx.begin(), idx.end(), 20u), idx.end());
}

TEST(OutlierSelect, TiesBrokenByIndexAndConstantBlocks) {
  // Constant: the k lowest indices are the "largest", the next k the "smallest".
  std::vector<float> c(64, 1.5f);
  EXPECT_EQ(kvc::select_outliers(c.data(), c.size(), 3), (std::vector<std::uint32_t>{0, 1, 2, 3, 4, 5}));
  // Four equal maxima at 5, 9, 30, 40 compete for two top slots: the lower indices win.
  std::vector<float> x(50, 0.0f);
  for (int i : {5, 9, 30, 40}) x[std::size_t(i)] = 2.0f;
  for (int i : {7, 8}) x[std::size_t(i)] = -1.0f;
  EXPECT_EQ(kvc::select_outliers(x.data(), x.size(), 2), (std::vector<std::uint32_t>{5, 7, 8, 9}));
  EXPECT_TRUE(kvc::select_outliers(x.data(), x.size(), 0).empty());
  EXPECT_EQ(OutlierFilter<200>::per_side(64 * 64), 40);  // floor(4096 * 0.02 / 2)
  EXPECT_EQ(OutlierFilter<1>::per_side(64 * 64), 0);     // floor(0.2)
}

TEST(OutlierSelect, InBlockIndexDecodesExactly) {
  // The epilogues split index i = t * d + c with a float product instead of a division: exhaustive.
  for (int d = 16; d <= 1024; d += 16) {
    const float inv = 1.0f / float(d);
    for (int i = 0; i < 65536; ++i) ASSERT_EQ(OutlierFilter<200>::token_of(i, inv), i / d) << "d " << d << " i " << i;
  }
}

// ---------------------------------------------------------------------------------------------- low rank
/// n x d matrix U diag(s) V^T with random orthonormal U, V (column-major).
Eigen::MatrixXf with_spectrum(int n, int d, const std::vector<float>& s, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int k = int(s.size());
  Eigen::MatrixXf gu(n, k), gv(d, k);
  for (int i = 0; i < gu.size(); ++i) gu.data()[i] = nd(rng);
  for (int i = 0; i < gv.size(); ++i) gv.data()[i] = nd(rng);
  const Eigen::MatrixXf u = Eigen::HouseholderQR<Eigen::MatrixXf>(gu).householderQ() * Eigen::MatrixXf::Identity(n, k);
  const Eigen::MatrixXf v = Eigen::HouseholderQR<Eigen::MatrixXf>(gv).householderQ() * Eigen::MatrixXf::Identity(d, k);
  return u * Eigen::Map<const Eigen::VectorXf>(s.data(), k).asDiagonal() * v.transpose();
}

TEST(PowerIteration, MatchesTheSvdTopSubspaceOnAKnownSpectrum) {
  // The rank-r fit's error against the optimal sqrt(sum_{i>r} s_i^2) (Eckart-Young, Eigen's SVD):
  // the excess shrinks like (s_{r+1} / s_r)^(2 iters) from a random start. Orthonormalizing every
  // iteration [default]: spectrum decaying 0.4x per index within 5 % after 3 iterations, 0.7x within
  // 25 %, both within 1 % after 10. Algorithm 2 literally (QR in the last iteration only) agrees at
  // 3 iterations and ranks <= 4; with more (rank 8, or 10 iterations) its fp32 columns collapse onto
  // the top singular vector (measured 1.3-3x above optimal), which is why every-QR is the default.
  // A is orthonormal in every case.
  kvc::HostLinalg la;
  struct Case {
    float decay;
    int iters;
    bool every;
    std::vector<int> ranks;
    double factor;
  };
  const Case cases[] = {{0.4f, 3, true, {1, 2, 4, 8}, 1.05}, {0.7f, 3, true, {1, 2, 4, 8}, 1.25},
                        {0.4f, 10, true, {1, 2, 4, 8}, 1.01}, {0.7f, 10, true, {1, 2, 4, 8}, 1.01},
                        {0.4f, 3, false, {1, 2, 4}, 1.05}, {0.7f, 3, false, {1, 2, 4}, 1.25}};
  for (const Case& cs : cases)
    for (auto [n, d] : {std::pair{64, 64}, std::pair{128, 64}, std::pair{32, 256}}) {
      std::vector<float> s;
      for (int i = 0; i < std::min(n, d); ++i) s.push_back(10.0f * std::pow(cs.decay, float(i)));
      const Eigen::MatrixXf R = with_spectrum(n, d, s, unsigned(n * 7 + d));
      const Eigen::JacobiSVD<Eigen::MatrixXf> svd(R);
      for (int r : cs.ranks) {
        Eigen::MatrixXf A(n, r), B(d, r);
        kvc::power_iteration(la, R.data(), n, d, n, r, cs.iters, cs.every, A.data(), B.data(), false, 42);
        const double err = (R - A * B.transpose()).norm();
        const double opt = svd.singularValues().tail(std::min(n, d) - r).norm();
        EXPECT_LE(err, cs.factor * opt) << n << "x" << d << " rank " << r << " decay " << cs.decay << " iters "
                                        << cs.iters << (cs.every ? " every-QR" : " literal");
        EXPECT_LE((A.transpose() * A - Eigen::MatrixXf::Identity(r, r)).cwiseAbs().maxCoeff(), 1e-4);
      }
    }
}

TEST(PowerIteration, IsAPureFunctionOfTheSeed) {
  kvc::HostLinalg la;
  const Eigen::MatrixXf R = Eigen::MatrixXf::Random(64, 64);
  Eigen::MatrixXf A1(64, 2), B1(64, 2), A2(64, 2), B2(64, 2);
  kvc::power_iteration(la, R.data(), 64, 64, 64, 2, 3, true, A1.data(), B1.data(), false, 7);
  kvc::power_iteration(la, R.data(), 64, 64, 64, 2, 3, true, A2.data(), B2.data(), false, 7);
  EXPECT_EQ(A1, A2);
  EXPECT_EQ(B1, B2);
}

// ---------------------------------------------------------------------------------------------- cache
template <class Cache>
double rel_error(const Filled<Cache>& f, bool keys) {
  double e = 0.0, r = 0.0;
  for (int s = 0; s < f.cfg.batch; ++s) {
    const auto dq = dequantize(*f.cache, 0, s);
    const KV& x = f.data[0][std::size_t(s)];
    const auto& a = keys ? x.k : x.v;
    const auto& b = keys ? dq.k : dq.v;
    for (std::size_t i = 0; i < a.size(); ++i) {
      e += double(a[i] - b[i]) * double(a[i] - b[i]);
      r += double(a[i]) * double(a[i]);
    }
  }
  return std::sqrt(e / r);
}
template <class Cache>
Filled<Cache> kv_like(int d = 64) {
  return make_filled<Cache>(1, 2, d, {512, 256}, 11);  // 12x key outlier channels, per-channel offsets
}

TEST(GearCache, EachCorrectionLowersTheReconstructionError) {
  // Same 4-bit per-block backbone: quant-only > outliers-only > full GEAR, for keys and values.
  using Quant4 = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kTensor>, kvc::BlockTokens<64>>;
  using Outliers2 = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kTensor>, OutlierFilter<200>,
                                           kvc::BlockTokens<64>>;
  const auto q = kv_like<Quant4>();
  const auto o = kv_like<Outliers2>();
  const auto g = kv_like<Gear4>();
  for (bool keys : {true, false}) {
    SCOPED_TRACE(keys ? "keys" : "values");
    EXPECT_LT(rel_error(o, keys), rel_error(q, keys));
    EXPECT_LT(rel_error(g, keys), rel_error(o, keys));
  }
}

TEST(GearCache, ErrorDoesNotGrowWithRankOrOutlierFraction) {
  using R1 = KiviWith<2, 64, 64, 0, LowRankResidual<Rank<1>>>;
  using R2 = KiviWith<2, 64, 64, 0, LowRankResidual<Rank<2>>>;
  using R8 = KiviWith<2, 64, 64, 0, LowRankResidual<Rank<8>>>;
  using S1 = KiviWith<2, 64, 64, 0, OutlierFilter<100>>;
  using S5 = KiviWith<2, 64, 64, 0, OutlierFilter<500>>;
  const double r1 = rel_error(kv_like<R1>(), true), r2 = rel_error(kv_like<R2>(), true), r8 = rel_error(kv_like<R8>(), true);
  EXPECT_LE(r2, r1 * 1.0001);
  EXPECT_LT(r8, r2);
  const double s1 = rel_error(kv_like<S1>(), false), s5 = rel_error(kv_like<S5>(), false);
  EXPECT_LT(s5, s1);
}

TEST(GearCache, BitsPerElementCountEveryByte) {
  // Gear4 at d = 64: 64-token blocks of 4-bit codes (2048 B) + one (lo, step) (4 B), the correction
  // region at 2064: 80 outliers x 4 B + rank max(1, floor(0.02 * 64)) = 1 factors (64 + 64) x 2 B,
  // = 2640 B, padded to 2688.
  using F = Gear4::key_format;
  EXPECT_EQ(F::correction::outliers(64, 64), 80);
  EXPECT_EQ(F::correction::rank(64, 64), 1);
  EXPECT_EQ(F::block_bytes(64), 2688u);
  Gear4 c(kvc::CacheConfig{1, 1, 2, 64, 200});
  const KV x = random_kv(200, 2, 64, 5);
  append_kv(c, 0, 0, x);
  // 3 blocks (192 tokens) per head and side + 8 fp16 tokens.
  EXPECT_EQ(c.stored_bytes(), 2u * 2u * (3u * 2688u + 8u * 64u * 2u));
  EXPECT_EQ(c.decode_read_bytes(0), c.stored_bytes());
  EXPECT_NEAR(c.bits_per_element(), 8.0 * double(c.stored_bytes()) / (200.0 * 2 * 2 * 64), 1e-12);
}

TEST(GearCache, OutlierFractionsArePerSide) {
  // Keys-only outliers: the value blocks are plain KIVI blocks (same bytes, same reconstruction), the
  // key blocks carry floor(64 * 64 * 0.01 / 2) = 20 outliers per side; values-only mirrors it.
  using Plain = KiviWith<3, 64, 64, 0>;
  using KeysOnly = KiviWith<3, 64, 64, 0, OutlierFilter<100, kvc::OutlierScope::kBlock, 0>>;
  using ValuesOnly = KiviWith<3, 64, 64, 0, OutlierFilter<0, kvc::OutlierScope::kBlock, 100>>;
  static_assert(!KeysOnly::value_format::kCorrected && KeysOnly::key_format::kCorrected);
  static_assert(ValuesOnly::value_format::kCorrected && !ValuesOnly::key_format::kCorrected);
  EXPECT_EQ(KeysOnly::key_format::correction::outliers(64, 64), 40);
  EXPECT_EQ(KeysOnly::value_format::block_bytes(64), Plain::value_format::block_bytes(64));
  EXPECT_EQ(ValuesOnly::key_format::block_bytes(64), Plain::key_format::block_bytes(64));
  const auto p = make_filled<Plain>(1, 2, 64, {200}, 5);
  const auto k = make_filled<KeysOnly>(1, 2, 64, {200}, 5);
  const auto v = make_filled<ValuesOnly>(1, 2, 64, {200}, 5);
  const auto dp = dequantize(*p.cache, 0, 0);
  const auto dk = dequantize(*k.cache, 0, 0);
  const auto dv = dequantize(*v.cache, 0, 0);
  EXPECT_TRUE(bytes_equal(dp.v, dk.v));
  EXPECT_TRUE(bytes_equal(dp.k, dv.k));
  EXPECT_LT(rel_error(k, true), rel_error(p, true));
  EXPECT_LT(rel_error(v, false), rel_error(p, false));
  EXPECT_EQ(k.cache->stored_bytes(), v.cache->stored_bytes());  // same bytes, on the other side
  EXPECT_GT(k.cache->stored_bytes(), p.cache->stored_bytes());
}

TEST(GearCache, OutliersAreExactUpToFp16AndTheLowRankPart) {
  // Outlier-only cache: at each stored outlier the reconstruction is x to fp16 rounding of x - x^.
  const auto f = make_filled<OutlierQuant4>(1, 1, 64, {64}, 3);
  const auto dq = dequantize(*f.cache, 0, 0);
  const KV& x = f.data[0][0];
  std::vector<float> block(x.k.begin(), x.k.begin() + 64 * 64);
  const auto idx = kvc::select_outliers(block.data(), block.size(), std::size_t(OutlierFilter<500>::per_side(4096)));
  for (auto i : idx) EXPECT_NEAR(dq.k[i], x.k[i], 1e-3 * std::fabs(x.k[i]) + 1e-3) << i;
}

TEST(GearCache, BadInputAndParametersAreRejected) {
  using TooHighRank = KiviWith<2, 64, 64, 0, LowRankResidual<Rank<65>>>;
  EXPECT_THROW(TooHighRank(kvc::CacheConfig{1, 1, 1, 64, 100}), kvc::Error);
  try {
    TooHighRank(kvc::CacheConfig{1, 1, 1, 64, 100});
  } catch (const kvc::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 65 exceeds"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TooHighRank(kvc::CacheConfig{1, 1, 1, 128, 100}), kvc::Error);  // min(64, 128) = 64 < 65
  using MaxRank = KiviWith<2, 64, 64, 0, LowRankResidual<Rank<64>>>;
  EXPECT_NO_THROW(MaxRank(kvc::CacheConfig{1, 1, 1, 64, 100}));
}

template <class Cache>
void expect_bad_input_leaves_cache_unchanged() {
  auto f = make_filled<Cache>(1, 2, 64, {100}, 9);
  const auto before = snapshot(*f.cache);
  KV bad = random_kv(40, 2, 64, 10);
  bad.v[bad.at(33, 1, 7)] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(f.cache->append(0, 0, bad.kview(0, 40), bad.vview(0, 40)), kvc::Error);
  KV big = random_kv(40, 2, 64, 11);
  big.k[big.at(5, 0, 0)] = 40000.0f;  // above GEAR's input limit (half of fp16's range)
  EXPECT_THROW(f.cache->append(0, 0, big.kview(0, 40), big.vview(0, 40)), kvc::Error);
  EXPECT_TRUE(same_state(before, snapshot(*f.cache)));
}
TEST(GearCache, NonFiniteAndOversizedInputLeaveTheCacheUnchanged) {
  expect_bad_input_leaves_cache_unchanged<GearKivi2>();
  expect_bad_input_leaves_cache_unchanged<GearKivi2Paper>();  // the 40 tokens would complete a block: a flush
}

// ---------------------------------------------------------------------------------------------- literal mode
// A float ring, so a cache fed a reconstruction holds exactly those floats (test below).
template <class O>
using LiteralF32 = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kTensor>, O,
                                          LowRankResidual<kvc::Rho<200>>, kvc::BlockTokens<64>, kvc::LiteralMode,
                                          kvc::FullPrecisionWindow<0, 0, float>>;

TEST(GearLiteral, PrefillIsOneFlushFromExactTokens) {
  // One append = one flush from exact tokens: literal mode stores what block mode stores.
  const auto a = make_filled<Gear4Literal>(1, 2, 64, {300, 130}, 21);
  const auto b = make_filled<Gear4>(1, 2, 64, {300, 130}, 21);
  for (int s = 0; s < 2; ++s) {
    const auto x = dequantize(*a.cache, 0, s);
    const auto y = dequantize(*b.cache, 0, s);
    EXPECT_TRUE(bytes_equal(x.k, y.k) && bytes_equal(x.v, y.v)) << s;
  }
  EXPECT_EQ(a.cache->stored_bytes(), b.cache->stored_bytes());
}

template <class Cache>
void expect_flush_recompresses_the_reconstruction() {
  // Cache A: a 128-token prefill (flush 1), then 64 single-token appends (flush 2 at the last). Flush
  // 2 compresses [reconstruction of blocks 0-1 ; exact block 2] afresh, which is what cache B stores
  // after one append of exactly those rows.
  constexpr int H = 2, d = 64;
  const KV x = random_kv(192, H, d, 31);
  Cache a(kvc::CacheConfig{1, 1, H, d, 192});
  a.append(0, 0, x.kview(0, 128), x.vview(0, 128));
  const auto r1 = dequantize(a, 0, 0);
  for (int t = 128; t < 192; ++t) a.append(0, 0, x.kview(t, 1), x.vview(t, 1));
  KV y = x;
  std::copy(r1.k.begin(), r1.k.end(), y.k.begin());
  std::copy(r1.v.begin(), r1.v.end(), y.v.begin());
  Cache b(kvc::CacheConfig{1, 1, H, d, 192});
  b.append(0, 0, y.kview(0, 192), y.vview(0, 192));
  const auto da = dequantize(a, 0, 0);
  const auto db = dequantize(b, 0, 0);
  EXPECT_TRUE(bytes_equal(da.k, db.k) && bytes_equal(da.v, db.v));
  // ... and flush 2 did change the older blocks (they were compressed again).
  EXPECT_FALSE(std::equal(r1.k.begin(), r1.k.end(), da.k.begin()));
}
TEST(GearLiteral, EachFlushRecompressesTheHistoryFromItsReconstruction) {
  expect_flush_recompresses_the_reconstruction<LiteralF32<OutlierFilter<200>>>();
  expect_flush_recompresses_the_reconstruction<LiteralF32<OutlierFilter<200, kvc::OutlierScope::kStream>>>();
}

TEST(GearLiteral, StreamScopeSelectsOverTheWholeHistory) {
  // Paper mode after one flush of 256 tokens (4 blocks): each head's stored outlier positions are
  // exactly select_outliers over its 256 x 64 keys (values), shared unevenly among the blocks, and
  // at each the reconstruction minus the low-rank part is x up to fp16 rounding.
  constexpr int H = 2, d = 64, T = 256, B = 64;
  kvc_test::GenOptions gen;
  const auto f = make_filled<Gear4Paper>(1, H, d, {T}, 41, gen);
  const KV& x = f.data[0][0];
  const auto p = f.cache->params(0);
  const int per_side = OutlierFilter<200>::per_side(T * d);
  std::vector<float> col(std::size_t(T) * d), blk(std::size_t(B) * d);
  for (int sd = 0; sd < 2; ++sd)
    for (int h = 0; h < H; ++h) {
      const auto side = sd == 0 ? kvc::Side::kKey : kvc::Side::kValue;
      const auto& src = sd == 0 ? x.k : x.v;
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < d; ++c)  // as the fp16 ring held them
          col[std::size_t(t) * d + c] = kvc::half_t::from_float(src[x.at(t, h, c)]).to_float();
      const auto want = kvc::select_outliers(col.data(), col.size(), std::size_t(per_side));
      std::vector<std::uint32_t> got;
      std::vector<int> counts;
      for (int b = 0; b < T / B; ++b) {
        const kvc::OutlierSlice o = p.outliers(side, 0, h, b);
        counts.push_back(o.n);
        for (int i = 0; i < o.n; ++i) {
          got.push_back(std::uint32_t(b * B * d + o.idx[i]));
          const std::byte* region = sd == 0 ? p.key_block(0, h, b) : p.value_block(0, h, b);
          if (sd == 0) Gear4Paper::key_format::decode_backbone(region, d, blk.data());
          else Gear4Paper::value_format::decode_backbone(region, d, blk.data());
          const float xi = col[std::size_t(b * B * d + o.idx[i])];
          EXPECT_NEAR(blk[o.idx[i]] + o.val[i].to_float(), xi, 1e-3 * (std::fabs(xi) + std::fabs(o.val[i].to_float())) + 1e-4);
        }
      }
      EXPECT_EQ(got, want) << "side " << sd << " head " << h;
      EXPECT_NE(*std::min_element(counts.begin(), counts.end()), *std::max_element(counts.begin(), counts.end()));
    }
  // Accounting: blocks without outliers (2064 B backbone region + rank-1 factors 256 B = 2320 -> 2368)
  // plus, per head and side, the table: 2 * 163 entries of 4 B and 5 offsets of 4 B.
  EXPECT_EQ(Gear4Paper::key_format::block_bytes(d), 2368u);
  EXPECT_EQ(f.cache->stored_bytes(), std::size_t(2 * H) * (4 * 2368 + 326 * 4 + 5 * 4));
  EXPECT_EQ(f.cache->decode_read_bytes(0), f.cache->stored_bytes());
}

// ---------------------------------------------------------------------------------------------- attention
template <class Cache>
class GearAttention : public ::testing::Test {};
using GearSchemes = ::testing::Types<GearKivi2, Gear4, GearWarm, OutlierQuant4, LowRankQuant4, Gear4Literal, Gear4Paper,
                                     GearKivi2Paper>;
struct GearNames {
  template <class T>
  static std::string GetName(int i) {
    static const char* const names[] = {"GearKivi2",     "Gear4",        "GearWarm",   "OutlierQuant4",
                                        "LowRankQuant4", "Gear4Literal", "Gear4Paper", "GearKivi2Paper"};
    return names[i];
  }
};
TYPED_TEST_SUITE(GearAttention, GearSchemes, GearNames);

TYPED_TEST(GearAttention, MatchesOracleOnTheReconstructedCache) {
  // Head dims 64/128/256, GQA 1/4/8, ragged batches crossing block and window boundaries, appended
  // in chunks of 50 tokens (literal mode: several flushes). kExact:
  // float rounding only; kFast: the integer dot products' rounding (10 % of max|o|, 5 % rms, as for
  // KIVI in test_attention.cpp) — the epilogues themselves are float in both.
  using Cache = TypeParam;
  struct Shape {
    int d, kv_heads, q_heads;
    std::vector<int> lengths;
  };
  const Shape shapes[] = {{64, 2, 2, {1, 70, 200}}, {128, 2, 8, {129, 64}}, {256, 1, 8, {300}}, {64, 3, 12, {63, 260}}};
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    std::uint64_t seed = 100;
    for (const Shape& sh : shapes) {
      auto f = make_filled<Cache>(1, sh.kv_heads, sh.d, sh.lengths, seed++, {}, 50);
      const int nseq = int(sh.lengths.size());
      const auto q = random_query(nseq, sh.q_heads, sh.d, seed++);
      const auto want = oracle_cache(*f.cache, 0, q, nseq, sh.q_heads);
      double maxv = 0.0;
      for (int s = 0; s < nseq; ++s) maxv = std::max(maxv, max_abs(dequantize(*f.cache, 0, s).v));
      for (auto prec : {kvc::Precision::kExact, kvc::Precision::kFast}) {
        kvc::AttentionOptions opt;
        opt.precision = prec;
        const auto got = fused(*f.cache, 0, q, nseq, sh.q_heads, opt);
        ASSERT_TRUE(all_finite(got));
        const bool exact = prec == kvc::Precision::kExact || !kHasIntDot<Cache>;
        const double tol = exact ? 2e-5 * maxv : 1e-5 * maxv + 0.1 * max_abs(want);
        EXPECT_LE(max_abs_diff(got, want), tol)
            << "d " << sh.d << " heads " << sh.q_heads << "/" << sh.kv_heads << (exact ? " exact" : " fast");
        if (!exact) {
          EXPECT_LE(rms_diff(got, want), 0.05 * rms(want));
        }
      }
    }
  }
}

TYPED_TEST(GearAttention, TheKernelAppliesTheCorrections) {
  // The epilogues are not no-ops: the fused output matches the corrected oracle (above) and is far
  // from attention over the backbone alone (each block decoded without its correction region).
  using Cache = TypeParam;
  using KF = typename Cache::key_format;
  using VF = typename Cache::value_format;
  auto f = make_filled<Cache>(1, 2, 64, {256}, 77);
  const auto q = random_query(1, 4, 64, 78);
  kvc::AttentionOptions opt;
  opt.precision = kvc::Precision::kExact;
  const auto got = fused(*f.cache, 0, q, 1, 4, opt);
  const auto want = oracle_cache(*f.cache, 0, q, 1, 4);
  const auto p = f.cache->params(0);
  const int nb = f.cache->quantized_blocks(0, 0), B = Cache::kBlockTokens, S = Cache::selector::kSink;
  ASSERT_GT(nb, 0);
  auto dq = dequantize(*f.cache, 0, 0);
  std::vector<float> kx(std::size_t(B) * 64), vx(kx.size());
  for (int h = 0; h < 2; ++h)
    for (int b = 0; b < nb; ++b) {
      KF::decode_backbone(p.key_block(0, h, b), 64, kx.data());
      VF::decode_backbone(p.value_block(0, h, b), 64, vx.data());
      for (int t = 0; t < B; ++t)
        for (int c = 0; c < 64; ++c) {
          const std::size_t i = (std::size_t(S + b * B + t) * 2 + h) * 64 + c;
          dq.k[i] = kx[std::size_t(t) * 64 + c];
          dq.v[i] = vx[std::size_t(t) * 64 + c];
        }
    }
  std::vector<float> backbone(q.size());
  kvc::reference::decode_attention(q.data(), 4, dq.k.data(), dq.v.data(), 256, 2, 64, backbone.data(), 0.0);
  const double tol = 2e-5 * max_abs(dequantize(*f.cache, 0, 0).v);
  EXPECT_LE(max_abs_diff(got, want), tol);
  EXPECT_GT(max_abs_diff(got, backbone), 20 * tol);
}
}  // namespace
