// AlignedKV over other schemes' fp16 parts (aligned/slot_planes.hpp): a scheme's full-precision slots
// (KIVI's window and sink, LogQuant's log-distributed set) stored as bit planes and read at the tiers of
// AlignedKV's rules. The cache must hold exactly what the plain scheme holds; attention with every tier
// forced to 16 must equal the plain scheme's; with real tiers it must equal the oracle on the window
// truncated as the rules decide (aligned_window_oracle.hpp, from the same AlignedLoader functions; the CUDA suite
// checks the device kernel against it too).
#include "aligned_window_oracle.hpp"
#include "test_util.hpp"

#include <set>

namespace kvc_test {
namespace sch {
/// KIVI-2 with an odd window and sink (ring and sink slots not a multiple of the block).
using KiviOdd = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, Axis::kChannel>>,
                                       kvc::values<kvc::GroupQuantizer<2, 32, Axis::kToken>>,
                                       kvc::FullPrecisionWindow<40, 3>>;
/// LogQuant with a small W: its set evicts and moves slots within a few dozen tokens.
using LogW5 = kvc::schemes::LogQuant<2, 5, 32>;
/// KIVI-4 per-token values on 64-token blocks, 4-bit (float-FMA value path).
using Kivi4B64 = kvc::schemes::Kivi<4, 64, 64>;
using RotKiviOdd = kvc::schemes::Rotated<KiviOdd>;
}  // namespace sch

/// The plain scheme, the same with AlignedLoader<> (real tiers) and with every tier forced to 16.
template <class Plain>
struct LoaderTriple {
  using plain = Plain;
  using aligned = kvc::schemes::AlignedWindow<Plain>;
  using full = kvc::schemes::AlignedWindow<Plain, kvc::AlignedLoader<99, 99, 99, 99>>;
};
template <> inline constexpr const char* scheme_name<LoaderTriple<sch::Kivi2>> = "Kivi2";
template <> inline constexpr const char* scheme_name<LoaderTriple<sch::KiviOdd>> = "KiviOdd";
template <> inline constexpr const char* scheme_name<LoaderTriple<sch::LogW5>> = "LogW5";
template <> inline constexpr const char* scheme_name<LoaderTriple<sch::LogQuant2>> = "LogQuant2";
template <> inline constexpr const char* scheme_name<LoaderTriple<sch::Kivi4B64>> = "Kivi4B64";
template <> inline constexpr const char* scheme_name<LoaderTriple<sch::RotKiviOdd>> = "RotKiviOdd";
}  // namespace kvc_test

