/// \file cpu_features.hpp
/// Which host SIMD path the fused CPU attention runs: the paths this build contains, what the CPU
/// supports (CPUID, read once and cached), and the pin a user or test may set. Host only.
///
/// Contract:
///  - A build contains the portable path, and, on x86-64 with g++ or clang (unless KVC_DISABLE_SIMD is
///    defined), the AVX2 (+FMA+F16C) and AVX-512 (F+BW+VL+DQ+VNNI) paths too (but see below). They
///    are compiled with per-function target attributes (attention/decode_attention.hpp), so a program
///    built for baseline x86-64 runs the AVX-512 kernels on a CPU that has them.
///  - KVC_DISPATCH_TARGET_ONLY (defined alike in every translation unit of a program) compiles only the paths
///    the compile target's -m flags guarantee the CPU runs: AVX-512 under -mavx512{f,bw,vl,dq,vnni}, AVX2 under
///    -mavx2 -mfma -mf16c, the portable path only without AVX2. For programs that run only where they were built
///    (-march=native: an evaluation harness, an engine built per machine): a third to two thirds fewer kernel
///    instances. The others throw like any path the build lacks (kAuto too, on a CPU that runs none).
///  - `Isa::kAuto` means: the `KVC_FORCE_ISA` environment variable (`portable`, `avx2`, `avx512`) if it
///    is set, else the best path the CPU supports. Both are read once per process.
///  - Asking for a path the build lacks or the CPU cannot run throws kvc::Error; nothing falls back
///    silently.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/error.hpp>

#include <cstdlib>
#include <string_view>

namespace kvc {

/// A host SIMD path of the fused CPU attention.
enum class Isa {
  kAuto,      ///< KVC_FORCE_ISA if set, else the best the CPU supports
  kPortable,  ///< scalar C++ (the compiler may still vectorise it)
  kAvx2,      ///< AVX2 + FMA + F16C, 8 float lanes, `vpdpbusd` emulated exactly
  kAvx512,    ///< AVX-512 F/BW/VL/DQ/VNNI, 16 float lanes, `vpdpbusd`
};

inline constexpr const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kPortable: return "portable";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512-vnni";
  }
  return "invalid";
}

#if !defined(KVC_DISABLE_SIMD) && (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#  define KVC_HAS_ISA_DISPATCH_ 1
#else
#  define KVC_HAS_ISA_DISPATCH_ 0
#endif
/// 1 when this build can contain SIMD attention paths chosen at run time (which: the two below).
#define KVC_HAS_ISA_DISPATCH() KVC_HAS_ISA_DISPATCH_
#if KVC_HAS_ISA_DISPATCH_ && defined(KVC_DISPATCH_TARGET_ONLY)
#  define KVC_HAS_AVX512_PATH_ KVC_HAS_AVX512()
#  define KVC_HAS_AVX2_PATH_ KVC_HAS_AVX2()
#  define KVC_HAS_PORTABLE_PATH_ (!KVC_HAS_AVX2())
#else
#  define KVC_HAS_AVX512_PATH_ KVC_HAS_ISA_DISPATCH_
#  define KVC_HAS_AVX2_PATH_ KVC_HAS_ISA_DISPATCH_
#  define KVC_HAS_PORTABLE_PATH_ 1
#endif
/// 1 when this build contains that attention path: the portable one always and the SIMD ones under
/// KVC_HAS_ISA_DISPATCH(), unless KVC_DISPATCH_TARGET_ONLY keeps only what the target runs (at least one).
#define KVC_HAS_PORTABLE_PATH() KVC_HAS_PORTABLE_PATH_
#define KVC_HAS_AVX2_PATH() KVC_HAS_AVX2_PATH_
#define KVC_HAS_AVX512_PATH() KVC_HAS_AVX512_PATH_

/// Whether this build contains the path `isa` (kAuto: always).
inline constexpr bool isa_compiled(Isa isa) noexcept {
  return isa == Isa::kAuto || (isa == Isa::kPortable && KVC_HAS_PORTABLE_PATH()) ||
         (isa == Isa::kAvx2 && KVC_HAS_AVX2_PATH()) || (isa == Isa::kAvx512 && KVC_HAS_AVX512_PATH());
}

