// One binary for the bandwidth limit and the kernels, so every ratio comes from one run.
//   BM_MemoryRead                        plain multi-threaded read of a 1 GiB buffer (the limit)
//   BM_MemoryReadRuns/run:<b>/kept:<%>   the same buffer in runs of b bytes, a random kept % of them read: what
//                                        skipping saves on this memory system (AlignedKV's partial loads)
//   BM_PeakMacs/<instruction>            peak multiply-adds per second of an instruction decode inner loops are
//                                        bound by (roofline.hpp: fma_f32_zmm/ymm, dpbusd_zmm, maddubs_ymm,
//                                        dpwssd_ymm, maddwd_ymm), all threads; skipped where the CPU lacks it
//   BM_DecodeAttention/<scheme>/T:<n>    fused decode attention, 8 KV heads, GQA 4, head dim 128,
//                                        batch 1; caches flushed before every iteration; <scheme>-exact:
//                                        Precision::kExact (float dot products over the codes)
//   BM_Append/<scheme>                   prefill compression throughput (4096 tokens; GEAR: block mode,
//                                        outlier selection + quantization + power iteration per block)
//   BM_AppendDecode/<scheme>/T:<n>       decode-time compression: one block's tokens appended one at a
//                                        time onto n - block tokens (the last completes a block: block
//                                        mode compresses it, LiteralMode recompresses the whole history);
//                                        per_token = the amortised cost of one token
//   BM_DecodeAttention/qaq/T:<n>         QAQ (QaqQuantizer<>) with targets calibrated to ~3 bits per element, everything
//                                        counted as kivi2's 3.05 (after 16 decode steps with varied queries fill the
//                                        histories); qaq_rot: the same with Rotation<Hadamard<>> (K and V)
//                                        qaq_a0n1_rot_lm: QaqQuantizer<1, 8, 0, 1, PaperBounds, LogMeta>, rotated
//   BM_QaqUpdateWidths/T:<n>             QAQ's per-step width update of that cache (history push, width rule,
//                                        moves between buckets), one step's probabilities repeated
//   BM_QaqDecodeStep/T:<n>/rho:<r>/bits10:<b>/fused:<f>  a whole QAQ step (attention + width update) with a new
//                                        query each step, independent (rho 0) or drifting (rho 995: q_i = 0.995
//                                        q_(i-1) + noise), at b / 10 bits per element; fused 1: qaq_decode_step (each
//                                        stream's update right after its attention), 0: decode_attention then
//                                        update_widths, timed apart (attention_ms / update_ms);
//                                        value_moved_pct: value records moved per step
//   BM_DecodeAttentionWarm/<scheme>/T:<n>  kivi2 and qaq (as above) with nothing flushed between the steps: the
//                                        cache stays in L2/L3 as far as it fits; ns_per_token = one step's time over
//                                        T x KV heads (both sides). Equal to the flushed row where a kernel's time is
//                                        its instructions, not its memory reads
//   BM_QaqStepOverKivi2/T:<n>/rho:<r>    the speed target's ratio: per iteration one kivi2 attention and one QAQ
//                                        step (rho as above, ~3 bits), each timed; ratio = QAQ / kivi2 (both under
//                                        the same machine drift)
//   BM_DecodeAttention/aligned_fp16/T:<n>  AlignedKV (AlignedLoader<>): fp16 bit planes read at the tiers its rules
//                                        choose (bytes_per_second: the bytes actually read; planes_per_second: all
//                                        planes; average_bits); aligned_fp16_tier16: the same kernel, every tier 16
// Counters: bytes_per_second = cache bytes one decode step reads (codes, scales, zeros, windows);
// bits_per_element = stored bits per K/V element, everything counted; roofline = the step's bound (max of its
// bytes at the bandwidth its cache flushes read at, read_gbs, and its products at their instruction's peak,
// measured once in this process as BM_PeakMacs does) over its time, with the two bounds as roof_mem_ms and
// roof_mac_ms; read_share = bytes_per_second / read_gbs (the flushes run BM_MemoryRead's kernel, so this is the
// step's share of BM_MemoryRead at the same moments) (roofline.hpp; the SIMD paths only).
#include "bench_util.hpp"

#include <kvc/kvc.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace {

