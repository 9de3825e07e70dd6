/// \file decode_attention.hpp
/// Fused CPU decode attention over a compressed cache: one query token per sequence, H query heads
/// over H_kv KV heads (GQA: query head h reads KV head h / (H / H_kv)), softmax(q.K^T * scale) . V
/// with an online softmax (base 2, log2(e) folded into the query). Packed codes are read block by
/// block; scales and zeros are folded into the dot products and never expanded into K/V:
///   keys, per-channel groups:  q.k_t = sum_c (q_c s_c) k^_tc + sum_c q_c z_c
///   keys, per-token groups:    q.k_t = sum_g s_tg (sum_{c in g} q_c k^_tc) + sum_g z_tg (sum_{c in g} q_c)
///   values, per-token groups:  o_c  += sum_t (p_t s_tg) v^_tc + sum_t p_t z_tg
///   values, per-channel:       o_c  += s_c sum_t p_t v^_tc + z_c sum_t p_t
///
/// Precision (AttentionOptions::precision):
///  - kFast (default): codes of <= 4 bits use integer dot products (VNNI `vpdpbusd` on AVX-512, its
///    exact emulation on AVX2 and in portable code), like llama.cpp's q8 activations. Per block, the
///    folded query is rounded to int8 (127 levels per head), plus a second int8 plane of its rounding
///    residual where one plane's error would exceed ~0.1x the codes' own quantisation error (key
///    outlier channels; see DecodeKernel::kLoPlaneRatio), and the value weights p_t*s_t to uint8 (255
///    levels per head and group); a centring correction removes the part of each rounding that meets
///    the codes' mean. The kernel's own error stays <= 0.25x the scheme's quantisation error on KV
///    with 100x key outlier channels (tests/test_attention.cpp, KernelErrorIsSmallNextToQuantization).
///  - kExact: float FMAs over the decoded codes; no rounding beyond float arithmetic. Slower on
///    <= 4-bit schemes (README: decode speed).
/// 5..8-bit codes and uncompressed blocks use float FMAs in both (one compiled kernel serves both precisions).
///
/// SIMD path (AttentionOptions::isa, core/cpu_features.hpp): the portable, AVX2 and AVX-512 kernels
/// are all compiled (per-function target attributes: this header opens a target region per path and
/// includes detail/decode_kernel.hpp into it), and the one the CPU supports is chosen at run time,
/// so a program built for baseline x86-64 runs the AVX-512 kernels where they exist.
///
/// Parallel over (sequence, KV head, split of blocks) with OpenMP; splits are merged flash-decoding
/// style. Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/attention/split_merge.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/core/aligned_buffer.hpp>
#include <kvc/core/bit_packing.hpp>
#include <kvc/core/cpu_features.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/phase_clock.hpp>
#include <kvc/core/view.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if KVC_HAS_ISA_DISPATCH() || KVC_HAS_AVX2() || KVC_HAS_AVX512()
#  include <immintrin.h>
#endif

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif
#if defined(__SSE__) || defined(__x86_64__)
#  include <xmmintrin.h>
#endif

KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
#ifndef KVC_PREFETCH_BYTES
/// Bytes of K+V blocks the CPU decode attention prefetches ahead (0: none; at least one block). 16 KiB: one fp16
/// block at d = 128, several compressed ones. On an AMD Zen 5, fp16 at T = 32768 took 8-18 % less time than with
/// 32 KiB on both SIMD paths, the compressed schemes within +-3 % or up to 8 % faster; on Zen 4, 16 to 128 KiB
/// measured alike (README).
#  define KVC_PREFETCH_BYTES 16384
#endif
#ifndef KVC_LO_PLANE_RATIO
/// Predicted kernel/quantisation error ratio above which Precision::kFast adds a second int8 query
/// plane to a key block (DecodeKernel::kLoPlaneRatio; a huge value turns the plane off).
#  define KVC_LO_PLANE_RATIO 0.1f
#endif
#ifndef KVC_PREFETCH_LOCALITY
#  define KVC_PREFETCH_LOCALITY 1  ///< __builtin_prefetch locality of that prefetch (1: into L2, not L1)
#endif

