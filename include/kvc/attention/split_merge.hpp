// kvc: nvcc-safe
/// \file split_merge.hpp
/// Flash-decoding bookkeeping shared by the CPU and CUDA decode attention (host+device):
///  - a split of one stream's tokens ends in a partial softmax state per query head: m, the running
///    max of its base-2 scores; l, the sum of 2^(s - m); acc, the unnormalised output sum_t 2^(s_t - m) v_t;
///  - splits merge exactly: O = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i with M = max_i m_i;
///    an empty split (m = -inf, l = 0) has weight 0;
///  - the CUDA kernels cut a stream's quantized blocks into `splits` ranges of `blocks_per_split`
///    (plan_splits / split_blocks), the sink and the full-precision tail going to split 0.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/numeric.hpp>

#include <cmath>
#include <cstddef>

namespace kvc {

/// -inf as a host+device constant (numeric_limits is not usable in device code without
/// --expt-relaxed-constexpr).
KVC_HOST_DEVICE float neg_inf() noexcept { return detail::bits_float(0xFF800000u); }

/// 2^x: the device's exp2f, std::exp2 on the host.
KVC_HOST_DEVICE float exp2_hd(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  return std::exp2(x);
#endif
}

/// Weight 2^(m_i - M) of a split in the merge; 0 for an empty split (m_i = -inf).
KVC_HOST_DEVICE float split_weight(float m_i, float M) noexcept {
  return m_i > neg_inf() ? exp2_hd(m_i - M) : 0.0f;
}

/// The merge of n partial states, in two steps so that each 2^(m_i - M) is computed once per row:
/// merge_weights writes w[i] = 2^(m_i - M) (m_i at m[i * sml], l_i at l[i * sml]) and returns
/// 1 / sum_i w_i l_i; merge_apply writes out[c] = (sum_i w_i acc_i[c]) * that, acc_i at acc + i * sacc,
/// for c in [0, d). At least one split must be non-empty. merge_apply's cooperative form: (lane, lanes)
/// writes channels lane, lane + lanes, ...
KVC_HOST_DEVICE float merge_weights(int n, const float* m, const float* l, std::ptrdiff_t sml, float* w) noexcept {
  float M = neg_inf();
  for (int i = 0; i < n; ++i) M = m[i * sml] > M ? m[i * sml] : M;
  float L = 0.0f;
  for (int i = 0; i < n; ++i) {
    w[i] = split_weight(m[i * sml], M);
    L += w[i] * l[i * sml];
  }
  return 1.0f / L;
}
template <class Out>
KVC_HOST_DEVICE void merge_apply(int n, const float* w, float inv, const float* acc, std::ptrdiff_t sacc, int d, Out* out,
                                 int lane = 0, int lanes = 1) noexcept {
  for (int c = lane; c < d; c += lanes) {
    float o = 0.0f;
    for (int i = 0; i < n; ++i) o += w[i] * acc[i * sacc + c];
    out[c] = StorageTraits<Out>::store(o * inv);
  }
}

/// How the CUDA kernels cut every stream of a batch into splits of whole blocks.
struct SplitPlan {
  int splits = 1;            ///< splits per stream (the grid's x extent)
  int blocks_per_split = 1;  ///< quantized blocks per split (the last non-empty split may hold fewer)
};

/// A plan for `items` (sequence, KV head, head chunk) work items whose longest stream holds
/// `max_blocks` quantized blocks: enough splits for about `target_ctas` CTAs, none with fewer than
/// `min_blocks_per_split` blocks (unless the stream has fewer), and no empty trailing split in the
/// longest stream. Host+device; every argument >= 0, min_blocks_per_split >= 1.
KVC_HOST_DEVICE SplitPlan plan_splits(int max_blocks, int items, int target_ctas, int min_blocks_per_split) noexcept {
  const int want = items >= target_ctas ? 1 : (target_ctas + items - 1) / (items > 0 ? items : 1);
  const int most = max_blocks / min_blocks_per_split;
  int splits = want < most ? want : most;
  if (splits < 1) splits = 1;
  const int bps = max_blocks > 0 ? (max_blocks + splits - 1) / splits : 1;
  return {max_blocks > 0 ? (max_blocks + bps - 1) / bps : 1, bps};
}

/// Blocks [*b0, *b1) of split `split` of a stream with `blocks` quantized blocks (empty past its end).
KVC_HOST_DEVICE void split_blocks(SplitPlan plan, int split, int blocks, int* b0, int* b1) noexcept {
  const int lo = split * plan.blocks_per_split, hi = lo + plan.blocks_per_split;
  *b0 = lo < blocks ? lo : blocks;
  *b1 = hi < blocks ? hi : blocks;
}
}  // namespace kvc
