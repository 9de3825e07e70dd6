// AlignedKV on the GPU (kvc::cuda::DeviceAlignedCache): upload() copies the host cache's bytes exactly; the device
// attention matches the CPU kernel's computation on the same cache (tiers forced to 16: to float summation order,
// with equal read statistics; the default rules: up to what a probability at a value tier's threshold may move,
// with equal key statistics); bad input throws and changes nothing.
// The CPU kernel itself (kvc/aligned/decode_attention.hpp) does not compile under nvcc (its SIMD layer), so the
// expectation is a scalar oracle here with the CPU kernel's structure and the same AlignedLoader rules: key tiers
// (Rule 1), float probabilities, Rule 2 through estimate_reference and value_tier, the truncated cache in double.
#include "cuda_test_util.cuh"

#include <kvc/aligned/aligned_cache.hpp>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/cuda/aligned/decode_attention.cuh>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using Default = kvc::AlignedLoader<>;
using Sixteen = kvc::AlignedLoader<99, 99, 99, 99>;  // every element read whole (but exactly-zero addends)
template <class L>
using Host = kvc::CompressedKVCache<L>;
template <class L>
using Dev = kvc::cuda::DeviceAlignedCache<L>;

// Ragged lengths: full blocks plus staging, a block exactly, staging only, one token.
const std::vector<int> kLengths = {300, 129, 64, 5, 1};
constexpr int kCap = 300, kH = 2;

template <class L>
Host<L> make_host(const kvc_test::KV& x, const std::vector<int>& len) {
  Host<L> c(kvc::CacheConfig{1, int(len.size()), x.H, x.d, kCap});
  for (int s = 0; s < int(len.size()); ++s) c.append(0, s, x.kview(0, len[std::size_t(s)]), x.vview(0, len[std::size_t(s)]));
  return c;
}

// K/V with channels of very different magnitude (all three key tiers occur).
kvc_test::KV outlier_kv(int d, std::uint64_t seed) {
  kvc_test::GenOptions gen;
  gen.outlier_channels = 6;
  gen.outlier_scale = 60.0f;
  return kvc_test::random_kv(kCap, kH, d, seed, gen);
}

// A query with every fifth channel small (lower key tiers), scaled (peaked attention: all value tiers).
std::vector<float> tiered_query(int nseq, int Hq, int d, std::uint64_t seed, float scale) {
  auto q = kvc_test::random_query(nseq, Hq, d, seed, scale);
  for (std::size_t i = 0; i < q.size(); i += 5) q[i] *= 1e-3f;
  return q;
}

std::vector<std::uint16_t> bits(const std::vector<kvc::half_t>& h) {
  std::vector<std::uint16_t> b(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) b[i] = h[i].bits;
  return b;
}

template <class L>
void expect_same_streams(const Host<L>& host, const Dev<L>& dev) {
  const auto& cfg = host.config();
  for (int s = 0; s < cfg.batch; ++s) {
    ASSERT_EQ(dev.length(0, s), host.length(0, s));
    for (int h = 0; h < cfg.kv_heads; ++h) {
      const auto& a = host.stream(0, s, h);
      const auto b = dev.stream(0, s, h);
      const std::string at = "seq " + std::to_string(s) + " head " + std::to_string(h);
      EXPECT_TRUE(a.khi == b.khi && a.kmid == b.kmid && a.klo == b.klo) << at << ": key planes";
      EXPECT_TRUE(a.vhi == b.vhi && a.vmid == b.vmid && a.vlo == b.vlo) << at << ": value planes";
      EXPECT_TRUE(bits(a.kst) == bits(b.kst) && bits(a.vst) == bits(b.vst)) << at << ": staging";
      EXPECT_TRUE(a.kmax == b.kmax && a.vmax == b.vmax) << at << ": Kmax / Vmax";
    }
  }
}

