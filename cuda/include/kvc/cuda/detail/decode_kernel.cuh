/// \file decode_kernel.cuh
/// The fused decode-attention kernels (flash-decoding): one CTA per (split of a stream's blocks, KV head
/// and chunk of its query heads, sequence) and a merge kernel. Per chunk of tokens (a quantized block,
/// or up to B full-precision sink / window tokens) a CTA
///   1. stages the block's bytes in shared memory (16-byte vector loads) and decodes them with the
///      policy's own host+device code (BlockFormat::decode) into fp32 tiles, then adds GEAR's
///      corrections with the policy's cooperative epilogue (BlockCorrection::add_*_to);
///   2. scores the tile against the CTA's query heads (GQA: the heads of one KV group share every
///      decoded tile), each thread one token and a slice of channels;
///   3. updates the online softmax (base 2) and accumulates p . V, each thread one channel.
/// Everything comes from CacheLayout::Params (passed as a __grid_constant__); identity formats and
/// absent corrections compile out with `if constexpr`. AlignedSinkWindow's masked rows (block 0's first
/// kMaskedRows, holding no token) score -inf, so their probability is exactly 0, as on the CPU. Math is
/// fp32 FMA on the decoded values, i.e. the CPU kernel's Precision::kExact.
/// With an AlignedLoader (Layout::kAlignedWindow) the full-precision slots are bit planes, read as the CPU's
/// DecodeKernel::aligned_window reads them (aligned_fp_tokens below): key tiers per channel from the scaled
/// query and the live slots' Kmax (Rule 1), then per chunk of B slots its live rows' keys at those tiers, the
/// chunk's softmax, value tiers per row from the chunk's probabilities (Rule 2: TopK candidates' tier-8 rows,
/// Vmax), and the rows at their tiers. The rules see the CTA's query heads: the whole GQA group, as on the
/// CPU, for groups up to 8 (a larger group is split over CTAs of 8 heads, and each picks tiers for its own).
#pragma once

#include <kvc/attention/split_merge.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/core/numeric.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvc::cuda::detail {

inline constexpr int kDecodeThreads = 128;

/// Shared-memory plan of one decode CTA (offsets in bytes). Tiles: keys [B][D + 1] (threads walk
/// tokens: an odd row stride keeps them on distinct banks), values [B][D] (threads walk channels).
template <class Layout, int D, int Heads>
struct DecodeSmem {
  using KF = typename Layout::key_format;
  using VF = typename Layout::value_format;
  static constexpr int B = Layout::kBlockTokens;
  static constexpr int NT = kDecodeThreads;
  static constexpr int kKeyLd = D + 1;
  static constexpr int kTok = B < NT ? B : NT;  ///< tokens scored at once (one per thread)
  static constexpr int kSlices = NT / kTok;     ///< channel slices per token
  static_assert(D % kSlices == 0, "kvc::cuda: head_dim must split into the score kernel's channel slices");
  static constexpr std::size_t align16(std::size_t x) { return (x + 15) / 16 * 16; }
  static constexpr std::size_t q = 0;                                                 // float [Heads][D]
  static constexpr std::size_t ktile = q + sizeof(float) * Heads * D;                 // float [B][D + 1]
  static constexpr std::size_t vtile = align16(ktile + sizeof(float) * B * kKeyLd);  // float [B][D]
  static constexpr std::size_t part = vtile + sizeof(float) * B * D;                 // float [kSlices][Heads][B]
  static constexpr std::size_t sc = part + sizeof(float) * kSlices * Heads * B;       // float [Heads][B]
  static constexpr std::size_t stat = sc + sizeof(float) * Heads * B;                 // float m, l, alpha [Heads]
  static constexpr std::size_t kraw = align16(stat + sizeof(float) * 3 * Heads);      // staged key block
  static constexpr std::size_t vraw = align16(kraw + (KF::kIdentity ? 0 : KF::block_bytes(D)));
  static constexpr std::size_t vraw_end = align16(vraw + (VF::kIdentity ? 0 : VF::block_bytes(D)));
  // AlignedLoader over the slots (aligned_fp_tokens; nothing otherwise): per chunk its probabilities [Heads][B],
  // the output estimates [Heads][D], the live rows' slots and value tiers [B], the TopK candidates [Heads][K] and
  // their counts, the references [Heads], the live-row count; per stream the key tiers, Kmax and Vmax [D] and the
  // live mask over the slot stride.
  static constexpr bool kPlanes = Layout::kAlignedWindow;
  static constexpr int kTopK = [] {  // candidates per head: min(TopK, the chunk's rows)
    if constexpr (kPlanes) return Layout::loader::kTopK < B ? Layout::loader::kTopK : B;
    else return 0;
  }();
  static constexpr std::size_t aprob = vraw_end;                                            // float [Heads][B]
  static constexpr std::size_t aest = aprob + (kPlanes ? sizeof(float) * Heads * B : 0);    // float [Heads][D]
  static constexpr std::size_t arows = aest + (kPlanes ? sizeof(float) * Heads * D : 0);    // int [B]
  static constexpr std::size_t atier = arows + (kPlanes ? sizeof(int) * B : 0);             // int [B]
  static constexpr std::size_t acand = atier + (kPlanes ? sizeof(int) * B : 0);             // int [Heads][K]
  static constexpr std::size_t ancand = acand + sizeof(int) * Heads * kTopK;                // int [Heads]
  static constexpr std::size_t aref = ancand + (kPlanes ? sizeof(int) * Heads : 0);         // int [Heads]
  static constexpr std::size_t acount = aref + (kPlanes ? sizeof(int) * Heads : 0);         // int
  static constexpr std::size_t ktier = acount + (kPlanes ? sizeof(int) : 0);                // u8 [D]
  static constexpr std::size_t kmax = ktier + (kPlanes ? D : 0);                            // u8 [D]
  static constexpr std::size_t vmax = kmax + (kPlanes ? D : 0);                             // u8 [D]
  static constexpr std::size_t alive = vmax + (kPlanes ? D : 0);                            // u8 [kFpStride]
  static constexpr std::size_t bytes = align16(alive + (kPlanes ? Layout::kFpStride : 0));
};

