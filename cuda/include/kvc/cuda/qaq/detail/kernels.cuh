/// \file kernels.cuh
/// QAQ's device kernels (kvc::cuda::DeviceQaqCache): append at B_max, the width update of one decode step
/// (history push, then a stable rebucketing of every stream side), and the decode attention over the mixed-bit
/// arenas (qaq/arena.hpp): scores over the key records, one softmax per stream that also hands back each
/// token's probability (max over the KV group's query heads, SPEC Q6), then the values' p . V. Keys and values
/// are bucketed independently, so the two passes meet in a score array indexed by token (the host kernel's
/// structure, qaq/decode_attention.hpp). Records are decoded by the policy's own host+device code
/// (RecordFormat, QaqQuantizer); fp32 math.
#pragma once

#include <kvc/attention/split_merge.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/qaq/arena.hpp>
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/record_format.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::cuda::qaq_detail {

inline constexpr int kThreads = 128;        ///< attention kernels: 4 warps, one record per warp at a time
inline constexpr int kUpdateThreads = 256;  ///< width update: one CTA per stream side

/// What the kernels read of one layer; device pointers (the mirror may be mapped host memory). Stream index
/// s = seq * kv_heads + head; side 0 keys, 1 values.
template <class Q>
struct Params {
  using arena = qaq::Arena<Q>;
  using history = typename Q::history;
  static constexpr int kWidths = arena::kWidths;
  int batch, kv_heads, head_dim, capacity, id_bytes;
  std::size_t arena_bytes;   ///< one stream side's arena (qaq::Arena::bytes)
  int* lengths;              ///< [batch]
  std::byte* arenas;         ///< [batch * kv_heads][2][arena_bytes]
  std::uint32_t* counts;     ///< [batch * kv_heads][2][kWidths]: records per width
  history* hist;             ///< [batch * kv_heads][capacity]
  const half_t* mirror;      ///< [batch * kv_heads][2][capacity][head_dim]
  const float* qnorm2;       ///< [kv_heads]: the layer's calibrated ||q||^2 percentiles
  const std::uint32_t* rotation;  ///< [kv_heads][Rot::head_words]: the layer's rotation tables (null: none)

  __device__ std::byte* arena_of(int s, int side) const { return arenas + (std::size_t(s) * 2 + side) * arena_bytes; }
  __device__ std::uint32_t* counts_of(int s, int side) const { return counts + (std::size_t(s) * 2 + side) * kWidths; }
  __device__ const half_t* mirror_row(int s, int side, int t) const {
    return mirror + ((std::size_t(s) * 2 + side) * capacity + t) * head_dim;
  }
};

/// The outliers a split side took before its rotation (qaq/split_outliers.hpp), [tokens][kv_heads][Q::outliers(d)]
/// per side (null: the side is not split).
struct SplitRows {
  const half_t* val[2];
  const std::uint8_t* idx[2];
};

/// Append: one thread per (token, stream head, side). Token t of the call becomes token n0 + t and record
/// counts[BMax] + t of its bucket; quantized from its (already written) mirror row, or on a split side from its
/// rotated residual (the mirror row) with the outliers taken before the rotation.
template <class Q>
__global__ void append_kernel(const __grid_constant__ Params<Q> p, int seq, int n0, int tokens, SplitRows split) {
  using record = qaq::RecordFormat<Q>;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= tokens * p.kv_heads * 2) return;
  const int side = i % 2, h = (i / 2) % p.kv_heads, t = i / (2 * p.kv_heads);
  const int s = seq * p.kv_heads + h, d = p.head_dim;
  const std::uint32_t* n = p.counts_of(s, side);
  std::byte* dst = p.arena_of(s, side) + Params<Q>::arena::bucket_offset(n, Q::kMaxBits, d, p.id_bytes) +
                   (std::size_t(n[Params<Q>::kWidths - 1]) + t) * record::bytes(d, Q::kMaxBits, p.id_bytes);
  if (split.val[side] != nullptr) {
    const std::size_t o = (std::size_t(t) * p.kv_heads + h) * Q::outliers(d);
    record::write_residual(dst, d, Q::kMaxBits, p.id_bytes, p.mirror_row(s, side, n0 + t), split.val[side] + o,
                           split.idx[side] + o, std::uint32_t(n0 + t));
  } else {
    record::write_row(dst, d, Q::kMaxBits, p.id_bytes, p.mirror_row(s, side, n0 + t), std::uint32_t(n0 + t));
  }
  if (side == 0) p.hist[std::size_t(s) * p.capacity + n0 + t].reset();
}