// The CPU kernel's computation (aligned/detail/attention_kernel.hpp) in scalar code, over the host cache: per stream
// the key tiers, the scores over the truncated keys (staged keys whole) and the softmax in double, the probabilities
// as floats (what the tiers are decided on), Rule 2's references and the row tiers from the policy's functions, the
// output over the truncated values in double; st: what the CPU kernel counts.
template <class L>
std::vector<float> host_attend(const Host<L>& c, const std::vector<float>& q, int nseq, int Hq, kvc::aligned::ReadStats* st) {
  const auto& cfg = c.config();
  const int d = cfg.head_dim, H = cfg.kv_heads, g = Hq / H, B = L::kBlock;
  const double scale = 1.0 / std::sqrt(double(d));
  auto f = [](std::uint16_t b) { return double(kvc::detail::half_bits_to_float(b)); };
  std::vector<float> out(q.size());
  kvc::aligned::ReadStats r;
  for (int s = 0; s < nseq; ++s)
    for (int kh = 0; kh < H; ++kh) {
      const auto& sm = c.stream(0, s, kh);
      const int T = c.length(0, s), full = T / B * B;
      const std::size_t Tz = std::size_t(T), dz = std::size_t(d);
      const float* qg = q.data() + (std::size_t(s) * Hq + std::size_t(kh) * g) * dz;
      std::vector<std::uint8_t> kt(dz);
      L::key_tiers(qg, g, d, sm.kmax.data(), kt.data());
      std::vector<std::uint16_t> kb(Tz * dz), vb(Tz * dz);
      for (int t = 0; t < T; ++t) {
        c.row_bits(sm, 0, t, kb.data() + std::size_t(t) * dz);
        c.row_bits(sm, 1, t, vb.data() + std::size_t(t) * dz);
      }
      std::vector<float> p(std::size_t(g) * Tz);
      for (int h = 0; h < g; ++h) {
        std::vector<double> e(Tz);
        double m = -1e300, sum = 0.0;
        for (int t = 0; t < T; ++t) {
          double a = 0.0;
          for (int ch = 0; ch < d; ++ch) {
            const std::uint16_t k = kb[std::size_t(t) * dz + std::size_t(ch)];
            a += double(qg[std::size_t(h) * dz + std::size_t(ch)]) * f(t < full ? kvc::aligned::truncate(k, kt[std::size_t(ch)]) : k);
          }
          e[std::size_t(t)] = a * scale;
          m = std::max(m, e[std::size_t(t)]);
        }
        for (double& x : e) sum += (x = std::exp(x - m));
        for (int t = 0; t < T; ++t) p[std::size_t(h) * Tz + std::size_t(t)] = float(e[std::size_t(t)] / sum);
      }
      std::vector<int> ref(static_cast<std::size_t>(g));
      std::vector<float> est(dz);
      for (int h = 0; h < g; ++h) {  // AlignedLoader::estimate_reference, spelled out (no host lambda in a host+device call)
        const float* ph = p.data() + std::size_t(h) * Tz;
        int cand[L::kTopK];
        const int k = L::top_candidates(ph, T, cand);
        std::fill(est.begin(), est.end(), 0.0f);
        for (int i = 0; i < k; ++i)
          for (int ch = 0; ch < d; ++ch)
            est[std::size_t(ch)] += ph[cand[i]] * std::fabs(float(f(kvc::aligned::truncate(vb[std::size_t(cand[i]) * dz + std::size_t(ch)], 8))));
        ref[std::size_t(h)] = L::value_reference(est.data(), d, sm.vmax.data());
      }
      std::vector<double> o(std::size_t(g) * dz, 0.0);
      std::size_t vt[3] = {0, 0, 0};
      for (int t = 0; t < T; ++t) {
        const int tier = t < full ? L::value_tier(p.data() + t, Tz, g, ref.data()) : 16;
        if (t < full) ++vt[(tier - 8) / 4];
        for (int h = 0; h < g; ++h)
          for (int ch = 0; ch < d; ++ch) {
            const std::uint16_t v = vb[std::size_t(t) * dz + std::size_t(ch)];
            o[std::size_t(h) * dz + std::size_t(ch)] +=
                double(p[std::size_t(h) * Tz + std::size_t(t)]) * f(t < full ? kvc::aligned::truncate(v, tier) : v);
          }
      }
      for (int h = 0; h < g; ++h)
        for (int ch = 0; ch < d; ++ch)
          out[(std::size_t(s) * Hq + std::size_t(kh) * g + std::size_t(h)) * dz + std::size_t(ch)] =
              float(o[std::size_t(h) * dz + std::size_t(ch)]);
      std::size_t kn[3] = {0, 0, 0};
      for (int ch = 0; ch < d; ++ch) ++kn[(kt[std::size_t(ch)] - 8) / 4];
      const std::size_t bt = std::size_t(full);
      for (int i = 0; i < 3; ++i) r.key_tiers[i] += kn[i] * bt, r.value_tiers[i] += vt[i] * dz;
      r.key_bytes += bt * dz + (kn[1] + 2 * kn[2]) * bt / 2;
      r.value_bytes += bt * dz + (vt[1] + 2 * vt[2]) * dz / 2;
      r.estimate_bytes += std::size_t(g) * std::size_t(std::min(L::kTopK, T)) * dz;
      r.staged_bytes += std::size_t(T - full) * dz * 2 * sizeof(kvc::half_t);
      r.meta_bytes += 2 * dz;
    }
  if (st) *st = r;
  return out;
}

