// The host+device building blocks of the CUDA kernels, run on the CPU (CI has no GPU): the flash-decoding
// merge and split plan, cooperative packing, the cooperative block compressor (each CTA thread's share
// run in turn) against the host cache's own blocks, and the cooperative correction epilogues against
// decode_block; the device append's plan replayed on the host. The kernels call exactly these functions;
// tests/cuda runs the kernels themselves.
#include <kvc/attention/split_merge.hpp>
#include <kvc/cache/append_plan.hpp>
#include <kvc/gear/host_linalg.hpp>
#include <kvc/schemes.hpp>

#include "test_data.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace {
using kvc_test::KV;

TEST(SplitMerge, MergingPartialSoftmaxStatesEqualsOneSoftmax) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int trial = 0; trial < 50; ++trial) {
    const int T = 1 + int(rng() % 300), d = 16 * (1 + int(rng() % 8));
    std::vector<float> s(T), v(std::size_t(T) * d);
    for (auto& x : s) x = 6.0f * n01(rng);
    for (auto& x : v) x = n01(rng);
    // cut [0, T) into splits at random points, some empty
    std::vector<int> cuts{0, T};
    for (int i = 0, n = int(rng() % 6); i < n; ++i) cuts.push_back(int(rng() % (T + 1)));
    std::sort(cuts.begin(), cuts.end());
    const int n = int(cuts.size()) - 1;
    std::vector<float> m(n), l(n), acc(std::size_t(n) * d, 0.0f);
    for (int i = 0; i < n; ++i) {
      float mx = kvc::neg_inf(), sum = 0.0f;
      for (int t = cuts[i]; t < cuts[i + 1]; ++t) mx = std::max(mx, s[t]);
      for (int t = cuts[i]; t < cuts[i + 1]; ++t) {
        const float e = std::exp2(s[t] - mx);
        sum += e;
        for (int c = 0; c < d; ++c) acc[std::size_t(i) * d + c] += e * v[std::size_t(t) * d + c];
      }
      m[i] = mx;
      l[i] = sum;
    }
    std::vector<float> out(d);
    // every lane split of the cooperative form writes the same row
    for (int lanes : {1, 3, 32}) {
      std::fill(out.begin(), out.end(), -1.0f);
      std::vector<float> w(n);
      const float inv = kvc::merge_weights(n, m.data(), l.data(), 1, w.data());
      for (int lane = 0; lane < lanes; ++lane) kvc::merge_apply(n, w.data(), inv, acc.data(), d, d, out.data(), lane, lanes);
      double mx = -HUGE_VAL, sum = 0.0;
      for (int t = 0; t < T; ++t) mx = std::max(mx, double(s[t]));
      for (int t = 0; t < T; ++t) sum += std::exp2(double(s[t]) - mx);
      for (int c = 0; c < d; ++c) {
        double o = 0.0;
        for (int t = 0; t < T; ++t) o += std::exp2(double(s[t]) - mx) * v[std::size_t(t) * d + c];
        ASSERT_NEAR(out[c], o / sum, 2e-6 * (1.0 + std::fabs(o / sum))) << "trial " << trial << " lanes " << lanes;
      }
    }
  }
}

TEST(SplitMerge, AnEmptySplitHasWeightZero) {
  EXPECT_EQ(kvc::split_weight(kvc::neg_inf(), 3.0f), 0.0f);
  EXPECT_EQ(kvc::split_weight(3.0f, 3.0f), 1.0f);
  EXPECT_EQ(kvc::split_weight(2.0f, 3.0f), 0.5f);
}

