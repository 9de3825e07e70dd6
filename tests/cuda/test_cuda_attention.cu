// The fused CUDA decode attention against the double-precision oracle on the reconstructed cache (the
// same packed bytes: a host cache uploaded bit for bit), across schemes, head dims 64/80/96/128/256,
// GQA 1/4/8, ragged batches (sequences that end inside the sink, the window or a block boundary),
// split counts, and fp32/fp16/bf16 queries; with an AlignedLoader over the slots, against the oracle on the cache
// with its window truncated as the rules decide (aligned_window_oracle.hpp, the CPU suite's).
#include <kvc/attention/reference.hpp>

#include "aligned_window_oracle.hpp"
#include "cuda_test_util.cuh"

#include <cmath>

namespace {
using namespace kvc_cuda_test;

/// One case: scheme C at head dim D with query type QT.
template <class C, int D, class QT = float>
struct Case {
  using cache = C;
  using query = QT;
  static constexpr int kD = D;
};

template <class QT>
double output_tolerance() {
  if constexpr (std::is_same_v<QT, kvc::half_t>) return 2e-3;     // fp16 output rounding (2^-11) and slack
  else if constexpr (std::is_same_v<QT, kvc::bfloat16_t>) return 1.6e-2;  // bf16: 2^-8
  else return 3e-5;  // fp32 sums over <= ~1000 tokens
}

/// Runs the GPU kernel for every GQA ratio and split setting and checks it against the oracle.
template <class K>
void check_case() {
  using C = typename K::cache;
  using QT = typename K::query;
  constexpr int D = K::kD, B = C::kBlockTokens, F = kvc_test::fp_span<typename C::selector>();
  const std::vector<int> lengths{F + 9 * B + 11, 1, F + 3 * B, 2, F + B - 1, F + 1};
  const auto f = kvc_test::make_filled<C>(1, 2, D, lengths, 31 + D);
  kvc::cuda::device_cache_t<C> dev(f.cfg);
  dev.upload(*f.cache);
  for (int g : {1, 4, 8}) {
    const int H = 2 * g;
    for (int nseq : {int(lengths.size()), 3})
      for (int forced : {0, 1}) {  // default plan; many one-block splits
        kvc::cuda::DecodeOptions opt;
        if (forced) {
          opt.min_blocks_per_split = 1;
          opt.target_ctas = 100000;
        }
        std::vector<float> qf = kvc_test::random_query(nseq, H, D, 7 * g + nseq, 1.5f);
        std::vector<QT> q(qf.size());
        for (std::size_t i = 0; i < q.size(); ++i) {
          q[i] = kvc::StorageTraits<QT>::store(qf[i]);
          qf[i] = kvc::StorageTraits<QT>::load(q[i]);  // the oracle sees the query the kernel sees
        }
        DeviceArray<QT> dq(q), dout(q.size());
        kvc::cuda::decode_attention<D>(dev, 0, nseq, H, dq.data(), dout.data(), opt);
        kvc::cuda::check(cudaDeviceSynchronize(), "decode_attention");
        const std::vector<QT> out = dout.get();
        for (int s = 0; s < nseq; ++s) {
          const auto x = kvc_test::dequantize(*f.cache, 0, s);
          std::vector<float> want(std::size_t(H) * D);
          kvc::reference::decode_attention(qf.data() + std::size_t(s) * H * D, H, x.k.data(), x.v.data(), lengths[s], 2,
                                           D, want.data());
          const double tol = output_tolerance<QT>() * (1.0 + kvc_test::max_abs(x.v));
          for (int i = 0; i < H * D; ++i) {
            const float got = kvc::StorageTraits<QT>::load(out[std::size_t(s) * H * D + i]);
            ASSERT_NEAR(got, want[i], tol) << scheme_name<C> << " d " << D << " gqa " << g << " seq " << s << " (" << lengths[s]
                                           << " tokens) head " << i / D << " channel " << i % D << " forced splits "
                                           << forced;
          }
        }
      }
  }
}

template <class K>
class CudaAttention : public ::testing::Test {};
struct CaseNames {
  template <class K>
  static std::string GetName(int) {
    using QT = typename K::query;
    const char* q = std::is_same_v<QT, float> ? "" : std::is_same_v<QT, kvc::half_t> ? "_qfp16" : "_qbf16";
    return std::string(scheme_name<typename K::cache>) + "_d" + std::to_string(K::kD) + q;
  }
};
using Cases = ::testing::Types<
    // every head dim on the baseline and on KIVI (3-bit with a sink and 16-channel groups: 80 and 96)
    Case<sch::Fp16, 64>, Case<sch::Fp16, 80>, Case<sch::Fp16, 96>, Case<sch::Fp16, 128>, Case<sch::Fp16, 256>,
    Case<sch::Kivi3Sink, 64>, Case<sch::Kivi3Sink, 80>, Case<sch::Kivi3Sink, 96>, Case<sch::Kivi3Sink, 128>,
    Case<sch::Kivi3Sink, 256>,
    // every scheme at 128
    Case<sch::Bf16, 128>, Case<sch::Fp32, 128>, Case<sch::Int8, 128>, Case<sch::Kivi4, 128>, Case<sch::Kivi2, 128>,
    Case<sch::GearKivi2, 128>, Case<sch::Gear4, 128>, Case<sch::OutlierQuant4, 64>,
    // LogQuant: blocks in eviction order + the log set and staging rows (fp_row_at); PartialLogQuant's
    // quantized value rows (fp_element)
    Case<sch::LogQuant2, 64>, Case<sch::LogQuant2, 128>, Case<sch::LogW3, 128>, Case<sch::PartialW40, 64>,
    Case<sch::PartialLogQuant2, 64>,
    // rotated: both sides, keys only with GEAR, the Hartley-mixed head dims 80/96, a 16-bit query
    Case<sch::RotKivi2, 128>, Case<sch::RotKeysGear4, 64>, Case<sch::RotKivi3Sink, 80>, Case<sch::RotKivi3Sink, 96>,
    Case<sch::RotKivi2, 64, kvc::half_t>,
    // the sink on the block grid (block 0's masked rows), every head dim; rotated, the sweep's scheme at 64 and 128
    Case<sch::Kivi3GridSink, 64>, Case<sch::Kivi3GridSink, 80>, Case<sch::Kivi3GridSink, 96>,
    Case<sch::Kivi3GridSink, 128>, Case<sch::Kivi3GridSink, 256>, Case<sch::RotGridSink4, 64>,
    Case<sch::RotGridSink4, 128>,
    // 16-bit queries
    Case<sch::Fp16, 128, kvc::half_t>, Case<sch::Kivi2, 128, kvc::half_t>, Case<sch::Bf16, 128, kvc::bfloat16_t>,
    Case<sch::Kivi4, 128, kvc::bfloat16_t>>;
TYPED_TEST_SUITE(CudaAttention, Cases, CaseNames);

TYPED_TEST(CudaAttention, MatchesTheOracleOnTheReconstructedCache) {
  KVC_REQUIRE_GPU();
  check_case<TypeParam>();
}

template <class C>
class CudaAlignedWindow : public ::testing::Test {};
using AlignedWindowSchemes =
    ::testing::Types<sch::AlignedKivi2, sch::AlignedKiviOdd, sch::AlignedRotKiviOdd, sch::AlignedLogW5>;
TYPED_TEST_SUITE(CudaAlignedWindow, AlignedWindowSchemes, Names);

// The slot planes read at the rules' tiers: near the oracle on the truncated window (fp32 scores of peaked
// softmaxes against double, as the CPU's kExact), nearer it than to the untruncated cache's attention, with every
// tier chosen somewhere; GQA 1/4/8 (one CTA holds the group, so the rules see it whole, as on the CPU), ragged
// lengths inside the sink, the window and past block boundaries, default and one-block splits. The read statistics
// equal the oracle's replication of what the CPU kernel counts, and asking for them changes no output bit.
TYPED_TEST(CudaAlignedWindow, RealTiersMatchTheOracleOnTheTruncatedWindow) {
  KVC_REQUIRE_GPU();
  using C = TypeParam;
  static_assert(C::layout::kAlignedWindow);
  std::size_t tiers[3] = {0, 0, 0};
  for (int d : {64, 128})
    for (int g : {1, 4, 8}) {
      SCOPED_TRACE("d " + std::to_string(d) + " g " + std::to_string(g));
      const std::vector<int> lengths = {2, 33, 64, 130, 177, 290};
      const auto f = kvc_test::make_filled<C>(1, 2, d, lengths, 5 + d * g);
      kvc::cuda::device_cache_t<C> dev(f.cfg);
      dev.upload(*f.cache);
      const int nseq = int(lengths.size()), Hq = 2 * g;
      const auto q = kvc_test::random_query(nseq, Hq, d, 31 + g, 2.0f);  // peaked probabilities: value tiers vary
      const float scale_log2 = 1.0f / std::sqrt(float(d)) * 1.4426950408889634f;  // the kernel's (decode_attention)
      std::vector<float> want(q.size()), full(q.size());
      double maxv = 0.0;
      kvc::aligned::ReadStats want_read;  // the planes' counts replicated, summed over the sequences
      std::size_t other = f.cache->decode_read_bytes(0);  // less each sequence's slots as fp16 rows, below
      for (int s = 0; s < nseq; ++s) {
        const float* qs = q.data() + std::size_t(s) * Hq * d;
        kvc::aligned::ReadStats read;
        const auto tw = kvc_test::truncated_window(*f.cache, 0, s, qs, Hq, scale_log2, tiers, read);
        want_read += read;
        other -= std::size_t(f.cfg.kv_heads) * 2 * d * 2 *
                 kvc::detail::fp_tokens<typename C::selector>(lengths[std::size_t(s)], C::kBlockTokens);
        const auto dq = kvc_test::dequantize(*f.cache, 0, s);
        maxv = std::max(maxv, kvc_test::max_abs(dq.v));
        kvc::reference::decode_attention(qs, Hq, tw.k.data(), tw.v.data(), lengths[std::size_t(s)], 2, d,
                                         want.data() + std::size_t(s) * Hq * d);
        kvc::reference::decode_attention(qs, Hq, dq.k.data(), dq.v.data(), lengths[std::size_t(s)], 2, d,
                                         full.data() + std::size_t(s) * Hq * d);
      }
      const double truncation = kvc_test::max_abs_diff(want, full);
      for (int forced : {0, 1}) {
        kvc::cuda::DecodeOptions opt;
        if (forced) {
          opt.min_blocks_per_split = 1;
          opt.target_ctas = 100000;
        }
        DeviceArray<float> dq(q), dout(q.size()), dcounted(q.size());
        kvc::cuda::decode_attention_any<64, 128>(dev, 0, nseq, Hq, dq.data(), dout.data(), opt);
        kvc::cuda::check(cudaDeviceSynchronize(), "decode_attention");
        const std::vector<float> got = dout.get();
        const double err = kvc_test::max_abs_diff(got, want);
        ASSERT_LE(err, 3e-5 * (1.0 + maxv)) << "forced splits " << forced << ", truncation effect " << truncation;
        if (truncation > 1e-4 * maxv) {  // the kernel truncated
          ASSERT_LT(err, 0.1 * truncation) << "forced splits " << forced;
        }
        kvc::aligned::ReadStats read;
        read.other_bytes = 12345;  // overwritten
        if (d == 64) kvc::cuda::decode_attention<64>(dev, 0, nseq, Hq, dq.data(), dcounted.data(), opt, &read);
        else kvc::cuda::decode_attention<128>(dev, 0, nseq, Hq, dq.data(), dcounted.data(), opt, &read);
        ASSERT_EQ(dcounted.get(), got) << "counting changed the output";
        EXPECT_TRUE(kvc_test::same_reads(read, want_read, other)) << "forced splits " << forced;
      }
    }
  EXPECT_GT(tiers[0], 0u);
  EXPECT_GT(tiers[1], 0u);
  EXPECT_GT(tiers[2], 0u);
}

TEST(CudaAttentionErrors, BadArgumentsThrowBeforeAnyLaunch) {
  KVC_REQUIRE_GPU();
  using C = sch::Kivi2;
  const auto f = kvc_test::make_filled<C>(1, 2, 128, {300, 0 + 1}, 3);
  kvc::cuda::device_cache_t<C> dev(f.cfg);
  dev.upload(*f.cache);
  DeviceArray<float> q(std::size_t(2) * 8 * 128), out(q.buf.size());
  EXPECT_THROW(kvc::cuda::decode_attention<128>(dev, 0, 3, 8, q.data(), out.data()), kvc::Error);  // nseq > batch
  EXPECT_THROW(kvc::cuda::decode_attention<128>(dev, 0, 2, 7, q.data(), out.data()), kvc::Error);  // heads
  EXPECT_THROW(kvc::cuda::decode_attention<64>(dev, 0, 2, 8, q.data(), out.data()), kvc::Error);   // head dim
  kvc::cuda::DecodeOptions bad;
  bad.scale = -1.0f;
  EXPECT_THROW(kvc::cuda::decode_attention<128>(dev, 0, 2, 8, q.data(), out.data(), bad), kvc::Error);
  kvc::cuda::device_cache_t<C> empty(f.cfg);
  EXPECT_THROW(kvc::cuda::decode_attention<128>(empty, 0, 1, 8, q.data(), out.data()), kvc::Error);  // no tokens
  EXPECT_THROW(kvc::cuda::decode_attention_any<64>(dev, 0, 2, 8, q.data(), out.data()), kvc::Error);  // not compiled
  EXPECT_NO_THROW((kvc::cuda::decode_attention_any<64, 128>(dev, 0, 2, 8, q.data(), out.data())));
}
}  // namespace