template <class L>
std::vector<float> device_attend(const Dev<L>& c, const std::vector<float>& q, int nseq, int Hq,
                                 kvc::aligned::ReadStats* st, const kvc::cuda::DecodeOptions& opt = {}) {
  kvc_cuda_test::DeviceArray<float> dq(q), dout(q.size());
  kvc::cuda::decode_attention_any<64, 128>(c, 0, nseq, Hq, dq.data(), dout.data(), opt, st);
  return dout.get();
}

// Several splits per sequence (blocks of 64 tokens: up to 5 for the longest).
kvc::cuda::DecodeOptions many_splits() {
  kvc::cuda::DecodeOptions o;
  o.min_blocks_per_split = 1;
  o.target_ctas = 1024;
  return o;
}

struct Shape {
  int d, g;  // head dim, GQA ratio (query heads per KV head)
};
class DeviceAligned : public ::testing::TestWithParam<Shape> {};

TEST_P(DeviceAligned, UploadCopiesTheHostBytes) {
  KVC_REQUIRE_GPU();
  const auto [d, g] = GetParam();
  const auto x = outlier_kv(d, 50 + d + g);
  const auto host = make_host<Default>(x, kLengths);
  Dev<Default> dev(host.config());
  dev.upload(host);
  expect_same_streams(host, dev);
}

TEST_P(DeviceAligned, AppendStoresTheHostBytes) {
  KVC_REQUIRE_GPU();
  const auto [d, g] = GetParam();
  const auto x = outlier_kv(d, 70 + d + g);
  const kvc::CacheConfig cfg{1, 3, kH, d, kCap};
  Host<Default> host(cfg);
  Dev<Default> dev(cfg);
  // chunks crossing block boundaries in every way: a prefill with staging left, one token, a chunk that completes
  // a block from the staging and stages more, exactly a block, single decode tokens across a boundary
  const std::vector<std::vector<int>> chunks = {{100, 1, 27, 63, 1, 64, 44}, {64, 1}, std::vector<int>(70, 1)};
  for (int s = 0; s < cfg.batch; ++s) {
    int t = 0;
    for (int n : chunks[std::size_t(s)]) {
      host.append(0, s, x.kview(t, n), x.vview(t, n));
      dev.append(0, s, x.kview(t, n), x.vview(t, n));
      t += n;
    }
  }
  expect_same_streams(host, dev);
  // and attention over the appended cache is the host's
  const int Hq = kH * g;
  const auto q = tiered_query(cfg.batch, Hq, d, 17 + g, 2.0f);
  const auto want = host_attend(host, q, cfg.batch, Hq, nullptr);
  const auto got = device_attend(dev, q, cfg.batch, Hq, nullptr);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-4 * kvc_test::max_abs(want) + 1e-7) << i;
}

