// QAQ (SPEC §2): the mixed-bit cache and its fused attention against the oracle while widths change every
// step, lowering and raising in place, accounting and bad input. The width rule, codec, record format and
// calibration file below it: test_qaq_record.cpp.
// calibration.hpp first: its kvc::qaq::detail must not hide kvc::detail from the QAQ headers after it
#include <kvc/qaq/calibration.hpp>
// the rest in order
#include <kvc/attention/reference.hpp>
#include <kvc/qaq/arena.hpp>
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/decode_attention.hpp>
#include <kvc/qaq/qaq_cache.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>

#include "qaq_test_util.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace kvc_test::qaq;

// ---------------------------------------------------------------------------------------------------------
// The mixed-bit cache and its fused attention
// ---------------------------------------------------------------------------------------------------------

using Qaq = kvc::CompressedKVCache<kvc::QaqQuantizer<>>;

kvc::qaq::QueryNormCalibration unit_calibration(int layers, int kv_heads, int d, float qn2 = 1.0f) {
  kvc::qaq::QueryNormCalibration c(layers, kv_heads, d);
  for (float& x : c.qnorm2) x = qn2;
  c.queries = 1;
  return c;
}

struct QaqShape {
  int d, H, Hq;
};

class QaqCacheAttention : public ::testing::TestWithParam<QaqShape> {};

// Ragged prefill, then decode steps: after every step the fused output equals the oracle on what the cache
// holds (in the original basis: a Rotation's rows un-rotated), the probabilities handed back equal the oracle's
// (max over the group), and widths move.
template <class Cache>
void matches_the_oracle_while_widths_change(QaqShape shape) {
  const auto [d, H, Hq] = shape;
  const std::vector<int> prefill{5, 17, 40};
  const int steps = 24, batch = int(prefill.size());
  std::vector<kvc_test::KV> x;
  for (int s = 0; s < batch; ++s) x.push_back(kvc_test::random_kv(prefill[std::size_t(s)] + steps, H, d, 100 + s));
  Cache c({1, batch, H, d, 128}, {1e-2, 5e-2}, unit_calibration(1, H, d));
  for (int s = 0; s < batch; ++s)
    c.append(0, s, x[std::size_t(s)].kview(0, prefill[std::size_t(s)]), x[std::size_t(s)].vview(0, prefill[std::size_t(s)]));
  kvc::qaq::TokenProbs probs;
  for (int step = 0; step < steps; ++step) {
    for (int s = 0; s < batch; ++s)
      c.append(0, s, x[std::size_t(s)].kview(prefill[std::size_t(s)] + step, 1),
               x[std::size_t(s)].vview(prefill[std::size_t(s)] + step, 1));
    const std::vector<float> q = kvc_test::random_query(batch, Hq, d, 7000 + step);
    std::vector<float> out(q.size()), want(q.size());
    for (int s = 0; s < batch; ++s) {
      const auto kv = kvc_test::dequantize(c, 0, s);
      const int T = c.length(0, s);
      kvc::reference::decode_attention(q.data() + std::size_t(s) * Hq * d, Hq, kv.k.data(), kv.v.data(), T, H, d,
                                       want.data() + std::size_t(s) * Hq * d);
    }
    // Probabilities as the oracle sees them, before the step changes widths.
    std::vector<std::vector<double>> pmax(std::size_t(batch * H));
    for (int s = 0; s < batch; ++s) {
      const auto kv = kvc_test::dequantize(c, 0, s);
      for (int h = 0; h < Hq; ++h) {
        const auto p = kvc::reference::attention_probabilities(q.data() + (std::size_t(s) * Hq + h) * d, kv.k.data(),
                                                               c.length(0, s), H, h / (Hq / H), d);
        auto& m = pmax[std::size_t(s * H + h / (Hq / H))];
        if (m.empty()) m = p;
        for (std::size_t t = 0; t < p.size(); ++t) m[t] = std::max(m[t], p[t]);
      }
    }
    double vmax = 0.0;
    for (const auto& k : x) vmax = std::max(vmax, double(kvc_test::max_abs(k.v)));
    // The scheme's own error this step: the oracle on the original K/V against the oracle on the cache.
    double quant_err2 = 0.0;
    for (int s = 0; s < batch; ++s) {
      std::vector<float> exact(std::size_t(Hq) * d);
      kvc::reference::decode_attention(q.data() + std::size_t(s) * Hq * d, Hq, x[std::size_t(s)].k.data(),
                                       x[std::size_t(s)].v.data(), c.length(0, s), H, d, exact.data());
      for (std::size_t i = 0; i < exact.size(); ++i) {
        const double e = double(exact[i]) - want[std::size_t(s) * Hq * d + i];
        quant_err2 += e * e;
      }
    }
    // Every SIMD path this CPU runs, both precisions, on the same cache state; then the step's width update.
    // kExact (and the portable path): float arithmetic, so float tolerances. kFast on AVX2/AVX-512 rounds the
    // query to int16 for the key dot products: its error stays a small fraction of the scheme's own (up to ~1 %
    // here, in the steps where every token is still at 8 bits; the bound in qaq/decode_attention.hpp).
    for (kvc::Isa isa : kvc_test::runnable_isas())
      for (kvc::Precision precision : {kvc::Precision::kExact, kvc::Precision::kFast}) {
        kvc::AttentionOptions opt;
        opt.isa = isa;
        opt.precision = precision;
        kvc::decode_attention(c, 0, kvc::QueryView::contiguous(q.data(), batch, Hq, d),
                              kvc::OutputView::contiguous(out.data(), batch, Hq, d), opt, &probs);
        const bool exact = precision == kvc::Precision::kExact || isa == kvc::Isa::kPortable;
        double kernel_err2 = 0.0;
        for (std::size_t i = 0; i < out.size(); ++i) {
          if (exact) {
            ASSERT_NEAR(out[i], want[i], 2e-5 * (vmax + 1.0))
                << "step " << step << " element " << i << " isa " << int(isa);
          }
          kernel_err2 += (double(out[i]) - want[i]) * (double(out[i]) - want[i]);
        }
        if (!exact) {
          ASSERT_LE(std::sqrt(kernel_err2), 0.05 * std::sqrt(quant_err2)) << "step " << step << " isa " << int(isa);
        }
        for (int s = 0; s < batch; ++s)
          for (int h = 0; h < H; ++h)
            for (int t = 0; t < c.length(0, s); ++t) {
              const double p = pmax[std::size_t(s * H + h)][std::size_t(t)];
              ASSERT_NEAR(probs.row(s, h)[t], p, exact ? 1e-5 : 1e-5 + 2e-3 * p)
                  << "step " << step << " seq " << s << " head " << h << " token " << t << " isa " << int(isa);
            }
      }
    // The step; update_stats() counts exactly the records it re-derived, lowered and raised.
    auto widths = [&](int side) {  // width of every (sequence, KV head, token)
      std::vector<int> w;
      for (int s = 0; s < batch; ++s)
        for (int h = 0; h < H; ++h) {
          std::vector<int> ws(std::size_t(c.length(0, s)), 0);
          c.for_each_record(side == 0 ? c.keys(0, s, h) : c.values(0, s, h),
                            [&](const std::byte*, int b, std::uint32_t t) { ws[t] = b; });
          w.insert(w.end(), ws.begin(), ws.end());
        }
      return w;
    };
    const std::vector<int> k0 = widths(0), v0 = widths(1);
    const kvc::qaq::UpdateStats u0 = c.update_stats();
    kvc::qaq_decode_step(c, 0, kvc::QueryView::contiguous(q.data(), batch, Hq, d),
                         kvc::OutputView::contiguous(out.data(), batch, Hq, d), {}, probs);
    const kvc::qaq::UpdateStats u1 = c.update_stats();
    EXPECT_EQ(u1.updates, u0.updates + 1);
    // Every record sits at the width the rule gives from its history and metadata (quantizer::width).
    for (int s = 0; s < batch; ++s)
      for (int h = 0; h < H; ++h) {
        const kvc::qaq::StepWidths<> rule(c.length(0, s), c.targets().key_sigma_s, 1.0, c.targets().value_sigma_x,
                                          Cache::quantizer::widths());
        const auto& hist = c.histories(0, s, h);
        for (int side = 0; side < 2; ++side)
          c.for_each_record(side == 0 ? c.keys(0, s, h) : c.values(0, s, h), [&](const std::byte* r, int b, std::uint32_t t) {
            ASSERT_EQ(b, Cache::quantizer::width(hist[t], Cache::record::meta(r), rule, side == 0))
                << "step " << step << " seq " << s << " head " << h << " side " << side << " token " << t;
          });
      }
    for (int side = 0; side < 2; ++side) {
      const std::vector<int>& before = side == 0 ? k0 : v0;
      const std::vector<int> after = widths(side);
      std::uint64_t lowered = 0, raised = 0;
      for (std::size_t i = 0; i < before.size(); ++i) lowered += after[i] < before[i], raised += after[i] > before[i];
      EXPECT_EQ(u1.records[side] - u0.records[side], before.size()) << "step " << step << " side " << side;
      EXPECT_EQ(u1.lowered[side] - u0.lowered[side], lowered) << "step " << step << " side " << side;
      EXPECT_EQ(u1.raised[side] - u0.raised[side], raised) << "step " << step << " side " << side;
    }
  }
  const kvc::qaq::UpdateStats u = c.update_stats();
  EXPECT_GT(u.lowered[1] + u.raised[1], 0u);  // values moved both ways over the steps
  EXPECT_GT(u.raised[1], 0u);
  // Widths did move: both sides hold several widths, and some tokens sit below B_max.
  for (int side = 0; side < 2; ++side) {
    const auto n = c.width_counts(0, side);
    int used = 0;
    for (int b = 1; b <= 8; ++b) used += n[std::size_t(b)] > 0;
    EXPECT_GE(used, 3) << "side " << side;
    EXPECT_LT(n[8], std::size_t(batch * H) * (40 + steps)) << "side " << side;
  }
}