using kvc_bench::kFlushBytes, kvc_bench::kKvHeads, kvc_bench::kGqa, kvc_bench::kHeadDim;
using kvc_bench::make_kv, kvc_bench::fill, kvc_bench::build_cache, kvc_bench::bench_query;

/// The read bandwidth: kvc_bench::read_pass over the 1 GiB read_buffer(), every thread (the kernel the decode rows'
/// cache flushes run, so their read_gbs is this benchmark's bandwidth at those moments).
void BM_MemoryRead(benchmark::State& state) {
  const auto& buf = kvc_bench::read_buffer();
  for (auto _ : state) benchmark::DoNotOptimize(kvc_bench::read_pass(buf.data(), buf.size()));
  state.counters["bytes_per_second"] =
      benchmark::Counter(static_cast<double>(kFlushBytes) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_MemoryRead)->UseRealTime()->Unit(benchmark::kMillisecond);

/// The roofline's compute side: kvc_bench::roofline::run_macs(m) on every thread.
void BM_PeakMacs(benchmark::State& state, kvc_bench::roofline::Mac m) {
  namespace rl = kvc_bench::roofline;
  if (!rl::runs(m)) {
    state.SkipWithError("this build or CPU does not run the instruction");
    return;
  }
  double macs = 0.0;
  for (auto _ : state) macs += rl::run_macs(m, 1L << 16);
  state.counters["macs_per_second"] = benchmark::Counter(macs, benchmark::Counter::kIsRate);
}

/// What skipping saves: the same 1 GiB buffer, read in runs of `run` bytes of which a random kept % are read
/// (an index list, no branches), the rest skipped. Compare its time with BM_MemoryRead's (every run read): a
/// partial-load scheme (AlignedKV) gains only where skipping runs of its size saves time on this memory system.
void BM_MemoryReadRuns(benchmark::State& state) {
  const std::size_t run = std::size_t(state.range(0)), n = kFlushBytes / sizeof(float), per = run / sizeof(float);
  kvc::AlignedBuffer<float> buf(n);
  for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(i & 1023);
  std::vector<std::uint32_t> runs;
  std::mt19937 rng(7);
  for (std::size_t r = 0; r < n / per; ++r)
    if (rng() % 100 < std::uint32_t(state.range(1))) runs.push_back(std::uint32_t(r));
  const auto count = static_cast<std::ptrdiff_t>(runs.size());
  for (auto _ : state) {
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
      float acc[16] = {};
#pragma omp for schedule(static)
      for (std::ptrdiff_t k = 0; k < count; ++k) {
        const float* p = buf.data() + std::size_t(runs[std::size_t(k)]) * per;
        for (std::size_t i = 0; i < per; i += 16)
#pragma omp simd
          for (int j = 0; j < 16; ++j) acc[j] += p[i + j];
      }
      for (float x : acc) total += x;
    }
    benchmark::DoNotOptimize(total);
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(runs.size() * run) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["kept"] = static_cast<double>(runs.size() * run) / static_cast<double>(kFlushBytes);
}
BENCHMARK(BM_MemoryReadRuns)
    ->ArgNames({"run", "kept"})
    ->ArgsProduct({{64, 256, 1024, 4096, 16384, 65536}, {50, 75, 100}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

template <class Cache, kvc::Precision Prec = kvc::Precision::kFast>
void BM_DecodeAttention(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const auto cache = build_cache<Cache>(tokens);
  kvc::AttentionOptions opt;
  opt.precision = Prec;
  kvc_bench::time_decode_steps(state, *cache, bench_query(), kKvHeads * kGqa, kHeadDim, opt);
}

/// AlignedKV: the attention over fp16 bit planes; bytes_per_second counts the bytes it actually read (its
/// aligned::ReadStats: planes at the chosen tiers, the value estimate's rows, staging, exponents; over a scheme's
/// slots also the blocks it reads whole), planes_per_second decode_read_bytes (AlignedKV's own cache: every plane
/// byte, what a tier-16 read takes; over a scheme's slots: the plain scheme's bytes), average_bits the leading
/// bits loaded per planar element.
template <class Cache>
void BM_DecodeAttentionAligned(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const auto cache = build_cache<Cache>(tokens);
  const std::vector<float> q = bench_query();
  std::vector<float> out(q.size());
  const auto qv = kvc::QueryView::contiguous(q.data(), 1, kKvHeads * kGqa, kHeadDim);
  const auto ov = kvc::OutputView::contiguous(out.data(), 1, kKvHeads * kGqa, kHeadDim);
  kvc::aligned::ReadStats st;
  kvc::decode_attention(*cache, 0, qv, ov, {}, &st);
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(kvc::Isa::kAuto)));
  const kvc_bench::StepTimes times = kvc_bench::time_steps(state, [&] {
    kvc::decode_attention(*cache, 0, qv, ov);
    benchmark::DoNotOptimize(out.data());
  });
  const double n = double(state.iterations());
  state.counters["bytes_per_second"] = benchmark::Counter(double(st.total_bytes()) * n, benchmark::Counter::kIsRate);
  state.counters["planes_per_second"] =
      benchmark::Counter(double(cache->decode_read_bytes(0)) * n, benchmark::Counter::kIsRate);
  state.counters["average_bits"] = st.average_bits();
  state.counters["bits_per_element"] = cache->bits_per_element();
  auto work = kvc_bench::decode_work(*cache, kKvHeads * kGqa, kHeadDim, kvc::resolve_isa(kvc::Isa::kAuto),
                                     kvc::Precision::kFast);
  if (work) work->bytes = double(st.total_bytes());  // what it read, not every plane
  kvc_bench::roofline::set_counters(state, work, times.steps, times.read_bandwidth(state));
}

/// What a Rotation adds to one decode step, alone: the 32 query heads rotated (with the scale and checks
/// decode_attention applies) and the 32 output rows un-rotated. Compare with a BM_DecodeAttention row's time.
template <class Cache>
void BM_RotationStep(benchmark::State& state) {
  const auto cache = build_cache<Cache>(64);
  const auto p = cache->params(0);
  const std::vector<float> q = bench_query();
  std::vector<float> out(q.size(), 1.0f);
  const auto qv = kvc::QueryView::contiguous(q.data(), 1, kKvHeads * kGqa, kHeadDim);
  for (auto _ : state) {
    auto qs = kvc::detail::rotated_query<typename Cache::layout>(p, kvc::detail::scaled_query(qv, 0.125f), qv, kGqa);
    for (int h = 0; h < kKvHeads * kGqa; ++h)
      Cache::rotation::unrotate(false, p.rotation, h / kGqa, kHeadDim, out.data() + std::size_t(h) * kHeadDim);
    benchmark::DoNotOptimize(qs.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["heads"] = kKvHeads * kGqa;
}

template <class Cache>
void BM_Append(benchmark::State& state) {
  const int tokens = 4096;
  const auto k = make_kv(tokens, true, 11), v = make_kv(tokens, false, 12);
  for (auto _ : state) {
    Cache cache(kvc::CacheConfig{1, 1, kKvHeads, kHeadDim, tokens});
    cache.append(0, 0, kvc::KVView::contiguous(k.data(), tokens, kKvHeads, kHeadDim),
                 kvc::KVView::contiguous(v.data(), tokens, kKvHeads, kHeadDim));
    benchmark::DoNotOptimize(cache.stored_bytes());
  }
  const double in_bytes = 2.0 * tokens * kKvHeads * kHeadDim * sizeof(float);
  state.counters["bytes_per_second"] = benchmark::Counter(in_bytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["tokens_per_second"] = benchmark::Counter(double(tokens) * state.iterations(), benchmark::Counter::kIsRate);
}

template <class Cache>
void BM_AppendDecode(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), B = Cache::kBlockTokens, first = tokens - B;
  const auto k = make_kv(tokens, true, 13), v = make_kv(tokens, false, 14);
  auto view = [&](const std::vector<float>& x, int t, int n) {
    return kvc::KVView::contiguous(x.data() + std::size_t(t) * kKvHeads * kHeadDim, n, kKvHeads, kHeadDim);
  };
  for (auto _ : state) {
    state.PauseTiming();
    Cache cache(kvc::CacheConfig{1, 1, kKvHeads, kHeadDim, tokens});
    cache.append(0, 0, view(k, 0, first), view(v, 0, first));
    state.ResumeTiming();
    for (int t = first; t < tokens; ++t) cache.append(0, 0, view(k, t, 1), view(v, t, 1));
    benchmark::DoNotOptimize(cache.stored_bytes());
  }
  // kIsRate | kInvert: seconds per token (printed with its SI prefix, e.g. 57.3us).
  state.counters["per_token"] =
      benchmark::Counter(double(B) * state.iterations(), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

/// The queries of QAQ's decode steps, a new one each step, n in turn. rho == 0: independent N(0, 1) queries (every
/// token's probability is redrawn each step: the most width churn). rho > 0: a stationary random walk
/// q_i = rho q_(i-1) + sqrt(1 - rho^2) xi_i, as a model's consecutive queries are correlated.
std::vector<std::vector<float>> qaq_queries(double rho = 0.0, int n = 16) {
  std::vector<std::vector<float>> qs{bench_query(100)};
  for (int i = 1; i < n; ++i) {
    std::vector<float> q = bench_query(100 + unsigned(i));
    for (std::size_t j = 0; j < q.size(); ++j)
      q[j] = float(rho * qs.back()[j] + std::sqrt(1.0 - rho * rho) * q[j]);
    qs.push_back(std::move(q));
  }
  return qs;
}

/// A QAQ cache of `tokens` tokens whose targets are calibrated to ~`bits` bits per element, everything counted
/// (bits_per_element(): codes, (lo, step), outliers with their channels, token ids, histories), as kivi2's 3.05
/// is: 16 decode steps (queries qs in turn) fill every history with what varied queries give, then each side's
/// target is bisected on the width rule over that state to the same average code width, `bits` less the fixed
/// per-token costs (0.94 bits/element at head dim 128: a width-b record is 4 + 16 b + 6 + 2 bytes per side).
/// QaqBench: QAQ's cache, with or without a Rotation.
using QaqPlain = kvc::CompressedKVCache<kvc::QaqQuantizer<>>;
template <class QaqBench = QaqPlain>
std::unique_ptr<QaqBench> build_qaq(int tokens, const std::vector<std::vector<float>>& qs, double bits,
                                    kvc::qaq::TokenProbs& probs) {
  kvc::qaq::QueryNormCalibration calib(1, kKvHeads, kHeadDim);
  for (float& x : calib.qnorm2) x = 1.0f;  // E ||q / sqrt(d)||^2 of the N(0, 1) query
  calib.queries = 1;
  auto cache = std::make_unique<QaqBench>(kvc::CacheConfig{1, 1, kKvHeads, kHeadDim, tokens},
                                          kvc::qaq::Targets{1e-3, 1e-3}, calib);
  fill(*cache, tokens);
  const int heads = kKvHeads * kGqa;
  std::vector<float> out(qs[0].size());
  for (const std::vector<float>& q : qs)
    kvc::qaq_decode_step(*cache, 0, kvc::QueryView::contiguous(q.data(), 1, heads, kHeadDim),
                         kvc::OutputView::contiguous(out.data(), 1, heads, kHeadDim), {}, probs);
  // The average width a target would give, from the rule over every record's metadata and history, without
  // moving anything or pushing the histories again (so they keep the maxima over varied queries).
  kvc::qaq::Targets t = cache->targets();
  auto average = [&](int side) {
    return [&, side](double target) {
      (side == 0 ? t.key_sigma_s : t.value_sigma_x) = target;
      double sum = 0.0, n = 0.0;
      for (int h = 0; h < kKvHeads; ++h) {
        const kvc::qaq::StepWidths<> rule(cache->length(0, 0), t.key_sigma_s, double(calib.at(0, h)), t.value_sigma_x,
                                          QaqBench::quantizer::widths());
        const auto& hist = cache->histories(0, 0, h);
        cache->for_each_record(side == 0 ? cache->keys(0, 0, h) : cache->values(0, 0, h),
                               [&](const std::byte* r, int, std::uint32_t tok) {
                                 sum += QaqBench::quantizer::width(hist[tok], QaqBench::record::meta(r), rule, side == 0);
                                 n += 1.0;
                               });
      }
      return sum / n;
    };
  };
  // bits_per_element is linear in the average code width (records are meta + 16 b + outliers + id bytes at d = 128)
  const double fixed = cache->bits_per_element() - 0.5 * (cache->average_width(0) + cache->average_width(1));
  t.key_sigma_s = kvc::qaq::calibrate_target(average(0), bits - fixed, 1e-9, 1e3, 30);
  t.value_sigma_x = kvc::qaq::calibrate_target(average(1), bits - fixed, 1e-9, 1e3, 30);
  cache->set_targets(t);
  const std::vector<float>& q = qs[0];  // one more step moves the tokens to the calibrated widths
  kvc::qaq_decode_step(*cache, 0, kvc::QueryView::contiguous(q.data(), 1, heads, kHeadDim),
                       kvc::OutputView::contiguous(out.data(), 1, heads, kHeadDim), {}, probs);
  return cache;
}

template <kvc::Precision Prec, class Cache = QaqPlain>
void BM_DecodeAttentionQaq(benchmark::State& state) {
  const auto qs = qaq_queries();
  kvc::qaq::TokenProbs probs;
  const auto cache = build_qaq<Cache>(static_cast<int>(state.range(0)), qs, 3.0, probs);
  kvc::AttentionOptions opt;
  opt.precision = Prec;
  kvc_bench::time_decode_steps(state, *cache, qs[0], kKvHeads * kGqa, kHeadDim, opt);
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(kvc::Isa::kAuto)));
  state.counters["key_bits"] = cache->average_width(0);
  state.counters["value_bits"] = cache->average_width(1);
}

/// BM_DecodeAttentionWarm: decode_attention over build(T)'s cache, back to back (no flush between the steps).
template <auto Build>
void BM_DecodeAttentionWarm(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), heads = kKvHeads * kGqa;
  const auto cache = Build(tokens);
  const std::vector<float> q = bench_query();
  std::vector<float> out(q.size());
  double seconds = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    kvc::decode_attention(*cache, 0, kvc::QueryView::contiguous(q.data(), 1, heads, kHeadDim),
                          kvc::OutputView::contiguous(out.data(), 1, heads, kHeadDim));
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(kvc::Isa::kAuto)));
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(cache->decode_read_bytes(0)) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["ns_per_token"] = 1e9 * seconds / (double(state.iterations()) * tokens * kKvHeads);
}
std::unique_ptr<QaqPlain> warm_qaq(int tokens) {
  kvc::qaq::TokenProbs probs;
  return build_qaq(tokens, qaq_queries(), 3.0, probs);
}

