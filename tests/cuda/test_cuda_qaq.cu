// QAQ on the GPU (kvc::cuda::DeviceQaqCache): device appends store the host's records; every decode step the
// device attention matches the host's (outputs and the probabilities handed back) and the device width update
// leaves exactly the host's buckets; bad input throws the host's errors and changes nothing.
#include "cuda_test_util.cuh"

#include <kvc/attention/reference.hpp>
#include <kvc/cuda/qaq/decode_attention.cuh>
#include <kvc/qaq/qaq_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using Q = kvc::QaqQuantizer<>;
using HostQaq = kvc::CompressedKVCache<Q>;
using DevQaq = kvc::cuda::DeviceQaqCache<Q>;
using Rot = kvc::Rotation<kvc::Hadamard<>>;
// with outliers a rotated side is split: they are taken before the rotation and the residual is rotated
using HostRotQaq = kvc::CompressedKVCache<Q, Rot>;
using DevRotQaq = kvc::cuda::DeviceQaqCache<Q, Rot>;
using QNoOutliers = kvc::QaqQuantizer<1, 8, 0>;  // without, the whole row is rotated
using HostRotQaqA0 = kvc::CompressedKVCache<QNoOutliers, Rot>;
using DevRotQaqA0 = kvc::cuda::DeviceQaqCache<QNoOutliers, Rot>;
using KeysRot = kvc::RotateKeys<kvc::Hadamard<>>;  // one side split, the other plain
using ValuesRot = kvc::RotateValues<kvc::Hadamard<>>;

kvc::qaq::QueryNormCalibration unit_calibration(int layers, int kv_heads, int d) {
  kvc::qaq::QueryNormCalibration c(layers, kv_heads, d);
  for (float& x : c.qnorm2) x = 1.0f;
  c.queries = 1;
  return c;
}

// Every bucket of every stream side of layer 0 equal, byte for byte.
template <class Host, class Dev>
void expect_same_buckets(const Host& host, const Dev& dev, const char* when) {
  const auto& cfg = host.config();
  for (int s = 0; s < cfg.batch; ++s)
    for (int h = 0; h < cfg.kv_heads; ++h)
      for (int side = 0; side < 2; ++side) {
        const auto& hb = side == 0 ? host.keys(0, s, h) : host.values(0, s, h);
        const auto db = dev.buckets(0, s, h, side);
        for (int w = 0; w < Dev::kWidths; ++w)
          ASSERT_TRUE(hb.bucket[std::size_t(w)] == db[std::size_t(w)])
              << when << ": seq " << s << " head " << h << " side " << side << " width " << w + 1 << " ("
              << hb.bucket[std::size_t(w)].size() << " vs " << db[std::size_t(w)].size() << " bytes)";
      }
}

// decode_attention<D> for the head dims the suite uses (run-time dispatch).
template <class Dev>
void attend(const Dev& c, int nseq, int heads, const float* q, float* out, float* probs, int stride) {
  kvc::cuda::decode_attention_any<64, 80, 128>(c, 0, nseq, heads, q, out, probs, stride);
}

struct Shape {
  int d, H, Hq;
  kvc::cuda::MirrorPlace mirror;
};
class DeviceQaq : public ::testing::TestWithParam<Shape> {};