namespace kvc {

/// How the dot products over <= 4-bit codes are computed (see the file comment).
enum class Precision {
  kFast,   ///< integer dot products; own error bounded relative to the quantisation error
  kExact,  ///< float FMAs over the decoded codes; float rounding only
};

/// Options of decode_attention. Invalid values throw kvc::Error (kInvalidArgument).
struct AttentionOptions {
  float scale = 0.0f;   ///< softmax scale, finite and >= 0; 0 means 1/sqrt(head_dim)
  int num_threads = 0;  ///< >= 0; 0 means all OpenMP threads
  int min_blocks_per_split = 16;  ///< >= 1: flash-decoding split granularity when sequences x heads < threads
  Precision precision = Precision::kFast;
  Isa isa = Isa::kAuto;  ///< SIMD path; kAuto: KVC_FORCE_ISA or the best the CPU supports
};

namespace detail {

inline constexpr float kLog2e = 1.4426950408889634f;

/// One work item: blocks [b0, b1) of stream (seq, kvh), plus its full-precision tokens (last split).
struct WorkItem {
  int seq, kvh, b0, b1;
  bool fp;
};

/// Floats of one work item's result: [group] running max, [group] running sum, [group][head_dim] unnormalised
/// output, then (a layout whose AlignedLoader reads the selector's slots) the item's aligned::ReadStats from float
/// item_stats_offset on, copied in and out with memcpy.
inline std::size_t item_stats_offset(int group, int head_dim) noexcept { return std::size_t(group) * (head_dim + 2); }
template <class Layout>
std::size_t item_floats(int group, int head_dim) noexcept {
  std::size_t n = item_stats_offset(group, head_dim);
  if constexpr (Layout::kAlignedWindow) n += (sizeof(aligned::ReadStats) + sizeof(float) - 1) / sizeof(float);
  return n;
}

/// The kernel entry points of one (layout, precision, SIMD path).
template <class Layout>
struct KernelFns {
  std::size_t (*scratch_floats)(const typename Layout::Params&, int group);
  /// result: item_floats<Layout>(group, head_dim) floats.
  void (*run)(const typename Layout::Params&, int group, const float* q, const WorkItem&, float* scratch,
              float* result);
};

/// Sets flush-to-zero / denormals-are-zero for this thread's lifetime of the object (x86 only).
class FlushDenormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

}  // namespace detail
}  // namespace kvc

// ------------------------------------------------------------------ the kernels, once per SIMD path
#if defined(__clang__)
#  define KVC_TARGET_BEGIN_AVX2_ _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#  define KVC_TARGET_BEGIN_AVX512_ \
    _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c\"))), apply_to = function)")
#  define KVC_TARGET_END_ _Pragma("clang attribute pop")
#else
#  define KVC_TARGET_BEGIN_AVX2_ _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#  define KVC_TARGET_BEGIN_AVX512_ \
    _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c\")")
#  define KVC_TARGET_END_ _Pragma("GCC pop_options")
#endif

#define KVC_ATTENTION_INTERNAL
#define KVC_PER_ISA_HEADER <kvc/attention/detail/decode_kernel.hpp>
#include <kvc/attention/detail/per_isa.hpp>
#undef KVC_PER_ISA_HEADER
#undef KVC_ATTENTION_INTERNAL