/// After append_kernel: counts[BMax] += tokens for every head of `seq`, and the sequence's length.
template <class Q>
__global__ void append_commit_kernel(const __grid_constant__ Params<Q> p, int seq, int tokens) {
  const int i = threadIdx.x;
  if (i < p.kv_heads * 2) p.counts_of(seq * p.kv_heads + i / 2, i % 2)[Params<Q>::kWidths - 1] += std::uint32_t(tokens);
  if (i == 0) p.lengths[seq] += tokens;
}

/// Sets *bad to the smallest flat index (seq * kv_heads + head) * stride + t whose probability is not a
/// finite value in [0, 1] (t < the sequence's length); *bad starts at UINT64_MAX.
template <class Q>
__global__ void check_probs_kernel(const __grid_constant__ Params<Q> p, const float* probs, int stride,
                                   unsigned long long* bad) {
  const int s = blockIdx.x, T = p.lengths[s / p.kv_heads];
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    const float x = probs[std::size_t(s) * stride + t];
    if (!(x >= 0.0f && x <= 1.0f)) atomicMin(bad, (unsigned long long)(std::size_t(s) * stride + t));
  }
}

/// Stable ranking of one chunk (one element per thread) by category in [0, W) (-1: none): the number of the
/// chunk's elements of the same category before this thread's (lane order, then warp order); total[w] gets
/// the chunk's count of category w. Shared: warp_n[warps][W], total[W]. Every thread of the CTA calls it.
template <int W>
__device__ int chunk_rank(int nb_index, std::uint32_t* warp_n, std::uint32_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const unsigned lt = (1u << lane) - 1u;
  int rank = 0;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const unsigned m = __ballot_sync(0xffffffffu, nb_index == w);
    if (nb_index == w) rank = __popc(m & lt);
    if (lane == 0) warp_n[warp * W + w] = __popc(m);
  }
  __syncthreads();
  if (nb_index >= 0)
    for (int k = 0; k < warp; ++k) rank += int(warp_n[k * W + nb_index]);
  if (threadIdx.x < W) {
    std::uint32_t s = 0;
    for (int k = 0; k < warps; ++k) s += warp_n[k * W + threadIdx.x];
    total[threadIdx.x] = s;
  }
  __syncthreads();
  return rank;
}

