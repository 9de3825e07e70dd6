// kvc: nvcc-safe
/// \file aligned_loader.hpp
/// `kvc::AlignedLoader`: AlignedKV's precision-aligned loading of fp16 K/V (SPEC §3; paper:
/// seeds/alignedkv-paper.txt). Not a compressor: K and V stay fp16, stored as three bit planes, and decode
/// attention reads only the leading 8, 12 or 16 bits each element needs.
///
/// Planes (SPEC §3.3) of an fp16 x (bits: sign | 5 exponent | 10 mantissa):
///   hi8 = bits 15..8 (sign, exponent, mantissa[9:8]), mid4 = bits 7..4, lo4 = bits 3..0.
///   tier 16: x;  tier 12: (bits & 0xFFF0) | 0x0008;  tier 8: (bits & 0xFF00) | 0x0080
/// The fill "100..." puts a truncated value at the midpoint of its truncation interval: relative error
/// <= 2^-(m + 1) with m kept mantissa bits (tier 12: 2^-7, tier 8: 2^-3; zeros and subnormals: absolute
/// error <= 2^-17 resp. 2^-21... below fp16's normal range, i.e. at most half the dropped interval).
/// Nibble planes hold two elements per byte: element 2j in the low nibble of byte j, 2j + 1 in the high one
/// (any head_dim % 16 == 0 unpacks 16 elements from 8 bytes).
///
/// Decisions, per decode step (SPEC §3.4-3.5; our choices A1-A5 in the comments):
///  - keys, per channel c (Rule 1): e_h[c] = binade(q_hc) + Kmax[c], Kmax[c] the largest fp16 exponent of
///    |K_tc| over the stream (metadata kept at append); diff[c] = min over the GQA group's query heads h of
///    max_c' e_h[c'] - e_h[c] (the most demanding head wins); tier = diff >= KHi ? 8 : diff >= KLo ? 12 : 16.
///  - values, per token t (Rule 2): per query head, O_est[c] = sum over TopK candidates (the argmax of each
///    strided bucket {t : t mod TopK = j}) of p_t |trunc8(V_tc)|, and ref_h = min_c (binade(O_est[c]) -
///    Vmax[c]); diff_t = min over heads of ref_h - binade(p_ht); tier as for keys with VLo, VHi.
/// binade(x) = floor(log2 |x|); fp16 exponents are the field minus 15 (zero and subnormals: -15, an upper
/// bound, A5); a zero query channel or probability adds nothing, so any tier is exact for it (binade
/// kNoBinade); O_est's binade is clamped below at -24 (fp16's last bit: A4, the alignment reference is
/// fp16's ulp while we accumulate in fp32).
/// BF16 (SPEC A6, not in the paper): not served. A bf16 hi8 byte holds the sign and 7 of its 8 exponent
/// bits, so an 8-bit tier would lose the exponent's last bit (a factor of 2). bf16 needs its own split
/// (sign + exponent + 3 mantissa bits = 12 / 16, or 9 / 12 / 16 across bytes), thresholds and kernels. A
/// window stored in bf16 (or fp32) under the loader fails to compile (cache/policies.hpp).
/// Host+device: the host cache, the CPU attention and the CUDA kernels share this struct.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvc {

