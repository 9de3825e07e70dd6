// Shared helpers of the kvc test suite: named cache schemes, a structured random K/V generator,
// per-element quantization error bounds read from a cache's own metadata, state snapshots for the
// strong-guarantee tests, and runners for the fused attention and the double-precision oracle.
#pragma once

#include <kvc/kvc.hpp>

#include "test_data.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <cstdio>
#include <vector>


// Every scheme's attention kernels (3 SIMD paths x its precisions) are compiled once per test binary,
// in tests/test_kernel_instances_*.cpp, not in every test source that calls them (compile time).
#define KVC_TEST_SCHEMES_A(X) X(Fp32) X(Fp16) X(Int8) X(Kivi4) X(Kivi2) X(Kivi3) X(Kivi1) X(Kivi8) X(Kivi4B128) X(Kivi2B128)
#define KVC_TEST_SCHEMES_B(X) X(Tensor4) X(MidTok4) X(MidKivi) X(Chan64) X(Sink) X(SinkGrid) X(Mixed56) X(Kivi4G16) X(Kivi2G16)
#define KVC_TEST_ATTENTION_SIGNATURE(S)                                                                          \
  void kvc::decode_attention<kvc_test::sch::S::layout>(const kvc_test::sch::S::layout::Params&, kvc::QueryView, \
                                                       kvc::OutputView, const kvc::AttentionOptions&);
#define KVC_TEST_EXTERN_ATTENTION(S) extern template KVC_TEST_ATTENTION_SIGNATURE(S)
#define KVC_TEST_INSTANTIATE_ATTENTION(S) template KVC_TEST_ATTENTION_SIGNATURE(S)
KVC_TEST_SCHEMES_A(KVC_TEST_EXTERN_ATTENTION)
KVC_TEST_SCHEMES_B(KVC_TEST_EXTERN_ATTENTION)

