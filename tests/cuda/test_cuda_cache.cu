// kvc::cuda::DeviceKVCache: device appends store what host appends store (bit for bit; GEAR's low-rank
// factors up to fp32 rounding), transfers are lossless, bad input throws the host cache's errors and
// leaves the cache unchanged, CUDA failures carry the runtime's text.
#include "cuda_test_util.cuh"

#include <cstring>

namespace {
using namespace kvc_cuda_test;
using kvc_test::KV;

template <class C>
class DeviceCache : public ::testing::Test {};
using CacheSchemes = ::testing::Types<sch::Fp16, sch::Bf16, sch::Fp32, sch::Int8, sch::Kivi4, sch::Kivi2, sch::Kivi3Sink,
                                      sch::GearKivi2, sch::Gear4, sch::OutlierQuant4, sch::LogQuant2, sch::LogW3,
                                      sch::PartialW40, sch::PartialLogQuant2, sch::LogGear, sch::RotKivi2,
                                      sch::RotKeysGear4, sch::RotKivi3Sink, sch::Kivi3GridSink, sch::RotGridSink4,
                                      sch::AlignedKivi2, sch::AlignedKiviOdd, sch::AlignedRotKiviOdd, sch::AlignedLogW5>;
TYPED_TEST_SUITE(DeviceCache, CacheSchemes, Names);

/// Appends `x` to both caches with the same calls: a prefill, then single tokens, then the rest; the
/// device cache alternates host and device input.
template <class C, class D>
void append_both(C& host, D& dev, int layer, int seq, const KV& x) {
  const int first = x.T / 3, singles = std::min(x.T - first, 37);
  auto both = [&](int t0, int n, bool device_input) {
    host.append(layer, seq, x.kview(t0, n), x.vview(t0, n));
    if (!device_input) {
      dev.append(layer, seq, x.kview(t0, n), x.vview(t0, n));
      return;
    }
    const std::size_t off = x.at(t0, 0, 0), cnt = std::size_t(n) * x.H * x.d;
    DeviceArray<float> k(std::vector<float>(x.k.begin() + off, x.k.begin() + off + cnt));
    DeviceArray<float> v(std::vector<float>(x.v.begin() + off, x.v.begin() + off + cnt));
    dev.append_device(layer, seq, kvc::KVView::contiguous(k.data(), n, x.H, x.d),
                      kvc::KVView::contiguous(v.data(), n, x.H, x.d));
    kvc::cuda::check(cudaDeviceSynchronize(), "append_device");  // the inputs are freed below
  };
  if (first > 0) both(0, first, false);
  for (int t = first; t < first + singles; ++t) both(t, 1, t % 2 == 0);
  if (x.T > first + singles) both(first + singles, x.T - first - singles, true);
}

/// Block bytes [0, upto) of every quantized block of both caches are equal.
template <class F, class P>
::testing::AssertionResult same_blocks(const P& a, const P& b, int seq, int heads, int blocks, int d, std::size_t upto,
                                       bool keys) {
  for (int h = 0; h < heads; ++h)
    for (int blk = 0; blk < blocks; ++blk) {
      const std::byte* x = keys ? a.key_block(seq, h, blk) : a.value_block(seq, h, blk);
      const std::byte* y = keys ? b.key_block(seq, h, blk) : b.value_block(seq, h, blk);
      if (std::memcmp(x, y, upto) != 0)
        return ::testing::AssertionFailure() << (keys ? "key" : "value") << " block " << blk << " of sequence " << seq
                                             << " head " << h << " differs";
    }
  return ::testing::AssertionSuccess();
}

/// The bytes of a block a device append reproduces exactly: all, or with GEAR's corrections everything up
/// to the low-rank factors.
template <class F>
std::size_t exact_bytes(int d) {
  if constexpr (F::kCorrected) return F::correction_offset(d) + F::correction::outlier_bytes(F::kBlockTokens, d);
  else return F::block_bytes(d);
}

TYPED_TEST(DeviceCache, DeviceAppendsStoreWhatHostAppendsStore) {
  KVC_REQUIRE_GPU();
  using C = TypeParam;
  using D = kvc::cuda::device_cache_t<C>;
  using KF = typename C::key_format;
  using VF = typename C::value_format;
  constexpr int B = C::kBlockTokens, F = kvc_test::fp_span<typename C::selector>();
  for (int d : {64, 128}) {
    const std::vector<int> lengths{F + 6 * B + 5, 1, F + 2 * B, F + B / 2, F + 1};  // ragged, block boundaries
    const kvc::CacheConfig cfg{2, int(lengths.size()), 2, d, lengths[0] + 3};
    C host(cfg);
    D dev(cfg);
    for (int l = 0; l < cfg.layers; ++l)
      for (int s = 0; s < cfg.batch; ++s)
        append_both(host, dev, l, s, kvc_test::random_kv(lengths[s], cfg.kv_heads, d, 100 + 10 * l + s));
    C back(cfg);
    dev.download(back);
    for (int l = 0; l < cfg.layers; ++l) {
      EXPECT_EQ(dev.stored_bytes(l), host.stored_bytes(l));
      for (int s = 0; s < cfg.batch; ++s) {
        ASSERT_EQ(back.length(l, s), host.length(l, s));
        const int nb = host.quantized_blocks(l, s);
        const auto hp = host.params(l), bp = back.params(l);
        // codes, metadata and (GEAR) outliers: bit for bit; the factors: see below
        const std::size_t kupto = exact_bytes<KF>(d), vupto = exact_bytes<VF>(d);
        EXPECT_TRUE(same_blocks<KF>(hp, bp, s, cfg.kv_heads, nb, d, kupto, true));
        EXPECT_TRUE(same_blocks<VF>(hp, bp, s, cfg.kv_heads, nb, d, vupto, false));
        const auto a = kvc_test::dequantize(host, l, s), b = kvc_test::dequantize(back, l, s);
        if constexpr (kLowRank<C>) {
          // Power iteration over cuBLAS/cuSOLVER vs Eigen: the same algorithm and start, fp32 rounding apart.
          const double scale = kvc_test::max_abs(a.k) + kvc_test::max_abs(a.v);
          EXPECT_LE(kvc_test::max_abs_diff(a.k, b.k), 1e-3 * scale) << "layer " << l << " seq " << s;
          EXPECT_LE(kvc_test::max_abs_diff(a.v, b.v), 1e-3 * scale) << "layer " << l << " seq " << s;
        } else {
          EXPECT_TRUE(kvc_test::bytes_equal(a.k, b.k)) << "layer " << l << " seq " << s;
          EXPECT_TRUE(kvc_test::bytes_equal(a.v, b.v)) << "layer " << l << " seq " << s;
        }
      }
    }
  }
}

TYPED_TEST(DeviceCache, UploadDownloadRoundTripIsLossless) {
  KVC_REQUIRE_GPU();
  using C = TypeParam;
  using D = kvc::cuda::device_cache_t<C>;
  constexpr int B = C::kBlockTokens;
  const auto f = kvc_test::make_filled<C>(2, 2, 64, {5 * B + 150, 40, 3 * B}, 7);
  D dev(f.cfg);
  dev.upload(*f.cache);
  EXPECT_EQ(dev.bits_per_element(), f.cache->bits_per_element());
  C back(f.cfg);
  dev.download(back);
  EXPECT_TRUE(kvc_test::same_state(kvc_test::snapshot(*f.cache), kvc_test::snapshot(back)));
  for (int l = 0; l < 2; ++l) {
    const auto a = f.cache->params(l), b = back.params(l);
    const std::size_t kb = std::size_t(f.cfg.batch) * f.cfg.kv_heads * a.capacity_blocks * C::key_format::block_bytes(64);
    EXPECT_EQ(std::memcmp(a.k_blocks, b.k_blocks, kb), 0);
  }
  dev.clear(1);  // forgets sequence 1 in every layer, keeps the others
  dev.download(back);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(back.length(l, 1), 0);
    EXPECT_EQ(back.length(l, 0), f.cache->length(l, 0));
  }
}