/// Slot planes' read counts (aligned_counters of decode_split_kernel): key elements read at tier 8 / 12 / 16, value
/// elements at tier 8 / 12 / 16, hi8 key bytes (the Kmax scan), hi8 value bytes (Vmax and the estimate).
inline constexpr int kAlignedCounters = 8;

/// Does nothing: a chunk whose value tile its `load` fills (every chunk but the slot planes').
struct NoLateLoad {
  __device__ void operator()() const {}
};

/// Copies `bytes` (a multiple of 16, both 16-byte aligned) from global to shared memory, cooperatively.
__device__ __forceinline__ void stage(const std::byte* __restrict__ src, std::byte* dst, std::size_t bytes) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* o = reinterpret_cast<uint4*>(dst);
  for (std::size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) o[i] = __ldg(s + i);
}

/// Decodes a staged block (quantized: from shared memory; identity: straight from global memory) into
/// tile[t * ld + c]: backbone first, then (after barriers) the outlier and residual corrections.
template <class F, int D>
__device__ __forceinline__ void decode_tile(const std::byte* block, float* tile, int ld) {
  constexpr int B = F::kBlockTokens;
  for (int i = threadIdx.x; i < B * D; i += blockDim.x) {
    // identity blocks: walk storage order so consecutive threads read consecutive elements
    int t, c;
    if constexpr (F::kIdentity && F::kSide == Side::kKey) {
      c = i / B;
      t = i - c * B;
    } else {
      t = i / D;
      c = i - t * D;
    }
    tile[t * ld + c] = F::decode(block, t, c, D);
  }
  if constexpr (F::kCorrected) {
    using C = typename F::correction;
    const std::byte* region = F::correction_region(block, D);
    __syncthreads();
    C::add_outliers_to(region, B, D, tile, ld, threadIdx.x, blockDim.x);
    __syncthreads();
    C::add_residual_to(region, B, D, tile, ld, threadIdx.x, blockDim.x);
  }
}

/// Loads full-precision tokens [i0, i0 + nt) (storage order: Params::fp_row_at) of one side into tile[t * ld + c];
/// PartialLogWindow's quantized value rows are decoded (Params::fp_element).
template <class Layout, int D>
__device__ __forceinline__ void load_fp_rows(const typename Layout::Params& p, Side side, int seq, int kvh, int i0,
                                             int nt, float* tile, int ld) {
  using W = typename Layout::window_t;
  for (int i = threadIdx.x; i < nt * D; i += blockDim.x) {
    const int t = i / D, c = i - t * D;
    if constexpr (Layout::kQuantizedFpValues) tile[t * ld + c] = p.fp_element(side, seq, kvh, i0 + t, c);
    else tile[t * ld + c] = StorageTraits<W>::load(p.fp_row_at(side, seq, kvh, i0 + t)[c]);
  }
}