namespace kvc_test {

/// Every scheme the generic suites run over.
using AllSchemes = ::testing::Types<sch::Fp32, sch::Fp16, sch::Int8, sch::Kivi4, sch::Kivi2, sch::Kivi3, sch::Kivi1,
                                    sch::Kivi8, sch::Tensor4, sch::MidTok4, sch::MidKivi, sch::Chan64, sch::Sink,
                                    sch::SinkGrid, sch::Mixed56>;

using kvc::kHasIntDot;  // either side reads <= 4-bit codes through integer dot products under kFast

// ------------------------------------------------------------------------------------------------
// Attention runners
// ------------------------------------------------------------------------------------------------
/// The SIMD paths of the fused attention this binary contains and this CPU runs (portable first); with
/// KVC_TEST_ISAS=widest in the environment only the widest of them (CI's sanitizer pass: the Release pass runs
/// every path; the sanitizers run the path with the most intricate loads, a third of the time on AVX-512).
inline std::vector<kvc::Isa> runnable_isas() {
  std::vector<kvc::Isa> r;
  for (kvc::Isa i : {kvc::Isa::kPortable, kvc::Isa::kAvx2, kvc::Isa::kAvx512})
    if (kvc::isa_supported(i)) r.push_back(i);
  static const bool widest = [] {
    const char* e = std::getenv("KVC_TEST_ISAS");
    if (e == nullptr || std::string_view(e).empty() || std::string_view(e) == "all") return false;
    if (std::string_view(e) == "widest") return true;
    std::fprintf(stderr, "[kvc] KVC_TEST_ISAS='%s' is not 'all' or 'widest'\n", e);
    std::abort();
  }();
  if (widest) r.erase(r.begin(), r.end() - 1);
  return r;
}
/// The paths this binary contains but this CPU cannot run, printed once per process so that a run
/// on a smaller CPU says what it did not test.
inline void report_unrunnable_isas() {
  static const bool once = [] {
    for (kvc::Isa i : {kvc::Isa::kAvx2, kvc::Isa::kAvx512})
      if (kvc::isa_compiled(i) && !kvc::isa_supported(i))
        std::printf("[kvc] this CPU cannot run the %s attention path: its tests are not run here\n", kvc::isa_name(i));
    if (!kvc::isa_compiled(kvc::Isa::kAvx2))
      std::printf("[kvc] this build contains only the portable attention path (KVC_DISABLE_SIMD)\n");
    return true;
  }();
  (void)once;
}
/// The path `fused` runs when its options leave `isa` at kAuto (set by KVC_FOR_EACH_ISA).
inline kvc::Isa& test_isa() {
  static kvc::Isa isa = kvc::Isa::kAuto;
  return isa;
}
struct IsaScope {
  kvc::Isa saved;
  explicit IsaScope(kvc::Isa i) : saved(test_isa()) { test_isa() = i; }
  ~IsaScope() { test_isa() = saved; }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};
/// Runs the statement that follows once per runnable path, with `fused` pinned to it.
#define KVC_FOR_EACH_ISA(isa)                                    \
  ::kvc_test::report_unrunnable_isas();                          \
  for (const kvc::Isa isa : ::kvc_test::runnable_isas())         \
    if (const ::kvc_test::IsaScope isa##_scope{isa}; true)

/// Fused decode attention of the first `nseq` sequences of `layer`; q: [nseq][Hq][d].
template <class Cache>
std::vector<float> fused(const Cache& c, int layer, const std::vector<float>& q, int nseq, int Hq,
                         const kvc::AttentionOptions& opt = {}) {
  const int d = c.config().head_dim;
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  kvc::AttentionOptions o = opt;
  if (o.isa == kvc::Isa::kAuto) o.isa = test_isa();
  kvc::decode_attention(c, layer, kvc::QueryView::contiguous(q.data(), nseq, Hq, d),
                        kvc::OutputView::contiguous(out.data(), nseq, Hq, d), o);
  return out;
}

/// The oracle on what the cache holds (its dequantize()).
template <class Cache>
std::vector<float> oracle_cache(const Cache& c, int layer, const std::vector<float>& q, int nseq, int Hq,
                                double scale = 0.0) {
  const auto& cfg = c.config();
  const int d = cfg.head_dim;
  std::vector<float> out(q.size());
  for (int s = 0; s < nseq; ++s) {
    const auto kv = dequantize(c, layer, s);
    kvc::reference::decode_attention(q.data() + std::size_t(s) * Hq * d, Hq, kv.k.data(), kv.v.data(),
                                     c.length(layer, s), cfg.kv_heads, d, out.data() + std::size_t(s) * Hq * d, scale);
  }
  return out;
}

/// The fused attention at both precisions on every runnable SIMD path against the oracle on the cache's
/// reconstruction (oracle_cache): exact (splits forced down to one block) within eps * maxv, maxv the largest
/// |value| held; fast within the kernel's own bound (0.1 of max |oracle| per element, 0.05 of its rms).
template <class Cache>
void expect_fused_matches_oracle(const Cache& c, int layer, const std::vector<float>& q, int nseq, int Hq, double eps) {
  const auto want = oracle_cache(c, layer, q, nseq, Hq);
  double maxv = 0.0;
  for (int s = 0; s < nseq; ++s) maxv = std::max(maxv, max_abs(dequantize(c, layer, s).v));
  KVC_FOR_EACH_ISA(isa) {
    SCOPED_TRACE(kvc::isa_name(isa));
    kvc::AttentionOptions exact;
    exact.precision = kvc::Precision::kExact;
    exact.min_blocks_per_split = 1;  // splits too, when there are blocks
    ASSERT_LE(max_abs_diff(fused(c, layer, q, nseq, Hq, exact), want), eps * maxv) << "exact precision";
    const auto fast = fused(c, layer, q, nseq, Hq);
    ASSERT_LE(max_abs_diff(fast, want), eps * maxv + 0.1 * max_abs(want)) << "fast precision";
    ASSERT_LE(rms_diff(fast, want), eps * maxv + 0.05 * rms(want)) << "fast precision";
  }
}

/// The oracle on original data, one KV per sequence.
inline std::vector<float> oracle_data(const std::vector<KV>& data, const std::vector<float>& q, int nseq, int Hq,
                                      double scale = 0.0) {
  std::vector<float> out(q.size());
  for (int s = 0; s < nseq; ++s) {
    const KV& x = data[std::size_t(s)];
    kvc::reference::decode_attention(q.data() + std::size_t(s) * Hq * x.d, Hq, x.k.data(), x.v.data(), x.T, x.H, x.d,
                                     out.data() + std::size_t(s) * Hq * x.d, scale);
  }
  return out;
}

/// Rigorous bound on |attn(K', V') - attn(K, V)| per output element of one sequence, given
/// elementwise |K' - K| <= eK and |V' - V| <= eV. With E_t = scale * sum_c |q_c| eK_tc, the perturbed
/// probabilities satisfy p'_t / p_t in [e^-E_t / Zmax, e^E_t / Zmin] (Zmax/min = sum_u p_u e^(+-E_u)),
/// and o' - o = sum_t p'_t (v'_t - v_t) + sum_t (p'_t - p_t)(v_t - m) for any constant m.
inline std::vector<double> attention_error_bound(const float* q, int Hq, const KV& x, const std::vector<float>& eK,
                                                 const std::vector<float>& eV, double scale = 0.0) {
  const int d = x.d, H = x.H, T = x.T, g = Hq / H;
  if (scale <= 0.0) scale = 1.0 / std::sqrt(double(d));
  std::vector<double> bound(std::size_t(Hq) * d, 0.0);
  std::vector<double> E(static_cast<std::size_t>(T)), up(E.size()), dp(E.size());
  for (int h = 0; h < Hq; ++h) {
    const int kh = h / g;
    const float* qh = q + std::size_t(h) * d;
    const auto p = kvc::reference::attention_probabilities(qh, x.k.data(), T, H, kh, d, scale);
    double zmax = 0.0, zmin = 0.0;
    for (int t = 0; t < T; ++t) {
      double e = 0.0;
      for (int c = 0; c < d; ++c) e += std::fabs(double(qh[c])) * eK[x.at(t, kh, c)];
      E[t] = std::min(scale * e, 600.0);
      zmax += p[t] * std::exp(E[t]);
      zmin += p[t] * std::exp(-E[t]);
    }
    for (int t = 0; t < T; ++t) {
      const double e = std::exp(E[t]);
      up[t] = p[t] * e / zmin;                                           // >= p'_t
      dp[t] = p[t] * std::max(e / zmin - 1.0, 1.0 - 1.0 / (e * zmax));  // >= |p'_t - p_t|
    }
    for (int c = 0; c < d; ++c) {
      double lo = HUGE_VAL, hi = -HUGE_VAL;
      for (int t = 0; t < T; ++t) {
        lo = std::min(lo, double(x.v[x.at(t, kh, c)]));
        hi = std::max(hi, double(x.v[x.at(t, kh, c)]));
      }
      const double m = 0.5 * (lo + hi);
      double b = 0.0;
      for (int t = 0; t < T; ++t) b += up[t] * eV[x.at(t, kh, c)] + dp[t] * std::fabs(double(x.v[x.at(t, kh, c)]) - m);
      bound[std::size_t(h) * d + c] = b;
    }
  }
  return bound;
}

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------
/// Expects `stmt` to throw kvc::Error with code `errc` and a message containing `substr`.
#define KVC_EXPECT_ERROR(stmt, errc, substr)                                                              \
  do {                                                                                                    \
    try {                                                                                                 \
      stmt;                                                                                               \
      ADD_FAILURE() << "expected kvc::Error from: " #stmt;                                               \
    } catch (const ::kvc::Error& e_) {                                                                    \
      EXPECT_EQ(static_cast<int>(e_.code()), static_cast<int>(errc)) << "message: " << e_.what();       \
      EXPECT_NE(std::string(e_.what()).find(substr), std::string::npos)                                  \
          << "message \"" << e_.what() << "\" does not contain \"" << (substr) << "\"";                 \
    }                                                                                                     \
  } while (0)

}  // namespace kvc_test