void BM_QaqUpdateWidths(benchmark::State& state) {
  kvc::qaq::TokenProbs probs;
  const auto cache = build_qaq(static_cast<int>(state.range(0)), qaq_queries(), 3.0, probs);
  for (auto _ : state) {
    cache->update_widths(0, probs);
    benchmark::DoNotOptimize(cache->stored_bytes());
  }
  state.counters["bits_per_element"] = cache->bits_per_element();
}

/// One whole QAQ decode step as a model runs it: attention with probabilities, then the width update they ask
/// for, with a new query every step, so tokens really move; value_moved_pct: the share of value records that
/// changed width per step. Independent queries (range(1) == 0) move about a fifth of them, half raised from the
/// mirror: the worst case. range(1) = 1000 rho > 0: drifting queries (qaq_queries). On this data (flat attention
/// over N(0, 1) keys) even small query steps move many tokens: rho = 0.97 moves ~15 %, 0.99 ~10 %, 0.995 ~8 %
/// (T = 4096); 0.995 is the row, about what SmolLM2 moves per step at 3.5-3.9 bits (kvc-eval's `moved`:
/// 3.8 % of the value records at qaq:3e-3:3e-2, 7.1 % at qaq:1e-3:1e-2).
/// range(2): the budget in tenths of a bit per element (30: kivi2's; 39: ~3 code bits per side). range(3): 1 runs
/// qaq_decode_step as a model does; 0 its two halves one after the other, to time them apart.
/// BM_QaqUpdateWidths repeats one step's probabilities, so after its first iteration nothing moves.
void BM_QaqDecodeStep(benchmark::State& state) {
  const auto qs = qaq_queries(double(state.range(1)) / 1000.0, 64);
  kvc::qaq::TokenProbs probs;
  const auto cache = build_qaq(static_cast<int>(state.range(0)), qs, double(state.range(2)) / 10.0, probs);
  const bool fused = state.range(3) != 0;
  std::vector<float> out(qs[0].size());
  const int heads = kKvHeads * kGqa;
  std::size_t step = 0;
  double attention_s = 0.0, update_s = 0.0;
  using clock = std::chrono::steady_clock;
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(kvc::Isa::kAuto)));
  const kvc::qaq::UpdateStats u0 = cache->update_stats();
  for (auto _ : state) {
    state.PauseTiming();
    kvc_bench::flush_caches();
    state.ResumeTiming();
    const std::vector<float>& q = qs[step++ % qs.size()];
    const auto qv = kvc::QueryView::contiguous(q.data(), 1, heads, kHeadDim);
    const auto ov = kvc::OutputView::contiguous(out.data(), 1, heads, kHeadDim);
    if (fused) {
      kvc::qaq_decode_step(*cache, 0, qv, ov, {}, probs);
    } else {  // qaq_decode_step's two halves, timed apart
      const auto t0 = clock::now();
      kvc::decode_attention(*cache, 0, qv, ov, {}, &probs);
      const auto t1 = clock::now();
      cache->update_widths(0, probs);
      update_s += std::chrono::duration<double>(clock::now() - t1).count();
      attention_s += std::chrono::duration<double>(t1 - t0).count();
    }
    benchmark::DoNotOptimize(out.data());
  }
  // the share of value records that changed width per step, over the timed steps only
  const kvc::qaq::UpdateStats u = cache->update_stats();
  const double moved = double(u.lowered[1] + u.raised[1] - u0.lowered[1] - u0.raised[1]);
  state.counters["value_moved_pct"] = 100.0 * moved / double(std::max<std::uint64_t>(1, u.records[1] - u0.records[1]));
  if (!fused) {
    state.counters["attention_ms"] = 1e3 * attention_s / double(state.iterations());
    state.counters["update_ms"] = 1e3 * update_s / double(state.iterations());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(cache->decode_read_bytes(0)) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bits_per_element"] = cache->bits_per_element();
  state.counters["key_bits"] = cache->average_width(0);
  state.counters["value_bits"] = cache->average_width(1);
}