namespace kvc {
/// Whether either side of T (a CacheLayout or a cache) reads <= 4-bit codes through integer dot products under
/// Precision::kFast (DecodeKernel::kInt). Only such schemes compute kFast and kExact differently, so only they compile
/// a kExact kernel of their own; elsewhere (fp16, int8, 5..8-bit, AlignedKV) kExact runs kFast's instance.
template <class T>
inline constexpr bool kHasIntDot = T::key_format::kIntDot || T::value_format::kIntDot;

namespace detail {

template <class Layout, bool Exact>
KernelFns<Layout> kernel_fns(Isa isa) noexcept {
  static_assert(!Exact || kHasIntDot<Layout>, "kExact without <= 4-bit codes runs the kFast instance");
  // isa: a path this build contains (resolve_isa)
  return select_isa(isa, [](auto tag) { return kernel_fns_for<Layout, Exact>(tag); });
}
}  // namespace detail

namespace detail {
/// The checks every decode attention makes of its query and output before it reads anything: shapes
/// against a cache of `batch` sequences (lengths[s] tokens), kv_heads x head_dim, non-empty sequences,
/// a finite query.
inline void check_decode_inputs(int batch, int kv_heads, int head_dim, const int* lengths, QueryView q, OutputView out) {
  KVC_CHECK(q.dim0 >= 1 && q.dim0 <= batch, Errc::kInvalidArgument, "query holds ", q.dim0,
            " sequences; the cache has ", batch);
  KVC_CHECK(q.dim2 == head_dim, Errc::kInvalidArgument, "query head_dim ", q.dim2, " != cache head_dim ", head_dim);
  KVC_CHECK(q.dim1 >= kv_heads && q.dim1 % kv_heads == 0, Errc::kInvalidArgument, "query heads ", q.dim1,
            " are not a positive multiple of the cache's ", kv_heads, " KV heads");
  KVC_CHECK(out.dim0 == q.dim0 && out.dim1 == q.dim1 && out.dim2 == q.dim2, Errc::kInvalidArgument,
            "output shape [", out.dim0, "][", out.dim1, "][", out.dim2, "] != query shape [", q.dim0, "][", q.dim1,
            "][", q.dim2, "]");
  KVC_CHECK(q.data != nullptr && out.data != nullptr, Errc::kInvalidArgument, "null query or output");
  for (int s = 0; s < q.dim0; ++s)
    KVC_CHECK(lengths[s] > 0, Errc::kInvalidArgument, "sequence ", s, " is empty: nothing to attend to");
  for (int s = 0; s < q.dim0; ++s)
    for (int h = 0; h < q.dim1; ++h)
      for (int c = 0; c < q.dim2; ++c)
        KVC_CHECK(std::isfinite(q.row(s, h)[c]), Errc::kNonFinite, "query sequence ", s, " head ", h, " channel ", c,
                  " is not finite");
}
}  // namespace detail

/// Checks AttentionOptions (throws kvc::Error naming the bad field); returns the SIMD path they
/// resolve to (see resolve_isa).
inline Isa validate(const AttentionOptions& opt) {
  KVC_CHECK(std::isfinite(opt.scale) && opt.scale >= 0.0f, Errc::kInvalidArgument, "AttentionOptions::scale ",
            opt.scale, " is not a finite value >= 0 (0 means 1/sqrt(head_dim))");
  KVC_CHECK(opt.num_threads >= 0, Errc::kInvalidArgument, "AttentionOptions::num_threads ", opt.num_threads,
            " is negative (0 means all OpenMP threads)");
  KVC_CHECK(opt.min_blocks_per_split >= 1, Errc::kInvalidArgument, "AttentionOptions::min_blocks_per_split ",
            opt.min_blocks_per_split, " is not >= 1");
  KVC_CHECK(opt.precision == Precision::kFast || opt.precision == Precision::kExact, Errc::kInvalidArgument,
            "AttentionOptions::precision ", static_cast<int>(opt.precision), " is not a kvc::Precision");
  return resolve_isa(opt.isa);
}


namespace detail {
/// The query times `scale` (softmax scale * log2(e)), contiguous [sequences][heads][head_dim]; throws
/// kOutOfRange naming the element whose product overflows float.
inline AlignedBuffer<float> scaled_query(QueryView q, float scale) {
  AlignedBuffer<float> qs(std::size_t(q.dim0) * q.dim1 * q.dim2);
  for (int s = 0; s < q.dim0; ++s)
    for (int h = 0; h < q.dim1; ++h)
      for (int c = 0; c < q.dim2; ++c) {
        const float x = q.row(s, h)[c] * scale;
        KVC_CHECK(std::isfinite(x), Errc::kOutOfRange, "query sequence ", s, " head ", h, " channel ", c, " (",
                  q.row(s, h)[c], ") times the softmax scale overflows float");
        qs[(std::size_t(s) * q.dim1 + h) * q.dim2 + c] = x;
      }
  return qs;
}

/// A rotated cache's query (Layout::rotation, rotate/rotation.hpp): every query head's row of the scaled
/// query `qs` ([sequences][heads][head_dim]) through its KV head's key transform, in place; throws kOutOfRange
/// when a rotated element overflows float. `q` (the caller's) names the row. Without key rotation: qs.
template <class Layout>
AlignedBuffer<float> rotated_query(const typename Layout::Params& p, AlignedBuffer<float> qs, QueryView q, int group) {
  if constexpr (Layout::rotation::kKeys) {
    const int d = q.dim2;
    for (int s = 0; s < q.dim0; ++s)
      for (int h = 0; h < q.dim1; ++h) {
        float* row = qs.data() + (std::size_t(s) * q.dim1 + h) * d;
        Layout::rotation::rotate(true, p.rotation, h / group, d, row);
        for (int c = 0; c < d; ++c)
          KVC_CHECK(std::isfinite(row[c]), Errc::kOutOfRange, "query sequence ", s, " head ", h,
                    " times the softmax scale, rotated, overflows float in channel ", c);
      }
  }
  (void)p, (void)q, (void)group;
  return qs;
}

/// The most threads decode attention runs with (AttentionOptions::num_threads, else OpenMP's default, at most
/// OpenMP's thread limit; 1 without OpenMP).
inline int attention_threads(const AttentionOptions& opt) noexcept {
#if KVC_HAS_OPENMP()
  return std::max(1, std::min(opt.num_threads > 0 ? opt.num_threads : omp_get_max_threads(), omp_get_thread_limit()));
#else
  (void)opt;
  return 1;
#endif
}

/// The factor the kernels apply to the query: (AttentionOptions::scale, or 1 / sqrt(d)) * log2(e), in float
/// (infinite for a scale above FLT_MAX / log2(e)).
inline float query_scale(const AttentionOptions& opt, int d) noexcept {
  return (opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(float(d))) * kLog2e;
}

/// decode_attention's input checks for a cache with its own container (config(), length(layer, seq): QAQ,
/// AlignedKV); returns every sequence's length.
template <class Cache>
std::vector<int> checked_lengths(const Cache& cache, int layer, QueryView q, OutputView out, const AttentionOptions& opt) {
  const auto& cfg = cache.config();
  KVC_CHECK(layer >= 0 && layer < cfg.layers, Errc::kInvalidArgument, "layer ", layer, " out of range [0, ",
            cfg.layers, ")");
  std::vector<int> lengths(std::size_t(cfg.batch));
  for (int s = 0; s < cfg.batch; ++s) lengths[std::size_t(s)] = cache.length(layer, s);
  check_decode_inputs(cfg.batch, cfg.kv_heads, cfg.head_dim, lengths.data(), q, out);
  (void)validate(opt);
  return lengths;
}
}  // namespace detail


namespace detail {
/// decode_attention over Params; stats (kAlignedWindow layouts only, may be null): set to the slot planes the
/// kernels read (other_bytes 0: the cache-level overload fills it in).
template <class Layout>
void run_decode_attention(const typename Layout::Params& p, QueryView q, OutputView out, const AttentionOptions& opt,
                          aligned::ReadStats* stats) {
  detail::check_decode_inputs(p.batch, p.kv_heads, p.head_dim, p.lengths, q, out);
  const Isa isa = validate(opt);

  const int g = q.dim1 / p.kv_heads, d = p.head_dim, nseq = q.dim0;
  const float scale = (opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d))) * detail::kLog2e;
  constexpr bool kOwnExact = kHasIntDot<Layout>;
  const detail::KernelFns<Layout> fns = kOwnExact && opt.precision == Precision::kExact
                                            ? detail::kernel_fns<Layout, kOwnExact>(isa)
                                            : detail::kernel_fns<Layout, false>(isa);
#if KVC_HAS_OPENMP()
  const int threads = opt.num_threads > 0 ? opt.num_threads : omp_get_max_threads();
#else
  const int threads = 1;
#endif
  // Work items: (sequence, KV head, split). Split a stream's blocks only when there are fewer streams
  // than ~4x threads, so each thread still gets whole streams when it can.
  std::vector<detail::WorkItem> work;
  std::vector<int> first_item(std::size_t(nseq) * p.kv_heads + 1, 0);
  const int streams = nseq * p.kv_heads;
  for (int s = 0; s < nseq; ++s) {
    const int nb = p.quantized_blocks(s);
    const int want = streams >= 4 * threads ? 1 : (4 * threads + streams - 1) / streams;
    const int splits = std::max(1, std::min(want, nb / opt.min_blocks_per_split));
    for (int h = 0; h < p.kv_heads; ++h) {
      first_item[std::size_t(s) * p.kv_heads + h] = static_cast<int>(work.size());
      for (int i = 0; i < splits; ++i)
        work.push_back({s, h, nb * i / splits, nb * (i + 1) / splits, i == splits - 1});
    }
  }
  first_item.back() = static_cast<int>(work.size());