TEST(SplitMerge, PlansCoverEveryBlockOnceWithinTheLimits) {
  for (int max_blocks : {0, 1, 2, 7, 64, 1000, 4097})
    for (int items : {1, 8, 128, 1024})
      for (int target : {1, 132, 528})
        for (int minb : {1, 4, 8}) {
          const kvc::SplitPlan pl = kvc::plan_splits(max_blocks, items, target, minb);
          ASSERT_GE(pl.splits, 1);
          ASSERT_GE(pl.blocks_per_split, 1);
          ASSERT_GE(std::int64_t(pl.splits) * pl.blocks_per_split, max_blocks);
          if (max_blocks > 0) {
            ASSERT_LT(std::int64_t(pl.splits - 1) * pl.blocks_per_split, max_blocks) << "empty split";
          }
          if (pl.splits > 1) {
            ASSERT_GE(pl.blocks_per_split, minb);
          }
          if (items >= target) {
            ASSERT_EQ(pl.splits, 1);
          }
          for (int nb : {0, max_blocks / 3, max_blocks}) {
            std::vector<int> seen(std::size_t(nb), 0);
            for (int s = 0; s < pl.splits; ++s) {
              int b0 = -1, b1 = -1;
              kvc::split_blocks(pl, s, nb, &b0, &b1);
              ASSERT_LE(b0, b1);
              for (int b = b0; b < b1; ++b) ++seen[std::size_t(b)];
            }
            for (int x : seen) ASSERT_EQ(x, 1);
          }
        }
}

TEST(CooperativePacking, EveryLaneSplitWritesTheSerialBytes) {
  std::mt19937_64 rng(5);
  for (int bits = 1; bits <= 8; ++bits)
    for (std::size_t n : {std::size_t(512), std::size_t(4096), std::size_t(8192)}) {
      std::vector<std::uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1u));
      std::vector<std::uint8_t> serial(kvc::packed_bytes(n, bits)), coop(serial.size(), 0xAB);
      kvc::pack_codes(codes.data(), n, bits, serial.data());
      for (unsigned lanes : {3u, 128u, 256u}) {
        std::fill(coop.begin(), coop.end(), std::uint8_t{0xAB});
        for (unsigned lane = 0; lane < lanes; ++lane) kvc::pack_codes(codes.data(), n, bits, coop.data(), lane, lanes);
        ASSERT_EQ(coop, serial) << bits << " bits, n " << n << ", " << lanes << " lanes";
      }
    }
}

/// The device compressor's steps (window rounding, quantize_groups, pack_codes; for GEAR the outlier
/// mask) run lane by lane, as a CTA of `lanes` threads would, reproduce the host cache's blocks.
template <class Cache>
void expect_cooperative_compression_matches(int d, int lanes) {
  using KF = typename Cache::key_format;
  using VF = typename Cache::value_format;
  using W = typename Cache::window_t;
  constexpr int B = Cache::kBlockTokens, S = Cache::selector::kSink;
  const int H = 2, T = S + 5 * B + Cache::selector::kRecent + 7;
  Cache cache(kvc::CacheConfig{1, 1, H, d, T});
  const KV x = kvc_test::random_kv(T, H, d, 11);
  cache.append(0, 0, x.kview(0, 40), x.vview(0, 40));
  cache.append(0, 0, x.kview(40, T - 40), x.vview(40, T - 40));
  const auto p = cache.params(0);
  auto one = [&]<class F>(const std::byte* stored, int h, int blk, const std::vector<float>& src) {
    std::vector<float> xb(std::size_t(B) * d);
    for (int t = 0; t < B; ++t)
      for (int c = 0; c < d; ++c)
        xb[std::size_t(t) * d + c] = kvc_test::storage_round<W>(src[x.at(S + blk * B + t, h, c)]);
    std::vector<std::byte> out(F::block_bytes(d), std::byte{0});
    std::vector<std::uint8_t> codes(std::size_t(B) * d), mask(codes.size(), 0);
    if constexpr (F::kCorrected && F::correction::kOutliers)
      for (auto i : kvc::select_outliers(xb.data(), xb.size(), std::size_t(F::correction::outliers(B, d) / 2)))
        mask[i] = 1;
    for (int lane = 0; lane < lanes; ++lane) {
      if constexpr (F::kIdentity) F::store_identity(xb.data(), d, out.data(), lane, lanes);
      else F::quantize_groups(xb.data(), d, codes.data(), out.data(), mask.data(), lane, lanes);
    }
    if constexpr (!F::kIdentity)
      for (int lane = 0; lane < lanes; ++lane)
        kvc::pack_codes(codes.data(), codes.size(), F::kBits, reinterpret_cast<std::uint8_t*>(out.data()), unsigned(lane),
                        unsigned(lanes));
    ASSERT_EQ(std::memcmp(out.data(), stored, F::backbone_bytes(d)), 0) << "block " << blk << " head " << h;
  };
  for (int h = 0; h < H; ++h)
    for (int blk = 0; blk < cache.quantized_blocks(0, 0); ++blk) {
      one.template operator()<KF>(p.key_block(0, h, blk), h, blk, x.k);
      one.template operator()<VF>(p.value_block(0, h, blk), h, blk, x.v);
    }
}

