/// \file kernels.cuh (aligned, private)
/// AlignedKV's device kernels (kvc::cuda::DeviceAlignedCache, aligned/decode_attention.cuh): the decode attention
/// over the fp16 bit planes, the same computation as the CPU kernel (aligned/detail/attention_kernel.hpp) with the
/// same policy functions (AlignedLoader's KVC_HOST_DEVICE rules), fp32 accumulation:
///  1. key_tiers_kernel, per (sequence, KV head): Rule 1 (AlignedLoader::key_tiers on the unscaled query) into a
///     [streams][D] byte array;
///  2. scores_kernel, per (split, KV head, sequence): one thread per token; per channel the planes its tier asks
///     for (hi8, plus mid4 / lo4), the staged tokens' fp16 whole; scores scaled by scale * log2(e);
///  3. softmax_kernel, per query head: base 2, normalised in place;
///  4. reference_kernel, per query head: Rule 2's reference (AlignedLoader::estimate_reference's computation:
///     the strided buckets' argmax = top_candidates, the candidates' tier-8 rows summed in candidate order, then
///     value_reference), handed on as the two value_scale()s;
///  5. values_kernel, per (split, KV head x head chunk, sequence): one warp per row; the row's tier from every
///     group head's probability (value_scale multiplications, as the CPU), its planes at that tier; partial
///     outputs per split, summed by sum_splits_kernel.
/// Read statistics (aligned::ReadStats) are counted on the device when `counters` is not null: [0, 3) key
/// elements by tier, [3, 6) value rows by tier; the rest the host knows from the lengths.
#pragma once

#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/core/numeric.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kvc::cuda::aligned_detail {

inline constexpr int kThreads = 128;  ///< attention kernels: 4 warps
inline constexpr int kCounters = 6;   ///< ReadStats counters on the device (see the file comment)

/// One layer of the cache; device pointers (written by append_kernel only, read by the attention kernels).
/// Stream s = seq * kv_heads + head owns, at s times its stride, the host stream's vectors
/// (aligned/aligned_cache.hpp) with room for the capacity.
struct Params {
  int batch, kv_heads, head_dim, block;
  std::size_t hi_stride;     ///< bytes of one stream's hi8 planes (keys or values): cap_blocks * block * head_dim
  std::size_t stage_stride;  ///< halves of one stream's staging (keys or values): (block - 1) * head_dim
  int* lengths;              ///< [batch]
  std::uint8_t *khi, *kmid, *klo;  ///< [streams][hi_stride], nibbles [streams][hi_stride / 2]
  std::uint8_t *vhi, *vmid, *vlo;  ///< the same for the values (token-major)
  half_t *kst, *vst;               ///< [streams][stage_stride]
  std::uint8_t *kmax, *vmax;       ///< [streams][head_dim]
};