namespace aligned {
/// binade() of zero (and of float subnormals): far below every real binade, so a zero addend gets tier 8
/// and never tightens anything.
inline constexpr int kNoBinade = -1000;
/// fp16's last bit, 2^-24: the finest absolute precision a result is aligned to (A4).
inline constexpr int kFp16UlpBinade = -24;

KVC_HOST_DEVICE constexpr std::uint8_t hi8(std::uint16_t bits) noexcept { return std::uint8_t(bits >> 8); }
KVC_HOST_DEVICE constexpr std::uint8_t mid4(std::uint16_t bits) noexcept { return std::uint8_t((bits >> 4) & 0xFu); }
KVC_HOST_DEVICE constexpr std::uint8_t lo4(std::uint16_t bits) noexcept { return std::uint8_t(bits & 0xFu); }
/// The fp16 bits a reader of `tier` (8, 12 or 16) leading bits sees, from the planes' parts.
KVC_HOST_DEVICE constexpr std::uint16_t assemble(std::uint8_t hi, std::uint8_t mid, std::uint8_t lo, int tier) noexcept {
  return std::uint16_t(unsigned(hi) << 8 |
                       (tier == 8 ? 0x80u : (unsigned(mid) << 4 | (tier == 12 ? 0x8u : unsigned(lo)))));
}
/// truncate(bits, tier) == assemble(hi8(bits), mid4(bits), lo4(bits), tier).
KVC_HOST_DEVICE constexpr std::uint16_t truncate(std::uint16_t bits, int tier) noexcept {
  return tier == 16 ? bits : tier == 12 ? std::uint16_t((bits & 0xFFF0u) | 0x0008u) : std::uint16_t((bits & 0xFF00u) | 0x0080u);
}
/// The binade (floor(log2 |x|)) an fp16 exponent field stands for: field - 15; zero and subnormals (field 0)
/// -15, an upper bound (they are < 2^-14).
KVC_HOST_DEVICE constexpr int fp16_binade(int field) noexcept { return field - 15; }
/// The exponent field of an fp16's magnitude (0..30 for finite values).
KVC_HOST_DEVICE constexpr int fp16_field(std::uint16_t bits) noexcept { return int((bits >> 10) & 0x1Fu); }
/// floor(log2 |x|) of a finite float, exact (from its exponent field); kNoBinade for zero and float subnormals.
KVC_HOST_DEVICE int binade(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  const int e = int((u >> 23) & 0xFFu);
  return e == 0 ? kNoBinade : e - 127;
}
/// The tier for a distance of `diff` binades below the reference, thresholds lo <= hi (SPEC §3.4, A1).
KVC_HOST_DEVICE constexpr int tier_for(int diff, int lo, int hi) noexcept { return diff >= hi ? 8 : diff >= lo ? 12 : 16; }
/// Bytes a reader of `tier` loads per element: the hi8 byte, plus half a byte per nibble plane.
KVC_HOST_DEVICE constexpr double tier_bytes(int tier) noexcept { return tier == 8 ? 1.0 : tier == 12 ? 1.5 : 2.0; }

/// What one decode attention over an AlignedKV cache read (optional out-parameter of its decode_attention):
/// the bytes it loaded from the planes, the staging area and the metadata, and the tiers it chose.
struct ReadStats {
  std::size_t key_bytes = 0;       ///< key planes (hi8 of every block, mid4 / lo4 of the channels that needed them)
  std::size_t value_bytes = 0;     ///< value planes (per token row: hi8, plus mid4 / lo4 as its tier asks)
  std::size_t estimate_bytes = 0;  ///< hi8 rows of the value estimate's candidates (Rule 2), per query head
  std::size_t staged_bytes = 0;    ///< fp16 K and V of the staged tokens (read whole)
  std::size_t meta_bytes = 0;      ///< Kmax / Vmax exponents (one byte per channel and side)
  std::size_t other_bytes = 0;     ///< read whole beside the planes (AlignedLoader over a scheme's slots: its
                                   ///< quantized blocks, metadata and corrections); 0 for AlignedKV's own cache
  /// Elements read at tier 8, 12, 16 (index 0, 1, 2): key elements of the blocks, value elements of the rows.
  std::size_t key_tiers[3] = {0, 0, 0}, value_tiers[3] = {0, 0, 0};
  /// Counts n key (value) elements read at `tier` (8, 12, 16): their tier and their nibble planes' bytes, half a
  /// byte per plane, n * (tier - 8) / 8. Their hi8 bytes are the caller's to count: a kernel reads them once for
  /// several purposes (the Kmax / Vmax scans, the value estimate).
  void count_keys(int tier, std::size_t n) noexcept { count(key_tiers, key_bytes, tier, n); }
  void count_values(int tier, std::size_t n) noexcept { count(value_tiers, value_bytes, tier, n); }
  [[nodiscard]] std::size_t total_bytes() const noexcept {
    return key_bytes + value_bytes + estimate_bytes + staged_bytes + meta_bytes + other_bytes;
  }
  /// Average leading bits loaded per planar element (the paper's Fig. 9), keys and values together.
  [[nodiscard]] double average_bits() const noexcept {
    const double n = double(key_tiers[0] + key_tiers[1] + key_tiers[2] + value_tiers[0] + value_tiers[1] + value_tiers[2]);
    return n > 0.0 ? (8.0 * double(key_tiers[0] + value_tiers[0]) + 12.0 * double(key_tiers[1] + value_tiers[1]) +
                      16.0 * double(key_tiers[2] + value_tiers[2])) / n
                   : 0.0;
  }
  ReadStats& operator+=(const ReadStats& o) noexcept {
    key_bytes += o.key_bytes, value_bytes += o.value_bytes, estimate_bytes += o.estimate_bytes;
    staged_bytes += o.staged_bytes, meta_bytes += o.meta_bytes, other_bytes += o.other_bytes;
    for (int i = 0; i < 3; ++i) key_tiers[i] += o.key_tiers[i], value_tiers[i] += o.value_tiers[i];
    return *this;
  }