TEST_P(QaqCacheAttention, MatchesTheOracleWhileWidthsChangeEveryStep) { matches_the_oracle_while_widths_change<Qaq>(GetParam()); }
// The same with K and V Hadamard-rotated (rotate/rotation.hpp): the outliers taken before the rotation (their
// terms with the un-rotated query, added to the un-rotated output), the residuals' records, mirror and raises in
// the rotated basis, the query rotated and the output un-rotated by the fused kernels; one side rotated; and
// without outliers (the whole row rotated).
TEST_P(QaqCacheAttention, RotatedMatchesTheOracleWhileWidthsChangeEveryStep) {
  matches_the_oracle_while_widths_change<kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>>(
      GetParam());
}
TEST_P(QaqCacheAttention, OneSideRotatedMatchesTheOracleWhileWidthsChangeEveryStep) {
  matches_the_oracle_while_widths_change<kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::RotateKeys<kvc::Hadamard<>>>>(
      GetParam());
  matches_the_oracle_while_widths_change<kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::RotateValues<kvc::Hadamard<>>>>(
      GetParam());
}
TEST_P(QaqCacheAttention, RotatedWithoutOutliersMatchesTheOracleWhileWidthsChangeEveryStep) {
  matches_the_oracle_while_widths_change<
      kvc::CompressedKVCache<kvc::QaqQuantizer<1, 8, 0>, kvc::Rotation<kvc::Hadamard<>>>>(GetParam());
}
// The 2-byte metadata (LogMeta): unrotated with outliers, and rotated without outliers at n = 1 (kvc-eval's
// qaq-a0n1-rot-lm).
TEST_P(QaqCacheAttention, LogMetaMatchesTheOracleWhileWidthsChangeEveryStep) {
  matches_the_oracle_while_widths_change<kvc::CompressedKVCache<LogQ<>>>(GetParam());
  matches_the_oracle_while_widths_change<kvc::CompressedKVCache<LogQ<1, 8, 0, 1>, kvc::Rotation<kvc::Hadamard<>>>>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Shapes, QaqCacheAttention,
                         ::testing::Values(QaqShape{64, 2, 2}, QaqShape{64, 1, 3}, QaqShape{128, 2, 8}, QaqShape{128, 3, 9},
                                           QaqShape{64, 1, 8}, QaqShape{128, 1, 16}, QaqShape{80, 2, 4}),
                         [](const auto& i) {
                           return "d" + std::to_string(i.param.d) + "_kv" + std::to_string(i.param.H) + "_q" +
                                  std::to_string(i.param.Hq);
                         });