/// Append to every KV head of `seq` (grid: kv_heads; one CTA per stream): tokens [n0, n0 + tokens) from x (device
/// fp32 [tokens][kv_heads][head_dim], keys at k, values at v), rounded to fp16 by half_t::from_float as the host
/// cache does; the bytes the host's append leaves. The blocks this call completes ([f0, f1)) go into the planes
/// from the old staging and the input (keys by token pair and channel, values by token and channel pair: each
/// nibble byte whole), Kmax / Vmax take the new tokens; then, after the old staging was read, the tokens past f1
/// into the staging.
template <int B>
__global__ void append_kernel(const __grid_constant__ Params p, int seq, int n0, int tokens, const float* __restrict__ k,
                              const float* __restrict__ v) {
  const int h = blockIdx.x, H = p.kv_heads, d = p.head_dim, s = seq * H + h;
  const int n1 = n0 + tokens, f0 = n0 / B * B, f1 = n1 / B * B;
  std::uint8_t *khi = p.khi + std::size_t(s) * p.hi_stride, *vhi = p.vhi + std::size_t(s) * p.hi_stride;
  std::uint8_t *kmid = p.kmid + std::size_t(s) * (p.hi_stride / 2), *klo = p.klo + std::size_t(s) * (p.hi_stride / 2);
  std::uint8_t *vmid = p.vmid + std::size_t(s) * (p.hi_stride / 2), *vlo = p.vlo + std::size_t(s) * (p.hi_stride / 2);
  half_t *kst = p.kst + std::size_t(s) * p.stage_stride, *vst = p.vst + std::size_t(s) * p.stage_stride;
  // token u's fp16 bits, channel c: the old staging (u < n0) or the input
  auto bits = [&](int side, int u, int c) -> std::uint16_t {
    if (u < n0) return (side == 0 ? kst : vst)[std::size_t(u - f0) * d + c].bits;
    return half_t::from_float((side == 0 ? k : v)[(std::size_t(u - n0) * H + h) * d + c]).bits;
  };
  for (int i = threadIdx.x; i < (f1 - f0) / 2 * d; i += blockDim.x) {  // keys: channel-major per block
    const int u = f0 + 2 * (i / d), c = i % d, j = u % B;
    const std::uint16_t a = bits(0, u, c), b = bits(0, u + 1, c);
    const std::size_t col = std::size_t(u / B) * d + std::size_t(c);
    khi[col * B + j] = aligned::hi8(a);
    khi[col * B + j + 1] = aligned::hi8(b);
    kmid[col * (B / 2) + j / 2] = std::uint8_t(aligned::mid4(a) | aligned::mid4(b) << 4);
    klo[col * (B / 2) + j / 2] = std::uint8_t(aligned::lo4(a) | aligned::lo4(b) << 4);
  }
  for (int i = threadIdx.x; i < (f1 - f0) * (d / 2); i += blockDim.x) {  // values: token-major
    const int u = f0 + i / (d / 2), c = 2 * (i % (d / 2));
    const std::uint16_t a = bits(1, u, c), b = bits(1, u, c + 1);
    const std::size_t row = std::size_t(u) * d + std::size_t(c);
    vhi[row] = aligned::hi8(a);
    vhi[row + 1] = aligned::hi8(b);
    vmid[row / 2] = std::uint8_t(aligned::mid4(a) | aligned::mid4(b) << 4);
    vlo[row / 2] = std::uint8_t(aligned::lo4(a) | aligned::lo4(b) << 4);
  }
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    int km = p.kmax[std::size_t(s) * d + c], vm = p.vmax[std::size_t(s) * d + c];
    for (int u = n0; u < n1; ++u) {
      const int fk = aligned::fp16_field(bits(0, u, c)), fv = aligned::fp16_field(bits(1, u, c));
      km = fk > km ? fk : km;
      vm = fv > vm ? fv : vm;
    }
    p.kmax[std::size_t(s) * d + c] = std::uint8_t(km);
    p.vmax[std::size_t(s) * d + c] = std::uint8_t(vm);
  }
  __syncthreads();  // the old staging has been read
  const int u0 = f1 > n0 ? f1 : n0;  // staged tokens before n0 stay where they are (f1 == f0 then)
  for (int i = threadIdx.x; i < (n1 - u0) * d; i += blockDim.x) {
    const int u = u0 + i / d, c = i % d;
    kst[std::size_t(u - f1) * d + c].bits = bits(0, u, c);
    vst[std::size_t(u - f1) * d + c].bits = bits(1, u, c);
  }
  if (h == 0 && threadIdx.x == 0) p.lengths[seq] = n1;
}

/// Tokens [r0, r1) of a split (r0 = split * per).
__device__ __forceinline__ void split_range(int T, int per, int* r0, int* r1) {
  *r0 = int(blockIdx.x) * per;
  *r1 = *r0 + per < T ? *r0 + per : T;
}

/// Rule 1 per (KV head, sequence): grid (kv_heads, nseq), one thread (O(group * D)). q: [nseq][query heads][D]
/// unscaled; ktier: [nseq * kv_heads][D]. Counts key elements per tier (blocks * block per channel).
template <class L>
__global__ void key_tiers_kernel(const __grid_constant__ Params p, const float* __restrict__ q, int group,
                                 std::uint8_t* __restrict__ ktier, unsigned long long* __restrict__ counters) {
  if (threadIdx.x != 0) return;
  const int kvh = blockIdx.x, seq = blockIdx.y, s = seq * p.kv_heads + kvh, d = p.head_dim;
  const float* qg = q + (std::size_t(seq) * p.kv_heads * group + std::size_t(kvh) * group) * d;
  std::uint8_t* tiers = ktier + std::size_t(s) * d;
  L::key_tiers(qg, group, d, p.kmax + std::size_t(s) * d, tiers);
  if (counters) {
    const unsigned long long bt = (unsigned long long)(p.lengths[seq] / p.block) * unsigned(p.block);
    unsigned long long k8 = 0, k12 = 0, k16 = 0;
    for (int c = 0; c < d; ++c) k8 += tiers[c] == 8, k12 += tiers[c] == 12, k16 += tiers[c] == 16;
    if (k8) atomicAdd(counters + 0, k8 * bt);
    if (k12) atomicAdd(counters + 1, k12 * bt);
    if (k16) atomicAdd(counters + 2, k16 * bt);
  }
}

