// kvc_bench's roofline: what bounds a decode step on this machine.
//
// On all OpenMP threads (the thread count decode attention runs with):
//  - the read bandwidth: in the decode benchmarks, the rate of the 1 GiB cache flushes between the timed
//    steps (bench_util.hpp), so both sides of a row see the same moments of a shared host whose bandwidth
//    drifts; BM_MemoryRead is the same limit as a row of its own;
//  - the peak multiply-add rate of every instruction a decode inner loop is bound by (Mac below), 12
//    independent accumulator chains per thread, best of 7 runs of ~20 ms, measured once per process.
// A decode step's bound is max(bytes / bandwidth, sum over instruction kinds of multiply-adds / peak): the
// fastest it could run if it only read its bytes or only issued its products. `roofline` = bound / measured
// time (1 = at the roofline). The model counts the products of the dot products (q . k_t and sum_t p_t v_t,
// T x d per query head and side) at the instruction the path's inner loop uses for that side; epilogues
// (scales, zeros, outliers, low-rank factors), softmax and the code unpacking are the overhead the roofline
// fraction exposes.
#pragma once

#include <kvc/kvc.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <optional>

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif

namespace kvc_bench::roofline {

/// The instructions decode inner loops are bound by. `macs`: multiply-adds one instruction (or the emulating
/// group) performs.
enum class Mac : int {
  kFmaZmm,      ///< float keys/values (identity, 5..8-bit codes), AVX-512 path
  kFmaYmm,      ///< the same, AVX2 path
  kDpbusdZmm,   ///< <= 4-bit codes (KIVI, GEAR-KIVI, LogQuant), AVX-512 path
  kMaddubsYmm,  ///< the same, AVX2 path: vpdpbusd emulated
  kDpwssdYmm,   ///< QAQ's int16 products (Precision::kFast), AVX-512 path
  kMaddwdYmm,   ///< the same, AVX2 path
};
inline constexpr int kMacKinds = 6;
struct MacInfo {
  const char* name;  ///< BM_PeakMacs/<name>
  int macs;
  kvc::Isa needs;
};
inline constexpr MacInfo kMacInfo[kMacKinds] = {
    {"fma_f32_zmm", 16, kvc::Isa::kAvx512},     // vfmadd231ps zmm
    {"fma_f32_ymm", 8, kvc::Isa::kAvx2},        // vfmadd231ps ymm
    {"dpbusd_zmm", 64, kvc::Isa::kAvx512},      // vpdpbusd zmm: 64 u8 x s8
    {"maddubs_ymm", 32, kvc::Isa::kAvx2},       // vpmaddubsw + vpmaddwd + vpaddd ymm: 32 u8 x s8
    {"dpwssd_ymm", 16, kvc::Isa::kAvx512},      // vpdpwssd ymm: 16 s16 x s16
    {"maddwd_ymm", 16, kvc::Isa::kAvx2},        // vpmaddwd + vpaddd ymm: 16 s16 x s16
};
inline const MacInfo& info(Mac m) noexcept { return kMacInfo[static_cast<int>(m)]; }

namespace detail {
inline constexpr int kChains = 12;  // independent accumulators per thread: > latency x issue ports

#if KVC_HAS_ISA_DISPATCH()  // x86-64, g++ or clang: GNU inline assembly
// Each loop is written in assembly so that every build (-march=native or none) measures the same
// instruction stream: per round kChains independent instructions into registers 0..11 (the emulated
// products through register 12, which renaming keeps free of false dependences), operands in 13..15;
// initial values are finite and normal (no denormal slow paths).
#  define KVC_BENCH_X12_(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#  define KVC_BENCH_LOOP_(setup, body)                                                                  \
    asm volatile(setup "1:\n\t" body "dec %[n]\n\tjnz 1b\n\t"                                      \
                 : [n] "+r"(iters)                                                                      \
                 : [f] "m"(kOne), [i] "m"(kInt)                                                        \
                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                   "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory")
inline constexpr float kOne = 1.0f;
inline constexpr int kInt = 0x01010101;
#  define KVC_BENCH_INIT_F_(r) "vbroadcastss %[f], %%" #r "\n\t"
#  define KVC_BENCH_INIT_I_(r) "vpbroadcastd %[i], %%" #r "\n\t"
#  define KVC_BENCH_ZINIT_(i) KVC_BENCH_INIT_F_(zmm##i)
#  define KVC_BENCH_YINIT_(i) KVC_BENCH_INIT_F_(ymm##i)
#  define KVC_BENCH_ZIINIT_(i) KVC_BENCH_INIT_I_(zmm##i)
#  define KVC_BENCH_YIINIT_(i) KVC_BENCH_INIT_I_(ymm##i)
#  define KVC_BENCH_FMA_Z_(i) "vfmadd231ps %%zmm14, %%zmm15, %%zmm" #i "\n\t"
#  define KVC_BENCH_FMA_Y_(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#  define KVC_BENCH_DPBUSD_Z_(i) "vpdpbusd %%zmm14, %%zmm15, %%zmm" #i "\n\t"
#  define KVC_BENCH_MADDUBS_Y_(i) \
    "vpmaddubsw %%ymm14, %%ymm15, %%ymm12\n\tvpmaddwd %%ymm13, %%ymm12, %%ymm12\n\tvpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"
#  define KVC_BENCH_DPWSSD_Y_(i) "vpdpwssd %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#  define KVC_BENCH_MADDWD_Y_(i) "vpmaddwd %%ymm14, %%ymm15, %%ymm12\n\tvpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"
#  define KVC_BENCH_AVX512_ __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#  define KVC_BENCH_AVX2_ __attribute__((target("avx2,fma")))
// One kernel per instruction: registers 0..15 initialised (init), then iters >= 1 rounds of op on 0..11.
#  define KVC_BENCH_KERNEL_(name, target, init, op)                                                   \
    target inline void name(long iters) {                                                            \
      KVC_BENCH_LOOP_(KVC_BENCH_X12_(init) init(12) init(13) init(14) init(15), KVC_BENCH_X12_(op)); \
    }
KVC_BENCH_KERNEL_(fma_zmm, KVC_BENCH_AVX512_, KVC_BENCH_ZINIT_, KVC_BENCH_FMA_Z_)
KVC_BENCH_KERNEL_(fma_ymm, KVC_BENCH_AVX2_, KVC_BENCH_YINIT_, KVC_BENCH_FMA_Y_)
KVC_BENCH_KERNEL_(dpbusd_zmm, KVC_BENCH_AVX512_, KVC_BENCH_ZIINIT_, KVC_BENCH_DPBUSD_Z_)
KVC_BENCH_KERNEL_(maddubs_ymm, KVC_BENCH_AVX2_, KVC_BENCH_YIINIT_, KVC_BENCH_MADDUBS_Y_)
KVC_BENCH_KERNEL_(dpwssd_ymm, KVC_BENCH_AVX512_, KVC_BENCH_YIINIT_, KVC_BENCH_DPWSSD_Y_)
KVC_BENCH_KERNEL_(maddwd_ymm, KVC_BENCH_AVX2_, KVC_BENCH_YIINIT_, KVC_BENCH_MADDWD_Y_)
#endif
}  // namespace detail

/// Whether this build and CPU run `m`.
inline bool runs(Mac m) noexcept {
  return KVC_HAS_ISA_DISPATCH() && kvc::isa_compiled(info(m).needs) && kvc::isa_supported(info(m).needs);
}

/// Runs `iters` rounds of `m` on every thread; returns the multiply-adds done (0 when `m` does not run here).
inline double run_macs(Mac m, long iters) {
  if (!runs(m)) return 0.0;
  int threads = 1;
#pragma omp parallel
  {
#if KVC_HAS_OPENMP()
#  pragma omp single
    threads = omp_get_num_threads();
#endif
#if KVC_HAS_ISA_DISPATCH()
    switch (m) {
      case Mac::kFmaZmm: detail::fma_zmm(iters); break;
      case Mac::kFmaYmm: detail::fma_ymm(iters); break;
      case Mac::kDpbusdZmm: detail::dpbusd_zmm(iters); break;
      case Mac::kMaddubsYmm: detail::maddubs_ymm(iters); break;
      case Mac::kDpwssdYmm: detail::dpwssd_ymm(iters); break;
      case Mac::kMaddwdYmm: detail::maddwd_ymm(iters); break;
    }
#endif
  }
  return double(threads) * double(iters) * detail::kChains * info(m).macs;
}

/// Best of 7 timed calls of f() (which returns the work done), as work per second: the machine's peak, not its
/// noise.
template <class F>
double best_rate(F&& f) {
  using clock = std::chrono::steady_clock;
  double best = 0.0;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = clock::now();
    const double work = f();
    best = std::max(best, work / std::chrono::duration<double>(clock::now() - t0).count());
  }
  return best;
}