TEST(CooperativeCompression, LaneByLaneEqualsTheHostCache) {
  using namespace kvc;
  expect_cooperative_compression_matches<schemes::Fp16>(64, 7);
  expect_cooperative_compression_matches<CompressedKVCache<NoQuantizer<bfloat16_t>>>(80, 256);
  expect_cooperative_compression_matches<schemes::Int8>(128, 256);
  expect_cooperative_compression_matches<schemes::Kivi2>(128, 7);
  expect_cooperative_compression_matches<schemes::Kivi4>(96, 256);
  expect_cooperative_compression_matches<schemes::Kivi<3, 32, 16>>(64, 5);
  expect_cooperative_compression_matches<schemes::GearKivi2>(64, 256);  // outliers exclude from the statistics
  expect_cooperative_compression_matches<schemes::Gear4>(64, 9);
}

/// The device append's plan (cache/append_plan.hpp), replayed on the host the way DeviceKVCache's kernels
/// execute it -- new blocks compressed from their row sources (old slots, or inputs rounded through the
/// window storage), then the slot writes gathered and scattered, then the changed quantized value rows
/// re-derived -- over arenas of our own, equals the host cache's append on every live byte: blocks,
/// full-precision rows in storage order, PartialLogWindow's quantized value rows.
template <class Cache>
void expect_replayed_plan_matches(const std::vector<int>& chunks) {
  using L = typename Cache::layout;
  using KF = typename L::key_format;
  using VF = typename L::value_format;
  using W = typename L::window_t;
  static_assert(!KF::kCorrected && !VF::kCorrected, "the replay covers compress_blocks_kernel's path");
  constexpr int B = L::kBlockTokens;
  const int H = 2, d = 64;
  int T = 0;
  for (int c : chunks) T += c;
  const KV x = kvc_test::random_kv(T, H, d, 91);
  Cache host(kvc::CacheConfig{1, 1, H, d, T});
  const int cap = host.params(0).capacity_blocks;
  std::vector<std::byte> kb(std::size_t(H) * cap * KF::block_bytes(d)), vb(std::size_t(H) * cap * VF::block_bytes(d));
  std::vector<W> kfp(std::size_t(H) * L::kFpSlots * d), vfp(kfp.size());
  std::vector<std::byte> vfq(std::size_t(H) * L::kFpSlots * L::value_row_bytes(d) + 1);
  int length = 0;
  typename L::Params r{1, H, d, cap, &length, kb.data(), vb.data(), kfp.data(), vfp.data(), 0,
                       nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, vfq.data()};
  auto value = [&](kvc::Side side, int h, int src, int c, int t0) {  // the kernels' source_value
    if (src >= 0) return kvc::StorageTraits<W>::load(r.fp_slot_row(side, 0, h, src)[c]);
    const auto& in = side == kvc::Side::kKey ? x.k : x.v;
    return kvc::StorageTraits<W>::load(kvc::StorageTraits<W>::store(in[x.at(t0 - 1 - src, h, c)]));
  };
  int t0 = 0;
  for (int tokens : chunks) {
    SCOPED_TRACE("append of " + std::to_string(tokens) + " at " + std::to_string(t0));
    host.append(0, 0, x.kview(t0, tokens), x.vview(t0, tokens));
    const auto plan = kvc::detail::AppendPlan<L>::make(length, tokens);
    std::vector<float> blk(std::size_t(B) * d);
    std::vector<std::uint8_t> codes(blk.size());
    for (int i = 0; i < plan.blocks; ++i)
      for (int h = 0; h < H; ++h)
        for (kvc::Side side : {kvc::Side::kKey, kvc::Side::kValue}) {
          for (int t = 0; t < B; ++t)
            for (int c = 0; c < d; ++c)
              blk[std::size_t(t) * d + c] = value(side, h, plan.block_rows[std::size_t(i) * B + t], c, t0);
          auto store = [&]<class F>(std::byte* dst) {
            if constexpr (F::kIdentity) {
              F::store_identity(blk.data(), d, dst);
            } else {
              F::quantize_groups(blk.data(), d, codes.data(), dst, nullptr);
              kvc::pack_codes(codes.data(), codes.size(), F::kBits, reinterpret_cast<std::uint8_t*>(dst));
            }
          };
          if (side == kvc::Side::kKey) store.template operator()<KF>(r.key_block(0, h, plan.first_block + i));
          else store.template operator()<VF>(r.value_block(0, h, plan.first_block + i));
        }
    std::vector<float> tmp(plan.dst.size() * H * 2 * d);  // gather, then scatter
    for (std::size_t i = 0; i < plan.dst.size(); ++i)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c) {
          tmp[((i * H + h) * 2) * d + c] = value(kvc::Side::kKey, h, plan.src[i], c, t0);
          tmp[((i * H + h) * 2 + 1) * d + c] = value(kvc::Side::kValue, h, plan.src[i], c, t0);
        }
    for (std::size_t i = 0; i < plan.dst.size(); ++i)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c) {
          r.fp_slot_row(kvc::Side::kKey, 0, h, plan.dst[i])[c] = kvc::StorageTraits<W>::store(tmp[((i * H + h) * 2) * d + c]);
          r.fp_slot_row(kvc::Side::kValue, 0, h, plan.dst[i])[c] =
              kvc::StorageTraits<W>::store(tmp[((i * H + h) * 2 + 1) * d + c]);
        }
    if constexpr (L::kQuantizedFpValues)
      for (int slot : plan.requantize)
        for (int h = 0; h < H; ++h) {
          std::vector<float> row(static_cast<std::size_t>(d));
          for (int c = 0; c < d; ++c) row[std::size_t(c)] = kvc::StorageTraits<W>::load(r.fp_slot_row(kvc::Side::kValue, 0, h, slot)[c]);
          L::value_row_format::quantize(row.data(), d, r.value_row_slot(0, h, slot));
        }
    length += tokens;
    t0 += tokens;
    // Every live byte equals the host cache's.
    const auto p = host.params(0);
    ASSERT_EQ(r.quantized_blocks(0), p.quantized_blocks(0));
    for (int h = 0; h < H; ++h) {
      for (int b = 0; b < r.quantized_blocks(0); ++b) {
        ASSERT_EQ(std::memcmp(r.key_block(0, h, b), p.key_block(0, h, b), KF::block_bytes(d)), 0) << "key block " << b;
        ASSERT_EQ(std::memcmp(r.value_block(0, h, b), p.value_block(0, h, b), VF::block_bytes(d)), 0) << "value block " << b;
      }
      for (int i = 0; i < r.fp_count(0); ++i) {
        ASSERT_EQ(std::memcmp(r.fp_row_at(kvc::Side::kKey, 0, h, i), p.fp_row_at(kvc::Side::kKey, 0, h, i), d * sizeof(W)), 0)
            << "key row " << i;
        if (r.fp_value_quantized(0, i))
          ASSERT_EQ(std::memcmp(r.value_row_at(0, h, i), p.value_row_at(0, h, i), L::value_row_bytes(d)), 0)
              << "quantized value row " << i;
        else
          ASSERT_EQ(std::memcmp(r.fp_row_at(kvc::Side::kValue, 0, h, i), p.fp_row_at(kvc::Side::kValue, 0, h, i), d * sizeof(W)), 0)
              << "value row " << i;
      }
    }
  }
}