  const std::size_t item_floats = detail::item_floats<Layout>(g, d);
  AlignedBuffer<float> results(work.size() * item_floats);
  const AlignedBuffer<float> qscaled = detail::rotated_query<Layout>(p, detail::scaled_query(q, scale), q, g);
  const std::size_t scratch_floats = fns.scratch_floats(p, g);
  const int nwork = static_cast<int>(work.size());

#if KVC_HAS_OPENMP()
#  pragma omp parallel num_threads(threads)
#endif
  {
    // Probabilities far below the running max underflow; denormal operands cost ~100-cycle assists on
    // x86, and flushing them to zero changes results by < 2^-126 relative. Restored on exit.
    const detail::FlushDenormals ftz;
    AlignedBuffer<float> scratch(scratch_floats);
#if KVC_HAS_OPENMP()
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int i = 0; i < nwork; ++i) {
      const detail::WorkItem& w = work[std::size_t(i)];
      fns.run(p, g, qscaled.data() + (std::size_t(w.seq) * q.dim1 + std::size_t(w.kvh) * g) * d, w, scratch.data(),
              results.data() + std::size_t(i) * item_floats);
    }
  }

  // Scores beyond float (a huge query against large keys) leave an infinite or NaN running max or
  // sum: report it instead of returning NaN. Checked before `out` is written.
  auto overflow = [&](int seq, int head) {
    float qmax = 0.0f;
    for (int c = 0; c < d; ++c) qmax = std::max(qmax, std::fabs(q.row(seq, head)[c]));
    detail::fail(Errc::kOutOfRange, "attention scores of sequence ", seq, " query head ", head,
                 " overflow float (max |q| ", qmax, ", softmax scale ", scale / detail::kLog2e,
                 "): scale the query or the cache down");
  };
  for (int i = 0; i < nwork; ++i) {
    const float* r = results.data() + std::size_t(i) * item_floats;
    const detail::WorkItem& w = work[std::size_t(i)];
    for (int h = 0; h < g; ++h) {
      bool ok = std::isfinite(r[h]) && std::isfinite(r[g + h]) && r[g + h] > 0.0f;
      for (int c = 0; c < d && ok; ++c) ok = std::isfinite(r[2 * g + std::size_t(h) * d + c]);
      if (!ok) overflow(w.seq, w.kvh * g + h);
    }
  }

  // Merge the splits of each stream (attention/split_merge.hpp).
  std::vector<float> weights(work.size());
  for (int s = 0; s < nseq; ++s)
    for (int kh = 0; kh < p.kv_heads; ++kh) {
      const int i0 = first_item[std::size_t(s) * p.kv_heads + kh], i1 = first_item[std::size_t(s) * p.kv_heads + kh + 1];
      const float* r = results.data() + std::size_t(i0) * item_floats;
      const auto stride = static_cast<std::ptrdiff_t>(item_floats);
      for (int h = 0; h < g; ++h) {
        const float inv = merge_weights(i1 - i0, r + h, r + g + h, stride, weights.data());
        merge_apply(i1 - i0, weights.data(), inv, r + 2 * g + std::size_t(h) * d, stride, d, out.row(s, kh * g + h));
        // Rotated values: o = R_v^T (sum_t p_t R_v v_t), once per query head.
        if constexpr (Layout::rotation::kValues)
          Layout::rotation::unrotate(false, p.rotation, kh, d, out.row(s, kh * g + h));
      }
    }
  if constexpr (Layout::kAlignedWindow)
    if (stats) {
      *stats = aligned::ReadStats{};
      for (int i = 0; i < nwork; ++i) {
        aligned::ReadStats r;
        std::memcpy(static_cast<void*>(&r), results.data() + std::size_t(i) * item_floats + item_stats_offset(g, d),
                    sizeof r);  // trivially copyable (static_assert beside ReadStats)
        *stats += r;
      }
    }
  (void)stats;
}
}  // namespace detail