namespace {

using namespace kvc_test;

// ------------------------------------------------------------------------------------------------ planes
TEST(SlotPlanes, EveryBitPatternRoundTripsAndTruncatesLikeAlignedKV) {
  for (bool keys : {true, false}) {
    std::vector<std::uint8_t> buf(2 * 4 * 6, 0);
    const kvc::aligned::SlotPlanes sp{buf.data(), 4, 6, keys};
    // neighbours of element (1, 3) hold a fixed pattern that must survive every write
    for (int s = 0; s < 4; ++s)
      for (int c = 0; c < 6; ++c) sp.set_bits(s, c, std::uint16_t(0x5A5A + 97 * (s * 6 + c)));
    for (std::uint32_t b = 0; b < 65536; ++b) {
      sp.set_bits(1, 3, std::uint16_t(b));
      ASSERT_EQ(sp.bits(1, 3, 16), b);
      ASSERT_EQ(sp.bits(1, 3, 12), kvc::aligned::truncate(std::uint16_t(b), 12));
      ASSERT_EQ(sp.bits(1, 3, 8), kvc::aligned::truncate(std::uint16_t(b), 8));
    }
    for (int s = 0; s < 4; ++s)
      for (int c = 0; c < 6; ++c)
        if (s != 1 || c != 3) {
          ASSERT_EQ(sp.bits(s, c), std::uint16_t(0x5A5A + 97 * (s * 6 + c))) << s << " " << c;
        }
    sp.copy_row(1, 2);
    for (int c = 0; c < 6; ++c) ASSERT_EQ(sp.bits(2, c), sp.bits(1, c));
  }
}

TEST(SlotPlanes, AssembledRunsEqualTheTruncatedElements) {
  std::mt19937 rng(7);
  for (bool keys : {true, false}) {
    const int stride = 32, d = 16;
    std::vector<std::uint8_t> buf(2 * stride * d);
    for (auto& x : buf) x = std::uint8_t(rng());
    const kvc::aligned::SlotPlanes sp{buf.data(), stride, d, keys};
    for (int tier : {8, 12, 16}) {
      // a key channel's slots, or a value row's channels: one contiguous run of the planes
      const int c = 5, slot = 9;
      const int n = keys ? stride : d;
      const std::size_t at = keys ? sp.index(0, c) : sp.index(slot, 0);
      std::vector<kvc::half_t> out(std::size_t(n), kvc::half_t{0xFFFF});
      kvc::aligned::assemble_run(tier, sp.hi() + at, sp.mid() + at / 2, sp.lo() + at / 2, n, out.data());
      for (int i = 0; i < n; ++i)
        ASSERT_EQ(out[std::size_t(i)].bits, keys ? sp.bits(i, c, tier) : sp.bits(slot, i, tier)) << tier << " " << i;
    }
  }
}

// ------------------------------------------------------------------------------------------------ caches
template <class T>
class AlignedWindow : public ::testing::Test {};
using Triples = ::testing::Types<LoaderTriple<sch::Kivi2>, LoaderTriple<sch::KiviOdd>, LoaderTriple<sch::LogW5>,
                                 LoaderTriple<sch::LogQuant2>, LoaderTriple<sch::Kivi4B64>, LoaderTriple<sch::RotKiviOdd>>;
TYPED_TEST_SUITE(AlignedWindow, Triples, SchemeNames);

/// Both caches filled alike: ragged lengths across the window / set and block boundaries, sequences
/// appended token by token, in chunks and at once.
template <class A, class B>
void fill_twins(A& a, B& b, const kvc::CacheConfig& cfg, const std::vector<int>& lengths, std::uint64_t seed) {
  for (int l = 0; l < cfg.layers; ++l)
    for (int s = 0; s < cfg.batch; ++s) {
      const KV x = random_kv(lengths[std::size_t(s)], cfg.kv_heads, cfg.head_dim, seed + 131u * l + s);
      const int chunk = s % 3 == 0 ? 1 : s % 3 == 1 ? 17 : 0;
      append_kv(a, l, s, x, chunk);
      append_kv(b, l, s, x, chunk);
    }
}

TYPED_TEST(AlignedWindow, HoldsAndCountsExactlyWhatThePlainSchemeHolds) {
  using Plain = typename TypeParam::plain;
  using Aligned = typename TypeParam::aligned;
  static_assert(Aligned::layout::kAlignedWindow && !Plain::layout::kAlignedWindow);
  const std::vector<int> lengths = {1, 2, 37, 70, 131, 190, 333};
  const kvc::CacheConfig cfg{2, int(lengths.size()), 2, 64, 400};
  Plain p(cfg);
  Aligned a(cfg);
  fill_twins(p, a, cfg, lengths, 11);
  for (int l = 0; l < cfg.layers; ++l) {
    for (int s = 0; s < cfg.batch; ++s) {
      ASSERT_EQ(a.length(l, s), lengths[std::size_t(s)]);
      const auto dp = dequantize(p, l, s), da = dequantize(a, l, s);
      ASSERT_EQ(dp.k, da.k) << "layer " << l << " seq " << s;
      ASSERT_EQ(dp.v, da.v) << "layer " << l << " seq " << s;
    }
    ASSERT_EQ(p.stored_bytes(l), a.stored_bytes(l));
    ASSERT_EQ(p.decode_read_bytes(l), a.decode_read_bytes(l));
  }
  ASSERT_EQ(p.bits_per_element(), a.bits_per_element());
  ASSERT_LE(p.allocated_bytes(), a.allocated_bytes());  // the planes' stride rounds up to the block
  // clear() and reuse: the next sequence's slots start from stale planes, which must not leak in
  p.clear(3);
  a.clear(3);
  const KV y = random_kv(90, cfg.kv_heads, cfg.head_dim, 99);
  append_kv(p, 1, 3, y, 5);
  append_kv(a, 1, 3, y, 5);
  ASSERT_EQ(dequantize(p, 1, 3).k, dequantize(a, 1, 3).k);
  ASSERT_EQ(dequantize(p, 1, 3).v, dequantize(a, 1, 3).v);
}

TYPED_TEST(AlignedWindow, BadInputIsRejectedAndLeavesTheCacheUnchanged) {
  using Aligned = typename TypeParam::aligned;
  const kvc::CacheConfig cfg{1, 1, 2, 64, 100};
  Aligned a(cfg);
  const KV x = random_kv(60, 2, 64, 5);
  append_kv(a, 0, 0, x, 7);
  const auto before = dequantize(a, 0, 0);
  KV bad = random_kv(3, 2, 64, 6);
  bad.v[bad.at(1, 1, 4)] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(a.append(0, 0, bad.kview(0, 3), bad.vview(0, 3)), kvc::Error);
  bad.v[bad.at(1, 1, 4)] = 1e6f;  // beyond fp16
  EXPECT_THROW(a.append(0, 0, bad.kview(0, 3), bad.vview(0, 3)), kvc::Error);
  const KV big = random_kv(41, 2, 64, 8);  // past the capacity
  EXPECT_THROW(a.append(0, 0, big.kview(0, 41), big.vview(0, 41)), kvc::Error);
  ASSERT_EQ(a.length(0, 0), 60);
  ASSERT_EQ(dequantize(a, 0, 0).k, before.k);
  ASSERT_EQ(dequantize(a, 0, 0).v, before.v);
}

TYPED_TEST(AlignedWindow, WithEveryTierAt16AttentionEqualsThePlainScheme) {
  using Plain = typename TypeParam::plain;
  using Full = typename TypeParam::full;
  for (int d : {64, 128})
    for (int g : {1, 4}) {
      SCOPED_TRACE("d " + std::to_string(d) + " g " + std::to_string(g));
      const std::vector<int> lengths = {3, 45, 170, 290};
      const kvc::CacheConfig cfg{1, int(lengths.size()), 2, d, 300};
      Plain p(cfg);
      Full a(cfg);
      fill_twins(p, a, cfg, lengths, 21 + d + g);
      const int Hq = 2 * g;
      const auto q = random_query(cfg.batch, Hq, d, 77);
      double maxv = 0.0;
      for (int s = 0; s < cfg.batch; ++s) maxv = std::max(maxv, max_abs(dequantize(p, 0, s).v));
      KVC_FOR_EACH_ISA(isa) {
        SCOPED_TRACE(kvc::isa_name(isa));
        for (auto prec : {kvc::Precision::kExact, kvc::Precision::kFast}) {
          kvc::AttentionOptions o;
          o.precision = prec;
          o.min_blocks_per_split = 1;
          // the window's rows are summed in slot order here, in storage order there: fp32 reassociation only
          ASSERT_LE(max_abs_diff(fused(a, 0, q, cfg.batch, Hq, o), fused(p, 0, q, cfg.batch, Hq, o)), 2e-6 * maxv);
        }
        // At tier 16: every live value row whole; every slot's hi8 key byte (the Kmax scan) and the nibbles of all
        // B slots of each chunk holding a token; the rest what the plain scheme's step reads. Exact.
        kvc::aligned::ReadStats read;
        std::vector<float> out(q.size());
        kvc::AttentionOptions o;
        o.isa = isa;
        kvc::decode_attention(a, 0, kvc::QueryView::contiguous(q.data(), cfg.batch, Hq, d),
                              kvc::OutputView::contiguous(out.data(), cfg.batch, Hq, d), o, &read);
        using Sel = typename Full::selector;
        constexpr int B = Full::kBlockTokens, S = Full::layout::kFpStride;
        std::size_t live = 0, chunk_slots = 0, strides = 0;
        for (int s = 0; s < cfg.batch; ++s) {
          const int n = lengths[std::size_t(s)], nfp = kvc::detail::fp_tokens<Sel>(n, B);
          std::set<int> chunks;
          for (int i = 0; i < nfp; ++i) chunks.insert(Sel::fp_slot(n, i, B) / B);
          live += std::size_t(nfp), chunk_slots += chunks.size() * B, strides += nfp > 0 ? S : 0;
        }
        const std::size_t H = std::size_t(cfg.kv_heads);
        EXPECT_EQ(read.value_bytes, H * live * d * 2);
        EXPECT_EQ(read.value_tiers[2], H * live * d);
        EXPECT_EQ(read.key_tiers[0] + read.key_tiers[1] + read.value_tiers[0] + read.value_tiers[1], 0u);
        EXPECT_EQ(read.key_tiers[2], H * chunk_slots * d);
        EXPECT_EQ(read.key_bytes, H * (strides + chunk_slots) * d);
        EXPECT_EQ(read.average_bits(), 16.0);
        EXPECT_EQ(read.other_bytes, p.decode_read_bytes(0) - H * live * d * 2 * 2);
      }
    }
}


TYPED_TEST(AlignedWindow, RealTiersMatchTheOracleOnTheTruncatedWindow) {
  using Plain = typename TypeParam::plain;
  using Aligned = typename TypeParam::aligned;
  {
    std::size_t tiers[3] = {0, 0, 0};
    for (int d : {64, 128})
      for (int g : {1, 2, 4}) {
        SCOPED_TRACE("d " + std::to_string(d) + " g " + std::to_string(g));
        const std::vector<int> lengths = {2, 33, 64, 130, 177, 290};
        const kvc::CacheConfig cfg{1, int(lengths.size()), 2, d, 300};
        Plain p(cfg);
        Aligned a(cfg);
        fill_twins(p, a, cfg, lengths, 5 + d * g);
        const int Hq = 2 * g;
        const auto q = random_query(cfg.batch, Hq, d, 31 + g, 2.0f);  // peaked probabilities: value tiers vary
        std::vector<float> want(q.size()), full(q.size());
        double maxv = 0.0;
        // per sequence: the planes' counts replicated, the slots' fp16 K and V as decode_read_bytes counts them
        std::vector<kvc::aligned::ReadStats> want_read(lengths.size());
        std::vector<std::size_t> window_bytes(lengths.size());
        for (int s = 0; s < cfg.batch; ++s) {
          const float* qs = q.data() + std::size_t(s) * Hq * d;
          const auto tw = truncated_window(a, 0, s, qs, Hq, kvc::detail::query_scale(kvc::AttentionOptions{}, d), tiers,
                                           want_read[std::size_t(s)]);
          window_bytes[std::size_t(s)] = std::size_t(cfg.kv_heads) * 2 * d * 2 *
                                         kvc::detail::fp_tokens<typename Aligned::selector>(lengths[std::size_t(s)],
                                                                                             Aligned::kBlockTokens);
          const auto dv = dequantize(p, 0, s);
          maxv = std::max(maxv, max_abs(dv.v));
          kvc::reference::decode_attention(qs, Hq, tw.k.data(), tw.v.data(), lengths[std::size_t(s)], 2, d,
                                           want.data() + std::size_t(s) * Hq * d);
          kvc::reference::decode_attention(qs, Hq, dv.k.data(), dv.v.data(), lengths[std::size_t(s)], 2, d,
                                           full.data() + std::size_t(s) * Hq * d);
        }
        const double truncation = max_abs_diff(want, full);
        KVC_FOR_EACH_ISA(isa) {
          SCOPED_TRACE(kvc::isa_name(isa));
          kvc::AttentionOptions o;
          o.precision = kvc::Precision::kExact;
          o.min_blocks_per_split = 1;
          const auto got = fused(a, 0, q, cfg.batch, Hq, o);
          const double err = max_abs_diff(got, want);
          // fp32 scores of peaked softmaxes (|logits| in the hundreds) against the double oracle
          ASSERT_LE(err, 2e-5 * maxv) << "truncation effect " << truncation;
          // What the call reports it read: the replicated planes' bytes, and the rest as decode_read_bytes has it
          // for the attended sequences. All of them, and the first nseq - 1 (fewer streams than threads: split
          // work items, whose other parts count nothing); 4 threads split the streams on any host.
          for (int nseq : {cfg.batch, cfg.batch - 1}) {
            SCOPED_TRACE("nseq " + std::to_string(nseq));
            kvc::aligned::ReadStats read, want_sum;
            read.other_bytes = 12345;  // overwritten
            std::vector<int> attended(lengths.begin(), lengths.begin() + nseq);
            attended.resize(lengths.size(), 0);
            std::size_t other = Aligned::rules::stored_bytes(cfg, attended.data());  // decode_read_bytes' count
            if (nseq == cfg.batch) {
              ASSERT_EQ(other, a.decode_read_bytes(0));
            }
            for (int s = 0; s < nseq; ++s) want_sum += want_read[std::size_t(s)], other -= window_bytes[std::size_t(s)];
            std::vector<float> out(std::size_t(nseq) * Hq * d), quiet(out.size());
            kvc::AttentionOptions o4 = o;
            o4.isa = isa, o4.num_threads = 4;
            kvc::decode_attention(a, 0, kvc::QueryView::contiguous(q.data(), nseq, Hq, d),
                                  kvc::OutputView::contiguous(out.data(), nseq, Hq, d), o4, &read);
            kvc::decode_attention(a, 0, kvc::QueryView::contiguous(q.data(), nseq, Hq, d),
                                  kvc::OutputView::contiguous(quiet.data(), nseq, Hq, d), o4, nullptr);
            ASSERT_EQ(out, quiet);  // counting changes nothing
            ASSERT_LE(max_abs_diff(out, std::vector<float>(want.begin(), want.begin() + std::ptrdiff_t(out.size()))),
                      2e-5 * maxv);
            EXPECT_TRUE(same_reads(read, want_sum, other));
          }
          // the kernel truncated: it is nearer the truncated window's attention than the exact one's
          if (truncation > 1e-4 * maxv) {
            ASSERT_LT(err, 0.1 * truncation);
          }
        }
      }
    // the rules chose every tier somewhere (else this test would not see them)
    EXPECT_GT(tiers[0], 0u);
    EXPECT_GT(tiers[1], 0u);
    EXPECT_GT(tiers[2], 0u);
  }
}

}  // namespace