/// The speed target's ratio with both sides under the same machine drift: per iteration one kivi2 decode attention
/// and one QAQ decode step (qaq_decode_step at ~3 bits; range(1) = 1000 rho as BM_QaqDecodeStep), each after a
/// cache flush and timed on its own. Counters: kivi2_ms, qaq_step_ms and ratio (their quotient over all
/// iterations). Separate rows of one run drift apart on a shared VM (+-15 % seen between rows minutes apart);
/// alternating at the 10 ms scale the ratio does not.
void BM_QaqStepOverKivi2(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const auto qs = qaq_queries(double(state.range(1)) / 1000.0, 64);
  kvc::qaq::TokenProbs probs;
  const auto qaq = build_qaq(tokens, qs, 3.0, probs);
  const auto kivi = build_cache<kvc::schemes::Kivi2>(tokens);
  const std::vector<float> qk = bench_query();
  std::vector<float> out(qk.size());
  const int heads = kKvHeads * kGqa;
  auto view = [&](const std::vector<float>& q) { return kvc::QueryView::contiguous(q.data(), 1, heads, kHeadDim); };
  const auto ov = kvc::OutputView::contiguous(out.data(), 1, heads, kHeadDim);
  using clock = std::chrono::steady_clock;
  double kivi_s = 0.0, qaq_s = 0.0;
  std::size_t step = 0;
  for (auto _ : state) {
    kvc_bench::flush_caches();
    const auto t0 = clock::now();
    kvc::decode_attention(*kivi, 0, view(qk), ov);
    const double k = std::chrono::duration<double>(clock::now() - t0).count();
    benchmark::DoNotOptimize(out.data());
    kvc_bench::flush_caches();
    const auto t1 = clock::now();
    kvc::qaq_decode_step(*qaq, 0, view(qs[step++ % qs.size()]), ov, {}, probs);
    const double a = std::chrono::duration<double>(clock::now() - t1).count();
    benchmark::DoNotOptimize(out.data());
    kivi_s += k, qaq_s += a;
    state.SetIterationTime(k + a);
  }
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(kvc::Isa::kAuto)));
  state.counters["kivi2_ms"] = 1e3 * kivi_s / double(state.iterations());
  state.counters["qaq_step_ms"] = 1e3 * qaq_s / double(state.iterations());
  state.counters["ratio"] = qaq_s / kivi_s;
  state.counters["bits_per_element"] = qaq->bits_per_element();
}

