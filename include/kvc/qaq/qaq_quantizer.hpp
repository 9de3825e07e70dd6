// kvc: nvcc-safe
/// \file qaq_quantizer.hpp
/// `kvc::QaqQuantizer`: QAQ's per-token adaptive-width quantizer (SPEC §2; paper: seeds/qaq-paper.txt).
///
/// One side (keys or values) of one (layer, KV head, token) is quantized on its own:
///  - outliers (SPEC §2.5, [code]): the k smallest and the k largest of the d values, k = ceil(alpha/2 * d)
///    with alpha = OutlierPermille / 1000 the total fraction (d = 64 or 128 at 1 %: k = 1), stay exact
///    (fp16 value and uint8 channel); ties go to the lower channel;
///  - the rest: the midpoint codec (SPEC Q-B) over [lo, hi] of the non-outliers, codes
///    floor((x - lo) / step_b) and x^ = lo + (code + 1/2) step_b.
/// Width nesting (our choice, SPEC §2.6 leaves it open): the step at width b is step_max * 2^(B_max - b),
/// step_max = (hi - lo) / 2^B_max rounded up to fp16. So the width-b code is the B_max code >> (B_max - b)
/// exactly, for every range (fp16-subnormal steps included): lowering a width is a shift of the stored
/// codes, and re-quantizing the original (the mirror) at any width gives the same codes as lowering.
/// The per-token metadata (lo, step_max) and the outliers do not depend on the width; how a record stores the
/// metadata is `Meta` (qaq/meta_format.hpp: two fp16 by default, or LogMeta's 2 bytes, whose codec snaps
/// (lo, step_max) to its grid before encoding).
/// Error bound: |x - x^| <= step_b / 2 for every non-outlier; outliers are exact.
/// The width decisions use range_bound = step_max * 2^B_max (>= hi - lo, within one fp16 rounding), which
/// the stored metadata gives back.
/// Host+device: the host cache, the CPU attention and the CUDA kernels share this struct.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/meta_format.hpp>
#include <kvc/quant/codec.hpp>

#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace kvc {

/// QAQ (SPEC §2): per-token widths in [BMin, BMax], recomputed every decode step from the error targets.
/// \tparam BMin, BMax       width range (SPEC Q2 default [1, 8]; 1 <= BMin <= BMax <= 8)
/// \tparam OutlierPermille  alpha in 1/1000, the total over both ends (paper: 1 % = 10; 0 disables outliers)
/// \tparam Window           n, the attention window of S^_t (paper: 5; 1 = the current probability)
/// \tparam Bounds           the error model (qaq::PaperBounds)
/// \tparam Meta             how a record stores (lo, step_max): qaq::Fp16Meta (4 bytes) or qaq::LogMeta (2 bytes)
template <int BMin = 1, int BMax = 8, int OutlierPermille = 10, int Window = 5, class Bounds = qaq::PaperBounds,
          class Meta = qaq::Fp16Meta>
struct QaqQuantizer {
  static_assert(BMin >= 1 && BMin <= BMax && BMax <= 8, "kvc::QaqQuantizer: widths must satisfy 1 <= BMin <= BMax <= 8");
  static_assert(OutlierPermille >= 0 && OutlierPermille <= 500,
                "kvc::QaqQuantizer: OutlierPermille (alpha, total over both ends) must be in [0, 500]");
  static_assert(Window >= 1 && Window <= 7, "kvc::QaqQuantizer: the attention window n must be in [1, 7]");
  using policy_kind = kind::adaptive_quantizer;
  using meta_format = Meta;
  using codec = typename Meta::codec;
  static_assert(std::is_base_of_v<MidpointCodec, codec>,
                "kvc::QaqQuantizer: the metadata format's codec must be the midpoint codec (its codes nest across widths)");
  using bounds = Bounds;
  using history = qaq::AttentionHistory<Window>;
  static constexpr int kMinBits = BMin;
  static constexpr int kMaxBits = BMax;
  static constexpr int kOutlierPermille = OutlierPermille;
  static constexpr int kWindow = Window;
  static constexpr int kMaxHeadDim = 256;  ///< outlier channels are uint8
  static constexpr const char* name() noexcept { return "qaq"; }
  KVC_HOST_DEVICE static constexpr qaq::WidthRange widths() noexcept { return {BMin, BMax}; }

  /// k: outliers at each end of a token's d values.
  KVC_HOST_DEVICE static constexpr int outliers_per_end(int d) noexcept { return (OutlierPermille * d + 1999) / 2000; }
  KVC_HOST_DEVICE static constexpr int outliers(int d) noexcept { return 2 * outliers_per_end(d); }