/// The split kernel. Grid: (split, kv_head * head_chunks, sequence). Writes, per query head of the CTA,
/// the partial state (m, l) to ml[(row * splits + split) * 2 + {0, 1}] and acc to acc[(row * splits +
/// split) * D + c], row = sequence * query_heads + query head. aligned_counters (kAlignedWindow layouts; may be
/// null): [kAlignedCounters], added to by the first head chunk of each (KV head, sequence), as the CPU counts.
template <class Layout, int D, int Heads, class QT>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_split_kernel(const __grid_constant__ typename Layout::Params p, const QT* __restrict__ q, int group,
                        float scale_log2, SplitPlan plan, float* __restrict__ ml, float* __restrict__ acc_out,
                        unsigned long long* __restrict__ aligned_counters) {
  using S = DecodeSmem<Layout, D, Heads>;
  using KF = typename Layout::key_format;
  using VF = typename Layout::value_format;
  static_assert(!Layout::kStreamOutliers,
                "kvc::cuda: stream-scope outliers (GEAR paper mode) have no device kernel; use OutlierScope::kBlock");
  constexpr int B = S::B, NT = S::NT, kCpt = (D + NT - 1) / NT;
  constexpr int kMasked = kvc::detail::masked_rows<typename Layout::selector>();  // rows of block 0 (AlignedSinkWindow)
  extern __shared__ __align__(16) std::byte decode_smem[];
  std::byte* smem = decode_smem;
  float* qs = reinterpret_cast<float*>(smem + S::q);
  float* kt = reinterpret_cast<float*>(smem + S::ktile);
  float* vt = reinterpret_cast<float*>(smem + S::vtile);
  float* part = reinterpret_cast<float*>(smem + S::part);
  float* sc = reinterpret_cast<float*>(smem + S::sc);
  float* st_m = reinterpret_cast<float*>(smem + S::stat);
  float* st_l = st_m + Heads;
  float* st_a = st_l + Heads;

  const int split = blockIdx.x, seq = blockIdx.z;
  const int chunks = (group + Heads - 1) / Heads;
  const int kvh = blockIdx.y / chunks, h0 = (blockIdx.y - kvh * chunks) * Heads;
  const int heads = group - h0 < Heads ? group - h0 : Heads;  // query heads of this CTA
  const int qheads = p.kv_heads * group, qrow0 = seq * qheads + kvh * group + h0;
  const int nb = p.quantized_blocks(seq);
  int b0, b1;
  split_blocks(plan, split, nb, &b0, &b1);

  for (int i = threadIdx.x; i < Heads * D; i += NT) {
    const int h = i / D;
    qs[i] = h < heads ? StorageTraits<QT>::load(q[std::size_t(qrow0 + h) * D + (i - h * D)]) * scale_log2 : 0.0f;
  }
  if constexpr (Layout::rotation::kKeys) {  // the scaled query in the keys' rotated basis: one thread per head
    __syncthreads();
    if (threadIdx.x < heads) Layout::rotation::rotate(true, p.rotation, kvh, D, qs + threadIdx.x * D);
  }
  if (threadIdx.x < Heads) {
    st_m[threadIdx.x] = neg_inf();
    st_l[threadIdx.x] = 0.0f;
  }
  float acc[Heads][kCpt];
#pragma unroll
  for (int h = 0; h < Heads; ++h)
#pragma unroll
    for (int j = 0; j < kCpt; ++j) acc[h][j] = 0.0f;
  __syncthreads();

  // One chunk: tiles filled by `load` (and the value tile by `late`, after the softmax, unless it is NoLateLoad),
  // rows [masked, nt) hold tokens.
  auto chunk = [&](int nt, int masked, auto&& load, auto&& late) {
    load();
    __syncthreads();
    // scores: thread (token ti, slice sl)
    const int ti = threadIdx.x % S::kTok, sl = threadIdx.x / S::kTok;
    constexpr int kPer = D / S::kSlices;
    // (when kTok does not divide NT, e.g. 96-token blocks, the last threads have no slice)
    for (int t = ti; t < B && sl < S::kSlices; t += S::kTok) {
      float a[Heads];
#pragma unroll
      for (int h = 0; h < Heads; ++h) a[h] = 0.0f;
      if (t < nt) {
        const float* kr = kt + t * S::kKeyLd + sl * kPer;
        const float* qr = qs + sl * kPer;
#pragma unroll 8
        for (int c = 0; c < kPer; ++c) {
          const float kv = kr[c];
#pragma unroll
          for (int h = 0; h < Heads; ++h) a[h] = fmaf(qr[h * D + c], kv, a[h]);
        }
      }
#pragma unroll
      for (int h = 0; h < Heads; ++h) part[(sl * Heads + h) * B + t] = a[h];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Heads * B; i += NT) {
      const int h = i / B, t = i - h * B;
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < S::kSlices; ++k) s += part[(k * Heads + h) * B + t];
      sc[i] = t < nt && t >= masked ? s : neg_inf();
    }
    __syncthreads();
    // online softmax: one warp per query head
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int h = warp; h < heads; h += NT / 32) {
      float mx = neg_inf();
      for (int t = lane; t < nt; t += 32) mx = fmaxf(mx, sc[h * B + t]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = st_m[h], m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int t = lane; t < B; t += 32) {
        const float e = t < nt ? exp2f(sc[h * B + t] - m_new) : 0.0f;
        sc[h * B + t] = e;
        sum += e;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();  // every lane has read st_m[h] before lane 0 overwrites it (shuffles order no memory)
      if (lane == 0) {
        const float alpha = split_weight(m_old, m_new);
        st_m[h] = m_new;
        st_l[h] = st_l[h] * alpha + sum;
        st_a[h] = alpha;
      }
    }
    __syncthreads();
    if constexpr (!std::is_same_v<std::decay_t<decltype(late)>, NoLateLoad>) {
      late();
      __syncthreads();
    }
    // p . V: thread per channel
#pragma unroll
    for (int j = 0; j < kCpt; ++j) {
      const int c = threadIdx.x + j * NT;
      if (c >= D) break;
#pragma unroll
      for (int h = 0; h < Heads; ++h) acc[h][j] *= h < heads ? st_a[h] : 0.0f;
      for (int t = 0; t < nt; ++t) {
        const float v = vt[t * D + c];
#pragma unroll
        for (int h = 0; h < Heads; ++h) acc[h][j] = fmaf(h < heads ? sc[h * B + t] : 0.0f, v, acc[h][j]);
      }
    }
    __syncthreads();  // the next chunk overwrites the tiles
  };

  auto fp_tokens = [&] {  // the full-precision tokens (selector storage order), B at a time: fp16 rows
    if constexpr (!S::kPlanes) {
      const int nfp = p.fp_count(seq);
      for (int i0 = 0; i0 < nfp; i0 += B) {
        const int nt = nfp - i0 < B ? nfp - i0 : B;
        chunk(
            nt, 0,
            [&] {
              load_fp_rows<Layout, D>(p, Side::kKey, seq, kvh, i0, nt, kt, S::kKeyLd);
              load_fp_rows<Layout, D>(p, Side::kValue, seq, kvh, i0, nt, vt, D);
            },
            NoLateLoad{});
      }
    }
  };
  // AlignedLoader: the slots' bit planes at the loader's tiers (file comment; DecodeKernel::aligned_window on the
  // CPU), in chunks of B slots over the stride, each chunk's live rows in slot order.
  auto aligned_fp_tokens = [&] {
    if constexpr (S::kPlanes) {
      using Loader = typename Layout::loader;
      constexpr int SS = Layout::kFpStride, K = S::kTopK;
      const int n = p.lengths[seq], nfp = p.fp_count(seq), tid = threadIdx.x;
      if (nfp <= 0) return;
      // what this CTA reads, counted by thread 0 (the CPU's aligned::ReadStats convention), if it counts
      const bool counts = aligned_counters != nullptr && h0 == 0 && tid == 0;
      unsigned long long cnt[kAlignedCounters] = {};
      const kvc::aligned::SlotPlanes kp = p.fp_planes(Side::kKey, seq, kvh), vp = p.fp_planes(Side::kValue, seq, kvh);
      float* aprob = reinterpret_cast<float*>(smem + S::aprob);
      float* aest = reinterpret_cast<float*>(smem + S::aest);
      int* rows = reinterpret_cast<int*>(smem + S::arows);
      int* vtier = reinterpret_cast<int*>(smem + S::atier);
      int* cand = reinterpret_cast<int*>(smem + S::acand);
      int* ncand = reinterpret_cast<int*>(smem + S::ancand);
      int* aref = reinterpret_cast<int*>(smem + S::aref);
      int* count = reinterpret_cast<int*>(smem + S::acount);
      auto* ktier = reinterpret_cast<std::uint8_t*>(smem + S::ktier);
      auto* kmax = reinterpret_cast<std::uint8_t*>(smem + S::kmax);
      auto* vmax = reinterpret_cast<std::uint8_t*>(smem + S::vmax);
      auto* live = reinterpret_cast<std::uint8_t*>(smem + S::alive);
      for (int j = tid; j < SS; j += NT) live[j] = 0;
      __syncthreads();
      for (int i = tid; i < nfp; i += NT) live[Layout::selector::fp_slot(n, i, B)] = 0xFF;
      __syncthreads();
      // Kmax / Vmax over the live slots: an fp16's exponent field is bits 6..2 of its hi8 byte. Keys channel-major: a
      // warp per channel, lanes over its slots (coalesced), a warp max; values slot-major: a thread per channel.
      const int warp = tid / 32, lane = tid % 32;
      for (int c = warp; c < D; c += NT / 32) {
        unsigned km = 0;
        for (int j = lane; j < SS; j += 32) km = max(km, unsigned(kp.hi()[std::size_t(c) * SS + j] & live[j] & 0x7Cu));
        for (int o = 16; o > 0; o >>= 1) km = max(km, __shfl_xor_sync(0xffffffffu, km, o));
        if (lane == 0) kmax[c] = std::uint8_t(km >> 2);
      }
      for (int c = tid; c < D; c += NT) {
        unsigned vm = 0;
        for (int j = 0; j < SS; ++j) vm = max(vm, unsigned(vp.hi()[std::size_t(j) * D + c] & live[j] & 0x7Cu));
        vmax[c] = std::uint8_t(vm >> 2);
      }
      __syncthreads();
      if (tid == 0) Loader::key_tiers(qs, heads, D, kmax, ktier);  // the scaled (and rotated) query, as the CPU's
      if (counts) cnt[6] = std::size_t(D) * SS, cnt[7] = std::size_t(nfp) * D;  // the hi8 scans above
      for (int j0 = 0; j0 < SS; j0 += B) {
        __syncthreads();  // ktier written; the previous chunk done with rows and count
        if (tid == 0) {
          int m = 0;
          for (int j = 0; j < B; ++j)
            if (live[j0 + j]) rows[m++] = j0 + j;
          *count = m;
        }
        __syncthreads();
        const int m = *count;
        if (m == 0) continue;
        if (counts)  // the chunk's B slots of every channel, at the channel's tier (dead slots too, as the CPU)
          for (int c = 0; c < D; ++c) cnt[(ktier[c] - 8) / 4] += B;
        chunk(
            m, 0,
            [&] {  // keys at their channels' tiers (channel-major planes: consecutive threads walk a channel's rows)
              for (int i = tid; i < m * D; i += NT) {
                const int c = i / m, t = i - c * m;
                kt[t * S::kKeyLd + c] = kvc::detail::half_bits_to_float(kp.bits(rows[t], c, ktier[c]));
              }
            },
            [&] {  // sc: each head's exp2(score - running max) of the m rows; Rule 2 on the chunk's probabilities
              if (tid < heads) {
                const float* w = sc + tid * B;
                float* pr = aprob + tid * B;
                float sum = 0.0f;
                for (int t = 0; t < m; ++t) sum += w[t];
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // all underflowed: every row adds nothing
                for (int t = 0; t < m; ++t) pr[t] = w[t] * inv;
                ncand[tid] = Loader::top_candidates(pr, m, cand + tid * K);
              }
              __syncthreads();
              for (int i = tid; i < heads * D; i += NT) {  // the estimate over the candidates' tier-8 rows
                const int h = i / D, c = i - h * D;
                float e = 0.0f;
                for (int k = 0; k < ncand[h]; ++k) {
                  const int t = cand[h * K + k];
                  e = fmaf(aprob[h * B + t], fabsf(kvc::detail::half_bits_to_float(vp.bits(rows[t], c, 8))), e);
                }
                aest[i] = e;
              }
              __syncthreads();
              if (tid < heads) aref[tid] = Loader::value_reference(aest + tid * D, D, vmax);
              __syncthreads();
              for (int t = tid; t < m; t += NT) vtier[t] = Loader::value_tier(aprob + t, B, heads, aref);
              __syncthreads();
              if (counts)
                for (int t = 0; t < m; ++t) cnt[3 + (vtier[t] - 8) / 4] += D;
              for (int i = tid; i < m * D; i += NT) {
                const int t = i / D, c = i - t * D;
                vt[t * D + c] = kvc::detail::half_bits_to_float(vp.bits(rows[t], c, vtier[t]));
              }
            });
      }
      if (counts)
        for (int i = 0; i < kAlignedCounters; ++i)
          if (cnt[i]) atomicAdd(aligned_counters + i, cnt[i]);
    }
  };
  if (split == 0) {
    fp_tokens();
    aligned_fp_tokens();
  }
  for (int blk = b0; blk < b1; ++blk) {
    chunk(
        B, blk == 0 ? kMasked : 0,
        [&] {
          const std::byte* kb = p.key_block(seq, kvh, blk);
          const std::byte* vb = p.value_block(seq, kvh, blk);
          if constexpr (!KF::kIdentity) stage(kb, smem + S::kraw, KF::block_bytes(D));
          if constexpr (!VF::kIdentity) stage(vb, smem + S::vraw, VF::block_bytes(D));
          if constexpr (!KF::kIdentity || !VF::kIdentity) __syncthreads();
          decode_tile<KF, D>(KF::kIdentity ? kb : smem + S::kraw, kt, S::kKeyLd);
          decode_tile<VF, D>(VF::kIdentity ? vb : smem + S::vraw, vt, D);
        },
        NoLateLoad{});
  }

  const std::size_t splits = std::size_t(gridDim.x);
  for (int h = threadIdx.x; h < heads; h += NT) {
    const std::size_t r = (std::size_t(qrow0 + h) * splits + split) * 2;
    ml[r] = st_m[h];
    ml[r + 1] = st_l[h];
  }