/// Bad input to both appends of a device cache of scheme C throws the host cache's error (same text) and
/// changes nothing.
template <class C>
void check_bad_input() {
  using D = kvc::cuda::device_cache_t<C>;
  const kvc::CacheConfig cfg{1, 2, 2, 64, 400};
  C host(cfg);
  D dev(cfg);
  KV x = kvc_test::random_kv(300, 2, 64, 3);
  host.append(0, 0, x.kview(0, 200), x.vview(0, 200));
  dev.append(0, 0, x.kview(0, 200), x.vview(0, 200));
  C before(cfg);
  dev.download(before);
  const auto snap = kvc_test::snapshot(before);

  auto host_error = [&](kvc::KVView k, kvc::KVView v) -> std::string {
    try {
      host.append(0, 0, k, v);
    } catch (const kvc::Error& e) {
      return e.what();
    }
    return "no error";
  };
  KV bad = x;
  bad.k[bad.at(210, 1, 17)] = std::nanf("");
  bad.v[bad.at(250, 0, 3)] = 1e30f;
  const std::string want_nan = host_error(bad.kview(200, 100), bad.vview(200, 100));
  try {
    dev.append(0, 0, bad.kview(200, 100), bad.vview(200, 100));
    ADD_FAILURE() << "NaN accepted";
  } catch (const kvc::Error& e) {
    EXPECT_EQ(e.code(), kvc::Errc::kNonFinite);
    EXPECT_EQ(std::string(e.what()), want_nan);
  }
  // device input: scanned on the device, the same message
  const std::size_t off = bad.at(200, 0, 0), cnt = std::size_t(100) * 2 * 64;
  DeviceArray<float> dk(std::vector<float>(bad.k.begin() + off, bad.k.begin() + off + cnt));
  DeviceArray<float> dv(std::vector<float>(bad.v.begin() + off, bad.v.begin() + off + cnt));
  try {
    dev.append_device(0, 0, kvc::KVView::contiguous(dk.data(), 100, 2, 64), kvc::KVView::contiguous(dv.data(), 100, 2, 64));
    ADD_FAILURE() << "NaN accepted from device memory";
  } catch (const kvc::Error& e) {
    EXPECT_EQ(std::string(e.what()), want_nan);
  }
  bad.k[bad.at(210, 1, 17)] = 0.0f;  // now only the out-of-range value
  const std::string want_range = host_error(bad.kview(200, 100), bad.vview(200, 100));
  try {
    dev.append(0, 0, bad.kview(200, 100), bad.vview(200, 100));
    ADD_FAILURE() << "1e30 accepted";
  } catch (const kvc::Error& e) {
    EXPECT_EQ(e.code(), kvc::Errc::kOutOfRange);
    EXPECT_EQ(std::string(e.what()), want_range);
  }
  KV big = kvc_test::random_kv(201, 2, 64, 4);
  EXPECT_THROW(dev.append(0, 0, big.kview(0, 201), big.vview(0, 201)), kvc::Error);  // capacity
  EXPECT_THROW(dev.append(0, 2, x.kview(0, 1), x.vview(0, 1)), kvc::Error);          // sequence
  EXPECT_THROW(dev.append(0, 0, kvc::KVView::contiguous(x.k.data(), 1, 1, 64), x.vview(0, 1)), kvc::Error);  // shape
  C after(cfg);
  dev.download(after);
  EXPECT_TRUE(kvc_test::same_state(snap, kvc_test::snapshot(after)));

  C other(kvc::CacheConfig{1, 2, 2, 64, 401});
  EXPECT_THROW(dev.upload(other), kvc::Error);
}

TEST(DeviceCacheErrors, BadInputThrowsTheHostErrorAndChangesNothing) {
  KVC_REQUIRE_GPU();
  check_bad_input<sch::Kivi2>();
  // Rotated: NaN found in the input, the range checked on the rotated rows (both appends).
  check_bad_input<sch::RotKivi2>();
}

TEST(DeviceCacheErrors, CudaFailuresCarryTheRuntimeText) {
  KVC_REQUIRE_GPU();
  try {
    kvc::cuda::DeviceBuffer<float> huge(std::size_t(1) << 50);  // 4 PiB
    ADD_FAILURE() << "allocated 4 PiB";
  } catch (const kvc::Error& e) {
    EXPECT_EQ(e.code(), kvc::Errc::kCuda);
    EXPECT_NE(std::string(e.what()).find("cudaErrorMemoryAllocation"), std::string::npos) << e.what();
  }
  // the failure was reported once: the next kernel launch checks clean (it used to inherit the error)
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(DeviceCacheErrors, WithoutAGpuTheTextSaysWhy) {
  std::string why;
  if (kvc::cuda::device_available(&why)) GTEST_SKIP() << "a GPU is present";
  EXPECT_FALSE(why.empty());
}
}  // namespace