template <class HostCache, class DevCache>
void every_step_matches_the_host_cache(Shape shape) {
  const auto [d, H, Hq, mirror] = shape;
  const std::vector<int> prefill{5, 17, 300};
  const int steps = 12, batch = int(prefill.size()), cap = 400;
  std::vector<kvc_test::KV> x;
  for (int s = 0; s < batch; ++s) x.push_back(kvc_test::random_kv(prefill[std::size_t(s)] + steps, H, d, 100 + s));
  const kvc::CacheConfig cfg{1, batch, H, d, cap};
  HostCache host(cfg, {1e-2, 5e-2}, unit_calibration(1, H, d));
  DevCache dev(cfg, {1e-2, 5e-2}, unit_calibration(1, H, d), mirror);
  for (int s = 0; s < batch; ++s) {
    const int n = prefill[std::size_t(s)];
    host.append(0, s, x[std::size_t(s)].kview(0, n), x[std::size_t(s)].vview(0, n));
    dev.append(0, s, x[std::size_t(s)].kview(0, n), x[std::size_t(s)].vview(0, n));
  }
  expect_same_buckets(host, dev, "after the prefill");
  EXPECT_EQ(dev.stored_bytes(), host.stored_bytes());
  EXPECT_EQ(dev.mirror_bytes(), host.mirror_bytes());

  kvc_cuda_test::DeviceArray<float> dprobs(std::size_t(batch) * H * cap);
  for (int step = 0; step < steps; ++step) {
    for (int s = 0; s < batch; ++s) {
      const int t = prefill[std::size_t(s)] + step;
      host.append(0, s, x[std::size_t(s)].kview(t, 1), x[std::size_t(s)].vview(t, 1));
      dev.append(0, s, x[std::size_t(s)].kview(t, 1), x[std::size_t(s)].vview(t, 1));
    }
    const std::vector<float> q = kvc_test::random_query(batch, Hq, d, 7000 + step);
    // the oracle on what the host cache holds (the device's buckets equal it): outputs and group-max probabilities
    std::vector<float> want(q.size());
    std::vector<std::vector<double>> pmax(std::size_t(batch * H));
    for (int s = 0; s < batch; ++s) {
      const auto kv = kvc_test::dequantize(host, 0, s);
      const int T = host.length(0, s);
      kvc::reference::decode_attention(q.data() + std::size_t(s) * Hq * d, Hq, kv.k.data(), kv.v.data(), T, H, d,
                                       want.data() + std::size_t(s) * Hq * d);
      for (int h = 0; h < Hq; ++h) {
        const auto pr = kvc::reference::attention_probabilities(q.data() + (std::size_t(s) * Hq + h) * d, kv.k.data(),
                                                                T, H, h / (Hq / H), d);
        auto& m = pmax[std::size_t(s * H + h / (Hq / H))];
        if (m.empty()) m = pr;
        for (std::size_t t = 0; t < pr.size(); ++t) m[t] = std::max(m[t], pr[t]);
      }
    }
    kvc_cuda_test::DeviceArray<float> dq(q), dout(q.size());
    attend(dev, batch, Hq, dq.data(), dout.data(), dprobs.data(), cap);
    const std::vector<float> got = dout.get(), p = dprobs.get();
    double vmax = 0.0;
    for (const auto& k : x) vmax = std::max(vmax, double(kvc_test::max_abs(k.v)));
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 2e-5 * (vmax + 1.0)) << "step " << step << " element " << i;
    for (int s = 0; s < batch; ++s)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < host.length(0, s); ++t)
          ASSERT_NEAR(p[(std::size_t(s) * H + h) * cap + t], pmax[std::size_t(s * H + h)][std::size_t(t)], 1e-5)
              << "step " << step << " seq " << s << " head " << h << " token " << t;
    // The same probabilities (the device's) drive both updates: the buckets must stay identical.
    kvc::qaq::TokenProbs hprobs;
    hprobs.resize(batch, H, cap);
    hprobs.p = p;
    host.update_widths(0, hprobs);
    dev.update_widths(0, dprobs.data(), cap);
    expect_same_buckets(host, dev, ("after step " + std::to_string(step)).c_str());
  }
  EXPECT_EQ(dev.stored_bytes(), host.stored_bytes());
  EXPECT_DOUBLE_EQ(dev.bits_per_element(), host.bits_per_element());
  for (int side = 0; side < 2; ++side) EXPECT_EQ(dev.width_counts(0, side), host.width_counts(0, side));
  // upload() copies the host state (records, histories, mirror): one more step on both still agrees
  DevCache up(cfg, {1e-2, 5e-2}, unit_calibration(1, H, d), mirror);
  up.upload(host);
  expect_same_buckets(host, up, "after upload");
  const std::vector<float> q = kvc_test::random_query(batch, Hq, d, 99);
  kvc_cuda_test::DeviceArray<float> dq(q), dout(q.size());
  attend(up, batch, Hq, dq.data(), dout.data(), dprobs.data(), cap);
  kvc::qaq::TokenProbs hprobs;
  hprobs.resize(batch, H, cap);
  hprobs.p = dprobs.get();
  host.update_widths(0, hprobs);
  up.update_widths(0, dprobs.data(), cap);
  expect_same_buckets(host, up, "after a step of the uploaded cache");
  // clear() forgets one sequence; appending to it again stores what the host stores
  host.clear(1);
  up.clear(1);
  host.append(0, 1, x[0].kview(0, 9), x[0].vview(0, 9));
  up.append(0, 1, x[0].kview(0, 9), x[0].vview(0, 9));
  expect_same_buckets(host, up, "after clear and append");
  EXPECT_EQ(up.length(0, 1), 9);
  const auto n = host.width_counts(0, 1);
  EXPECT_LT(n[8], std::size_t(batch * H) * (300 + steps)) << "widths should have moved below B_max";
}

