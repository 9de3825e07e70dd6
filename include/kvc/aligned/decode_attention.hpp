/// \file decode_attention.hpp (aligned)
/// Fused CPU decode attention over AlignedKV's fp16 bit planes (SPEC §3.4, §3.5, §3.9): two passes per
/// (sequence, KV head) stream, both streaming over the planes and loading only the leading bits each element
/// needs (aligned/detail/attention_kernel.hpp, compiled per SIMD path like the main kernel and chosen at run time
/// by AttentionOptions::isa):
///  1. key tiers per channel from the query (Rule 1, AlignedLoader::key_tiers; the unscaled query's exponents),
///     scores over every block (hi8, plus mid4 / lo4 where the tier asks), the staged tokens whole; softmax;
///  2. value tiers per token from the probabilities against the TopK estimate (Rule 2), the output from every
///     row's leading bits, the staged rows whole.
/// The elements a tier reads are exactly the truncated fp16 values (aligned::truncate), accumulated in fp32 (A4):
/// the result is the attention over the truncated cache up to float summation order. AttentionOptions::
/// precision does not apply (no integer products). With `stats`, what was read (aligned::ReadStats, summed over
/// the streams). Parallel over streams with OpenMP. Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/aligned/aligned_cache.hpp>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/attention/decode_attention.hpp>
#include <kvc/core/aligned_buffer.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#if KVC_HAS_OPENMP()
#  include <omp.h>
#endif

namespace kvc::detail {
/// One (sequence, KV head) stream of an AlignedKV cache as the kernels read it.
struct AlignedStream {
  const std::uint8_t *khi, *kmid, *klo, *vhi, *vmid, *vlo;
  const half_t *kst, *vst;  ///< staged K, V [T - blocks * block][d]
  const std::uint8_t* vmax;
  int d, g, T, blocks, block;
};
/// Value rows per tile of the kernel's second pass (their planes stay in L1 while every channel chunk reads them).
inline constexpr int kAlignedTileRows = 32;
/// A stream's per-head strides in the kernel's scratch: channels rounded up to 32 (one AVX-512 assembly), tokens
/// to 16 (one AVX-512 vector).
inline int aligned_padded_dim(int d) noexcept { return (d + 31) / 32 * 32; }
inline std::size_t aligned_padded_tokens(int T) noexcept { return (std::size_t(T) + 15) / 16 * 16; }
/// The float scratch one stream needs: scores [g][T'], outputs [g][d'], the value estimate [d], the value scales
/// [2][g], the value tiers as bytes [T].
inline std::size_t aligned_scratch_floats(int g, int T, int d) noexcept {
  return std::size_t(g) * (aligned_padded_tokens(T) + std::size_t(aligned_padded_dim(d))) + std::size_t(d) +
         2 * std::size_t(g) + (std::size_t(T) + 3) / 4;
}
/// The int scratch: Rule 2's references [g], a tile's rows by tier [3][tile].
inline std::size_t aligned_scratch_ints(int g) noexcept { return std::size_t(g) + 3 * std::size_t(kAlignedTileRows); }
}  // namespace kvc::detail

KVC_SUPPRESS_INTRINSIC_WARNINGS_BEGIN
#define KVC_ATTENTION_INTERNAL
#define KVC_PER_ISA_HEADER <kvc/aligned/detail/attention_kernel.hpp>
#include <kvc/attention/detail/per_isa.hpp>
#undef KVC_PER_ISA_HEADER
#undef KVC_ATTENTION_INTERNAL
KVC_SUPPRESS_INTRINSIC_WARNINGS_END

namespace kvc {

/// Decode attention over `layer` of an AlignedKV cache; q, out: [sequences][query_heads][head_dim] as
/// kvc::decode_attention, with its errors. stats (optional): set to what this call read.
template <int KLo, int KHi, int VLo, int VHi, int TopK, int Block>
void decode_attention(const CompressedKVCache<AlignedLoader<KLo, KHi, VLo, VHi, TopK, Block>>& cache, int layer,
                      QueryView q, OutputView out, const AttentionOptions& opt = {}, aligned::ReadStats* stats = nullptr) {
  using Loader = AlignedLoader<KLo, KHi, VLo, VHi, TopK, Block>;
  const CacheConfig& cfg = cache.config();
  const std::vector<int> lengths = detail::checked_lengths(cache, layer, q, out, opt);  // validates opt too
  const Isa isa = resolve_isa(opt.isa);
  const int nseq = q.dim0, H = cfg.kv_heads, g = q.dim1 / H, d = cfg.head_dim;
  const float scale = detail::query_scale(opt, d);
  const int tmax = *std::max_element(lengths.begin(), lengths.begin() + nseq);
  // isa: a path this build contains (resolve_isa)
  const auto run = detail::select_isa(isa, [](auto tag) { return aligned_stream_kernel<Loader>(tag); });
  const AlignedBuffer<float> qs = detail::scaled_query(q, scale);
  AlignedBuffer<float> result(std::size_t(nseq) * q.dim1 * d);
  const int streams = nseq * H;
  std::vector<unsigned char> finite(std::size_t(streams), 1);
  std::vector<aligned::ReadStats> read(static_cast<std::size_t>(streams));
#if KVC_HAS_OPENMP()
#  pragma omp parallel num_threads(detail::attention_threads(opt))
#endif
  {
    AlignedBuffer<float> scratch(detail::aligned_scratch_floats(g, tmax, d));
    std::vector<float> qraw(std::size_t(g) * d);
    std::vector<std::uint8_t> ktier(static_cast<std::size_t>(d));
    std::vector<int> ints(detail::aligned_scratch_ints(g));
#if KVC_HAS_OPENMP()
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int i = 0; i < streams; ++i) {
      const int s = i / H, kh = i % H;
      const auto& st = cache.stream(layer, s, kh);
      for (int h = 0; h < g; ++h) std::copy_n(q.row(s, kh * g + h), d, qraw.data() + std::size_t(h) * d);
      Loader::key_tiers(qraw.data(), g, d, st.kmax.data(), ktier.data());
      const detail::AlignedStream view{
          st.khi.data(), st.kmid.data(), st.klo.data(), st.vhi.data(), st.vmid.data(), st.vlo.data(),
          st.kst.data(), st.vst.data(), st.vmax.data(), d, g, lengths[std::size_t(s)], st.blocks(d), Block};
      const std::size_t q0 = (std::size_t(s) * q.dim1 + std::size_t(kh) * g) * d;
      const detail::FlushDenormals ftz;  // probabilities far below the max underflow (see decode_attention.hpp)
      finite[std::size_t(i)] = run(view, qs.data() + q0, ktier.data(), scratch.data(), ints.data(), result.data() + q0,
                                   read[std::size_t(i)]);
    }
  }
  for (int i = 0; i < streams; ++i)
    KVC_CHECK(finite[std::size_t(i)], Errc::kOutOfRange, "attention scores of sequence ", i / H, " KV head ", i % H,
              " overflow float: scale the query or the cache down");
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < q.dim1; ++h) std::copy_n(result.data() + (std::size_t(s) * q.dim1 + h) * d, d, out.row(s, h));
  if (stats) {
    *stats = aligned::ReadStats{};
    for (const auto& r : read) *stats += r;
  }
}
}  // namespace kvc
