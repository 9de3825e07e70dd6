// Shared by the kvc_bench sources and kvc_phases: the synthetic K/V and query, the cache flush and the timed
// decode-step loop, so every BM_DecodeAttention* benchmark measures and reports the same way.
#pragma once

#include "roofline.hpp"

#include <kvc/kvc.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#if KVC_HAS_AVX512()
#  include <immintrin.h>
#endif

namespace kvc_bench {

inline constexpr std::size_t kFlushBytes = std::size_t(1) << 30;  // > every last-level cache we run on
/// The decode rows' shape: 8 KV heads, GQA 4, head dim 128, batch 1.
inline constexpr int kKvHeads = 8, kGqa = 4, kHeadDim = 128;

/// Keys with realistic structure: per-channel offsets and a few large outlier channels.
inline std::vector<float> make_kv(int tokens, bool keys, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(std::size_t(tokens) * kKvHeads * kHeadDim);
  std::vector<float> offset(kKvHeads * kHeadDim), gain(kKvHeads * kHeadDim, 1.0f);
  for (int i = 0; i < kKvHeads * kHeadDim; ++i) {
    offset[i] = keys ? 0.5f * nd(rng) : 0.0f;
    if (keys && i % 37 == 5) gain[i] = 8.0f;  // outlier channels
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::size_t ch = i % (kKvHeads * kHeadDim);
    x[i] = offset[ch] + gain[ch] * nd(rng);
  }
  return x;
}

/// Appends `tokens` tokens of make_kv data to layer 0, sequence 0, in prefill chunks.
template <class Cache>
void fill(Cache& cache, int tokens) {
  const int chunk = 4096;
  for (int t0 = 0; t0 < tokens; t0 += chunk) {
    const int n = std::min(chunk, tokens - t0);
    const auto k = make_kv(n, true, 1u + t0), v = make_kv(n, false, 7u + t0);
    cache.append(0, 0, kvc::KVView::contiguous(k.data(), n, kKvHeads, kHeadDim),
                 kvc::KVView::contiguous(v.data(), n, kKvHeads, kHeadDim));
  }
}

template <class Cache>
std::unique_ptr<Cache> build_cache(int tokens) {
  auto cache = std::make_unique<Cache>(kvc::CacheConfig{1, 1, kKvHeads, kHeadDim, tokens});
  fill(*cache, tokens);
  return cache;
}

/// The decode query: N(0, 1) per element, every head.
inline std::vector<float> bench_query(unsigned seed = 3) {
  std::vector<float> q(std::size_t(kKvHeads) * kGqa * kHeadDim);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);
  return q;
}

/// The read-bandwidth kernel: sums n floats (n % 64 == 0, 64-byte aligned) on every OpenMP thread, 256 bytes per
/// step in independent accumulators: AVX-512 adds where the build has them, else 64 lanes the compiler
/// vectorises. BM_MemoryRead times it over read_buffer(); the cache flushes between timed decode steps run it too,
/// so their bandwidth (read_gbs, read_share) is BM_MemoryRead's at the moments the steps run.
KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
inline float read_pass(const float* buf, std::size_t n) {
  assert(n % 64 == 0 && reinterpret_cast<std::uintptr_t>(buf) % 64 == 0);  // the loops below read whole 256-byte steps
  float total = 0.0f;
#pragma omp parallel reduction(+ : total)
  {
#if KVC_HAS_AVX512()
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#  pragma omp for schedule(static)
    for (std::size_t i = 0; i < n; i += 64) {
      a0 = _mm512_add_ps(a0, _mm512_load_ps(buf + i));
      a1 = _mm512_add_ps(a1, _mm512_load_ps(buf + i + 16));
      a2 = _mm512_add_ps(a2, _mm512_load_ps(buf + i + 32));
      a3 = _mm512_add_ps(a3, _mm512_load_ps(buf + i + 48));
    }
    total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
    // 64 lanes: 8 independent add chains of 8 floats (AVX2), so the adds' latency cannot bound the read
    float acc[64] = {};
#  pragma omp for schedule(static)
    for (std::size_t i = 0; i < n; i += 64)
#  pragma omp simd
      for (int j = 0; j < 64; ++j) acc[j] += buf[i + j];
    for (float x : acc) total += x;
#endif
  }
  return total;
}
KVC_SUPPRESS_INTRINSIC_WARNINGS_END

/// The 1 GiB buffer read_pass reads: one for the whole binary, larger than every last-level cache we run on, its
/// values different from page to page (a page-periodic pattern could let a hypervisor merge the pages).
inline const kvc::AlignedBuffer<float>& read_buffer() {
  static const kvc::AlignedBuffer<float> buf = [] {
    kvc::AlignedBuffer<float> b(kFlushBytes / sizeof(float));
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i % 1000003u);
    return b;
  }();
  return buf;
}