 private:
  static void count(std::size_t (&tiers)[3], std::size_t& bytes, int tier, std::size_t n) noexcept {
    tiers[(tier - 8) / 4] += n;
    bytes += n * std::size_t(tier - 8) / 8;
  }
};
// The decode kernels carry it through their work items' float results by memcpy.
static_assert(std::is_trivially_copyable_v<ReadStats>, "kvc: aligned::ReadStats must stay trivially copyable");
}  // namespace aligned

/// AlignedKV (SPEC §3): fp16 K/V in bit planes, read at per-element precision by decode attention.
/// \tparam KLo, KHi  key tier thresholds in binades (A1 default 4 / 8: 10 - diff mantissa bits needed)
/// \tparam VLo, VHi  value tier thresholds (default 4 / 8, the principle's; SPEC §3.5 [default])
/// \tparam TopK      strided buckets of the value estimate's approximate top-k (A2 default 32)
/// \tparam Block     tokens per key block (keys channel-major within a block; the newest Block - 1 tokens at
///                   most wait in fp16 staging), a multiple of 16 (SPEC default 64)
/// Thresholds above every possible distance (e.g. 99) force tier 16 on every element but exactly-zero addends
/// (a zero query channel, an underflowed probability), which read hi8 only: they add nothing at any tier.
/// Beside a quantizer and a selector (CompressedKVCache<..., AlignedLoader<...>>, schemes::AlignedWindow) it loads
/// the selector's fp16 slots (aligned/slot_planes.hpp); Block is then unused (the slots go in chunks of the cache's
/// block).
template <int KLo = 4, int KHi = 8, int VLo = 4, int VHi = 8, int TopK = 32, int Block = 64>
struct AlignedLoader {
  static_assert(0 <= KLo && KLo <= KHi && 0 <= VLo && VLo <= VHi,
                "kvc::AlignedLoader: tier thresholds must satisfy 0 <= Lo <= Hi (binades below the reference)");
  static_assert(TopK >= 1, "kvc::AlignedLoader: TopK (strided buckets of the value estimate) must be >= 1");
  static_assert(Block >= 16 && Block <= 1024 && Block % 16 == 0,
                "kvc::AlignedLoader: Block (tokens per key block) must be a multiple of 16 in [16, 1024]");
  using policy_kind = kind::loader;
  static constexpr int kKeyLo = KLo, kKeyHi = KHi, kValueLo = VLo, kValueHi = VHi, kTopK = TopK, kBlock = Block;

  /// Rule 1: the tier of every key channel for one KV head. q: [g][d] the group's query heads (any common
  /// positive scale gives the same binade differences only up to rounding; pass the unscaled query),
  /// kmax[c]: the fp16 exponent field of max_t |K_tc|; tiers[c] out (8, 12 or 16).
  KVC_HOST_DEVICE static void key_tiers(const float* q, int g, int d, const std::uint8_t* kmax, std::uint8_t* tiers) noexcept {
    for (int c = 0; c < d; ++c) tiers[c] = 8;
    for (int h = 0; h < g; ++h) {
      const float* qh = q + std::size_t(h) * d;
      int top = aligned::kNoBinade;
      for (int c = 0; c < d; ++c) {
        const int e = key_binade(qh[c], kmax[c]);
        top = e > top ? e : top;
      }
      if (top == aligned::kNoBinade) continue;  // a zero query head needs nothing
      for (int c = 0; c < d; ++c) {
        const int t = aligned::tier_for(top - key_binade(qh[c], kmax[c]), KLo, KHi);
        tiers[c] = std::uint8_t(t > tiers[c] ? t : tiers[c]);
      }
    }
  }
  /// binade of the addend bound |q_c| max_t |K_tc| (kNoBinade for a zero q_c).
  KVC_HOST_DEVICE static int key_binade(float qc, std::uint8_t kmax) noexcept {
    const int b = aligned::binade(qc);
    return b == aligned::kNoBinade ? b : b + aligned::fp16_binade(kmax);
  }