TEST(DeviceAppendPlan, ReplayedOnTheHostEqualsTheHostAppend) {
  using namespace kvc;
  const std::vector<int> chunks{1, 1, 5, 40, 1, 1, 1, 97, 3, 1, 130, 1, 1, 64, 2, 1, 1, 1, 200, 1};
  expect_replayed_plan_matches<schemes::Kivi2>(chunks);
  expect_replayed_plan_matches<kvc_test::sch::Sink>(chunks);
  expect_replayed_plan_matches<kvc_test::sch::LogW3>(chunks);
  expect_replayed_plan_matches<kvc_test::sch::PartialW40>(chunks);
  expect_replayed_plan_matches<schemes::PartialLogQuant<2, 3, 32>>(chunks);
  expect_replayed_plan_matches<schemes::PartialLogQuant2>(chunks);
}

/// The kernels' tile decode: backbone into a tile with a padded row stride, then the outlier and the
/// residual epilogues lane by lane (two passes, as between the CTA's barriers) = decode_block.
template <class Cache>
void expect_cooperative_corrections_match(int d) {
  using KF = typename Cache::key_format;
  using VF = typename Cache::value_format;
  constexpr int B = Cache::kBlockTokens;
  const auto f = kvc_test::make_filled<Cache>(1, 2, d, {B * 4 + Cache::selector::kRecent + 3}, 17);
  const auto p = f.cache->params(0);
  auto one = [&]<class F>(const std::byte* blk) {
    const int ld = d + 1;
    std::vector<float> want(std::size_t(B) * d), tile(std::size_t(B) * ld, 0.0f);
    F::decode_block(blk, d, want.data());
    for (int t = 0; t < B; ++t)
      for (int c = 0; c < d; ++c) tile[std::size_t(t) * ld + c] = F::decode(blk, t, c, d);
    if constexpr (F::kCorrected) {
      const std::byte* region = F::correction_region(blk, d);
      for (int lane = 0; lane < 128; ++lane) F::correction::add_outliers_to(region, B, d, tile.data(), ld, lane, 128);
      for (int lane = 0; lane < 128; ++lane) F::correction::add_residual_to(region, B, d, tile.data(), ld, lane, 128);
    }
    for (int t = 0; t < B; ++t)
      for (int c = 0; c < d; ++c)
        ASSERT_EQ(tile[std::size_t(t) * ld + c], want[std::size_t(t) * d + c]) << "t " << t << " c " << c;
  };
  for (int h = 0; h < 2; ++h)
    for (int blk = 0; blk < f.cache->quantized_blocks(0, 0); ++blk) {
      one.template operator()<KF>(p.key_block(0, h, blk));
      one.template operator()<VF>(p.value_block(0, h, blk));
    }
}