// qaq_decode_step runs each stream's update right after its attention in one parallel loop: the same outputs,
// probabilities, buckets (byte for byte, in order) and histories as decode_attention then update_widths, over
// ragged batches, GQA groups with and without g % 4 == 0, thread counts, and steps whose tokens keep moving.
TEST(QaqCache, FusedStepEqualsAttentionThenUpdate) {
  for (const QaqShape shape : {QaqShape{64, 2, 8}, QaqShape{128, 3, 9}, QaqShape{32, 1, 1}})
    for (int threads : {1, 2, 3}) {
      const auto [d, H, Hq] = shape;
      const std::vector<int> prefill{9, 33, 2};
      const int steps = 14, batch = int(prefill.size());
      std::vector<kvc_test::KV> x;
      for (int s = 0; s < batch; ++s) x.push_back(kvc_test::random_kv(prefill[std::size_t(s)] + steps, H, d, 300 + s));
      Qaq fused({2, batch, H, d, 64}, {1e-2, 5e-2}, unit_calibration(2, H, d)), apart = fused;
      for (Qaq* c : {&fused, &apart})
        for (int l = 0; l < 2; ++l)
          for (int s = 0; s < batch; ++s)
            c->append(l, s, x[std::size_t(s)].kview(0, prefill[std::size_t(s)]), x[std::size_t(s)].vview(0, prefill[std::size_t(s)]));
      kvc::AttentionOptions opt;  // 1 thread: the portable kernel (where compiled); 3: kExact; 2: the default
      opt.num_threads = threads;
      if (threads == 1 && kvc::isa_compiled(kvc::Isa::kPortable)) opt.isa = kvc::Isa::kPortable;
      if (threads == 3) opt.precision = kvc::Precision::kExact;
      kvc::qaq::TokenProbs pf, pa;
      for (int step = 0; step < steps; ++step) {
        const int layer = step % 2;
        for (Qaq* c : {&fused, &apart})
          for (int s = 0; s < batch; ++s)
            c->append(layer, s, x[std::size_t(s)].kview(prefill[std::size_t(s)] + step, 1),
                      x[std::size_t(s)].vview(prefill[std::size_t(s)] + step, 1));
        const std::vector<float> q = kvc_test::random_query(batch, Hq, d, 900 + step);
        ASSERT_TRUE(kvc::qaq::detail::scores_cannot_overflow(kvc::QueryView::contiguous(q.data(), batch, Hq, d), d, opt));
        std::vector<float> of(q.size()), oa(q.size());
        kvc::qaq_decode_step(fused, layer, kvc::QueryView::contiguous(q.data(), batch, Hq, d),
                             kvc::OutputView::contiguous(of.data(), batch, Hq, d), opt, pf);
        kvc::decode_attention(apart, layer, kvc::QueryView::contiguous(q.data(), batch, Hq, d),
                              kvc::OutputView::contiguous(oa.data(), batch, Hq, d), opt, &pa);
        apart.update_widths(layer, pa);
        const std::string at = "d " + std::to_string(d) + " Hq " + std::to_string(Hq) + " threads " +
                               std::to_string(threads) + " step " + std::to_string(step);
        ASSERT_TRUE(kvc_test::bytes_equal(of, oa)) << at;
        for (int s = 0; s < batch; ++s)
          for (int h = 0; h < H; ++h) {
            ASSERT_EQ(0, std::memcmp(pf.row(s, h), pa.row(s, h), sizeof(float) * std::size_t(fused.length(layer, s)))) << at;
            for (int side = 0; side < 2; ++side)
              ASSERT_EQ((side == 0 ? fused.keys(layer, s, h) : fused.values(layer, s, h)).bucket,
                        (side == 0 ? apart.keys(layer, s, h) : apart.values(layer, s, h)).bucket)
                  << at << " seq " << s << " head " << h << " side " << side;
            const auto &hf = fused.histories(layer, s, h), &ha = apart.histories(layer, s, h);
            ASSERT_EQ(hf.size(), ha.size()) << at;
            ASSERT_EQ(0, std::memcmp(hf.data(), ha.data(), hf.size() * sizeof(hf[0]))) << at;
          }
        const kvc::qaq::UpdateStats uf = fused.update_stats(), ua = apart.update_stats();
        ASSERT_EQ(uf.updates, ua.updates) << at;
        ASSERT_EQ(uf.records, ua.records) << at;
        ASSERT_EQ(uf.lowered, ua.lowered) << at;
        ASSERT_EQ(uf.raised, ua.raised) << at;
      }
      EXPECT_GT(fused.update_stats().lowered[1] + fused.update_stats().raised[1], 0u);  // tokens did move
    }
}

// A step qaq_decode_step rejects changes nothing: not a history, not a record, not the step count. The cache has
// taken good steps first (full histories, tokens moving), so a step that ran would change it; scores that
// overflow float (a huge query, or a finite scale whose float product with log2(e) is not) take the two halves
// apart and fail before the update; bad views fail before the overflow test reads them.
TEST(QaqCache, FusedStepErrorsLeaveTheCacheUnchanged) {
  const int d = 64, H = 2, Hq = 4, batch = 2, T = 20;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 12);
  Qaq c({1, batch, H, d, 32}, {1e-2, 5e-2}, unit_calibration(1, H, d));
  c.append(0, 0, x.kview(0, T), x.vview(0, T));
  c.append(0, 1, x.kview(0, 11), x.vview(0, 11));
  kvc::qaq::TokenProbs probs;
  std::vector<float> out(std::size_t(batch) * Hq * d);
  const auto ov = kvc::OutputView::contiguous(out.data(), batch, Hq, d);
  for (int step = 0; step < 7; ++step) {
    const std::vector<float> q = kvc_test::random_query(batch, Hq, d, 40 + step);
    kvc::qaq_decode_step(c, 0, kvc::QueryView::contiguous(q.data(), batch, Hq, d), ov, {}, probs);
  }
  ASSERT_GT(c.update_stats().lowered[1] + c.update_stats().raised[1], 0u);
  struct Snapshot {
    std::vector<std::vector<std::byte>> buckets;
    std::vector<std::uint8_t> histories;
    kvc::qaq::UpdateStats stats;
  };
  auto snapshot = [&] {
    Snapshot sn;
    for (int s = 0; s < batch; ++s)
      for (int h = 0; h < H; ++h) {
        for (const auto* sd : {&c.keys(0, s, h), &c.values(0, s, h)})
          for (const auto& b : sd->bucket) sn.buckets.push_back(b);
        const auto& hist = c.histories(0, s, h);
        const auto* p = reinterpret_cast<const std::uint8_t*>(hist.data());
        sn.histories.insert(sn.histories.end(), p, p + hist.size() * sizeof(hist[0]));
      }
    sn.stats = c.update_stats();
    return sn;
  };
  const Snapshot before = snapshot();
  auto expect_unchanged = [&](const char* what) {
    const Snapshot now = snapshot();
    EXPECT_TRUE(now.buckets == before.buckets) << what;
    EXPECT_TRUE(now.histories == before.histories) << what;
    EXPECT_EQ(now.stats.updates, before.stats.updates) << what;
    EXPECT_EQ(now.stats.records, before.stats.records) << what;
  };
  const std::vector<float> good = kvc_test::random_query(batch, Hq, d, 99);
  const std::vector<float> huge(good.size(), 3e38f), zero(good.size(), 0.0f);
  const auto huge_q = kvc::QueryView::contiguous(huge.data(), batch, Hq, d);
  EXPECT_FALSE(kvc::qaq::detail::scores_cannot_overflow(huge_q, d, {}));
  EXPECT_EQ(error_of([&] { kvc::qaq_decode_step(c, 0, huge_q, ov, {}, probs); }), kvc::Errc::kOutOfRange);
  expect_unchanged("huge query");
  kvc::AttentionOptions big_scale;
  big_scale.scale = 3e38f;  // finite, accepted; times log2(e) in float: infinite, so 0 * inf = NaN scores
  const auto zero_q = kvc::QueryView::contiguous(zero.data(), batch, Hq, d);
  EXPECT_FALSE(kvc::qaq::detail::scores_cannot_overflow(zero_q, d, big_scale));
  EXPECT_EQ(error_of([&] { kvc::qaq_decode_step(c, 0, zero_q, ov, big_scale, probs); }), kvc::Errc::kOutOfRange);
  expect_unchanged("scale overflowing float");
  kvc::QueryView null_q = kvc::QueryView::contiguous(good.data(), batch, Hq, d);
  null_q.data = nullptr;
  EXPECT_EQ(error_of([&] { kvc::qaq_decode_step(c, 0, null_q, ov, {}, probs); }), kvc::Errc::kInvalidArgument);
  expect_unchanged("null query");
  EXPECT_EQ(error_of([&] {
              kvc::qaq_decode_step(c, 0, kvc::QueryView::contiguous(good.data(), batch, Hq / 2, 2 * d), ov, {}, probs);
            }),
            kvc::Errc::kInvalidArgument);
  expect_unchanged("head_dim");
  EXPECT_EQ(error_of([&] { kvc::qaq_decode_step(c, 1, kvc::QueryView::contiguous(good.data(), batch, Hq, d), ov, {}, probs); }),
            kvc::Errc::kInvalidArgument);
  expect_unchanged("layer");
  // and the good step after them runs (and changes the cache)
  kvc::qaq_decode_step(c, 0, kvc::QueryView::contiguous(good.data(), batch, Hq, d), ov, {}, probs);
  EXPECT_EQ(c.update_stats().updates, before.stats.updates + 1);
}

