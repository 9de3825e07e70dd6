// Shared by the kvc_bench sources: the cache flush and the timed decode-step loop, so every
// BM_DecodeAttention* benchmark measures and reports the same way.
#pragma once

#include <kvc/kvc.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

namespace kvc_bench {

inline constexpr std::size_t kFlushBytes = std::size_t(1) << 30;  // > every last-level cache we run on

/// Evicts the cache hierarchy by reading a buffer larger than the LLC (untimed). Reading, not
/// writing, so the caches are left holding clean lines and the timed decode pays no write-backs.
/// One buffer for the whole binary.
inline void flush_caches() {
  static const std::vector<std::uint64_t> buf(kFlushBytes / sizeof(std::uint64_t), 1);
  std::uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
  for (std::size_t i = 0; i < buf.size(); i += 8) sum += buf[i];
  benchmark::DoNotOptimize(sum);
}

/// Times one fused decode step over layer 0 of `cache` per iteration (caches flushed, untimed, before
/// each), and sets the counters: bytes_per_second (cache bytes one step reads: codes, scales, zeros,
/// windows) and bits_per_element (stored bits per K/V element, everything counted). The label names
/// the SIMD path that ran (chosen at run time; KVC_FORCE_ISA pins it).
template <class Cache>
void time_decode_steps(benchmark::State& state, const Cache& cache, const std::vector<float>& q, int heads,
                       int head_dim, const kvc::AttentionOptions& opt = {}) {
  std::vector<float> out(q.size());
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(opt.isa)));
  for (auto _ : state) {
    state.PauseTiming();
    flush_caches();
    state.ResumeTiming();
    kvc::decode_attention(cache, 0, kvc::QueryView::contiguous(q.data(), 1, heads, head_dim),
                          kvc::OutputView::contiguous(out.data(), 1, heads, head_dim), opt);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(cache.decode_read_bytes(0)) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bits_per_element"] = cache.bits_per_element();
}
}  // namespace kvc_bench
