/// \file append_kernels.cuh
/// Device side of DeviceKVCache::append: the block compressor, the full-precision slot writer and the
/// input scan. They run the same host+device policy code as the host cache (quantize_group_masked,
/// BlockFormat::index / group_of, pack_codes), on the same values (the input rounded through the window
/// storage, as the host's slots hold it), so the stored codes and metadata are bit-identical.
#pragma once

#include <kvc/cache/append_plan.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/core/bit_packing.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/gear/block_correction.hpp>
#include <kvc/quant/codec.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::cuda::detail {

inline constexpr int kAppendThreads = 256;

/// Element c of row source `src` (kvc::detail::input_source, cache/append_plan.hpp) of one side as the host's slots hold it: an old slot
/// is read from its row (or, with an AlignedLoader, from its slot planes, whole), an input token rounded through the
/// window storage.
template <class Layout>
__device__ float source_value(const typename Layout::Params& p, Side side, int seq, int head, int src, int c,
                              const float* in) {
  using W = typename Layout::window_t;
  if (src >= 0) {
    if constexpr (Layout::kAlignedWindow) return kvc::detail::half_bits_to_float(p.fp_planes(side, seq, head).bits(src, c));
    else return StorageTraits<W>::load(p.fp_slot_row(side, seq, head, src)[c]);
  }
  const float x = in[(std::size_t(-1 - src) * p.kv_heads + head) * p.head_dim + c];
  return StorageTraits<W>::load(StorageTraits<W>::store(x));
}

/// Dynamic shared memory of compress_blocks_kernel: the block's values and one byte per code.
template <class F>
constexpr std::size_t compress_smem_bytes(int d) {
  return std::size_t(F::kBlockTokens) * d * (sizeof(float) + (F::kIdentity ? 0 : 1));
}

/// Compresses blocks blk0 + blockIdx.x of KV head blockIdx.y of sequence `seq`, side F::kSide, row t
/// from src[blockIdx.x * B + t] (see source_value). One CTA per block; groups are quantized one per thread, then the
/// codes are packed cooperatively. Block mode without corrections (the cache static_asserts that).
template <class Layout, class F>
__global__ void __launch_bounds__(kAppendThreads)
    compress_blocks_kernel(const __grid_constant__ typename Layout::Params p, int seq, int blk0,
                           const int* __restrict__ src, const float* __restrict__ in) {
  static_assert(!F::kCorrected, "kvc::cuda: blocks with GEAR corrections go through compress_gear_kernel");
  constexpr int B = F::kBlockTokens;
  constexpr Side side = F::kSide;
  extern __shared__ __align__(16) unsigned char append_smem[];
  unsigned char* smem = append_smem;
  const int d = p.head_dim, head = blockIdx.y, blk = blk0 + blockIdx.x;
  const int* rows = src + std::size_t(blockIdx.x) * B;
  float* x = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < B * d; i += blockDim.x) {
    const int t = i / d, c = i - t * d;
    x[i] = source_value<Layout>(p, side, seq, head, rows[t], c, in);
  }
  __syncthreads();
  std::byte* dst = side == Side::kKey ? p.key_block(seq, head, blk) : p.value_block(seq, head, blk);
  if constexpr (F::kIdentity) {
    F::store_identity(x, d, dst, threadIdx.x, blockDim.x);
  } else {
    std::uint8_t* codes = smem + std::size_t(B) * d * sizeof(float);
    F::quantize_groups(x, d, codes, dst, nullptr, threadIdx.x, blockDim.x);
    __syncthreads();
    pack_codes(codes, std::size_t(B) * d, F::kBits, reinterpret_cast<std::uint8_t*>(dst), threadIdx.x, blockDim.x);
  }
}

// ------------------------------------------------------------------------------------------------
// GEAR (block mode): outliers, backbone, residual on the device; the low-rank fit then runs
// power_iteration over CudaLinalg (DeviceKVCache) and write_factors_kernel stores it.
// ------------------------------------------------------------------------------------------------

/// Order-preserving map of a float to uint32 (-0 and +0 map alike, as they compare equal on the host).
__device__ __forceinline__ unsigned ordered_key(float f) {
  const unsigned u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Sum of v over the CTA, returned to every thread (counter: one shared int).
__device__ __forceinline__ int block_sum(int v, int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) *counter = 0;
  __syncthreads();
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0 && v != 0) atomicAdd(counter, v);
  __syncthreads();
  return *counter;
}