  /// Rule 2's reference of one query head: min_c (binade(O_est[c]) - Vmax[c]), O_est [d] the head's output
  /// estimate, vmax[c] the fp16 exponent field of max_t |V_tc|. A token's distance is then ref - binade(p_t).
  KVC_HOST_DEVICE static int value_reference(const float* o_est, int d, const std::uint8_t* vmax) noexcept {
    int ref = 1 << 20;
    for (int c = 0; c < d; ++c) {
      int b = aligned::binade(o_est[c]);
      b = b < aligned::kFp16UlpBinade ? aligned::kFp16UlpBinade : b;
      const int r = b - aligned::fp16_binade(vmax[c]);
      ref = r < ref ? r : ref;
    }
    return ref;
  }
  /// The tier of a value row whose probabilities under the group's heads are p[h * stride] (h < g), against the
  /// heads' references ref[h]: the most demanding head wins. A zero probability adds nothing (no constraint).
  KVC_HOST_DEVICE static int value_tier(const float* p, std::size_t stride, int g, const int* ref) noexcept {
    int tier = 8;
    for (int h = 0; h < g; ++h) {
      const int b = aligned::binade(p[std::size_t(h) * stride]);
      if (b == aligned::kNoBinade) continue;
      const int t = aligned::tier_for(ref[h] - b, VLo, VHi);
      tier = t > tier ? t : tier;
    }
    return tier;
  }
  /// value_tier as multiplications (what the kernels vectorise): with m_X = max over heads h of p_h *
  /// value_scale(ref[h], VX), value_tier == (m_Lo >= 1 ? 16 : m_Hi >= 1 ? 12 : 8) for probabilities p in [0, 1].
  /// value_scale(ref, lo) = 2^-x, x = ref - lo + 1 the lowest binade of p that needs more than that threshold's
  /// tier (binade(p) >= x <=> p >= 2^x for normal p); x <= -126: 2^126 (every normal p qualifies, zero and float
  /// subnormals, binade kNoBinade, never do); x >= 127: 0 (no p <= 1 qualifies). Exact: scaling by 2^k is.
  KVC_HOST_DEVICE static float value_scale(int ref, int lo) noexcept {
    const int x = ref - lo + 1;
    if (x >= 127) return 0.0f;
    const std::uint32_t u = std::uint32_t(127 - (x < -126 ? -126 : x)) << 23;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  /// The tier value_scale's multiplications decide: m_lo, m_hi the max over the group's heads of p_h *
  /// value_scale(ref_h, VLo), p_h * value_scale(ref_h, VHi). Branch-free (m_lo >= 1 implies m_hi >= 1: VLo <= VHi).
  KVC_HOST_DEVICE static constexpr int scaled_value_tier(float m_lo, float m_hi) noexcept {
    return 8 + 4 * int(m_hi >= 1.0f) + 4 * int(m_lo >= 1.0f);
  }
  /// Rule 2's reference of one query head from its probabilities p[0, T): the output estimate O_est[c] = sum over
  /// the TopK candidates (top_candidates) of p_t |V_tc| read at tier 8, then value_reference. tier8_bits(t, c)
  /// gives V_tc's fp16 bits at tier 8 (only its hi8 byte is read); est: [d] scratch. The kernels and the
  /// measurements that model them call this one function.
  template <class Tier8Bits>
  KVC_HOST_DEVICE static int estimate_reference(const float* p, int T, int d, const std::uint8_t* vmax,
                                                Tier8Bits&& tier8_bits, float* est) noexcept {
    int cand[TopK];
    const int k = top_candidates(p, T, cand);
    for (int c = 0; c < d; ++c) est[c] = 0.0f;
    for (int i = 0; i < k; ++i)
      for (int c = 0; c < d; ++c) est[c] += p[cand[i]] * std::fabs(detail::half_bits_to_float(tier8_bits(cand[i], c)));
    return value_reference(est, d, vmax);
  }
  /// The approximate top-k of SPEC §3.5 (A2): for each of the min(TopK, T) strided buckets {t : t mod TopK = j},
  /// the index of its largest p (the first on ties). cand: [min(TopK, T)]; returns their count.
  KVC_HOST_DEVICE static int top_candidates(const float* p, int T, int* cand) noexcept {
    const int k = T < TopK ? T : TopK;
    for (int j = 0; j < k; ++j) cand[j] = j;
    for (int t = k, j = 0; t < T; ++t, j = j + 1 == TopK ? 0 : j + 1)  // one forward pass, j = t mod TopK
      cand[j] = p[t] > p[cand[j]] ? t : cand[j];
    return k;
  }
};
}  // namespace kvc