namespace detail {
/// CPUID and XCR0 read for `isa` (cpu_runs caches it: CPUID traps to the hypervisor on a VM).
inline bool detect_cpu_runs(Isa isa) noexcept {
#if KVC_HAS_ISA_DISPATCH()
  __builtin_cpu_init();  // safe to repeat; needed when called before libgcc's constructor ran
  switch (isa) {
    case Isa::kAvx2: {
      // F16C from CPUID leaf 1, ECX bit 29 (clang 14's __builtin_cpu_supports does not know "f16c").
      unsigned eax = 1, ebx = 0, ecx = 0, edx = 0;
      __asm__("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && ((ecx >> 29) & 1u) != 0;
    }
    case Isa::kAvx512:
      // Also checks that the OS saves the ZMM/opmask state (libgcc / compiler-rt read XCR0).
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && detect_cpu_runs(Isa::kAvx2);
    default: return isa == Isa::kPortable;
  }
#else
  return isa == Isa::kPortable;
#endif
}

/// Whether this CPU runs `isa` (read once per process).
inline bool cpu_runs(Isa isa) noexcept {
  static const bool avx2 = detect_cpu_runs(Isa::kAvx2), avx512 = detect_cpu_runs(Isa::kAvx512);
  switch (isa) {
    case Isa::kPortable: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    default: return false;
  }
}

/// Parses a KVC_FORCE_ISA value; kAuto for an unknown one (the caller reports it).
inline bool parse_isa(std::string_view s, Isa& out) noexcept {
  if (s == "portable") out = Isa::kPortable;
  else if (s == "avx2") out = Isa::kAvx2;
  else if (s == "avx512" || s == "avx512-vnni") out = Isa::kAvx512;
  else if (s.empty() || s == "auto") out = Isa::kAuto;
  else return false;
  return true;
}

inline Isa best_cpu_isa() noexcept {
  static const Isa best = [] {
    if (isa_compiled(Isa::kAvx512) && cpu_runs(Isa::kAvx512)) return Isa::kAvx512;
    if (isa_compiled(Isa::kAvx2) && cpu_runs(Isa::kAvx2)) return Isa::kAvx2;
    return Isa::kPortable;
  }();
  return best;
}
}  // namespace detail

/// Whether this build contains `isa` and this CPU can run it.
inline bool isa_supported(Isa isa) noexcept {
  if (isa == Isa::kAuto) return true;
  return isa_compiled(isa) && detail::cpu_runs(isa);
}

/// The concrete path a request resolves to. kAuto: KVC_FORCE_ISA (read once) or the best the CPU
/// supports. Throws kvc::Error (kInvalidArgument) for an unknown KVC_FORCE_ISA value, or a path
/// this build lacks or this CPU cannot run.
inline Isa resolve_isa(Isa requested) {
  KVC_CHECK(requested == Isa::kAuto || requested == Isa::kPortable || requested == Isa::kAvx2 ||
                requested == Isa::kAvx512,
            Errc::kInvalidArgument, "Isa value ", static_cast<int>(requested), " is not a kvc::Isa");
  if (requested == Isa::kAuto) {
    static const char* const env = std::getenv("KVC_FORCE_ISA");
    Isa forced = Isa::kAuto;
    KVC_CHECK(env == nullptr || detail::parse_isa(env, forced), Errc::kInvalidArgument, "KVC_FORCE_ISA='", env,
              "' is not one of auto, portable, avx2, avx512");
    // the best path is compiled, unless KVC_DISPATCH_TARGET_ONLY left out the portable one: checked below
    requested = forced == Isa::kAuto ? detail::best_cpu_isa() : forced;
  }
  KVC_CHECK(isa_compiled(requested), Errc::kInvalidArgument, "the ", isa_name(requested),
            " attention path is not compiled into this build (KVC_DISABLE_SIMD, KVC_DISPATCH_TARGET_ONLY, or not "
            "x86-64 g++/clang)");
  KVC_CHECK(detail::cpu_runs(requested), Errc::kInvalidArgument, "this CPU cannot run the ", isa_name(requested),
            " attention path");
  return requested;
}

/// Name of the path decode_attention runs by default (for logs, benchmark labels, the quickstart).
inline const char* simd_path_name() { return isa_name(resolve_isa(Isa::kAuto)); }

}  // namespace kvc