/// The low nibble (element 2j) or the high one (2j + 1) of a nibble byte.
__device__ __forceinline__ std::uint8_t nibble(std::uint8_t b, bool high) { return std::uint8_t(high ? b >> 4 : b & 0xFu); }

/// Scores: grid (splits, kv_heads, nseq), kThreads threads, one per token. scores[(seq * query heads + qh) *
/// stride + t] = q . k_t * scale_log2 with k_t the key at its channels' tiers (staged keys whole).
template <class L, int D, int Heads>
__global__ void __launch_bounds__(kThreads)
    scores_kernel(const __grid_constant__ Params p, const float* __restrict__ q, const std::uint8_t* __restrict__ ktier,
                  int group, float scale_log2, int per, float* __restrict__ scores, int stride) {
  constexpr int B = L::kBlock;
  __shared__ float qs[Heads * D];
  __shared__ std::uint8_t tier[D];
  const int kvh = blockIdx.y, seq = blockIdx.z, s = seq * p.kv_heads + kvh, T = p.lengths[seq];
  int r0, r1;
  split_range(T, per, &r0, &r1);
  if (r0 >= r1) return;
  const int full = T / B * B, qheads = p.kv_heads * group;
  for (int c = threadIdx.x; c < D; c += blockDim.x) tier[c] = ktier[std::size_t(s) * D + c];
  const std::uint8_t* khi = p.khi + std::size_t(s) * p.hi_stride;
  const std::uint8_t* kmid = p.kmid + std::size_t(s) * (p.hi_stride / 2);
  const std::uint8_t* klo = p.klo + std::size_t(s) * (p.hi_stride / 2);
  const half_t* kst = p.kst + std::size_t(s) * p.stage_stride;
  for (int h0 = 0; h0 < group; h0 += Heads) {
    const int heads = group - h0 < Heads ? group - h0 : Heads;
    __syncthreads();
    for (int i = threadIdx.x; i < Heads * D; i += blockDim.x) {
      const int h = i / D;
      qs[i] = h < heads ? q[(std::size_t(seq) * qheads + kvh * group + h0 + h) * D + i % D] * scale_log2 : 0.0f;
    }
    __syncthreads();
    for (int t = r0 + int(threadIdx.x); t < r1; t += blockDim.x) {
      float a[Heads];
#pragma unroll
      for (int h = 0; h < Heads; ++h) a[h] = 0.0f;
      if (t < full) {
        // channel-major block: channel c's tokens at (b * D + c) * B; tier[c] is the same for every thread
        const int j = t % B;
        const bool high = (j & 1) != 0;
        const std::size_t b0 = std::size_t(t / B) * D;
        for (int c = 0; c < D; ++c) {
          const int tc = tier[c];
          const std::size_t col = b0 + std::size_t(c);
          const std::uint8_t hi = khi[col * B + j];
          std::uint8_t mid = 0, lo = 0;
          if (tc >= 12) mid = nibble(kmid[col * (B / 2) + j / 2], high);
          if (tc == 16) lo = nibble(klo[col * (B / 2) + j / 2], high);
          const float x = detail::half_bits_to_float(aligned::assemble(hi, mid, lo, tc));
#pragma unroll
          for (int h = 0; h < Heads; ++h) a[h] = fmaf(qs[h * D + c], x, a[h]);
        }
      } else {
        const half_t* row = kst + std::size_t(t - full) * D;
        for (int c = 0; c < D; ++c) {
          const float x = row[c].to_float();
#pragma unroll
          for (int h = 0; h < Heads; ++h) a[h] = fmaf(qs[h * D + c], x, a[h]);
        }
      }
      for (int h = 0; h < heads; ++h) scores[(std::size_t(seq) * qheads + kvh * group + h0 + h) * stride + t] = a[h];
    }
  }
}

/// A CTA-wide max (is_max) or sum of one value per thread; every thread gets the result. red: [kThreads / 32].
__device__ __forceinline__ float block_reduce(float v, bool is_max, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, u) : v + u;
  }
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < warps; ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
  return v;
}

