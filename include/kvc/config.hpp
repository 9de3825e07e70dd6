// kvc: nvcc-safe
/// \file config.hpp
/// Version, host/device annotations and feature macros. Every kvc header includes this first.
/// Feature macros are function-like (`KVC_HAS_AVX512()`), so a misspelt one is a compile error
/// instead of a silent `0`.
#pragma once

#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 1
#define KVC_VERSION_PATCH 0

#if defined(__CUDACC__)
#  define KVC_HAS_CUDA_COMPILER_ 1
#  define KVC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#  define KVC_HAS_CUDA_COMPILER_ 0
#  define KVC_HOST_DEVICE inline
#endif
#define KVC_HAS_CUDA_COMPILER() KVC_HAS_CUDA_COMPILER_
/// Host kernels' inner loops that must be inlined for their register tiles to stay in registers.
#if defined(__GNUC__) || defined(__clang__)
#  define KVC_ALWAYS_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#  define KVC_ALWAYS_INLINE __forceinline
#else
#  define KVC_ALWAYS_INLINE inline
#endif
/// The same for a lambda, written after its parameter list: `[&](int c) KVC_INLINE_LAMBDA { ... }`.
#if defined(__GNUC__) || defined(__clang__)
#  define KVC_INLINE_LAMBDA __attribute__((always_inline))
#else
#  define KVC_INLINE_LAMBDA
#endif
/// Before a host+device function template that calls a callable it is given: nvcc then accepts host-only
/// callables (lambdas of host code) in its host instantiations without a warning (CUTLASS does the same).
#if defined(__CUDACC__) && !defined(__clang__)
#  define KVC_HD_CALLABLE_TEMPLATE _Pragma("nv_exec_check_disable")
#else
#  define KVC_HD_CALLABLE_TEMPLATE
#endif

// What the compiler targets for this translation unit (-m flags). The fused attention does not depend
// on these: it compiles every SIMD path with target attributes and picks one at run time
// (core/cpu_features.hpp); they serve code that is inlined into default-target functions (fp16
// batch conversion, benchmarks). KVC_DISABLE_SIMD turns both off (portable code only).
#if !defined(KVC_DISABLE_SIMD) && !defined(__CUDA_ARCH__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#  define KVC_HAS_AVX512_ 1
#else
#  define KVC_HAS_AVX512_ 0
#endif
#if !defined(KVC_DISABLE_SIMD) && !defined(__CUDA_ARCH__) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#  define KVC_HAS_AVX2_ 1
#else
#  define KVC_HAS_AVX2_ 0
#endif
#if !defined(KVC_DISABLE_SIMD) && !defined(__CUDA_ARCH__) && defined(__F16C__)
#  define KVC_HAS_F16C_ 1
#else
#  define KVC_HAS_F16C_ 0
#endif
#define KVC_HAS_AVX512() KVC_HAS_AVX512_
#define KVC_HAS_AVX2() KVC_HAS_AVX2_
#define KVC_HAS_F16C() KVC_HAS_F16C_

#if defined(_OPENMP)
#  define KVC_HAS_OPENMP_ 1
#else
#  define KVC_HAS_OPENMP_ 0
#endif
#define KVC_HAS_OPENMP() KVC_HAS_OPENMP_

// GCC 12 reports its own intrinsics' `__Y = __Y` idiom (_mm*_undefined_*) as (maybe-)uninitialized;
// kvc's SIMD headers wrap themselves in these.
#if defined(__GNUC__) && !defined(__clang__)
#  define KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
        _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#  define KVC_SUPPRESS_INTRINSIC_WARNINGS_END _Pragma("GCC diagnostic pop")
#else
#  define KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
#  define KVC_SUPPRESS_INTRINSIC_WARNINGS_END
#endif