TEST_P(DeviceAligned, AllSixteenMatchesTheHostAndItsReadStatistics) {
  KVC_REQUIRE_GPU();
  const auto [d, g] = GetParam();
  const auto x = outlier_kv(d, 100 + d + g);
  const auto host = make_host<Sixteen>(x, kLengths);
  Dev<Sixteen> dev(host.config());
  dev.upload(host);
  const int nseq = int(kLengths.size()), Hq = kH * g;
  const auto q = tiered_query(nseq, Hq, d, 7 + g, 1.0f);
  kvc::aligned::ReadStats hs;
  const auto want = host_attend(host, q, nseq, Hq, &hs);
  for (const auto& opt : {kvc::cuda::DecodeOptions{}, many_splits()}) {
    kvc::aligned::ReadStats ds;
    const auto got = device_attend(dev, q, nseq, Hq, &ds, opt);
    const double tol = 1e-5 * kvc_test::max_abs(want) + 1e-7;
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], tol) << "d " << d << " g " << g << " splits " << opt.min_blocks_per_split << " element " << i;
    EXPECT_EQ(ds.key_bytes, hs.key_bytes);
    EXPECT_EQ(ds.value_bytes, hs.value_bytes);
    EXPECT_EQ(ds.estimate_bytes, hs.estimate_bytes);
    EXPECT_EQ(ds.staged_bytes, hs.staged_bytes);
    EXPECT_EQ(ds.meta_bytes, hs.meta_bytes);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(ds.key_tiers[i], hs.key_tiers[i]) << "key tier " << i;
      EXPECT_EQ(ds.value_tiers[i], hs.value_tiers[i]) << "value tier " << i;
    }
  }
  // without statistics: the same output
  const auto again = device_attend(dev, q, nseq, Hq, nullptr);
  for (std::size_t i = 0; i < again.size(); ++i) ASSERT_NEAR(again[i], want[i], 1e-5 * kvc_test::max_abs(want) + 1e-7);
}

TEST_P(DeviceAligned, DefaultTiersMatchTheHost) {
  KVC_REQUIRE_GPU();
  const auto [d, g] = GetParam();
  const auto x = outlier_kv(d, 200 + d + g);
  const auto host = make_host<Default>(x, kLengths);
  Dev<Default> dev(host.config());
  dev.upload(host);
  const int nseq = int(kLengths.size()), Hq = kH * g;
  const auto q = tiered_query(nseq, Hq, d, 9 + g, 2.0f);
  kvc::aligned::ReadStats hs;
  const auto want = host_attend(host, q, nseq, Hq, &hs);
  // the data exercises every key tier and more than one value tier
  for (int i = 0; i < 3; ++i) EXPECT_GT(hs.key_tiers[i], 0u) << "key tier " << i;
  EXPECT_GT(hs.value_tiers[0] + hs.value_tiers[1], 0u);
  for (const auto& opt : {kvc::cuda::DecodeOptions{}, many_splits()}) {
    kvc::aligned::ReadStats ds;
    const auto got = device_attend(dev, q, nseq, Hq, &ds, opt);
    // a probability right at a value tier's threshold may round to the other side on the GPU
    const double tol = 2e-4 * kvc_test::max_abs(want) + 1e-7;
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], tol) << "d " << d << " g " << g << " splits " << opt.min_blocks_per_split << " element " << i;
    // key tiers depend on the query and Kmax alone: exactly the host's
    EXPECT_EQ(ds.key_bytes, hs.key_bytes);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(ds.key_tiers[i], hs.key_tiers[i]) << "key tier " << i;
    EXPECT_EQ(ds.estimate_bytes, hs.estimate_bytes);
    EXPECT_EQ(ds.staged_bytes, hs.staged_bytes);
    EXPECT_EQ(ds.meta_bytes, hs.meta_bytes);
    // value tiers: the same rows but a few at a threshold
    const std::size_t rows = 4 * std::size_t(d);
    std::size_t total_d = 0, total_h = 0;
    for (int i = 0; i < 3; ++i) {
      const std::size_t a = ds.value_tiers[i], b = hs.value_tiers[i];
      EXPECT_LE(a > b ? a - b : b - a, rows) << "value tier " << i;
      total_d += a, total_h += b;
    }
    EXPECT_EQ(total_d, total_h);
    const std::size_t vb = ds.value_bytes, hb = hs.value_bytes;
    EXPECT_LE(vb > hb ? vb - hb : hb - vb, rows);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceAligned,
                         ::testing::Values(Shape{64, 1}, Shape{64, 4}, Shape{128, 1}, Shape{128, 4}));

using kvc_cuda_test::error_of;

