// kvc_phases: where one decode block's time goes, per scheme and SIMD path (the cost breakdown behind the
// roofline table). The kernels are kvc_bench's, compiled with KVC_PHASE_CLOCK (kvc/core/phase_clock.hpp): TSC
// marks between the kernel's phases, summed over the threads and divided by the blocks run. A program of its
// own: the marked kernels must not meet unmarked ones in one binary.
//   BM_Phases/<scheme>/T:<n>/cold:1   kvc_bench's BM_DecodeAttention step (8 KV heads, GQA 4, head dim 128,
//                                     batch 1, every thread, caches flushed before each step): memory included
//   BM_Phases/<scheme>/T:<n>/cold:0   the same step repeated on one thread with nothing flushed, at a T whose
//                                     cache stays in L2/L3: the block's compute alone
// Counters, TSC ticks per block (block_tokens tokens of one KV head, all its query heads): one per phase (other, fp_tokens,
// key_prep, key_dot, corrections, softmax, value_prep, value_dot: phase_clock.hpp's list), `ticks` (their sum),
// `mem_ticks` (the block's bytes, the step's decode_read_bytes over its blocks, at the read bandwidth of the
// flushes shared by the threads: the memory floor; cold rows only), `tsc_ghz`. A mark costs ~20-40 ticks and a
// block takes 6-9 of them, so compare phases, and kvc_bench's times for the totals.
// Run: KVC_FORCE_ISA=avx2 ./build/benchmarks/kvc_phases, and again without the pin.
#define KVC_PHASE_CLOCK 1
#include "bench_util.hpp"

#include <kvc/kvc.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <string>
#include <thread>

namespace {

using kvc_bench::kGqa, kvc_bench::kHeadDim, kvc_bench::kKvHeads;

/// TSC ticks per second, from 50 ms of steady_clock (the TSC is invariant on every x86 we run on).
double tsc_hz() {
  static const double hz = [] {
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t c0 = __rdtsc();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const std::uint64_t c1 = __rdtsc();
    return double(c1 - c0) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }();
  return hz;
}

template <class Cache>
void BM_Phases(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const bool cold = state.range(1) != 0;
  const auto cache = kvc_bench::build_cache<Cache>(tokens);
  const std::vector<float> q = kvc_bench::bench_query();
  std::vector<float> out(q.size());
  const int heads = kKvHeads * kGqa;
  kvc::AttentionOptions opt;
  if (!cold) opt.num_threads = 1;
  auto step = [&] {
    kvc::decode_attention(*cache, 0, kvc::QueryView::contiguous(q.data(), 1, heads, kHeadDim),
                          kvc::OutputView::contiguous(out.data(), 1, heads, kHeadDim), opt);
    benchmark::DoNotOptimize(out.data());
  };
  step();  // warm-up (scratch, page faults)
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(opt.isa)));
  kvc::phase::reset();
  kvc_bench::StepTimes times;
  if (cold) {
    times = kvc_bench::time_steps(state, step);
  } else {
    for (auto _ : state) step();
  }
  const kvc::phase::Slot sum = kvc::phase::totals();
  if (sum.blocks == 0) {
    state.SkipWithError("no quantized block ran");
    return;
  }
  const double blocks = double(sum.blocks);
  double total = 0.0;
  for (int p = 0; p < kvc::phase::kCount; ++p) {
    const double per = double(sum.ticks[std::size_t(p)]) / blocks;
    state.counters[kvc::phase::kPhaseNames[p]] = per;
    total += per;
  }
  state.counters["ticks"] = total;
  state.counters["block_tokens"] = Cache::kBlockTokens;
  state.counters["tsc_ghz"] = tsc_hz() * 1e-9;
  if (cold) {
    const double blocks_per_step = blocks / double(state.iterations());
    const double bytes = double(cache->decode_read_bytes(0)) / blocks_per_step;
    const int threads = kvc::detail::attention_threads(opt);
    state.counters["mem_ticks"] = bytes / (times.read_bandwidth(state) / threads) * tsc_hz();
  }
}

template <class Cache>
void register_phases(const std::string& name) {
  benchmark::RegisterBenchmark(("BM_Phases/" + name).c_str(), BM_Phases<Cache>)
      ->ArgNames({"T", "cold"})
      ->Args({32768, 1})
      ->Args({1024, 0})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

const int registered = [] {
  using namespace kvc::schemes;
  register_phases<Fp16>("fp16");
  register_phases<Int8>("int8");
  register_phases<Kivi4>("kivi4");
  register_phases<Kivi2>("kivi2");
  register_phases<GearKivi4>("gear_kivi4");
  register_phases<GearKivi2>("gear_kivi2");
  register_phases<LogQuant2>("logquant2");
  register_phases<LogQuant4>("logquant4");
  register_phases<PartialLogQuant2>("partiallogquant2");
  return 0;
}();

}  // namespace