/// Peak multiply-adds per second of `m` on all threads (measured once; 0 when `m` does not run here).
inline double peak_macs(Mac m) {
  static double peak[kMacKinds] = {};
  static bool measured[kMacKinds] = {};
  const int i = static_cast<int>(m);
  if (!measured[i]) {
    if (runs(m)) {
      // ~20 ms a run: the fastest of short warm-up runs (clock ramp) sizes it
      const long probe = 1L << 16;
      const double fastest = run_macs(m, probe) / best_rate([&] { return run_macs(m, probe); });
      const long iters = std::max(probe, static_cast<long>(double(probe) * 0.02 / fastest));
      peak[i] = best_rate([&] { return run_macs(m, iters); });
    }
    measured[i] = true;
    std::fprintf(stderr, "kvc_bench roofline: %s peak %.1f G multiply-adds/s\n", info(m).name, peak[i] * 1e-9);
  }
  return peak[i];
}

/// The work one decode step does: the bytes it reads and its multiply-adds per instruction kind.
struct Work {
  double bytes = 0.0;
  double macs[kMacKinds] = {};
  void add(Mac m, double n) { macs[static_cast<int>(m)] += n; }
};

/// Seconds the step needs at least: reading its bytes, and issuing its products.
struct Bound {
  double memory_s = 0.0, compute_s = 0.0;
  [[nodiscard]] double seconds() const { return std::max(memory_s, compute_s); }
};
inline Bound bound(const Work& w, double read_bandwidth) {
  Bound b;
  b.memory_s = w.bytes / read_bandwidth;
  for (int i = 0; i < kMacKinds; ++i)
    if (w.macs[i] > 0.0) b.compute_s += w.macs[i] / peak_macs(static_cast<Mac>(i));
  return b;
}