/// Exclusive prefix sum of v over the threads in index order (scan: blockDim.x shared ints).
__device__ __forceinline__ int block_exclusive_scan(int v, int* scan) {
  __syncthreads();
  scan[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int i = 0; i < int(blockDim.x); ++i) {
      const int x = scan[i];
      scan[i] = run;
      run += x;
    }
  }
  __syncthreads();
  return scan[threadIdx.x];
}

/// Sets mask[i] = 1 for the k unmasked elements of largest key(i), ties to the lower index (the host's
/// select_outliers order): an MSB-first radix select of the k-th key, then the ties in index order
/// (thread j owns the contiguous chunk j of the n elements). Every thread calls it.
template <class Key>
__device__ void select_largest(int n, int k, Key key, std::uint8_t* mask, int* scan, int* counter) {
  if (k <= 0) return;
  unsigned p = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned cand = p | (1u << bit);
    int cnt = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) cnt += !mask[i] && key(i) >= cand;
    if (block_sum(cnt, counter) >= k) p = cand;
  }
  int gt = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) gt += !mask[i] && key(i) > p;
  const int need = k - block_sum(gt, counter);
  const int per = (n + int(blockDim.x) - 1) / int(blockDim.x), lo = int(threadIdx.x) * per;
  const int hi = lo + per < n ? lo + per : n;
  int eq = 0;
  for (int i = lo; i < hi; ++i) eq += !mask[i] && key(i) == p;
  int rank = block_exclusive_scan(eq, scan);  // barrier: every count above read the old mask
  for (int i = lo; i < hi; ++i) {
    if (mask[i]) continue;
    const unsigned kk = key(i);
    if (kk > p || (kk == p && rank++ < need)) mask[i] = 1;
  }
  __syncthreads();
}

/// Dynamic shared memory of compress_gear_kernel.
template <class F>
constexpr std::size_t gear_smem_bytes(int d) {
  return (std::size_t(F::kBlockTokens) * d * (sizeof(float) + 2) + 15) / 16 * 16 + sizeof(int) * (kAppendThreads + 1);
}

/// GEAR's block compression (SPEC §1.3 steps 1-3, the host's CompressedKVCache::compress_block on the
/// device, bit for bit): outliers = the signed top/bottom s/2 of the block, backbone quantized over the
/// inliers, outlier entries fp16(x - x^) ascending by index; with a low-rank residual, the remaining
/// residual x - x^ - S goes to residual[(blockIdx.x * kv_heads + head) * d * B + c * B + t] (column-major
/// B x d) for the host-driven power iteration.
template <class Layout, class F>
__global__ void __launch_bounds__(kAppendThreads)
    compress_gear_kernel(const __grid_constant__ typename Layout::Params p, int seq, int blk0,
                         const int* __restrict__ src, const float* __restrict__ in, float* __restrict__ residual) {
  using C = typename F::correction;
  static_assert(C::kActive && !F::kIdentity);
  constexpr int B = F::kBlockTokens;
  constexpr Side side = F::kSide;
  extern __shared__ __align__(16) unsigned char gear_smem[];
  const int d = p.head_dim, head = blockIdx.y, blk = blk0 + blockIdx.x, n = B * d;
  float* x = reinterpret_cast<float*>(gear_smem);
  std::uint8_t* codes = gear_smem + std::size_t(n) * sizeof(float);
  std::uint8_t* mask = codes + n;
  int* scan = reinterpret_cast<int*>(gear_smem + (std::size_t(n) * (sizeof(float) + 2) + 15) / 16 * 16);
  int* counter = scan + blockDim.x;
  const int* rows = src + std::size_t(blockIdx.x) * B;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int t = i / d, c = i - t * d;
    x[i] = source_value<Layout>(p, side, seq, head, rows[t], c, in);
    mask[i] = 0;
  }
  __syncthreads();
  std::byte* dst = side == Side::kKey ? p.key_block(seq, head, blk) : p.value_block(seq, head, blk);
  std::byte* region = dst + F::correction_offset(d);
  if constexpr (C::kOutliers) {
    const int k = C::outliers(B, d) / 2;
    select_largest(n, k, [&](int i) { return ordered_key(x[i]); }, mask, scan, counter);
    select_largest(n, k, [&](int i) { return ~ordered_key(x[i]); }, mask, scan, counter);
  }
  F::quantize_groups(x, d, codes, dst, mask, threadIdx.x, blockDim.x);
  __syncthreads();
  pack_codes(codes, std::size_t(n), F::kBits, reinterpret_cast<std::uint8_t*>(dst), threadIdx.x, blockDim.x);
  __syncthreads();  // the packed codes (global) are visible to the whole CTA after the barrier
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int t = i / d, c = i - t * d;
    x[i] -= F::decode(dst, t, c, d);  // the residual x - x^, as the host computes it
  }
  if constexpr (C::kOutliers) {
    const int no = C::outliers(B, d);
    auto* idx = reinterpret_cast<std::uint16_t*>(region);
    auto* val = reinterpret_cast<half_t*>(region + std::size_t(no) * sizeof(std::uint16_t));
    const int per = (n + int(blockDim.x) - 1) / int(blockDim.x), lo = int(threadIdx.x) * per;
    const int hi = lo + per < n ? lo + per : n;
    int cnt = 0;
    for (int i = lo; i < hi; ++i) cnt += mask[i];
    int o = block_exclusive_scan(cnt, scan);  // barrier: the residual above is complete
    for (int i = lo; i < hi; ++i)
      if (mask[i]) {
        idx[o] = static_cast<std::uint16_t>(i);
        val[o] = half_t::from_float(x[i]);
        x[i] -= val[o].to_float();
        ++o;
      }
  }
  if constexpr (C::kLowRank) {
    __syncthreads();
    float* rc = residual + (std::size_t(blockIdx.x) * gridDim.y + head) * std::size_t(n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int c = i / B, t = i - c * B;  // column-major B x d: coalesced writes
      rc[i] = x[t * d + c];
    }
  }
}