/// Every record of (layer 0, seq) reconstructs exactly as the original (x; with a Rotation, R x rounded to fp16 as
/// the mirror holds it; on a split side the outliers of x and the rotated residual's codes) quantized at the
/// record's width.
template <class Cache>
void expect_records_are_the_original_at_their_width(const Cache& c, int seq, const kvc_test::KV& x) {
  using Q = typename Cache::quantizer;
  const int d = x.d;
  for (int h = 0; h < x.H; ++h)
    for (int side = 0; side < 2; ++side) {
      const auto& sd = side == 0 ? c.keys(0, seq, h) : c.values(0, seq, h);
      c.for_each_record(sd, [&](const std::byte* r, int b, std::uint32_t t) {
        const std::size_t n = static_cast<std::size_t>(d);
        std::vector<float> orig(n), got(n), fresh(n);
        for (int i = 0; i < d; ++i) orig[std::size_t(i)] = (side == 0 ? x.k : x.v)[x.at(int(t), h, i)];
        if (side == 0 ? Cache::kSplitKeys : Cache::kSplitValues) {
          // the outliers taken in the original basis and kept as they are; the codes are the rotated residual's
          const int no = Q::outliers(d);
          std::vector<std::uint8_t> idx(std::size_t(no), 0);
          std::vector<kvc::half_t> val(static_cast<std::size_t>(no));
          std::uint32_t taken[Q::kMaxHeadDim / 32] = {};
          Q::select_outliers(orig.data(), d, idx.data(), val.data(), taken);
          std::vector<float> sorted = orig;  // the outliers are x's k smallest and k largest values, as fp16
          std::sort(sorted.begin(), sorted.end());
          for (int j = 0; j < no; ++j) {
            const float want = j < no / 2 ? sorted[std::size_t(j)] : sorted[n - 1 - std::size_t(j - no / 2)];
            ASSERT_EQ(val[std::size_t(j)].bits, kvc::half_t::from_float(want).bits) << "outlier " << j;
          }
          for (int j = 0; j < no; ++j) {
            ASSERT_EQ(Cache::record::outlier_channels(r, d, b)[j], idx[std::size_t(j)]);
            ASSERT_EQ(Cache::record::outlier_values(r, d, b)[j].bits, val[std::size_t(j)].bits);
            orig[idx[std::size_t(j)]] = 0.0f;
          }
          Cache::rotation::rotate(side == 0, c.rotation_tables(0), h, d, orig.data());
          for (float& o : orig) o = kvc::half_t::from_float(o).to_float();
          std::vector<std::uint8_t> c8(n);
          const kvc::QuantMeta m = Q::quantize_all(orig.data(), d, c8.data());
          for (int i = 0; i < d; ++i) fresh[std::size_t(i)] = Q::decode(m, b, Q::narrow(c8[std::size_t(i)], b));
          kvc::qaq::RecordFormat<Q, true>::decode(r, d, b, got.data());
          ASSERT_EQ(got, fresh) << "split side " << side << " head " << h << " token " << t << " width " << b;
          return;
        }
        if constexpr (Cache::kRotated) Cache::rotation::rotate(side == 0, c.rotation_tables(0), h, d, orig.data());
        for (float& o : orig) o = kvc::half_t::from_float(o).to_float();
        Cache::record::decode(r, d, b, got.data());
        const Coded f = code<Q>(orig);
        std::vector<std::uint8_t> cb(n);
        for (int i = 0; i < d; ++i) cb[std::size_t(i)] = Q::narrow(f.codes[std::size_t(i)], b);
        Q::decode_token(f.m, b, cb.data(), f.idx.data(), f.val.data(), d, fresh.data());
        ASSERT_EQ(got, fresh) << "side " << side << " head " << h << " token " << t << " width " << b;
      });
    }
}

template <class Cache>
void lowering_shifts_and_raising_restores_from_the_mirror(int d) {
  const int H = 2, T = 60;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 42);
  Cache c({1, 1, H, d, 64}, {1.0, 1.0}, unit_calibration(1, H, d));
  c.append(0, 0, x.kview(0, T), x.vview(0, T));
  expect_records_are_the_original_at_their_width(c, 0, x);  // all at B_max
  EXPECT_EQ(c.width_counts(0, 0)[8], std::size_t(H * T));
  kvc::qaq::TokenProbs probs;
  probs.resize(1, H, T);
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) probs.row(0, h)[t] = 1.0f / float(1 + t);
  for (int i = 0; i < 4; ++i) c.update_widths(0, probs);  // fewer than n = 5 observations: B_max stays
  EXPECT_EQ(c.width_counts(0, 0)[8], std::size_t(H * T));
  EXPECT_EQ(c.width_counts(0, 1)[8], std::size_t(H * T));
  c.update_widths(0, probs);  // the fifth: loose targets lower everything
  const double loose_k = c.average_width(0), loose_v = c.average_width(1);
  EXPECT_LT(loose_k, 3.0);
  EXPECT_LT(loose_v, 3.0);
  expect_records_are_the_original_at_their_width(c, 0, x);
  c.set_targets({1e-4, 1e-4});
  c.update_widths(0, probs);  // tight targets: raised from the mirror
  EXPECT_GT(c.average_width(0), loose_k + 2.0);
  EXPECT_GT(c.average_width(1), loose_v + 2.0);
  expect_records_are_the_original_at_their_width(c, 0, x);
  c.set_targets({3e-2, 3e-2});
  c.update_widths(0, probs);  // and down again, by shifts
  expect_records_are_the_original_at_their_width(c, 0, x);
  // Attention-aware values: the most attended token holds at least the width of the least attended one.
  int first = -1, last = -1;
  c.for_each_record(c.values(0, 0, 0), [&](const std::byte*, int b, std::uint32_t t) {
    if (t == 0) first = b;
    if (t == std::uint32_t(T - 1)) last = b;
  });
  EXPECT_GE(first, last);
}

