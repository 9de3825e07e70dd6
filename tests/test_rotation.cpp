// Rotation (rotate/*.hpp): the transforms are orthonormal with exact inverses for every head dim the cache
// accepts; a rotated fp32 cache attends like an unrotated one; rotated quantized caches (every quantizer
// family, windows, LogQuant's selector, GEAR's corrections, GQA, ragged batches) match the oracle on their
// reconstruction, which comes back in the original basis; rotation lowers the quantization error of
// per-token grids on keys with outlier channels; bad input is rejected with the cache unchanged.
#include "test_util.hpp"

#include <kvc/rotate/rotation.hpp>

namespace {

using namespace kvc_test;
using kvc::Axis;
using kvc::GroupQuantizer;
using kvc::Hadamard;
using kvc::Rotation;

using Rot = Rotation<Hadamard<>>;
using RotFp32 = kvc::CompressedKVCache<kvc::NoQuantizer<float>, Rot>;
/// Per-token 4-bit uniform (the grid rotation helps most), 16-token window.
using RotInt4 = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kToken>, kvc::FullPrecisionWindow<16>, Rot>;
/// KIVI-2 with 16-channel value groups (head dims 80/112), rotation first in the pack.
using RotKivi2 = kvc::CompressedKVCache<Rot, kvc::keys<GroupQuantizer<2, 32, Axis::kChannel>>,
                                        kvc::values<GroupQuantizer<2, 16, Axis::kToken>>, kvc::FullPrecisionWindow<32, 4>>;
/// LogQuant's selector with GEAR's corrections, keys rotated only.
using RotKeysLogGear = kvc::CompressedKVCache<kvc::keys<GroupQuantizer<3, 32, Axis::kChannel>>,
                                              kvc::values<GroupQuantizer<3, 16, Axis::kToken>>, kvc::LogWindow<5>,
                                              kvc::OutlierFilter<100>, kvc::LowRankResidual<kvc::Rank<1>>,
                                              kvc::RotateKeys<Hadamard<7>>>;
/// Values rotated only, 8-bit per-token (float-FMA path).
using RotValues8 = kvc::CompressedKVCache<kvc::UniformQuantizer<8, kvc::Scope::kToken>, kvc::RotateValues<Hadamard<>>>;

/// R as a dense matrix, column j = R e_j.
template <class T>
std::vector<double> dense(const std::uint32_t* table, int d, bool transpose = false) {
  std::vector<double> m(std::size_t(d) * d);
  std::vector<float> x(static_cast<std::size_t>(d));
  for (int j = 0; j < d; ++j) {
    std::fill(x.begin(), x.end(), 0.0f);
    x[std::size_t(j)] = 1.0f;
    if (transpose) T::apply_transpose(table, d, x.data());
    else T::apply(table, d, x.data());
    for (int i = 0; i < d; ++i) m[std::size_t(i) * d + j] = x[std::size_t(i)];
  }
  return m;
}

const int kHeadDims[] = {16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 1008};

TEST(Hadamard, OrthonormalWithExactInverseAndFullMixing) {
  using H = Hadamard<>;
  for (int d : kHeadDims) {
    SCOPED_TRACE("head dim " + std::to_string(d));
    ASSERT_TRUE(H::supports(d));
    std::vector<std::uint32_t> t(H::table_words(d));
    H::make_table(d, 12345, t.data());
    const auto r = dense<H>(t.data(), d), rt = dense<H>(t.data(), d, true);
    double worst = 0.0, smallest = 1.0;
    const int every = d > 256 ? 9 : 1;  // d = 1008: a ninth of the columns of R^T R (the O(d^3) check under ASan)
    for (int i = 0; i < d; i += every)
      for (int j = 0; j < d; ++j) {
        double dot = 0.0;  // (R^T R)_ij
        for (int k = 0; k < d; ++k) dot += r[std::size_t(k) * d + i] * r[std::size_t(k) * d + j];
        worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
        // apply_transpose is R^T.
        ASSERT_NEAR(rt[std::size_t(i) * d + j], r[std::size_t(j) * d + i], 1e-6);
        smallest = std::min(smallest, std::fabs(r[std::size_t(i) * d + j]));
      }
    EXPECT_LE(worst, 8 * std::log2(double(d)) * 1.2e-7) << "R^T R != I to fp32 rounding";
    // Every output channel depends on every input channel (the Hartley matrix mixes the power-of-two blocks).
    if (d != 1008) {
      EXPECT_GT(smallest, 0.1 / std::sqrt(double(d)));
    }
    // Round trip: exact to rounding.
    std::mt19937 rng(static_cast<unsigned>(d));
    std::normal_distribution<float> nd;
    std::vector<float> x(static_cast<std::size_t>(d)), y;
    for (auto& e : x) e = 100.0f * nd(rng);
    y = x;
    H::apply(t.data(), d, y.data());
    double n2x = 0.0, n2y = 0.0;
    for (int c = 0; c < d; ++c) n2x += double(x[c]) * x[c], n2y += double(y[c]) * y[c];
    EXPECT_NEAR(std::sqrt(n2y), std::sqrt(n2x), 1e-6 * std::sqrt(n2x) * std::log2(double(d)));
    H::apply_transpose(t.data(), d, y.data());
    EXPECT_LE(max_abs_diff(x, y), 4e-7 * std::log2(double(d)) * max_abs(x));
  }
  EXPECT_FALSE(H::supports(16 * 65));  // m = 65 blocks of 16 is beyond kMaxBlocks
}

TEST(Hadamard, TablesAreSeededPerStreamAndReproducible) {
  const int d = 64;
  std::vector<std::uint32_t> a(Rot::head_words(d) * 6), b(a.size());
  Rot::make_tables(2, 3, d, a.data());
  Rot::make_tables(2, 3, d, b.data());
  EXPECT_EQ(a, b);
  // Every (layer, head, side) has its own signs.
  for (std::size_t i = 0; i < 12; ++i)
    for (std::size_t j = i + 1; j < 12; ++j) EXPECT_NE(std::vector<std::uint32_t>(a.begin() + 2 * i, a.begin() + 2 * i + 2),
                                                       std::vector<std::uint32_t>(a.begin() + 2 * j, a.begin() + 2 * j + 2));
  std::vector<std::uint32_t> c(Rotation<Hadamard<1>>::head_words(d) * 6);
  Rotation<Hadamard<1>>::make_tables(2, 3, d, c.data());
  EXPECT_NE(a, c) << "another seed, other signs";
}

TEST(Rotation, Fp32CacheAttendsLikeTheUnrotatedOne) {
  for (int d : {16, 48, 64, 80, 96, 112, 128, 256})
    for (int g : {1, 4}) {
      SCOPED_TRACE("head dim " + std::to_string(d) + ", GQA " + std::to_string(g));
      const std::vector<int> lengths = {1, 31, 33, 70};
      const int H = 2, Hq = H * g, nseq = int(lengths.size());
      auto plain = make_filled<kvc::schemes::Fp32>(2, H, d, lengths, 11);
      auto rot = make_filled<RotFp32>(2, H, d, lengths, 11);
      const auto q = random_query(nseq, Hq, d, 12);
      // dequantize() gives back the original rows, to rounding.
      for (int s = 0; s < nseq; ++s) {
        const auto x = dequantize(*rot.cache, 1, s);
        const auto y = dequantize(*plain.cache, 1, s);
        ASSERT_LE(max_abs_diff(x.k, y.k), 2e-6 * max_abs(y.k) * std::log2(double(d)));
        ASSERT_LE(max_abs_diff(x.v, y.v), 2e-6 * max_abs(y.v) * std::log2(double(d)));
      }
      const auto want = fused(*plain.cache, 1, q, nseq, Hq);
      KVC_FOR_EACH_ISA(isa) {
        SCOPED_TRACE(kvc::isa_name(isa));
        EXPECT_LE(max_abs_diff(fused(*rot.cache, 1, q, nseq, Hq), want), 1e-5 * max_abs(want));
      }
      // The layer's tables are counted: 2 sides x H heads x d sign bits.
      EXPECT_EQ(rot.cache->stored_bytes(1), plain.cache->stored_bytes(1) + std::size_t(H) * Rot::head_words(d) * 4);
    }
}

template <class Cache>
class RotatedCache : public ::testing::Test {};
using RotatedSchemes = ::testing::Types<RotInt4, RotKivi2, RotKeysLogGear, RotValues8>;
struct RotatedNames {
  template <class T>
  static std::string GetName(int) {
    if (std::is_same_v<T, RotInt4>) return "RotInt4";
    if (std::is_same_v<T, RotKivi2>) return "RotKivi2";
    if (std::is_same_v<T, RotKeysLogGear>) return "RotKeysLogGear";
    return "RotValues8";
  }
};
TYPED_TEST_SUITE(RotatedCache, RotatedSchemes, RotatedNames);

TYPED_TEST(RotatedCache, AttentionMatchesOracleOnTheReconstructedCache) {
  using Cache = TypeParam;
  std::uint64_t seed = 900;
  for (int d : {64, 80, 112, 128})
    for (int g : {1, 3}) {
      SCOPED_TRACE("head dim " + std::to_string(d) + ", GQA " + std::to_string(g));
      // Ragged: empty-block, one-block, block-boundary and window-boundary lengths.
      const std::vector<int> lengths = {1, 16, 17, 32, 33, 63, 64, 65, 131};
      const int nseq = int(lengths.size()), H = 2, Hq = H * g;
      GenOptions gen;
      gen.outlier_scale = 6.0f;
      auto f = make_filled<Cache>(1, H, d, lengths, seed++, gen, 7);
      const auto q = random_query(nseq, Hq, d, seed++);
      expect_fused_matches_oracle(*f.cache, 0, q, nseq, Hq, 2e-5);
    }
}

TYPED_TEST(RotatedCache, ReconstructionIsInTheOriginalBasis) {
  using Cache = TypeParam;
  const int d = 64, H = 2, T = 150;
  auto f = make_filled<Cache>(1, H, d, {T}, 31);
  const auto x = dequantize(*f.cache, 0, 0);
  const KV& in = f.data[0][0];
  // Quantization error (up to ~0.35 of the rows' rms at 2 bits) stays well below a basis mismatch (~1.4).
  EXPECT_LE(rms_diff(x.k, in.k), 0.4 * rms(in.k));
  EXPECT_LE(rms_diff(x.v, in.v), 0.4 * rms(in.v));
  EXPECT_GT(f.cache->bits_per_element(), 0.0);
}

TYPED_TEST(RotatedCache, BadInputLeavesTheCacheUnchanged) {
  using Cache = TypeParam;
  const int d = 64, H = 2, T = 80;
  KV x = random_kv(T, H, d, 41);
  Cache c(kvc::CacheConfig{1, 1, H, d, T});
  c.append(0, 0, x.kview(0, 40), x.vview(0, 40));
  const auto before = snapshot(c);
  KV bad = x;
  bad.k[bad.at(45, 1, 5)] = std::nanf("");
  KVC_EXPECT_ERROR(c.append(0, 0, bad.kview(40, 10), bad.vview(40, 10)), kvc::Errc::kNonFinite, "key token 5 head 1 channel 5");
  EXPECT_TRUE(same_state(before, snapshot(c)));
  // A row within fp16's range whose rotation is not: R^T (1e5 e_3) has entries 1e5 / sqrt(64) = 12500.
  bad = x;
  constexpr bool keys = Cache::rotation::kKeys;
  std::vector<float> row(static_cast<std::size_t>(d), 0.0f);
  row[3] = 1e5f;
  Cache::rotation::unrotate(keys, c.params(0).rotation, 0, d, row.data());
  std::copy(row.begin(), row.end(), (keys ? bad.k : bad.v).begin() + std::ptrdiff_t(bad.at(42, 0, 0)));
  EXPECT_LE(max_abs(row), 12501.0);
  KVC_EXPECT_ERROR(c.append(0, 0, bad.kview(40, 10), bad.vview(40, 10)), kvc::Errc::kOutOfRange,
                   std::string(keys ? "key" : "value") + " token 2 head 0 rotated channel 3");
  EXPECT_TRUE(same_state(before, snapshot(c)));
  // An unsupported head dim: 16 x 65.
  KVC_EXPECT_ERROR(Cache(kvc::CacheConfig{1, 1, 1, 16 * 65, 8}), kvc::Errc::kInvalidArgument, "rotation");
  c.append(0, 0, x.kview(40, 40), x.vview(40, 40));  // still usable
  EXPECT_EQ(c.length(0, 0), T);
}

/// The reason for the policy: per-token 4-bit keys with outlier channels lose far less with rotation.
TEST(Rotation, LowersPerTokenQuantizationErrorOnOutlierChannels) {
  using Plain = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kToken>, kvc::FullPrecisionWindow<16>>;
  GenOptions gen;
  gen.outlier_channels = 4;
  gen.outlier_scale = 20.0f;
  auto plain = make_filled<Plain>(1, 2, 128, {512}, 5, gen);
  auto rot = make_filled<RotInt4>(1, 2, 128, {512}, 5, gen);
  const KV& in = plain.data[0][0];
  const double e_plain = rms_diff(dequantize(*plain.cache, 0, 0).k, in.k);
  const double e_rot = rms_diff(dequantize(*rot.cache, 0, 0).k, in.k);
  EXPECT_LT(e_rot, 0.5 * e_plain) << "plain " << e_plain << ", rotated " << e_rot;
  // Same grid: the bits differ only by the tables (2 x 2 heads x 4 words).
  EXPECT_EQ(rot.cache->stored_bytes(), plain.cache->stored_bytes() + 2 * Rot::head_words(128) * 4);
}

}  // namespace