/// Stores the fitted factors of blocks blk0 + blockIdx.x, KV head blockIdx.y, in fp16 after the
/// outliers of the correction region: A (B x r) and Bm (d x r), column-major, from a[(item) * B * r] and
/// b[(item) * d * r], item = blockIdx.x * kv_heads + head (the host's order: A^T then B^T row-major).
template <class Layout, class F>
__global__ void write_factors_kernel(const __grid_constant__ typename Layout::Params p, int seq, int blk0,
                                     const float* __restrict__ a, const float* __restrict__ b) {
  using C = typename F::correction;
  constexpr int B = F::kBlockTokens;
  const int d = p.head_dim, head = blockIdx.y, blk = blk0 + blockIdx.x, r = C::rank(B, d);
  std::byte* dst = F::kSide == Side::kKey ? p.key_block(seq, head, blk) : p.value_block(seq, head, blk);
  auto* f = reinterpret_cast<half_t*>(dst + F::correction_offset(d) + C::outlier_bytes(B, d));
  const std::size_t item = std::size_t(blockIdx.x) * gridDim.y + head;
  for (int i = threadIdx.x; i < B * r; i += blockDim.x) f[i] = half_t::from_float(a[item * B * r + i]);
  for (int i = threadIdx.x; i < d * r; i += blockDim.x) f[B * r + i] = half_t::from_float(b[item * d * r + i]);
}

/// The full-precision slot writes of an append, phase 1: row i of KV head blockIdx.y, both sides, from
/// src[i] (see source_value) into tmp[((i * kv_heads + head) * 2 + side) * d] (blockIdx.x = i). Phase 2
/// (scatter_slots_kernel) stores them into slots dst[i]: a slot may be both read and written (LogWindow's
/// compaction), so every read happens before any write.
template <class Layout>
__global__ void gather_slots_kernel(const __grid_constant__ typename Layout::Params p, int seq,
                                    const int* __restrict__ src, const float* __restrict__ k,
                                    const float* __restrict__ v, float* __restrict__ tmp) {
  const int i = blockIdx.x, head = blockIdx.y, d = p.head_dim;
  float* out = tmp + (std::size_t(i) * p.kv_heads + head) * 2 * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    out[c] = source_value<Layout>(p, Side::kKey, seq, head, src[i], c, k);
    out[d + c] = source_value<Layout>(p, Side::kValue, seq, head, src[i], c, v);
  }
}
template <class Layout>
__global__ void scatter_slots_kernel(const __grid_constant__ typename Layout::Params p, int seq,
                                     const int* __restrict__ dst, const float* __restrict__ tmp) {
  using W = typename Layout::window_t;
  const int i = blockIdx.x, head = blockIdx.y, d = p.head_dim;
  const float* in = tmp + (std::size_t(i) * p.kv_heads + head) * 2 * d;
  W* kr = p.fp_slot_row(Side::kKey, seq, head, dst[i]);
  W* vr = p.fp_slot_row(Side::kValue, seq, head, dst[i]);
  for (int c = threadIdx.x; c < d; c += blockDim.x) {  // exact: the values went through W in phase 1
    kr[c] = StorageTraits<W>::store(in[c]);
    vr[c] = StorageTraits<W>::store(in[d + c]);
  }
}