  /// Quantizes x[0, d) (d <= kMaxHeadDim; values representable in fp16: the mirror's): codes[c] = the B_max
  /// code of every channel (outliers too, clamped; reconstruction replaces them), out_idx/out_val[0, outliers(d))
  /// the outliers (the k smallest ascending, then the k largest descending). Returns (lo, step_max).
  KVC_HOST_DEVICE static QuantMeta quantize(const float* x, int d, std::uint8_t* codes, std::uint8_t* out_idx,
                                            half_t* out_val) noexcept {
    std::uint32_t taken[kMaxHeadDim / 32] = {};
    select_outliers(x, d, out_idx, out_val, taken);
    return quantize_group_masked<codec>(
        1, d, BMax, [&](int, int c) { return x[c]; }, [&](int, int c, std::uint8_t q) { codes[c] = q; },
        [&](int, int c) { return !((taken[c >> 5] >> (c & 31)) & 1u); });
  }
  /// The outliers of x[0, d) alone (as quantize picks them), their channels also set in the bit mask
  /// taken[kMaxHeadDim / 32] (zeroed by the caller).
  KVC_HOST_DEVICE static void select_outliers(const float* x, int d, std::uint8_t* out_idx, half_t* out_val,
                                              std::uint32_t* taken) noexcept {
    auto is_taken = [&](int c) { return (taken[c >> 5] >> (c & 31)) & 1u; };
    const int k = outliers_per_end(d);
    for (int j = 0; j < 2 * k; ++j) {
      // the first smallest (largest) untaken value; the running extreme stays in a register, so the scan is
      // not a chain of dependent loads through `best`
      int best = -1;
      float bv = 0.0f;
      if (j < k) {
        for (int c = 0; c < d; ++c)
          if (!is_taken(c) && (best < 0 || x[c] < bv)) best = c, bv = x[c];
      } else {
        for (int c = 0; c < d; ++c)
          if (!is_taken(c) && (best < 0 || x[c] > bv)) best = c, bv = x[c];
      }
      taken[best >> 5] |= 1u << (best & 31);
      out_idx[j] = static_cast<std::uint8_t>(best);
      out_val[j] = half_t::from_float(bv);
    }
  }
  /// The codec over all d values, no outliers (a rotated residual whose outliers were taken before the
  /// rotation: qaq_cache.hpp). Returns (lo, step_max).
  KVC_HOST_DEVICE static QuantMeta quantize_all(const float* x, int d, std::uint8_t* codes) noexcept {
    return quantize_group<codec>(1, d, BMax, [&](int, int c) { return x[c]; },
                                 [&](int, int c, std::uint8_t q) { codes[c] = q; });
  }

  /// Step at width b (exact: a power-of-two scaling of an fp16 value).
  KVC_HOST_DEVICE static float step(QuantMeta m, int b) noexcept {
    return m.step.to_float() * float(1u << (BMax - b));
  }
  /// x^ = zero + scale * code_b at width b.
  KVC_HOST_DEVICE static Affine affine(QuantMeta m, int b) noexcept { return affine(m.lo.to_float(), m.step.to_float(), b); }
  /// The same from the metadata already converted to float (kernels that convert fp16 in bulk).
  KVC_HOST_DEVICE static Affine affine(float lo, float step_max, int b) noexcept {
    const float w = step_max * float(1u << (BMax - b));
    return {lo + codec::kZeroOffset * w, w};
  }
  /// The width-b code of a B_max code (or of a wider code `from`).
  KVC_HOST_DEVICE static std::uint8_t narrow(std::uint8_t code, int b, int from = BMax) noexcept {
    return static_cast<std::uint8_t>(code >> (from - b));
  }
  /// Upper bound on the non-outliers' range that the metadata gives back (the width rule's range_t).
  KVC_HOST_DEVICE static double range_bound(QuantMeta m) noexcept { return range_bound(m.step.to_float()); }
  /// range_bound of a step_max already widened to float.
  KVC_HOST_DEVICE static double range_bound(float step_max) noexcept { return double(step_max) * double(1u << BMax); }
  /// The width the step's `rule` gives a token with history `hist` and metadata m (keys: `key`): B_max until
  /// the history holds n observations (SPEC §2.4 [code]). The device update uses it; the host cache uses
  /// StepLimits, equal to it (key_width / value_width are its two halves).
  KVC_HOST_DEVICE static int width(const history& hist, QuantMeta m, const qaq::StepWidths<Bounds>& rule,
                                   bool key) noexcept {
    return key ? key_width(hist.full(), range_bound(m), rule) : value_width(hist, range_bound(m), rule);
  }
  /// A key's width: it needs of its history only whether it is full.
  KVC_HOST_DEVICE static int key_width(bool full, double range, const qaq::StepWidths<Bounds>& rule) noexcept {
    return full ? rule.key(range) : BMax;
  }
  KVC_HOST_DEVICE static int value_width(const history& hist, double range, const qaq::StepWidths<Bounds>& rule) noexcept {
    return hist.full() ? rule.value(range, hist.s_hat_code()) : BMax;
  }
  /// One step's width rule as limits on the fp16 bits of step_max (host): a full history's width is
  /// BMin + #{b in [BMin, BMax) : step_max bits > limit[b]}, limit[b] the largest step_max (bits) that the rule
  /// puts at width <= b (-1: none). Exact, not an approximation: the rule is non-decreasing in step_max (a
  /// division by a positive denominator, then ceil(log2)), non-negative fp16 values order as their bits, and
  /// each limit is found by evaluating the rule itself (a bisection bracketed around step_max ~
  /// denominator 2^(b - BMax)): key() and value() equal key_width / value_width for every finite step_max >= 0
  /// (tested over every fp16 step and code); other bits take the rule directly. Value limits are built per
  /// probability code on first use. Replaces a double division and its guards per record with 7 integer
  /// compares.
  class StepLimits {
   public:
    explicit StepLimits(const qaq::StepWidths<Bounds>& rule) : rule_(&rule) {
      key_ = limits([&](double range) { return rule.key(range); }, rule.key_denom);
    }
    /// The width of a key with a full history and step_max bits `step` (key_width).
    [[nodiscard]] int key(std::uint16_t step) const noexcept {
      return step <= kMaxFinite ? count(key_, step) : rule_->key(range_bound(half_t{step}.to_float()));
    }
    /// The width of a value with a full history, S^ code `code` and step_max bits `step` (value_width).
    [[nodiscard]] int value(std::uint16_t step, std::uint8_t code) {
      if (step > kMaxFinite) return rule_->value(range_bound(half_t{step}.to_float()), code);
      if (!built_[code]) {
        value_[code] = limits([&](double range) { return rule_->value(range, code); }, rule_->value_denom[code]);
        built_[code] = true;
      }
      return count(value_[code], step);
    }