/// Evicts the cache hierarchy by reading read_buffer() with read_pass (untimed by the benchmark). Reading, not
/// writing, so the caches are left holding clean lines and the timed decode pays no write-backs. Returns the
/// seconds the read took: kFlushBytes over it is BM_MemoryRead's bandwidth at the moments the decode steps run (the
/// roofline's memory side; the shared hosts' bandwidth drifts by tens of percent).
inline double flush_caches() {
  const auto& buf = read_buffer();
  const auto t0 = std::chrono::steady_clock::now();
  benchmark::DoNotOptimize(read_pass(buf.data(), buf.size()));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Seconds of the timed decode steps and of the flushes between them (for the roofline counters).
struct StepTimes {
  double steps = 0.0, flushes = 0.0;
  [[nodiscard]] double read_bandwidth(benchmark::State& state) const {
    return flushes > 0.0 ? double(kFlushBytes) * double(state.iterations()) / flushes : 0.0;
  }
};

/// The benchmark loop of the decode rows: per iteration the caches flushed (untimed), then step() timed.
template <class Step>
StepTimes time_steps(benchmark::State& state, Step&& step) {
  StepTimes times;
  for (auto _ : state) {
    state.PauseTiming();
    times.flushes += flush_caches();
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    times.steps += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return times;
}

/// The roofline work of one decode step over layer 0 of `cache` (every sequence) on `isa`'s path: the bytes
/// it reads (decode_read_bytes) and its products, T x d per query head and side, at the instruction that
/// side's inner loop uses (roofline.hpp); nullopt on the portable path.
template <class Cache>
std::optional<roofline::Work> decode_work(const Cache& cache, int heads, int head_dim, kvc::Isa isa,
                                          kvc::Precision precision) {
  using roofline::Mac;
  const std::optional<Mac> fmac = roofline::float_mac(isa), bmac = roofline::byte_mac(isa),
                           imac = roofline::int16_mac(isa);
  if (!fmac || !bmac || !imac) return std::nullopt;
  roofline::Work w;
  w.bytes = static_cast<double>(cache.decode_read_bytes(0));
  const double per_token = double(heads) * head_dim;  // multiply-adds per token and side
  for (int seq = 0; seq < cache.config().batch; ++seq) {
    const double n = cache.length(0, seq);
    if constexpr (requires { typename Cache::key_format; }) {
      // Quantized blocks: <= 4-bit codes by byte products (vpdpbusd or its AVX2 emulation) with kFast, wider
      // codes, identity blocks and kExact by float FMAs; the full-precision rows (windows, log sets, staging)
      // by float FMAs.
      const double q = double(cache.quantized_blocks(0, seq)) * Cache::kBlockTokens;
      const bool fast = precision == kvc::Precision::kFast;
      w.add(fast && Cache::key_format::kIntDot ? *bmac : *fmac, q * per_token);
      w.add(fast && Cache::value_format::kIntDot ? *bmac : *fmac, q * per_token);
      w.add(*fmac, 2.0 * (n - q) * per_token);
    } else if constexpr (requires { typename Cache::loader; }) {
      w.add(*fmac, 2.0 * n * per_token);  // AlignedKV: fp16 assembled from the planes, float FMAs
    } else {
      // QAQ: int16 products on both sides with Precision::kFast, float FMAs with kExact
      w.add(precision == kvc::Precision::kFast ? *imac : *fmac, 2.0 * n * per_token);
    }
  }
  return w;
}

/// Times one fused decode step over layer 0 of `cache` per iteration (caches flushed, untimed, before
/// each), and sets the counters: bytes_per_second (cache bytes one step reads: codes, scales, zeros,
/// windows), bits_per_element (stored bits per K/V element, everything counted) and the roofline counters
/// (roofline.hpp: roofline, roof_mem_ms, roof_mac_ms, read_gbs; not on the portable path), the memory side at
/// the bandwidth the flushes between the steps read at. The label names
/// the SIMD path that ran (chosen at run time; KVC_FORCE_ISA pins it).
template <class Cache>
void time_decode_steps(benchmark::State& state, const Cache& cache, const std::vector<float>& q, int heads,
                       int head_dim, const kvc::AttentionOptions& opt = {}) {
  std::vector<float> out(q.size());
  state.SetLabel(kvc::isa_name(kvc::resolve_isa(opt.isa)));
  const StepTimes times = time_steps(state, [&] {
    kvc::decode_attention(cache, 0, kvc::QueryView::contiguous(q.data(), 1, heads, head_dim),
                          kvc::OutputView::contiguous(out.data(), 1, heads, head_dim), opt);
    benchmark::DoNotOptimize(out.data());
  });
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(cache.decode_read_bytes(0)) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bits_per_element"] = cache.bits_per_element();
  roofline::set_counters(state, decode_work(cache, heads, head_dim, kvc::resolve_isa(opt.isa), opt.precision),
                         times.steps, times.read_bandwidth(state));
}
}  // namespace kvc_bench