TEST_P(DeviceQaq, EveryStepMatchesTheHostCache) {
  KVC_REQUIRE_GPU();
  every_step_matches_the_host_cache<HostQaq, DevQaq>(GetParam());
}
// K and V Hadamard-rotated: rotated on the host at append (the host cache's tables; with QAQ's outliers taken
// before the rotation, the residual rotated), the query rotated in the scores kernel, the output un-rotated in the
// final sum, the outliers' terms added in the original basis; the buckets still equal the host's byte for byte.
TEST_P(DeviceQaq, RotatedEveryStepMatchesTheHostCache) {
  KVC_REQUIRE_GPU();
  every_step_matches_the_host_cache<HostRotQaq, DevRotQaq>(GetParam());
}
TEST_P(DeviceQaq, RotatedWithoutOutliersEveryStepMatchesTheHostCache) {
  KVC_REQUIRE_GPU();
  every_step_matches_the_host_cache<HostRotQaqA0, DevRotQaqA0>(GetParam());
}
TEST_P(DeviceQaq, OneSideRotatedEveryStepMatchesTheHostCache) {
  KVC_REQUIRE_GPU();
  every_step_matches_the_host_cache<kvc::CompressedKVCache<Q, KeysRot>, kvc::cuda::DeviceQaqCache<Q, KeysRot>>(GetParam());
  every_step_matches_the_host_cache<kvc::CompressedKVCache<Q, ValuesRot>, kvc::cuda::DeviceQaqCache<Q, ValuesRot>>(
      GetParam());
}

// The 2-byte metadata (qaq::LogMeta): the device's appends and raises write the host's bytes.
TEST_P(DeviceQaq, LogMetaEveryStepMatchesTheHostCache) {
  KVC_REQUIRE_GPU();
  using LogQ = kvc::QaqQuantizer<1, 8, 10, 5, kvc::qaq::PaperBounds, kvc::qaq::LogMeta>;
  using LogQA0N1 = kvc::QaqQuantizer<1, 8, 0, 1, kvc::qaq::PaperBounds, kvc::qaq::LogMeta>;
  every_step_matches_the_host_cache<kvc::CompressedKVCache<LogQ>, kvc::cuda::DeviceQaqCache<LogQ>>(GetParam());
  every_step_matches_the_host_cache<kvc::CompressedKVCache<LogQA0N1, Rot>, kvc::cuda::DeviceQaqCache<LogQA0N1, Rot>>(
      GetParam());
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceQaq,
                         ::testing::Values(Shape{64, 2, 2, kvc::cuda::MirrorPlace::kHost},
                                           Shape{64, 1, 3, kvc::cuda::MirrorPlace::kDevice},
                                           Shape{80, 2, 4, kvc::cuda::MirrorPlace::kHost},  // a partial warp
                                           Shape{128, 2, 8, kvc::cuda::MirrorPlace::kHost},
                                           Shape{128, 3, 9, kvc::cuda::MirrorPlace::kDevice}));

using kvc_cuda_test::error_of;