    static constexpr int kLanes = 8;  // >= BMax - BMin; spare lanes never count
    using Limits = std::array<std::int16_t, kLanes>;
    /// The key limits: two steps whose key limits are equal give every key with finite step_max bits the same
    /// width (the host cache then re-decides only the keys whose histories became full).
    [[nodiscard]] const Limits& key_limits() const noexcept { return key_; }

   private:
    static constexpr std::uint16_t kMaxFinite = 0x7bff;  // largest finite fp16 bits (65504)
    static int count(const Limits& lim, std::uint16_t step) noexcept {
#if KVC_QAQ_SSE2_  // the 8 compares as one (the limits do not decrease with the width: true lanes first)
      return BMin + detail::leading_ones_lanes16(_mm_cmpgt_epi16(
                        _mm_set1_epi16(std::int16_t(step)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(lim.data()))));
#else
      int w = BMin;
      for (int j = 0; j < kLanes; ++j) w += int(std::int16_t(step) > lim[std::size_t(j)]);
      return w;
#endif
    }
    /// The limits of `rule` (range -> width); `denom` its denominator, a hint: widths change near step_max =
    /// denom 2^(b - BMax), and the bisection, not the hint, decides.
    template <class Rule>
    static Limits limits(Rule&& rule, double denom) {
      auto width = [&](int bits) { return rule(range_bound(half_t{std::uint16_t(bits)}.to_float())); };
      Limits lim;
      lim.fill(std::numeric_limits<std::int16_t>::max());
      for (int b = BMin; b < BMax; ++b) {
        // largest bits in [0, kMaxFinite] with width <= b: lo satisfies it, hi does not (or is past the end)
        int lo = -1, hi = kMaxFinite + 1;
        const double guess = denom * double(1u << b) / double(1u << BMax);
        if (guess > 0.0 && guess < double(half_t::kMax)) {  // bracket the crossing, then bisect
          const int c = half_t::from_float(float(guess)).bits;
          if (c - 2 >= 0 && width(c - 2) <= b) lo = c - 2;
          if (c + 2 <= kMaxFinite && width(c + 2) > b) hi = c + 2;
        }
        if (lo < 0 && width(0) <= b) lo = 0;
        if (lo >= 0)
          while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            (width(mid) <= b ? lo : hi) = mid;
          }
        lim[std::size_t(b - BMin)] = std::int16_t(lo);
      }
      return lim;
    }
    const qaq::StepWidths<Bounds>* rule_;
    Limits key_;
    std::array<Limits, 256> value_;
    std::array<bool, 256> built_{};
  };

  /// Reconstruction of channel c from its width-b code (outliers not applied).
  KVC_HOST_DEVICE static float decode(QuantMeta m, int b, std::uint8_t code_b) noexcept {
    const Affine a = affine(m, b);
    return mul_add_rounded(a.scale, static_cast<float>(code_b), a.zero);
  }
  /// Reconstruction of a whole token, x[0, d), from width-b codes codes_b[c] and its outliers.
  KVC_HOST_DEVICE static void decode_token(QuantMeta m, int b, const std::uint8_t* codes_b, const std::uint8_t* out_idx,
                                           const half_t* out_val, int d, float* x) noexcept {
    for (int c = 0; c < d; ++c) x[c] = decode(m, b, codes_b[c]);
    for (int j = 0; j < outliers(d); ++j) x[out_idx[j]] = out_val[j].to_float();
  }
};
}  // namespace kvc