/// Softmax per query head (base 2: the scores carry log2(e)), normalised in place: grid (query heads, nseq).
/// (A template, like every kernel here, so that each translation unit's instance is an inline definition.)
template <class L>
__global__ void __launch_bounds__(kThreads)
    softmax_kernel(const __grid_constant__ Params p, int qheads, float* __restrict__ scores, int stride) {
  __shared__ float red[kThreads / 32];
  const int seq = blockIdx.y, T = p.lengths[seq];
  float* sh = scores + (std::size_t(seq) * qheads + blockIdx.x) * stride;
  float m = -INFINITY;
  for (int t = threadIdx.x; t < T; t += blockDim.x) m = fmaxf(m, sh[t]);
  m = block_reduce(m, true, red);
  float sum = 0.0f;
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    const float e = exp2f(sh[t] - m);
    sh[t] = e;
    sum += e;
  }
  sum = block_reduce(sum, false, red);
  const float inv = 1.0f / sum;
  for (int t = threadIdx.x; t < T; t += blockDim.x) sh[t] *= inv;
}

/// Rule 2's reference per query head: grid (query heads, nseq), kThreads threads. probs as softmax_kernel left
/// them; scales[row][2] = value_scale(ref, VLo), value_scale(ref, VHi). The estimate is
/// AlignedLoader::estimate_reference's: the argmax of every strided bucket (top_candidates: one thread per bucket,
/// the first on ties), then per channel the candidates' tier-8 |V| times p summed in candidate order (separate
/// multiply and add, as the CPU), then value_reference.
template <class L, int D>
__global__ void __launch_bounds__(kThreads)
    reference_kernel(const __grid_constant__ Params p, int group, const float* __restrict__ probs, int stride,
                     float* __restrict__ scales) {
  constexpr int K = L::kTopK, B = L::kBlock;
  __shared__ int cand[K];
  __shared__ float est[D];
  const int qh = blockIdx.x, seq = blockIdx.y, qheads = p.kv_heads * group, s = seq * p.kv_heads + qh / group;
  const int T = p.lengths[seq], full = T / B * B, k = T < K ? T : K;
  const float* ph = probs + (std::size_t(seq) * qheads + qh) * stride;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    int best = j;
    for (int t = j + K; t < T; t += K) best = ph[t] > ph[best] ? t : best;
    cand[j] = best;
  }
  __syncthreads();
  const std::uint8_t* vhi = p.vhi + std::size_t(s) * p.hi_stride;
  const half_t* vst = p.vst + std::size_t(s) * p.stage_stride;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float e = 0.0f;
    for (int i = 0; i < k; ++i) {
      const int t = cand[i];
      const std::uint16_t bits = t < full ? aligned::assemble(vhi[std::size_t(t) * D + c], 0, 0, 8)
                                          : aligned::truncate(vst[std::size_t(t - full) * D + c].bits, 8);
      e = __fadd_rn(e, __fmul_rn(ph[t], fabsf(detail::half_bits_to_float(bits))));
    }
    est[c] = e;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ref = L::value_reference(est, D, p.vmax + std::size_t(s) * D);
    scales[(std::size_t(seq) * qheads + qh) * 2] = L::value_scale(ref, L::kValueLo);
    scales[(std::size_t(seq) * qheads + qh) * 2 + 1] = L::value_scale(ref, L::kValueHi);
  }
}