TEST(QaqCache, LoweringShiftsAndRaisingRestoresFromTheMirror) { lowering_shifts_and_raising_restores_from_the_mirror<Qaq>(64); }
// Rotated: the mirror holds R (x - o), from which raises re-encode (d 64: one Hadamard block; 96: 3 mixed blocks
// of 32); without outliers R x; one side rotated, the other as the plain cache.
TEST(QaqCache, RotatedLoweringShiftsAndRaisingRestoresFromTheRotatedMirror) {
  using Rotated = kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>;
  static_assert(Rotated::kSplitKeys && Rotated::kSplitValues);
  lowering_shifts_and_raising_restores_from_the_mirror<Rotated>(64);
  lowering_shifts_and_raising_restores_from_the_mirror<Rotated>(96);
  using NoOutliers = kvc::CompressedKVCache<kvc::QaqQuantizer<1, 8, 0>, kvc::Rotation<kvc::Hadamard<>>>;
  static_assert(!NoOutliers::kSplitKeys && !NoOutliers::kSplitValues);
  lowering_shifts_and_raising_restores_from_the_mirror<NoOutliers>(64);
  lowering_shifts_and_raising_restores_from_the_mirror<kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::RotateKeys<kvc::Hadamard<>>>>(64);
  lowering_shifts_and_raising_restores_from_the_mirror<kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::RotateValues<kvc::Hadamard<>>>>(96);
}
TEST(QaqCache, LogMetaLoweringShiftsAndRaisingRestoresFromTheMirror) {
  lowering_shifts_and_raising_restores_from_the_mirror<kvc::CompressedKVCache<LogQ<>>>(64);
  lowering_shifts_and_raising_restores_from_the_mirror<kvc::CompressedKVCache<LogQ<1, 8, 0>, kvc::Rotation<kvc::Hadamard<>>>>(64);
}

// A rotated cache with outliers reconstructs x^ = R^T y^ + o in the original basis: with a few channels 60x larger
// than the rest (the outliers of every token), ||x^ - x|| <= sqrt(d) step / 2 (the residual's codes; R is
// orthonormal) + 2^-10 ||x|| (fp16 roundings of the residual and of the outliers), per token, head and side, at
// B_max; and the step is set by the residual, not by the large channels.
TEST(QaqCache, RotatedWithOutliersReconstructsTheInputInTheOriginalBasis) {
  using Rotated = kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>;
  using R = Rotated::record;
  for (int d : {64, 96}) {
    const int H = 2, T = 40;
    kvc_test::KV x = kvc_test::random_kv(T, H, d, 77);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        x.k[x.at(t, h, 3)] = 60.0f * std::fabs(x.k[x.at(t, h, 3)]) + 60.0f;  // one large channel per side and token
        x.v[x.at(t, h, d - 5)] = -60.0f * std::fabs(x.v[x.at(t, h, d - 5)]) - 60.0f;
      }
    Rotated c({1, 1, H, d, 64}, {1e-2, 1e-2}, unit_calibration(1, H, d));
    c.append(0, 0, x.kview(0, T), x.vview(0, T));
    const auto got = kvc_test::dequantize(c, 0, 0);
    double worst = 0.0;  // the largest error relative to its bound
    for (int h = 0; h < H; ++h)
      for (int side = 0; side < 2; ++side)
        c.for_each_record(side == 0 ? c.keys(0, 0, h) : c.values(0, 0, h), [&](const std::byte* r, int b, std::uint32_t t) {
          ASSERT_EQ(b, 8);
          const std::vector<float>& in = side == 0 ? x.k : x.v;
          const std::vector<float>& out = side == 0 ? got.k : got.v;
          double err2 = 0.0, norm2 = 0.0, big = 0.0;
          for (int i = 0; i < d; ++i) {
            const double e = double(out[x.at(int(t), h, i)]) - in[x.at(int(t), h, i)];
            err2 += e * e;
            norm2 += double(in[x.at(int(t), h, i)]) * in[x.at(int(t), h, i)];
            big = std::max(big, std::fabs(double(in[x.at(int(t), h, i)])));
          }
          const double step = R::meta(r).step.to_float();
          const double bound = std::sqrt(double(d)) * step / 2.0 + std::ldexp(std::sqrt(norm2), -10);
          EXPECT_LE(std::sqrt(err2), bound) << "d " << d << " side " << side << " head " << h << " token " << t;
          worst = std::max(worst, std::sqrt(err2) / bound);
          // the residual's range, not the large channel's: step well under what the whole row would need
          EXPECT_LT(step * 256.0, 0.5 * big) << "d " << d << " side " << side << " token " << t;
        });
    EXPECT_GT(worst, 0.01);  // the bound is not vacuous
  }
}