template <class Cache>
void register_append_decode(const char* name) {
  benchmark::RegisterBenchmark((std::string("BM_AppendDecode/") + name).c_str(), BM_AppendDecode<Cache>)
      ->ArgName("T")
      ->Arg(4096)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

/// BM_DecodeAttention/<name> (through Decode), its -exact twin if asked, and BM_Append/<name>.
template <class Cache, void (*Decode)(benchmark::State&) = BM_DecodeAttention<Cache>>
void register_scheme(const char* name, bool exact_too = false) {
  benchmark::RegisterBenchmark((std::string("BM_DecodeAttention/") + name).c_str(), Decode)
      ->ArgName("T")
      ->Arg(4096)
      ->Arg(32768)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  if (exact_too)
    benchmark::RegisterBenchmark((std::string("BM_DecodeAttention/") + name + "-exact").c_str(),
                                 BM_DecodeAttention<Cache, kvc::Precision::kExact>)
        ->ArgName("T")
        ->Arg(4096)
        ->Arg(32768)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark((std::string("BM_Append/") + name).c_str(), BM_Append<Cache>)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

const int registered = [] {
  for (int m = 0; m < kvc_bench::roofline::kMacKinds; ++m)
    benchmark::RegisterBenchmark((std::string("BM_PeakMacs/") + kvc_bench::roofline::kMacInfo[m].name).c_str(),
                                 BM_PeakMacs, static_cast<kvc_bench::roofline::Mac>(m))
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  register_scheme<kvc::schemes::Fp32>("fp32");
  register_scheme<kvc::schemes::Fp16>("fp16");
  register_scheme<kvc::schemes::Int8>("int8");
  register_scheme<kvc::schemes::Kivi4>("kivi4", true);
  register_scheme<kvc::schemes::Kivi2>("kivi2", true);
  register_scheme<kvc::schemes::GearKivi4>("gear_kivi4", true);
  register_scheme<kvc::schemes::GearKivi2>("gear_kivi2", true);
  // LogQuant (W = 42, G = 64) beside KIVI-2 on the same quantizer and full-precision budget.
  register_scheme<kvc::schemes::LogQuant2>("logquant2");
  register_scheme<kvc::schemes::LogQuant4>("logquant4");
  register_scheme<kvc::schemes::PartialLogQuant2>("partiallogquant2");  // + quantized value rows
  register_scheme<kvc::schemes::Kivi2Budget126>("kivi2_g64_w126");
  // Rotation: the query rotated and the output un-rotated once per step and head; nothing per token.
  register_scheme<kvc::schemes::Int4>("int4");
  register_scheme<kvc::schemes::Rotated<kvc::schemes::Int4>>("int4_rot");
  register_scheme<kvc::schemes::Rotated<kvc::schemes::Kivi4>>("kivi4_rot");
  register_scheme<kvc::schemes::Rotated<kvc::schemes::Kivi2>>("kivi2_rot");
  // The <= 4.6-bit scheme of the SmolLM2 sweep: KIVI-4 on 64-token groups, a 4-token sink on the block grid
  // (block 0's sink rows masked), rotated; beside the same blocks without sink and rotation.
  register_scheme<kvc::schemes::KiviWith<4, 64, 64, 0>>("kivi4_b64");
  register_scheme<kvc::schemes::KiviGridSink<4>>("kivi4_b64_gsink4");
  register_scheme<kvc::schemes::Rotated<kvc::schemes::KiviGridSink<4>>>("kivi4_b64_gsink4_rot");
  benchmark::RegisterBenchmark("BM_RotationStep/hadamard", BM_RotationStep<kvc::schemes::Rotated<kvc::schemes::Int4>>)
      ->Unit(benchmark::kMicrosecond);
  // AlignedKV: fp16 in bit planes read at the tiers its rules choose, and the same kernel forced to 16 bits.
  benchmark::RegisterBenchmark("BM_DecodeAttention/aligned_fp16", BM_DecodeAttentionAligned<kvc::CompressedKVCache<kvc::AlignedLoader<>>>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_DecodeAttention/aligned_fp16_tier16",
                               BM_DecodeAttentionAligned<kvc::CompressedKVCache<kvc::AlignedLoader<99, 99, 99, 99>>>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  // AlignedKV over other schemes' fp16 parts: KIVI-2's 128-token window and LogQuant's set stored as slot planes,
  // read at the tiers AlignedKV's rules give (bytes_per_second: what the step reported it read, aligned::ReadStats;
  // planes_per_second: decode_read_bytes, the plain scheme's bytes).
  using Kivi2Aligned = kvc::schemes::AlignedWindow<kvc::schemes::Kivi2>;
  using LogQuant2Aligned = kvc::schemes::AlignedWindow<kvc::schemes::LogQuant2>;
  register_scheme<Kivi2Aligned, BM_DecodeAttentionAligned<Kivi2Aligned>>("kivi2_aligned");
  register_scheme<LogQuant2Aligned, BM_DecodeAttentionAligned<LogQuant2Aligned>>("logquant2_aligned");
  // QAQ at ~3 bits per element as kivi2 (its attention reads the records; its width update runs every step).
  benchmark::RegisterBenchmark("BM_DecodeAttention/qaq", BM_DecodeAttentionQaq<kvc::Precision::kFast>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_DecodeAttention/qaq-exact", BM_DecodeAttentionQaq<kvc::Precision::kExact>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(
      "BM_DecodeAttention/qaq_rot",
      BM_DecodeAttentionQaq<kvc::Precision::kFast, kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  // kvc-eval's qaq-a0n1-rot-lm cache (no outliers, n = 1, Hadamard-rotated, LogMeta's 2-byte (lo, step)), also
  // calibrated to ~3 bits per element everything counted.
  benchmark::RegisterBenchmark(
      "BM_DecodeAttention/qaq_a0n1_rot_lm",
      BM_DecodeAttentionQaq<kvc::Precision::kFast,
                            kvc::CompressedKVCache<kvc::QaqQuantizer<1, 8, 0, 1, kvc::qaq::PaperBounds, kvc::qaq::LogMeta>,
                                                   kvc::Rotation<kvc::Hadamard<>>>>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  // Both kernels warm: the time each takes beside its memory reads.
  benchmark::RegisterBenchmark("BM_DecodeAttentionWarm/kivi2", BM_DecodeAttentionWarm<build_cache<kvc::schemes::Kivi2>>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_DecodeAttentionWarm/qaq", BM_DecodeAttentionWarm<warm_qaq>)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_QaqUpdateWidths", BM_QaqUpdateWidths)
      ->ArgName("T")->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_QaqDecodeStep", BM_QaqDecodeStep)
      ->ArgNames({"T", "rho", "bits10", "fused"})->Args({4096, 0, 30, 1})->Args({32768, 0, 30, 1})
      ->Args({4096, 995, 30, 1})->Args({32768, 995, 30, 1})->Args({32768, 0, 39, 1})->Args({32768, 995, 39, 1})
      ->Args({4096, 995, 30, 0})->Args({32768, 0, 30, 0})->Args({32768, 995, 30, 0})
      ->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_QaqStepOverKivi2", BM_QaqStepOverKivi2)
      ->ArgNames({"T", "rho"})->Args({4096, 995})->Args({32768, 995})
      ->UseManualTime()->Unit(benchmark::kMillisecond);
  // Decode-time compression, block mode vs GEAR's literal mode (Algorithm 1) on the same policies.
  using namespace kvc::schemes;
  register_append_decode<GearKivi2>("gear_kivi2");
  register_append_decode<KiviWith<2, 32, 32, 128, kvc::OutlierFilter<50>, kvc::LowRankResidual<kvc::Rank<1>>,
                                   kvc::LiteralMode>>("gear_kivi2_literal");
  // GearKivi2 with the 1 % outliers it had before (the speed side of picking s).
  register_scheme<KiviWith<2, 32, 32, 128, kvc::OutlierFilter<100>, kvc::LowRankResidual<kvc::Rank<1>>>>(
      "gear_kivi2_s1");
  register_append_decode<LogQuant2>("logquant2");  // eviction moves + staging
  register_append_decode<PartialLogQuant2>("partiallogquant2");
  register_append_decode<Kivi2Budget126>("kivi2_g64_w126");
  register_append_decode<Gear4>("gear4");
  register_append_decode<Gear4Literal>("gear4_literal");
  register_append_decode<Gear4Paper>("gear4_paper");
  return 0;
}();
}  // namespace

BENCHMARK_MAIN();