/// Width update of one stream side (SPEC §2.6) after this step's histories were pushed: every record's new
/// width from the step's rule (qaq::StepWidths, as the host), then the host's rebucketing into `scratch`, in
/// the host's order: new bucket w = the records that stay in w (in order), then the movers into w (lowered
/// by a shift or raised from the mirror) in scan order; copied back over the arena. So the device holds the
/// bytes the host's update_widths() gives. Grid: (kv_heads, batch, 2 sides); kUpdateThreads threads.
template <class Q>
__global__ void __launch_bounds__(kUpdateThreads)
    update_kernel(const __grid_constant__ Params<Q> p, qaq::Targets targets, std::byte* scratch) {
  using P = Params<Q>;
  using arena = typename P::arena;
  using record = qaq::RecordFormat<Q>;
  constexpr int W = P::kWidths, BMin = Q::kMinBits;
  using Rule = qaq::StepWidths<typename Q::bounds>;
  __shared__ alignas(Rule) unsigned char rule_bytes[sizeof(Rule)];  // StepWidths' WidthRange has initializers
  Rule& rule = *reinterpret_cast<Rule*>(rule_bytes);
  // category of a record: 2 (new width - BMin) + (moves ? 1 : 0)
  __shared__ std::uint32_t n_old[W], n_cat[2 * W], base[2 * W], total[2 * W], warp_n[(kUpdateThreads / 32) * 2 * W];
  __shared__ std::size_t off_new[W];
  const int h = blockIdx.x, seq = blockIdx.y, side = blockIdx.z, s = seq * p.kv_heads + h, d = p.head_dim;
  const int T = p.lengths[seq];
  const bool key = side == 0;
  if (threadIdx.x == 0) rule.set_scalars(T, targets.key_sigma_s, double(p.qnorm2[h]), Q::widths());
  for (int c = threadIdx.x; c < 255; c += blockDim.x)
    rule.value_denom[c] = T > 1 ? Rule::value_denom_at(T, targets.value_sigma_x, c) : 1.0;
  if (threadIdx.x < W) n_old[threadIdx.x] = p.counts_of(s, side)[threadIdx.x];
  if (threadIdx.x < 2 * W) n_cat[threadIdx.x] = base[threadIdx.x] = 0;
  __syncthreads();
  const std::byte* src = p.arena_of(s, side);
  // record i: its bytes, width b, and category (new width nb)
  auto classify = [&](std::uint32_t i, const std::byte** r, int* b, int* nb) {
    const typename arena::Slot sl = arena::slot(n_old, i, d, p.id_bytes);
    *r = src + sl.offset;
    *b = sl.width;
    const std::uint32_t tok = record::token(*r, d, sl.width, p.id_bytes);
    *nb = Q::width(p.hist[std::size_t(s) * p.capacity + tok], record::meta(*r), rule, key);
    return 2 * (*nb - BMin) + (*nb != *b ? 1 : 0);
  };
  // pass 1: records per category, hence the new bucket offsets
  for (int i = threadIdx.x; i < T; i += blockDim.x) {
    const std::byte* r;
    int b, nb;
    atomicAdd(&n_cat[classify(std::uint32_t(i), &r, &b, &nb)], 1u);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    std::size_t o = 0;
    for (int w = 0; w < W; ++w) {
      off_new[w] = o;
      o += std::size_t(n_cat[2 * w] + n_cat[2 * w + 1]) * record::bytes(d, BMin + w, p.id_bytes);
    }
  }
  __syncthreads();
  // pass 2: chunks of blockDim records in scan order, ranked stably within their category
  std::byte* dst_arena = scratch + (std::size_t(s) * 2 + side) * p.arena_bytes;
  for (int i0 = 0; i0 < T; i0 += blockDim.x) {
    const int i = i0 + int(threadIdx.x);
    const std::byte* r = nullptr;
    int b = 0, nb = 0, cat = -1;
    if (i < T) cat = classify(std::uint32_t(i), &r, &b, &nb);
    const int rank = chunk_rank<2 * W>(cat, warp_n, total);
    if (cat >= 0) {
      const int w = nb - BMin;
      const std::uint32_t pos = (cat & 1 ? n_cat[2 * w] : 0u) + base[cat] + std::uint32_t(rank);
      std::byte* dst = dst_arena + off_new[w] + std::size_t(pos) * record::bytes(d, nb, p.id_bytes);
      if (nb == b) {
        for (std::size_t k = 0; k < record::bytes(d, b, p.id_bytes); ++k) dst[k] = r[k];
      } else if (nb < b) {
        record::lower(r, b, dst, nb, d, p.id_bytes);
      } else {
        record::raise(r, b, dst, nb, d, p.id_bytes, p.mirror_row(s, side, int(record::token(r, d, b, p.id_bytes))));
      }
    }
    __syncthreads();
    if (threadIdx.x < 2 * W) base[threadIdx.x] += total[threadIdx.x];
    __syncthreads();
  }
  // copy back the bytes written: whole 16-byte words (both arenas are 16-byte aligned), then the tail bytes
  // (not the rest of the last word: scratch past `used` was never written; initcheck flags reading it)
  std::size_t used = 0;
  for (int w = 0; w < W; ++w) used += std::size_t(n_cat[2 * w] + n_cat[2 * w + 1]) * record::bytes(d, BMin + w, p.id_bytes);
  const uint4* from = reinterpret_cast<const uint4*>(dst_arena);
  std::byte* to_bytes = p.arena_of(s, side);
  uint4* to = reinterpret_cast<uint4*>(to_bytes);
  for (std::size_t k = threadIdx.x; k < used / 16; k += blockDim.x) to[k] = from[k];
  for (std::size_t k = used / 16 * 16 + threadIdx.x; k < used; k += blockDim.x) to_bytes[k] = dst_arena[k];
  if (threadIdx.x < W) p.counts_of(s, side)[threadIdx.x] = n_cat[2 * threadIdx.x] + n_cat[2 * threadIdx.x + 1];
}

/// Pushes this step's probabilities into the histories: grid (kv_heads, batch).
template <class Q>
__global__ void push_kernel(const __grid_constant__ Params<Q> p, const float* probs, int stride) {
  const int s = blockIdx.y * p.kv_heads + blockIdx.x, T = p.lengths[blockIdx.y];
  for (int t = threadIdx.x; t < T; t += blockDim.x)
    p.hist[std::size_t(s) * p.capacity + t].push(probs[std::size_t(s) * stride + t]);
}