// Keys are re-decided only when the step's key limits change (decide_keys): at long context they stay equal for
// several steps while tokens keep filling their histories. Whichever path a step takes, every key (and value,
// decided through the same fullness partition) must sit at the rule's width after it: across steps with equal
// and with changed limits, a target change, ragged streams (a second sequence of another length) and a cleared,
// refilled sequence.
// Run with windows n = 5 and n = 1 (with n = 1 a refilled history is full after its first step).
template <class Cache>
void keys_follow_the_rule() {
  const int d = 64, H = 2, L = 2, T0 = 3000, steps = 40, burst = 50, cap = T0 + steps + burst + 8;
  const std::vector<int> prefill{T0, T0 / 3};
  const int batch = int(prefill.size());
  std::vector<kvc_test::KV> x;
  for (int s = 0; s < batch; ++s) x.push_back(kvc_test::random_kv(cap, H, d, 500 + s));
  Cache c({L, batch, H, d, cap}, {1e-4, 1e-2}, unit_calibration(L, H, d));
  auto append = [&](int l, int s, int n) {
    const int t = c.length(l, s);
    c.append(l, s, x[std::size_t(s)].kview(t, n), x[std::size_t(s)].vview(t, n));
  };
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < batch; ++s) append(l, s, prefill[std::size_t(s)]);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  kvc::qaq::TokenProbs probs;
  auto step = [&](int l) {
    probs.resize(batch, H, cap);
    for (float& p : probs.p) p = u(rng) * u(rng) * 0.01f;
    c.update_widths(l, probs);
  };
  auto key_limits = [&](int T) {
    const kvc::qaq::StepWidths<> rule(T, c.targets().key_sigma_s, 1.0, c.targets().value_sigma_x, Cache::quantizer::widths());
    return typename Cache::quantizer::StepLimits(rule).key_limits();
  };
  auto expect_keys_at_the_rule = [&](const std::string& when) {
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < batch; ++s)
        for (int h = 0; h < H; ++h) {
          const kvc::qaq::StepWidths<> rule(c.length(l, s), c.targets().key_sigma_s, 1.0, c.targets().value_sigma_x,
                                            Cache::quantizer::widths());
          const auto& hist = c.histories(l, s, h);
          for (int side = 0; side < 2; ++side)  // values too: the same fullness partition decides them
            c.for_each_record(side == 0 ? c.keys(l, s, h) : c.values(l, s, h), [&](const std::byte* r, int b,
                                                                                  std::uint32_t t) {
              ASSERT_EQ(b, Cache::quantizer::width(hist[t], Cache::record::meta(r), rule, side == 0))
                  << when << " layer " << l << " seq " << s << " head " << h << " token " << t << " side " << side;
            });
        }
  };
  // Layer 0 is updated every step, layer 1 every third (a layer's widths follow its own updates).
  int same = 0, changed = 0;
  for (int i = 0; i < steps; ++i) {
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < batch; ++s) append(l, s, 1);
    (key_limits(c.length(0, 0)) == key_limits(c.length(0, 0) - 1) ? same : changed) += 1;
    step(0);
    if (i % 3 == 2) step(1);
    if (i % 3 == 2) expect_keys_at_the_rule("step " + std::to_string(i));
    if (i == steps / 2) {
      c.set_targets({3e-4, 1e-2});  // new limits at the same length
      step(0);
      step(1);
      expect_keys_at_the_rule("after the target change");
    }
  }
  EXPECT_GT(same, 0);  // both paths ran (sequence 0's limits; sequence 1's change more often)
  EXPECT_GT(changed, 0);
  int used = 0;
  for (std::size_t n : c.width_counts(0, 0)) used += n > 0;
  EXPECT_GE(used, 3);  // keys spread over several widths
  // A burst of tokens after the histories filled, then steps without appends: the new tokens fill and are
  // decided while older keys keep their widths.
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < batch; ++s) append(l, s, burst);
  for (int i = 0; i < 7; ++i) {
    step(0);
    step(1);
    expect_keys_at_the_rule("after the burst, step " + std::to_string(i));
  }
  // A cleared sequence refilled to the same length (so the same limits) starts over: once its histories fill,
  // its keys are decided.
  const int refill = c.length(0, 1);
  c.clear(1);
  for (int l = 0; l < L; ++l) append(l, 1, refill);
  for (int i = 0; i < 7; ++i) {
    step(0);
    step(1);
    expect_keys_at_the_rule("after clear, step " + std::to_string(i));
  }
  EXPECT_LT(c.width_counts(0, 0)[8], std::size_t(H) * cap);
}
TEST(QaqCache, KeysFollowTheRuleWhetherOrNotTheStepsLimitsChange) {
  keys_follow_the_rule<Qaq>();
  keys_follow_the_rule<kvc::CompressedKVCache<kvc::QaqQuantizer<1, 8, 10, 1>>>();
}

// The device arena (qaq/arena.hpp) is the host buckets back to back: bucket offsets and the record numbering
// that the device kernels use find every host record, in bucket order.
TEST(QaqArena, AddressesEveryRecordOfTheHostBuckets) {
  const int d = 64, H = 1;
  Qaq c({1, 1, H, d, 256}, {3e-2, 1e-1}, unit_calibration(1, H, d));
  const auto x = kvc_test::random_kv(200, H, d, 9);
  c.append(0, 0, x.kview(0, 200), x.vview(0, 200));
  kvc::qaq::TokenProbs probs;
  for (int step = 0; step < 6; ++step) {  // move widths: a spread of probabilities
    probs.resize(1, H, 200);
    for (int t = 0; t < 200; ++t) probs.row(0, 0)[t] = std::exp2(-float(t % 23));
    c.update_widths(0, probs);
  }
  using A = kvc::qaq::Arena<Qaq::quantizer>;
  for (int side = 0; side < 2; ++side) {
    const auto& sd = side == 0 ? c.keys(0, 0, 0) : c.values(0, 0, 0);
    std::vector<std::byte> arena;
    std::uint32_t n[A::kWidths];
    int used = 0;
    for (int w = 0; w < A::kWidths; ++w) {
      const auto& bk = sd.bucket[std::size_t(w)];
      ASSERT_EQ(A::bucket_offset(n, w + 1, d, c.id_bytes()), arena.size()) << "side " << side << " width " << w + 1;
      arena.insert(arena.end(), bk.begin(), bk.end());
      n[w] = std::uint32_t(c.records(sd, w + 1));
      used += n[w] > 0;
    }
    EXPECT_GE(used, 3) << "side " << side;
    EXPECT_GE(A::bytes(d, 256, c.id_bytes()), arena.size());
    EXPECT_EQ(A::bytes(d, 256, c.id_bytes()) % 16, 0u);
    std::uint32_t i = 0;
    c.for_each_record(sd, [&](const std::byte* r, int b, std::uint32_t t) {
      const auto sl = A::slot(n, i++, d, c.id_bytes());
      ASSERT_EQ(sl.width, b);
      ASSERT_EQ(std::memcmp(arena.data() + sl.offset, r, Qaq::record::bytes(d, b, c.id_bytes())), 0);
      ASSERT_EQ(Qaq::record::token(arena.data() + sl.offset, d, b, c.id_bytes()), t);
    });
    EXPECT_EQ(i, 200u);
  }
}

