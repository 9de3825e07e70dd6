/// \file phase_clock.hpp
/// Opt-in per-phase TSC tick counters of the fused CPU decode kernel: where a block's time goes (the
/// cost breakdown behind `kvc_phases`). Host only.
///
/// Contract:
///  - Off unless `KVC_PHASE_CLOCK` is defined before the first kvc header: then `KVC_PHASE(p)`,
///    `KVC_PHASE_BEGIN()` and `KVC_PHASE_BLOCK()` expand to nothing and this file declares nothing else.
///  - On (x86-64 only: it reads the TSC), `KVC_PHASE_BEGIN()` starts the calling thread's clock and
///    every `KVC_PHASE(p)` adds the ticks since the thread's previous mark to phase `p` of the thread's
///    slot (its OpenMP thread number), so consecutive marks split the time between them without gaps.
///    A mark costs one `rdtsc` (~20-40 ticks): compare phases of one build, not with a plain build.
///  - Define it only in a program of its own (benchmarks: `kvc_phases`): kernels compiled with and
///    without it have the same symbols and different bodies, so they must not be linked together.
#pragma once

#if defined(KVC_PHASE_CLOCK)
#  if !(defined(__x86_64__) || defined(_M_X64))
#    error "KVC_PHASE_CLOCK reads the x86 TSC: define it only on x86-64"
#  endif
#  include <x86intrin.h>

#  include <array>
#  include <cstdint>
#  if defined(_OPENMP)
#    include <omp.h>
#  endif

namespace kvc::phase {

/// What a kernel mark closes. kOther: between blocks (loop, prefetch, the work item's setup and reductions).
enum Phase : int {
  kOther,
  kFpTokens,     ///< full-precision tokens (windows, sinks, log sets): scores, softmax and values
  kKeyPrep,      ///< a key block's codes unpacked, metadata widened, the query folded and rounded to int8
  kKeyDot,       ///< the key dot products and their epilogues (scores)
  kCorrections,  ///< GEAR's outliers and low-rank epilogues on scores and outputs
  kSoftmax,      ///< online softmax over the block's scores, rescaling of the accumulators
  kValuePrep,    ///< a value block's codes unpacked, metadata widened, weights p_t s_t rounded to uint8
  kValueDot,     ///< the value dot products and their accumulation into the output
  kCount
};
inline constexpr const char* kPhaseNames[kCount] = {"other",   "fp_tokens",  "key_prep",  "key_dot",
                                                    "corrections", "softmax", "value_prep", "value_dot"};

/// One thread's counters, a cache line of their own.
struct alignas(64) Slot {
  std::uint64_t last = 0;
  std::array<std::uint64_t, kCount> ticks{};
  std::uint64_t blocks = 0;
};
inline constexpr int kSlots = 64;
inline Slot slots[kSlots];

inline Slot& slot() noexcept {
#  if defined(_OPENMP)
  return slots[omp_get_thread_num() % kSlots];
#  else
  return slots[0];
#  endif
}
inline void begin() noexcept { slot().last = __rdtsc(); }
inline void mark(Phase p) noexcept {
  Slot& s = slot();
  const std::uint64_t t = __rdtsc();
  s.ticks[p] += t - s.last;
  s.last = t;
}
inline void reset() noexcept {
  for (Slot& s : slots) s = Slot{};
}
/// Every slot's ticks per phase and blocks, summed.
inline Slot totals() noexcept {
  Slot sum;
  for (const Slot& s : slots) {
    for (int p = 0; p < kCount; ++p) sum.ticks[std::size_t(p)] += s.ticks[std::size_t(p)];
    sum.blocks += s.blocks;
  }
  return sum;
}
}  // namespace kvc::phase

#  define KVC_PHASE_BEGIN() ::kvc::phase::begin()
#  define KVC_PHASE(p) ::kvc::phase::mark(::kvc::phase::p)
#  define KVC_PHASE_BLOCK() (++::kvc::phase::slot().blocks)
#else
#  define KVC_PHASE_BEGIN() ((void)0)
#  define KVC_PHASE(p) ((void)0)
#  define KVC_PHASE_BLOCK() ((void)0)
#endif