/// A warp's share of one record: lane owns channels lane + 32 j (j < kC), decoded with the outliers in place, or
/// for a split side (Split) the codes alone (the rotated residual's; the kernels add the outliers apart).
template <class Q, int D, bool Split = false>
__device__ __forceinline__ void decode_record(const std::byte* r, int b, int id_bytes, float (&x)[(D + 31) / 32]) {
  using record = qaq::RecordFormat<Q>;
  constexpr int kC = (D + 31) / 32;
  const int lane = threadIdx.x % 32;
  const QuantMeta m = record::meta(r);
#pragma unroll
  for (int j = 0; j < kC; ++j) {
    const int c = lane + 32 * j;
    x[j] = c < D ? Q::decode(m, b, std::uint8_t(record::code_at(r, c, b))) : 0.0f;
  }
  (void)id_bytes;
  if constexpr (Split) return;
  const half_t* ov = record::outlier_values(r, D, b);
  const std::uint8_t* oi = record::outlier_channels(r, D, b);
  for (int o = 0; o < Q::outliers(D); ++o) {
    const int c = oi[o];
    if (c % 32 != lane) continue;
#pragma unroll
    for (int j = 0; j < kC; ++j)
      if (j == c / 32) x[j] = ov[o].to_float();
  }
}

/// A side is split when it is rotated and QAQ keeps outliers: they are taken before the rotation, in the original
/// basis (qaq_cache.hpp), so the kernels add their terms with the un-rotated query and to the un-rotated output.
template <class Q, class Rot>
inline constexpr bool kSplitKeys = Rot::kKeys && Q::kOutlierPermille > 0;
template <class Q, class Rot>
inline constexpr bool kSplitValues = Rot::kValues && Q::kOutlierPermille > 0;

/// Records [r0, r1) of a split (r0 = split * per).
__device__ __forceinline__ void split_range(int T, int per, int* r0, int* r1) {
  *r0 = int(blockIdx.x) * per;
  *r1 = *r0 + per < T ? *r0 + per : T;
}