TEST(QaqCache, AccountingCountsRecordsHistoriesAndTheMirrorApart) {
  const int d = 64, H = 2, T = 10;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 9);
  Qaq c({1, 1, H, d, 100}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  EXPECT_EQ(c.id_bytes(), 2);
  c.append(0, 0, x.kview(0, T), x.vview(0, T));
  // Per token and KV head: two records at 8 bits of 4 (lo, step) + 64 (codes) + 2 x 3 (outliers) + 2 (id) bytes,
  // and the 6-byte history.
  EXPECT_EQ(c.stored_bytes(), std::size_t(T * H * (2 * 76 + 6)));
  EXPECT_DOUBLE_EQ(c.bits_per_element(), 8.0 * (2 * 76 + 6) / (2 * 64));
  EXPECT_EQ(c.mirror_bytes(), std::size_t(T * H * 2 * d * 2));
  EXPECT_EQ(c.decode_read_bytes(0), c.stored_bytes(0));
  Qaq big({1, 1, H, d, 70000}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  EXPECT_EQ(big.id_bytes(), 4);
  // LogMeta: 2 metadata bytes per record instead of 4 (0.25 bits/element less at d = 64)
  kvc::CompressedKVCache<LogQ<>> lm({1, 1, H, d, 100}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  lm.append(0, 0, x.kview(0, T), x.vview(0, T));
  EXPECT_EQ(lm.stored_bytes(), std::size_t(T * H * (2 * 74 + 6)));
  EXPECT_DOUBLE_EQ(c.bits_per_element() - lm.bits_per_element(), 0.25);
}

TEST(QaqCache, BadInputIsRejectedAndLeavesTheCacheUnchanged) {
  const int d = 64, H = 2, T = 12;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 4);
  const auto calib = unit_calibration(1, H, d);
  EXPECT_EQ(error_of([&] { Qaq({1, 1, H, d, 64}, {0.0, 1.0}, calib); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { Qaq({1, 1, H, d, 64}, {1.0, std::nan("")}, calib); }), kvc::Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { Qaq({1, 1, 3, d, 64}, {1.0, 1.0}, calib); }), kvc::Errc::kInvalidArgument);  // shape
  EXPECT_EQ(error_of([&] { Qaq({1, 1, H, 272, 64}, {1.0, 1.0}, unit_calibration(1, H, 272)); }),
            kvc::Errc::kInvalidArgument);  // head_dim > 256
  kvc::qaq::QueryNormCalibration unset(1, H, d);
  unset.queries = 1;
  EXPECT_EQ(error_of([&] { Qaq({1, 1, H, d, 64}, {1.0, 1.0}, unset); }), kvc::Errc::kInvalidArgument);

  Qaq c({1, 2, H, d, 16}, {1e-2, 1e-2}, calib);
  c.append(0, 0, x.kview(0, 8), x.vview(0, 8));
  c.append(0, 1, x.kview(0, 3), x.vview(0, 3));
  const auto before = kvc_test::dequantize(c, 0, 0);
  const std::size_t bytes = c.stored_bytes();
  auto unchanged = [&] {
    EXPECT_EQ(c.length(0, 0), 8);
    EXPECT_EQ(c.stored_bytes(), bytes);
    const auto now = kvc_test::dequantize(c, 0, 0);
    EXPECT_TRUE(kvc_test::bytes_equal(now.k, before.k) && kvc_test::bytes_equal(now.v, before.v));
  };
  kvc_test::KV bad = x.prefix(2);
  bad.k[std::size_t(d + 5)] = std::nanf("");
  EXPECT_EQ(error_of([&] { c.append(0, 0, bad.kview(0, 2), bad.vview(0, 2)); }), kvc::Errc::kNonFinite);
  unchanged();
  bad = x.prefix(2);
  bad.v[3] = 1e6f;
  EXPECT_EQ(error_of([&] { c.append(0, 0, bad.kview(0, 2), bad.vview(0, 2)); }), kvc::Errc::kOutOfRange);
  unchanged();
  EXPECT_EQ(error_of([&] { c.append(0, 0, x.kview(0, 9), x.vview(0, 9)); }), kvc::Errc::kCapacityExceeded);
  unchanged();
  kvc::qaq::TokenProbs probs;
  probs.resize(2, H, 8);
  probs.row(0, 1)[7] = 1.5f;
  EXPECT_EQ(error_of([&] { c.update_widths(0, probs); }), kvc::Errc::kInvalidArgument);
  unchanged();
  for (float p : {std::nanf(""), -0.25f, std::numeric_limits<float>::infinity()}) {  // named: sequence, head, token
    probs.resize(2, H, 8);
    probs.row(1, 0)[2] = p;
    std::string what;
    EXPECT_EQ(error_of([&] { c.update_widths(0, probs); }, &what), kvc::Errc::kInvalidArgument) << p;
    EXPECT_NE(what.find("sequence 1 KV head 0 token 2"), std::string::npos) << what;
    unchanged();
  }
  probs.resize(2, H, 4);  // too short for sequence 0
  EXPECT_EQ(error_of([&] { c.update_widths(0, probs); }), kvc::Errc::kInvalidArgument);
  unchanged();
  const std::vector<float> q = kvc_test::random_query(1, H, d, 3);
  std::vector<float> out(q.size());
  EXPECT_EQ(error_of([&] {
              kvc::qaq_decode_step(c, 0, kvc::QueryView::contiguous(q.data(), 1, H, d),
                                   kvc::OutputView::contiguous(out.data(), 1, H, d), {}, probs);
            }),
            kvc::Errc::kInvalidArgument);  // one of two sequences
  unchanged();
  EXPECT_EQ(error_of([&] { c.clear(2); }), kvc::Errc::kInvalidArgument);  // the cache has two sequences
  EXPECT_EQ(error_of([&] { c.clear(-1); }), kvc::Errc::kInvalidArgument);
  unchanged();
}

// A rotated QAQ cache: a row whose rotation leaves fp16's range is refused naming the rotated channel, NaN before rotation names the input channel; the cache is unchanged.
TEST(QaqCache, RotatedBadInputIsRejectedAndLeavesTheCacheUnchanged) {
  using Rotated = kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>;
  const int d = 64, H = 2, T = 6;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 9);
  Rotated c({1, 1, H, d, 16}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  c.append(0, 0, x.kview(0, 4), x.vview(0, 4));
  const auto before = kvc_test::dequantize(c, 0, 0);
  const std::size_t bytes = c.stored_bytes(), mirror = c.mirror_bytes();
  auto unchanged = [&] {
    EXPECT_EQ(c.length(0, 0), 4);
    EXPECT_EQ(c.stored_bytes(), bytes);
    EXPECT_EQ(c.mirror_bytes(), mirror);
    const auto now = kvc_test::dequantize(c, 0, 0);
    EXPECT_TRUE(kvc_test::bytes_equal(now.k, before.k) && kvc_test::bytes_equal(now.v, before.v));
  };
  kvc_test::KV bad = x.prefix(2);
  for (int i = 0; i < d; ++i) bad.v[std::size_t(x.at(1, 1, i))] = 60000.0f;  // each < 65504; R v has rms 60000
  std::string what;
  EXPECT_EQ(error_of([&] { c.append(0, 0, bad.kview(0, 2), bad.vview(0, 2)); }, &what), kvc::Errc::kOutOfRange);
  EXPECT_NE(what.find("value token 1 head 1 rotated channel"), std::string::npos) << what;
  unchanged();
  bad = x.prefix(2);
  bad.k[std::size_t(x.at(0, 1, 7))] = std::nanf("");
  EXPECT_EQ(error_of([&] { c.append(0, 0, bad.kview(0, 2), bad.vview(0, 2)); }, &what), kvc::Errc::kNonFinite);
  EXPECT_NE(what.find("key token 0 head 1 channel 7"), std::string::npos) << what;
  unchanged();
  bad = x.prefix(2);
  bad.k[std::size_t(x.at(1, 0, 9))] = 1e6f;  // an outlier, taken before the rotation and kept in fp16: out of range
  EXPECT_EQ(error_of([&] { c.append(0, 0, bad.kview(0, 2), bad.vview(0, 2)); }, &what), kvc::Errc::kOutOfRange);
  EXPECT_NE(what.find("key token 1 head 0 channel 9 = "), std::string::npos) << what;
  unchanged();
  // the tables are part of the compressed cache: every decode step reads them
  Rotated e({1, 1, H, d, 16}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  kvc::CompressedKVCache<kvc::QaqQuantizer<>> plain({1, 1, H, d, 16}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  EXPECT_EQ(e.stored_bytes(), 0u);
  e.append(0, 0, x.kview(0, 4), x.vview(0, 4));
  plain.append(0, 0, x.kview(0, 4), x.vview(0, 4));
  EXPECT_EQ(e.stored_bytes(), plain.stored_bytes() + std::size_t(H) * Rotated::rotation::head_words(d) * 4);
}
}  // namespace

namespace {
// Every width's kernels (each width unpacks its own way; a cache with BMin == BMax holds one width), every path
// this CPU runs, head dims 64, 80 and 128, GQA 3 and 4: kFast within 5 % of the scheme's own error, kExact at
// float rounding.
template <int W>
void check_one_width(int d, int H, int Hq) {
  using Fixed = kvc::CompressedKVCache<kvc::QaqQuantizer<W, W>>;
  const int T = 70;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 300 + W);
  Fixed c({1, 1, H, d, T}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  c.append(0, 0, x.kview(0, T), x.vview(0, T));
  const std::vector<float> q = kvc_test::random_query(1, Hq, d, 40 + W);
  std::vector<float> out(q.size()), want(q.size()), exact(q.size());
  const auto kv = kvc_test::dequantize(c, 0, 0);
  kvc::reference::decode_attention(q.data(), Hq, kv.k.data(), kv.v.data(), T, H, d, want.data());
  kvc::reference::decode_attention(q.data(), Hq, x.k.data(), x.v.data(), T, H, d, exact.data());
  double scheme2 = 0.0;
  for (std::size_t i = 0; i < q.size(); ++i) scheme2 += (double(exact[i]) - want[i]) * (double(exact[i]) - want[i]);
  for (kvc::Isa isa : kvc_test::runnable_isas())
    for (int form = 0; form < 2; ++form) {  // kExact, kFast
      kvc::AttentionOptions opt;
      opt.isa = isa;
      opt.precision = form == 0 ? kvc::Precision::kExact : kvc::Precision::kFast;
      kvc::decode_attention(c, 0, kvc::QueryView::contiguous(q.data(), 1, Hq, d),
                            kvc::OutputView::contiguous(out.data(), 1, Hq, d), opt);
      double err2 = 0.0;
      for (std::size_t i = 0; i < q.size(); ++i) {
        if (form == 0) {
          ASSERT_NEAR(out[i], want[i], 2e-5) << "width " << W << " d " << d << " isa " << int(isa);
        }
        err2 += (double(out[i]) - want[i]) * (double(out[i]) - want[i]);
      }
      EXPECT_LE(std::sqrt(err2), 0.05 * std::sqrt(scheme2))
          << "width " << W << " d " << d << " g " << Hq / H << " isa " << int(isa) << " form " << form;
    }
}

TEST(QaqCacheAttention, EveryWidthOnEveryPathMatchesTheOracle) {
  for (const QaqShape sh : {QaqShape{64, 2, 8}, QaqShape{128, 1, 3}, QaqShape{80, 1, 4}})
    [&]<int... W>(std::integer_sequence<int, W...>) {
      (check_one_width<W + 1>(sh.d, sh.H, sh.Hq), ...);
    }(std::make_integer_sequence<int, 8>{});
}

// BMin == BMax: per-token uniform quantization with QAQ's codec and outliers (the paper's Fig. 4 baseline).
TEST(QaqCache, FixedWidthIsPerTokenUniformWithoutIdsOrHistories) {
  using Fixed = kvc::CompressedKVCache<kvc::QaqQuantizer<3, 3>>;
  static_assert(!Fixed::kAdaptive);
  const int d = 64, H = 2, Hq = 6, T = 37;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 77);
  Fixed c({1, 1, H, d, 64}, {1e-2, 1e-2}, unit_calibration(1, H, d));
  EXPECT_EQ(c.id_bytes(), 0);
  c.append(0, 0, x.kview(0, 20), x.vview(0, 20));
  c.append(0, 0, x.kview(20, T - 20), x.vview(20, T - 20));
  // Per token, KV head and side: lo, step (4) + 64 x 3 bits (24) + 2 outliers x 3 bytes.
  EXPECT_EQ(c.stored_bytes(), std::size_t(T * H * 2 * 34));
  const std::vector<float> q = kvc_test::random_query(1, Hq, d, 5);
  std::vector<float> out(q.size()), want(q.size());
  kvc::qaq::TokenProbs probs;
  const auto kv = kvc_test::dequantize(c, 0, 0);
  kvc::reference::decode_attention(q.data(), Hq, kv.k.data(), kv.v.data(), T, H, d, want.data());
  // Every token is the original quantized at 3 bits, in token order.
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < d; ++i) {
      const std::size_t at = x.at(T - 1, h, i);
      EXPECT_NEAR(kv.k[at], x.k[at], 0.5 * (kvc_test::max_abs(x.k) * 2 / 8.0) + 1e-3);
    }
  kvc::AttentionOptions opt;
  opt.precision = kvc::Precision::kExact;  // float arithmetic: the output is the oracle's to float rounding
  kvc::qaq_decode_step(c, 0, kvc::QueryView::contiguous(q.data(), 1, Hq, d),
                       kvc::OutputView::contiguous(out.data(), 1, Hq, d), opt, probs);
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], want[i], 1e-4);
  EXPECT_EQ(c.width_counts(0, 0)[3], std::size_t(T * H));
  EXPECT_EQ(c.width_counts(0, 1)[3], std::size_t(T * H));
  const auto after = kvc_test::dequantize(c, 0, 0);
  EXPECT_TRUE(kvc_test::bytes_equal(after.k, kv.k) && kvc_test::bytes_equal(after.v, kv.v));
}
}  // namespace