TEST(DeviceQaqErrors, BadInputThrowsTheHostErrorAndChangesNothing) {
  KVC_REQUIRE_GPU();
  const int d = 64, H = 2, cap = 40;
  const kvc::CacheConfig cfg{1, 1, H, d, cap};
  DevQaq dev(cfg, {1e-2, 5e-2}, unit_calibration(1, H, d));
  auto kv = kvc_test::random_kv(cap + 1, H, d, 5);
  dev.append(0, 0, kv.kview(0, 30), kv.vview(0, 30));
  const auto before = dev.buckets(0, 0, 1, 0);
  const std::size_t bytes = dev.stored_bytes();
  // NaN input, capacity overflow, bad index, bad targets
  auto bad = kv;
  bad.k[bad.at(30, 0, 3)] = std::nanf("");  // token 30: the one appended below
  EXPECT_EQ(error_of([&] { dev.append(0, 0, bad.kview(30, 1), bad.vview(30, 1)); }), kvc::Errc::kNonFinite);
  EXPECT_EQ(error_of([&] { dev.append(0, 0, kv.kview(0, 11), kv.vview(0, 11)); }), kvc::Errc::kCapacityExceeded);
  EXPECT_EQ(error_of([&] { dev.append(1, 0, kv.kview(0, 1), kv.vview(0, 1)); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { dev.set_targets({0.0, 1.0}); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { dev.clear(1); }), kvc::Errc::kInvalidArgument);
  // a probability outside [0, 1]: nothing moves
  std::vector<float> p(std::size_t(H) * cap, 0.01f);
  p[std::size_t(cap) + 7] = 1.5f;
  kvc_cuda_test::DeviceArray<float> dp(p);
  EXPECT_EQ(error_of([&] { dev.update_widths(0, dp.data(), cap); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { dev.update_widths(0, dp.data(), 20); }), kvc::Errc::kInvalidArgument);  // stride < length
  // attention: a probability row shorter than the sequence, GQA that does not divide, too many sequences, a
  // head dim without a kernel
  kvc_cuda_test::DeviceArray<float> q(std::size_t(2 * H * d)), out(std::size_t(2 * H * d));
  EXPECT_EQ(error_of([&] { attend(dev, 1, H, q.data(), out.data(), dp.data(), 20); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(dev, 1, 3, q.data(), out.data(), dp.data(), cap); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { attend(dev, 2, H, q.data(), out.data(), dp.data(), cap); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] {
              kvc::cuda::decode_attention_any<128>(dev, 0, 1, H, q.data(), out.data(), dp.data(), cap);
            }),
            kvc::Errc::kInvalidArgument);
  EXPECT_TRUE(dev.buckets(0, 0, 1, 0) == before);
  EXPECT_EQ(dev.stored_bytes(), bytes);
  EXPECT_EQ(dev.length(0, 0), 30);
}

// A rotated device cache: a row whose rotation leaves fp16's range throws the host cache's error (naming the rotated
// channel) and changes nothing.
TEST(DeviceQaqErrors, RotatedOutOfRangeThrowsTheHostErrorAndChangesNothing) {
  KVC_REQUIRE_GPU();
  const int d = 64, H = 2, cap = 40;
  const kvc::CacheConfig cfg{1, 1, H, d, cap};
  DevRotQaq dev(cfg, {1e-2, 5e-2}, unit_calibration(1, H, d));
  HostRotQaq host(cfg, {1e-2, 5e-2}, unit_calibration(1, H, d));
  auto kv = kvc_test::random_kv(cap, H, d, 5);
  dev.append(0, 0, kv.kview(0, 10), kv.vview(0, 10));
  const auto before = dev.buckets(0, 0, 1, 1);
  const std::size_t bytes = dev.stored_bytes();
  auto bad = kv;
  for (int c = 0; c < d; ++c) bad.v[bad.at(10, 1, c)] = 60000.0f;  // each < 65504; R v has rms 60000
  std::string dev_what, host_what;
  EXPECT_EQ(error_of([&] { dev.append(0, 0, bad.kview(10, 1), bad.vview(10, 1)); }, &dev_what), kvc::Errc::kOutOfRange);
  EXPECT_EQ(error_of([&] { host.append(0, 0, bad.kview(10, 1), bad.vview(10, 1)); }, &host_what), kvc::Errc::kOutOfRange);
  EXPECT_EQ(dev_what, host_what);
  EXPECT_NE(dev_what.find("rotated channel"), std::string::npos) << dev_what;
  EXPECT_TRUE(dev.buckets(0, 0, 1, 1) == before);
  EXPECT_EQ(dev.stored_bytes(), bytes);
  EXPECT_EQ(dev.length(0, 0), 10);
}
}  // namespace