/// Scores: grid (splits, kv_heads, nseq). scores[(seq * query_heads + qh) * stride + token] = q . k * scale
/// * log2(e), for the `group` query heads of the KV head (chunks of Heads in registers). With the keys of Rot
/// rotated, each query row is rotated in shared memory first (one thread per row: q . k = (R q) . (R k)); on a
/// split side the outliers' terms use the row before its rotation (q . k = (R q) . y^ + q . o).
template <class Q, int D, int Heads, class QT, class Rot>
__global__ void __launch_bounds__(kThreads)
    scores_kernel(const __grid_constant__ Params<Q> p, const QT* __restrict__ q, int group, float scale_log2, int per,
                  float* __restrict__ scores, int stride) {
  using record = qaq::RecordFormat<Q>;
  constexpr int kC = (D + 31) / 32;
  constexpr bool kSplit = kSplitKeys<Q, Rot>;
  __shared__ float qs[Heads * D];
  __shared__ float qo[kSplit ? Heads * D : 1];  // split: the query rows before the rotation
  const int kvh = blockIdx.y, seq = blockIdx.z, s = seq * p.kv_heads + kvh, T = p.lengths[seq];
  int r0, r1;
  split_range(T, per, &r0, &r1);
  if (r0 >= r1) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, qheads = p.kv_heads * group;
  __shared__ std::uint32_t n[Params<Q>::kWidths];
  if (threadIdx.x < Params<Q>::kWidths) n[threadIdx.x] = p.counts_of(s, 0)[threadIdx.x];
  for (int h0 = 0; h0 < group; h0 += Heads) {
    const int heads = group - h0 < Heads ? group - h0 : Heads;
    __syncthreads();
    for (int i = threadIdx.x; i < Heads * D; i += blockDim.x) {
      const int h = i / D;
      qs[i] = h < heads ? StorageTraits<QT>::load(q[(std::size_t(seq) * qheads + kvh * group + h0 + h) * D + i % D]) *
                              scale_log2
                        : 0.0f;
      if constexpr (kSplit) qo[i] = qs[i];
    }
    if constexpr (Rot::kKeys) {
      __syncthreads();
      if (threadIdx.x < heads) Rot::rotate(true, p.rotation, kvh, D, qs + threadIdx.x * D);
    }
    __syncthreads();
    for (int i = r0 + warp; i < r1; i += kThreads / 32) {
      const auto sl = Params<Q>::arena::slot(n, std::uint32_t(i), D, p.id_bytes);
      const std::byte* r = p.arena_of(s, 0) + sl.offset;
      float x[kC];
      decode_record<Q, D, kSplit>(r, sl.width, p.id_bytes, x);
      float a[Heads];
#pragma unroll
      for (int h = 0; h < Heads; ++h) {
        a[h] = 0.0f;
#pragma unroll
        for (int j = 0; j < kC; ++j)
          if (lane + 32 * j < D) a[h] = fmaf(qs[h * D + lane + 32 * j], x[j], a[h]);
        if constexpr (kSplit) {
          const half_t* ov = record::outlier_values(r, D, sl.width);
          const std::uint8_t* oi = record::outlier_channels(r, D, sl.width);
          for (int o = lane; o < Q::outliers(D); o += 32) a[h] = fmaf(qo[h * D + oi[o]], ov[o].to_float(), a[h]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a[h] += __shfl_xor_sync(0xffffffffu, a[h], o);
      }
      if (lane == 0) {
        const std::uint32_t tok = record::token(r, D, sl.width, p.id_bytes);
        for (int h = 0; h < heads; ++h) scores[(std::size_t(seq) * qheads + kvh * group + h0 + h) * stride + tok] = a[h];
      }
    }
  }
}

/// Softmax per (KV head, sequence): turns each query head's scores into probabilities in place and writes
/// probs[(seq * kv_heads + kvh) * probs_stride + t] = the largest over the group (when probs is not null).
template <class Q>
__global__ void __launch_bounds__(kThreads)
    softmax_kernel(const __grid_constant__ Params<Q> p, int group, float* __restrict__ scores, int stride,
                   float* __restrict__ probs, int probs_stride) {
  __shared__ float red[kThreads / 32];
  const int kvh = blockIdx.x, seq = blockIdx.y, T = p.lengths[seq], qheads = p.kv_heads * group;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto block_reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
      const float u = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, u) : v + u;
    }
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int k = 1; k < kThreads / 32; ++k) v = is_max ? fmaxf(v, red[k]) : v + red[k];
    return v;
  };
  for (int h = 0; h < group; ++h) {
    float* sc = scores + (std::size_t(seq) * qheads + kvh * group + h) * stride;
    float m = neg_inf();
    for (int t = threadIdx.x; t < T; t += kThreads) m = fmaxf(m, sc[t]);
    m = block_reduce(m, true);
    float l = 0.0f;
    for (int t = threadIdx.x; t < T; t += kThreads) {
      const float e = exp2f(sc[t] - m);
      sc[t] = e;
      l += e;
    }
    const float inv = 1.0f / block_reduce(l, false);
    for (int t = threadIdx.x; t < T; t += kThreads) sc[t] *= inv;
  }
  if (probs == nullptr) return;
  __syncthreads();
  float* out = probs + (std::size_t(seq) * p.kv_heads + kvh) * probs_stride;
  for (int t = threadIdx.x; t < T; t += kThreads) {
    float mx = 0.0f;
    for (int h = 0; h < group; ++h) mx = fmaxf(mx, scores[(std::size_t(seq) * qheads + kvh * group + h) * stride + t]);
    out[t] = mx;
  }
}