TEST(CooperativeCorrections, LaneByLaneEqualsDecodeBlock) {
  expect_cooperative_corrections_match<kvc::schemes::GearKivi2>(64);
  expect_cooperative_corrections_match<kvc::schemes::Gear4>(128);
  expect_cooperative_corrections_match<kvc::schemes::OutlierQuant4>(64);
  expect_cooperative_corrections_match<kvc::schemes::LowRankQuant4>(64);
  expect_cooperative_corrections_match<kvc::schemes::Kivi2>(96);
}

TEST(DeviceNumerics, UniformStreamIsTheHostBackendsFill) {
  const kvc::HostLinalg la;
  std::vector<float> a(7 * 5);
  la.fill_uniform(7, 5, a.data(), 7, 42);
  for (int j = 0; j < 5; ++j)
    for (int i = 0; i < 7; ++i) {
      const float u = kvc::uniform_pm1(42, std::uint64_t(j) * 7 + i);
      EXPECT_EQ(a[std::size_t(j) * 7 + i], u);
      EXPECT_GE(u, -1.0f);
      EXPECT_LT(u, 1.0f);
    }
  EXPECT_NE(kvc::uniform_pm1(42, 0), kvc::uniform_pm1(43, 0));
  EXPECT_NE(kvc::low_rank_seed(0, 0, 0, 0, true), kvc::low_rank_seed(0, 0, 0, 0, false));
  EXPECT_NE(kvc::low_rank_seed(0, 0, 1, 0, true), kvc::low_rank_seed(0, 0, 0, 1, true));
}

TEST(DeviceNumerics, RoundedMultiplyAddRoundsTheProduct) {
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: the product rounds to 1 + 2^-11 (ties to even), so minus
  // (1 + 2^-11) gives exactly 0; a fused multiply-add would keep 2^-24.
  const float a = 1.0f + 0x1.0p-12f;
  EXPECT_EQ(kvc::mul_add_rounded(a, a, -(1.0f + 0x1.0p-11f)), 0.0f);
  EXPECT_EQ(kvc::mul_add_rounded(3.0f, 0.5f, 1.0f), 2.5f);
}
}  // namespace