/// Values: grid (splits, kv_heads * chunks, nseq), kThreads threads; one warp per row, lane j owning the channel
/// pairs (2 (j + 32 i), 2 (j + 32 i) + 1) (one hi8 word, one nibble byte per plane). A planar row's tier is
/// AlignedLoader::value_tier of the whole group's probabilities (through value_scale, as the CPU kernel); the
/// staged rows whole. part[((split * nseq + seq) * query heads + qh) * D + c]: the split's share of the output.
template <class L, int D, int Heads>
__global__ void __launch_bounds__(kThreads)
    values_kernel(const __grid_constant__ Params p, int group, int per, const float* __restrict__ probs, int stride,
                  const float* __restrict__ scales, int nseq, float* __restrict__ part,
                  unsigned long long* __restrict__ counters) {
  constexpr int B = L::kBlock, kPairs = D / 2, kJ = (kPairs + 31) / 32, kWarps = kThreads / 32;
  __shared__ float red[kWarps][Heads][D];
  const int chunks = (group + Heads - 1) / Heads, kvh = int(blockIdx.y) / chunks, chunk = int(blockIdx.y) % chunks;
  const int seq = blockIdx.z, s = seq * p.kv_heads + kvh, T = p.lengths[seq], full = T / B * B;
  const int qheads = p.kv_heads * group, row0 = seq * qheads + kvh * group, h0 = chunk * Heads;
  const int heads = group - h0 < Heads ? group - h0 : Heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int r0, r1;
  split_range(T, per, &r0, &r1);
  float acc[Heads][kJ][2];
#pragma unroll
  for (int h = 0; h < Heads; ++h)
#pragma unroll
    for (int j = 0; j < kJ; ++j) acc[h][j][0] = acc[h][j][1] = 0.0f;
  unsigned long long v8 = 0, v12 = 0, v16 = 0;  // planar rows read at each tier
  const std::uint8_t* vhi = p.vhi + std::size_t(s) * p.hi_stride;
  const std::uint8_t* vmid = p.vmid + std::size_t(s) * (p.hi_stride / 2);
  const std::uint8_t* vlo = p.vlo + std::size_t(s) * (p.hi_stride / 2);
  const half_t* vst = p.vst + std::size_t(s) * p.stage_stride;
  for (int t = r0 + warp; t < r1; t += kWarps) {
    float w[Heads];
#pragma unroll
    for (int h = 0; h < Heads; ++h) w[h] = h < heads ? probs[std::size_t(row0 + h0 + h) * stride + t] : 0.0f;
    if (t < full) {
      float mlo = 0.0f, mhi = 0.0f;
      for (int h = 0; h < group; ++h) {
        const float x = probs[std::size_t(row0 + h) * stride + t];
        mlo = fmaxf(mlo, x * scales[std::size_t(row0 + h) * 2]);
        mhi = fmaxf(mhi, x * scales[std::size_t(row0 + h) * 2 + 1]);
      }
      const int tier = L::scaled_value_tier(mlo, mhi);  // the same for the whole warp
      v8 += tier == 8, v12 += tier == 12, v16 += tier == 16;
      const std::uint8_t* hi = vhi + std::size_t(t) * D;
      const std::uint8_t* mid = vmid + std::size_t(t) * (D / 2);
      const std::uint8_t* lo = vlo + std::size_t(t) * (D / 2);
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int pr = lane + 32 * j;
        if (kPairs % 32 != 0 && pr >= kPairs) continue;
        const std::uint16_t h2 = reinterpret_cast<const std::uint16_t*>(hi)[pr];  // row and pair even: aligned
        const std::uint8_t m = tier >= 12 ? mid[pr] : std::uint8_t(0), l = tier == 16 ? lo[pr] : std::uint8_t(0);
        const float xe = detail::half_bits_to_float(aligned::assemble(std::uint8_t(h2 & 0xFFu), nibble(m, false), nibble(l, false), tier));
        const float xo = detail::half_bits_to_float(aligned::assemble(std::uint8_t(h2 >> 8), nibble(m, true), nibble(l, true), tier));
#pragma unroll
        for (int h = 0; h < Heads; ++h) {
          acc[h][j][0] = fmaf(w[h], xe, acc[h][j][0]);
          acc[h][j][1] = fmaf(w[h], xo, acc[h][j][1]);
        }
      }
    } else {
      const half_t* row = vst + std::size_t(t - full) * D;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int pr = lane + 32 * j;
        if (kPairs % 32 != 0 && pr >= kPairs) continue;
        const float xe = row[2 * pr].to_float(), xo = row[2 * pr + 1].to_float();
#pragma unroll
        for (int h = 0; h < Heads; ++h) {
          acc[h][j][0] = fmaf(w[h], xe, acc[h][j][0]);
          acc[h][j][1] = fmaf(w[h], xo, acc[h][j][1]);
        }
      }
    }
  }
  if (counters && chunk == 0 && lane == 0) {  // each planar row once (chunk 0's warp that read it)
    if (v8) atomicAdd(counters + 3, v8);
    if (v12) atomicAdd(counters + 4, v12);
    if (v16) atomicAdd(counters + 5, v16);
  }
#pragma unroll
  for (int h = 0; h < Heads; ++h)
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const int pr = lane + 32 * j;
      if (kPairs % 32 != 0 && pr >= kPairs) continue;
      red[warp][h][2 * pr] = acc[h][j][0];
      red[warp][h][2 * pr + 1] = acc[h][j][1];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * D; i += blockDim.x) {
    const int h = i / D, c = i % D;
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w][h][c];
    part[((std::size_t(blockIdx.x) * nseq + seq) * qheads + kvh * group + h0 + h) * D + c] = v;
  }
}

/// out[row][c] = sum over splits of part: grid (rows), D threads or fewer.
template <int D>
__global__ void sum_splits_kernel(const float* __restrict__ part, int splits, std::size_t rows, float* __restrict__ out) {
  const std::size_t row = blockIdx.x;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float v = 0.0f;
    for (int k = 0; k < splits; ++k) v += part[(std::size_t(k) * rows + row) * D + c];
    out[row * D + c] = v;
  }
}
}  // namespace kvc::cuda::aligned_detail