/// p . V over the value records of a split: grid (splits, kv_heads * chunks, nseq); writes the split's partial
/// outputs part[((split * nseq + seq) * query_heads + qh) * D + c] (probabilities are already normalised, so
/// the splits merge by a plain sum). A split value side (Rot) writes the outliers' share apart, in the original
/// basis, to opart (same indexing): sum_splits_kernel adds it after the un-rotation.
template <class Q, int D, int Heads, class Rot>
__global__ void __launch_bounds__(kThreads)
    values_kernel(const __grid_constant__ Params<Q> p, int group, int per, const float* __restrict__ probs_by_head,
                  int stride, int nseq, float* __restrict__ part, float* __restrict__ opart) {
  using record = qaq::RecordFormat<Q>;
  constexpr int kC = (D + 31) / 32, kWarps = kThreads / 32;
  constexpr bool kSplit = kSplitValues<Q, Rot>;
  __shared__ float red[kWarps][Heads][D];
  __shared__ float ored[kSplit ? Heads : 1][kSplit ? D : 1];  // split: sum of p x_c over the outliers
  __shared__ std::uint32_t n[Params<Q>::kWidths];
  const int chunks = (group + Heads - 1) / Heads;
  const int kvh = blockIdx.y / chunks, h0 = (blockIdx.y % chunks) * Heads, seq = blockIdx.z;
  const int heads = group - h0 < Heads ? group - h0 : Heads;
  const int s = seq * p.kv_heads + kvh, T = p.lengths[seq], qheads = p.kv_heads * group;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int r0, r1;
  split_range(T, per, &r0, &r1);
  if (threadIdx.x < Params<Q>::kWidths) n[threadIdx.x] = p.counts_of(s, 1)[threadIdx.x];
  if constexpr (kSplit)
    for (int i = threadIdx.x; i < Heads * D; i += kThreads) ored[i / D][i % D] = 0.0f;
  __syncthreads();
  float acc[Heads][kC];
#pragma unroll
  for (int h = 0; h < Heads; ++h)
#pragma unroll
    for (int j = 0; j < kC; ++j) acc[h][j] = 0.0f;
  for (int i = r0 + warp; i < r1; i += kWarps) {
    const auto sl = Params<Q>::arena::slot(n, std::uint32_t(i), D, p.id_bytes);
    const std::byte* r = p.arena_of(s, 1) + sl.offset;
    float x[kC];
    decode_record<Q, D, kSplit>(r, sl.width, p.id_bytes, x);
    const std::uint32_t tok = record::token(r, D, sl.width, p.id_bytes);
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
      const float pr = h < heads ? probs_by_head[(std::size_t(seq) * qheads + kvh * group + h0 + h) * stride + tok] : 0.0f;
#pragma unroll
      for (int j = 0; j < kC; ++j) acc[h][j] = fmaf(pr, x[j], acc[h][j]);
      if constexpr (kSplit) {
        const half_t* ov = record::outlier_values(r, D, sl.width);
        const std::uint8_t* oi = record::outlier_channels(r, D, sl.width);
        for (int o = lane; o < Q::outliers(D); o += 32) atomicAdd(&ored[h][oi[o]], pr * ov[o].to_float());
      }
    }
  }
#pragma unroll
  for (int h = 0; h < Heads; ++h)
#pragma unroll
    for (int j = 0; j < kC; ++j)
      if (lane + 32 * j < D) red[warp][h][lane + 32 * j] = acc[h][j];
  __syncthreads();
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int h = i / D, c = i % D;
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w][h][c];
    const std::size_t at = ((std::size_t(blockIdx.x) * nseq + seq) * qheads + kvh * group + h0 + h) * D + c;
    part[at] = v;
    if constexpr (kSplit) opart[at] = ored[h][c];
  }
}

/// out[row][c] = sum over splits of part: grid (rows = nseq x query heads), D threads or fewer. With the values
/// of Rot rotated, the row is un-rotated in shared memory before it is stored (o = R^T sum_t p_t (R v_t); row's
/// KV head (row % query heads) / group, tables of the layer), then a split side's outlier share (opart, the
/// same sum; null when the values are not split) is added in the original basis.
template <int D, class QT, class Rot>
__global__ void sum_splits_kernel(const float* __restrict__ part, const float* __restrict__ opart, int splits,
                                  std::size_t rows, QT* __restrict__ out, const std::uint32_t* __restrict__ tables,
                                  int query_heads, int group) {
  const std::size_t row = blockIdx.x;
  __shared__ float o[Rot::kValues ? D : 1];
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float v = 0.0f;
    for (int k = 0; k < splits; ++k) v += part[(std::size_t(k) * rows + row) * D + c];
    if constexpr (Rot::kValues) o[c] = v;
    else out[row * D + c] = StorageTraits<QT>::store(v);
  }
  if constexpr (Rot::kValues) {
    __syncthreads();
    if (threadIdx.x == 0) Rot::unrotate(false, tables, int(row % std::size_t(query_heads)) / group, D, o);
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      float v = o[c];
      if (opart != nullptr)
        for (int k = 0; k < splits; ++k) v += opart[(std::size_t(k) * rows + row) * D + c];
      out[row * D + c] = StorageTraits<QT>::store(v);
    }
  }
}
}  // namespace kvc::cuda::qaq_detail