#pragma unroll
  for (int j = 0; j < kCpt; ++j) {
    const int c = threadIdx.x + j * NT;
    if (c >= D) break;
    for (int h = 0; h < heads; ++h) acc_out[(std::size_t(qrow0 + h) * splits + split) * D + c] = acc[h][j];
  }
}

/// Dynamic shared memory of the merge kernel, in floats: the split weights, then 1 / L, padded to whole
/// 16-byte words. ptxas may fuse the remainder of merge_apply's loop over the weights into one wider load
/// (memcheck on sm_90 saw a 12-byte read of a 2-float allocation), which stays inside the padded words.
__host__ __device__ constexpr int merge_smem_floats(int splits) { return (splits + 1 + 3) / 4 * 4; }

/// Merge kernel: grid (query head, sequence); row = sequence * query_heads + head. Dynamic shared memory:
/// merge_smem_floats(splits) floats, plus D with value rotation (Rot::kValues: the merged row is un-rotated
/// there, o = R_v^T o', by one thread, with the tables `rot` of KV head = query head / group).
template <int D, class QT, class Rot = NoRotation>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_merge_kernel(int splits, const float* __restrict__ ml, const float* __restrict__ acc, QT* __restrict__ out,
                        const std::uint32_t* __restrict__ rot = nullptr, int group = 1) {
  extern __shared__ float merge_smem[];
  const std::size_t row = std::size_t(blockIdx.y) * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0)
    merge_smem[splits] = merge_weights(splits, ml + row * splits * 2, ml + row * splits * 2 + 1, 2, merge_smem);
  __syncthreads();
  if constexpr (Rot::kValues) {
    float* o = merge_smem + merge_smem_floats(splits);
    merge_apply(splits, merge_smem, merge_smem[splits], acc + row * splits * D, D, D, o, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) Rot::unrotate(false, rot, int(blockIdx.x) / group, D, o);
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) out[row * D + c] = StorageTraits<QT>::store(o[c]);
  } else {
    merge_apply(splits, merge_smem, merge_smem[splits], acc + row * splits * D, D, D, out + row * D, threadIdx.x,
                blockDim.x);
  }
}
}  // namespace kvc::cuda::detail