/// The instruction kind of float products, byte (u8 x s8) products and int16 products on `isa`'s path;
/// nullopt on the portable path (no roofline: the compiler's vectorisation decides).
inline std::optional<Mac> float_mac(kvc::Isa isa) {
  if (isa == kvc::Isa::kAvx512) return Mac::kFmaZmm;
  if (isa == kvc::Isa::kAvx2) return Mac::kFmaYmm;
  return std::nullopt;
}
inline std::optional<Mac> byte_mac(kvc::Isa isa) {
  if (isa == kvc::Isa::kAvx512) return Mac::kDpbusdZmm;
  if (isa == kvc::Isa::kAvx2) return Mac::kMaddubsYmm;
  return std::nullopt;
}
inline std::optional<Mac> int16_mac(kvc::Isa isa) {
  if (isa == kvc::Isa::kAvx512) return Mac::kDpwssdYmm;
  if (isa == kvc::Isa::kAvx2) return Mac::kMaddwdYmm;
  return std::nullopt;
}

/// Sets the counters roofline (the step's bound over its measured time: `seconds` for all iterations), roof_mem_ms
/// and roof_mac_ms (the two bounds of one step), read_gbs (the bandwidth the memory side used, GB/s) and read_share
/// (the step's bytes per second over read_gbs: its share of BM_MemoryRead's bandwidth at the same moments, free of
/// the host's drift between benchmarks) from the step's work; nothing on the portable path.
inline void set_counters(benchmark::State& state, const std::optional<Work>& w, double seconds, double read_bandwidth) {
  if (!w || state.iterations() == 0 || !(seconds > 0.0) || !(read_bandwidth > 0.0)) return;
  const Bound b = bound(*w, read_bandwidth);
  state.counters["roofline"] = b.seconds() * double(state.iterations()) / seconds;
  state.counters["read_gbs"] = 1e-9 * read_bandwidth;
  state.counters["read_share"] = b.memory_s * double(state.iterations()) / seconds;
  state.counters["roof_mem_ms"] = 1e3 * b.memory_s;
  state.counters["roof_mac_ms"] = 1e3 * b.compute_s;
}
}  // namespace kvc_bench::roofline