/// Phase 2 with an AlignedLoader: stores the count gathered rows into slots dst[0, count) of the slot planes of KV
/// head blockIdx.x, both sides (SlotPlanes::set_bits, as the host's store_row). Two elements share each nibble byte
/// (keys: slots 2j, 2j + 1 of one channel; values: channels 2j, 2j + 1 of one slot), so a thread owns a key channel
/// or a value channel pair and walks the slots in order: no byte is written by two threads.
template <class Layout>
__global__ void scatter_slot_planes_kernel(const __grid_constant__ typename Layout::Params p, int seq,
                                           const int* __restrict__ dst, int count, const float* __restrict__ tmp) {
  static_assert(Layout::kAlignedWindow, "kvc::cuda: slot planes exist with an AlignedLoader only");
  const int head = blockIdx.x, d = p.head_dim;
  const kvc::aligned::SlotPlanes kp = p.fp_planes(Side::kKey, seq, head), vp = p.fp_planes(Side::kValue, seq, head);
  auto row = [&](int i) { return tmp + (std::size_t(i) * p.kv_heads + head) * 2 * d; };
  for (int c = threadIdx.x; c < d; c += blockDim.x)  // exact: the values went through fp16 in phase 1
    for (int i = 0; i < count; ++i) kp.set_bits(dst[i], c, half_t::from_float(row(i)[c]).bits);
  for (int j = threadIdx.x; j < d / 2; j += blockDim.x)
    for (int i = 0; i < count; ++i) {
      const float* v = row(i) + d;
      vp.set_bits(dst[i], 2 * j, half_t::from_float(v[2 * j]).bits);
      vp.set_bits(dst[i], 2 * j + 1, half_t::from_float(v[2 * j + 1]).bits);
    }
}

/// PartialLogWindow: quantizes the fp16 value row of slot slots[blockIdx.x] of KV head blockIdx.y into the
/// slot's quantized value row (Layout::value_row_format, the host's quantize_value). Dynamic shared
/// memory: head_dim floats.
template <class Layout>
__global__ void quantize_value_rows_kernel(const __grid_constant__ typename Layout::Params p, int seq,
                                           const int* __restrict__ slots) {
  static_assert(Layout::kQuantizedFpValues, "kvc::cuda: quantized value rows exist with PartialLogWindow only");
  using W = typename Layout::window_t;
  extern __shared__ float row_smem[];
  const int slot = slots[blockIdx.x], head = blockIdx.y, d = p.head_dim;
  const W* v = p.fp_slot_row(Side::kValue, seq, head, slot);
  for (int c = threadIdx.x; c < d; c += blockDim.x) row_smem[c] = StorageTraits<W>::load(v[c]);
  __syncthreads();
  if (threadIdx.x == 0) Layout::value_row_format::quantize(row_smem, d, p.value_row_slot(seq, head, slot));
}

/// y[r] <- R x[r] for the rows r < rows of x ([rows][d] fp32, row r of KV head r % kv_heads) through the
/// keys' (keys) or the values' transform of Rot with one layer's tables: one thread per row (a row's
/// transform is sequential; this runs once per appended token and head).
template <class Rot>
__global__ void rotate_rows_kernel(const float* __restrict__ x, float* __restrict__ y, int rows, int kv_heads, int d,
                                   const std::uint32_t* __restrict__ tables, bool keys) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float* dst = y + std::size_t(r) * d;
  for (int c = 0; c < d; ++c) dst[c] = x[std::size_t(r) * d + c];
  Rot::rotate(keys, tables, r % kv_heads, d, dst);
}

/// first_bad <- min(first_bad, index of the first element of x[0, n) that is not finite or exceeds
/// `limit` in magnitude). first_bad starts at n.
template <class T>
__global__ void scan_inputs_kernel(const T* __restrict__ x, unsigned long long n, float limit,
                                   unsigned long long* first_bad) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    const float v = StorageTraits<T>::load(x[i]);
    if (!(fabsf(v) <= limit)) atomicMin(first_bad, i);  // NaN fails the comparison too
  }
}
}  // namespace kvc::cuda::detail