TEST(DeviceAlignedErrors, BadInputThrowsAndChangesNothing) {
  KVC_REQUIRE_GPU();
  const int d = 64;
  const auto x = outlier_kv(d, 5);
  const std::vector<int> len = {70, 0};  // sequence 1 empty
  const auto host = make_host<Default>(x, len);
  Dev<Default> dev(host.config());
  dev.upload(host);
  const auto before = dev.stream(0, 0, 1);
  // upload: a host cache of another config (capacity, head count): nothing changes
  Host<Default> other(kvc::CacheConfig{1, 2, kH, d, kCap + 64});
  other.append(0, 0, x.kview(0, 100), x.vview(0, 100));
  EXPECT_EQ(error_of([&] { dev.upload(other); }), kvc::Errc::kInvalidArgument);
  Host<Default> heads(kvc::CacheConfig{1, 2, 1, d, kCap});
  EXPECT_EQ(error_of([&] { dev.upload(heads); }), kvc::Errc::kInvalidArgument);
  const auto after = dev.stream(0, 0, 1);
  EXPECT_TRUE(after.khi == before.khi && after.vhi == before.vhi && after.vlo == before.vlo &&
              bits(after.kst) == bits(before.kst));
  EXPECT_EQ(dev.length(0, 0), 70);
  EXPECT_EQ(dev.length(0, 1), 0);
  // append: NaN input, past the capacity, keys and values of different lengths, a bad index: nothing changes
  auto nan = x;
  nan.k[nan.at(70, 1, 3)] = std::nanf("");
  EXPECT_EQ(error_of([&] { dev.append(0, 0, nan.kview(70, 1), nan.vview(70, 1)); }), kvc::Errc::kNonFinite);
  EXPECT_EQ(error_of([&] { dev.append(0, 0, x.kview(0, kCap - 69), x.vview(0, kCap - 69)); }),
            kvc::Errc::kCapacityExceeded);
  EXPECT_EQ(error_of([&] { dev.append(0, 0, x.kview(0, 2), x.vview(0, 1)); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { dev.append(0, 2, x.kview(0, 1), x.vview(0, 1)); }), kvc::Errc::kInvalidArgument);
  const auto appended = dev.stream(0, 0, 1);
  EXPECT_TRUE(appended.khi == before.khi && appended.vhi == before.vhi && bits(appended.kst) == bits(before.kst) &&
              appended.kmax == before.kmax);
  EXPECT_EQ(dev.length(0, 0), 70);
  // attention: a head dim without a kernel, no / too many sequences, GQA that does not divide, null pointers, a bad
  // scale or split option, an empty sequence, a bad layer
  kvc_cuda_test::DeviceArray<float> q(std::size_t(2 * 4 * d)), out(std::size_t(2 * 4 * d));
  auto attend = [&](int nseq, int Hq, const float* qp, float* op, kvc::cuda::DecodeOptions o = {}, int layer = 0) {
    kvc::cuda::decode_attention<64>(dev, layer, nseq, Hq, qp, op, o);
  };
  EXPECT_EQ(error_of([&] { kvc::cuda::decode_attention<128>(dev, 0, 1, kH, q.data(), out.data()); }),
            kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { kvc::cuda::decode_attention_any<128>(dev, 0, 1, kH, q.data(), out.data()); }),
            kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(0, kH, q.data(), out.data()); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(3, kH, q.data(), out.data()); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(1, 3, q.data(), out.data()); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(1, kH, nullptr, out.data()); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(1, kH, q.data(), nullptr); }), kvc::Errc::kInvalidArgument);
  kvc::cuda::DecodeOptions bad;
  bad.scale = -1.0f;
  EXPECT_EQ(error_of([&] { attend(1, kH, q.data(), out.data(), bad); }), kvc::Errc::kInvalidArgument);
  bad.scale = std::nanf("");
  EXPECT_EQ(error_of([&] { attend(1, kH, q.data(), out.data(), bad); }), kvc::Errc::kInvalidArgument);
  bad = {};
  bad.min_blocks_per_split = 0;
  EXPECT_EQ(error_of([&] { attend(1, kH, q.data(), out.data(), bad); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(2, kH, q.data(), out.data()); }), kvc::Errc::kInvalidArgument);  // seq 1 empty
  EXPECT_EQ(error_of([&] { attend(1, kH, q.data(), out.data(), {}, 1); }), kvc::Errc::kInvalidArgument);
  // a bad config: the host cache's error
  EXPECT_EQ(error_of([&] { Dev<Default> none(kvc::CacheConfig{1, 1, 0, d, kCap}); }), kvc::Errc::kInvalidArgument);
  // the one good call still works
  attend(1, kH, q.data(), out.data());
  kvc::cuda::check(cudaDeviceSynchronize(), "aligned attention");
}
}  // namespace