/// Decode attention over one layer of a cache's Params (the low-level entry point).
/// q, out: [sequences][query_heads][head_dim], sequences <= batch; query_heads a multiple of kv_heads.
/// Sequence i attends to the cache's sequence i, which must hold at least one token.
template <class Layout>
void decode_attention(const typename Layout::Params& p, QueryView q, OutputView out, const AttentionOptions& opt = {}) {
  detail::run_decode_attention<Layout>(p, q, out, opt, nullptr);
}

/// Decode attention over `layer` of a CompressedKVCache (or anything with `params(layer)` and `layout`).
template <class Cache>
void decode_attention(const Cache& cache, int layer, QueryView q, OutputView out, const AttentionOptions& opt = {}) {
  decode_attention<typename Cache::layout>(cache.params(layer), q, out, opt);
}

/// The same over a cache whose selector's full-precision slots an AlignedLoader reads (schemes::AlignedWindow),
/// with `stats` (may be null) set to what the step read: the slot planes at the tiers the rules chose
/// (key_bytes, value_bytes, key_tiers, value_tiers; hi8 of every slot's key and of every live value row, which
/// also serve Kmax / Vmax and the value estimate, counted once) and, in other_bytes, what it reads whole: the
/// quantized blocks with their metadata and corrections, as decode_read_bytes counts them for the attended
/// sequences.
template <class Cache>
  requires Cache::layout::kAlignedWindow
void decode_attention(const Cache& cache, int layer, QueryView q, OutputView out, const AttentionOptions& opt,
                      aligned::ReadStats* stats) {
  using L = typename Cache::layout;
  detail::run_decode_attention<L>(cache.params(layer), q, out, opt, stats);
  if (stats) {
    // decode_read_bytes of the attended sequences, less their full-precision slots
    const auto& cfg = cache.config();
    std::vector<int> lengths(std::size_t(cfg.batch), 0);
    for (int s = 0; s < q.dim0; ++s) lengths[std::size_t(s)] = cache.length(layer, s);
    stats->other_bytes = Cache::rules::stored_bytes(cfg, lengths.data()) - Cache::rules::slot_bytes(cfg, lengths.data());
  }
}
}  // namespace kvc
KVC_SUPPRESS_INTRINSIC_WARNINGS_END
