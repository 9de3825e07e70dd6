// kvc: nvcc-safe
/// \file policies.hpp
/// The runtime shape of a cache (`CacheConfig`) and the compile-time resolution of a `Policy...` pack
/// (quantizers per side, selector, block size, GEAR's corrections), shared by the host container
/// `CompressedKVCache` and the device container `kvc::cuda::DeviceKVCache`, so both compose the same
/// policies into the same `CacheLayout` and reject the same combinations with the same messages.
#pragma once

#include <kvc/config.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>
#include <kvc/gear/block_correction.hpp>
#include <kvc/gear/literal_mode.hpp>
#include <kvc/quant/no_quantizer.hpp>
#include <kvc/rotate/rotation.hpp>
#include <kvc/select/full_precision_window.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvc {

/// Runtime shape of a cache. `capacity` is the most tokens one sequence may hold.
struct CacheConfig {
  int layers = 1;
  int batch = 1;  ///< sequences
  int kv_heads = 0;
  int head_dim = 0;
  int capacity = 0;
};

namespace detail {
template <class... P>
struct resolve_policies {
  static constexpr bool kOk = check_policies<P...>::kOk;
  using bare = typename find_policy<kind::quantizer, void, P...>::type;
  static constexpr bool kHasBare = !std::is_void_v<bare>;
  using key_q = std::conditional_t<kHasBare, bare,
                                   typename find_policy<kind::key_quantizer, keys<NoQuantizer<half_t>>, P...>::type::type>;
  using value_q =
      std::conditional_t<kHasBare, bare,
                         typename find_policy<kind::value_quantizer, values<NoQuantizer<half_t>>, P...>::type::type>;

  template <class Q>
  static constexpr int identity_width() {
    if constexpr (Q::kIsIdentity) return static_cast<int>(sizeof(typename Q::storage));
    else return 2;
  }
  template <class Q>
  using storage_of = std::conditional_t<Q::kIsIdentity, typename identity_storage<Q>::type, half_t>;
  // Default selector: no window, stored like the identity side(s): an fp32 cache keeps its tail in
  // fp32, a bf16 cache in bf16; mixed 16-bit storages fall back to fp32, quantized sides to fp16.
  using default_window_storage =
      std::conditional_t<(identity_width<key_q>() > 2 || identity_width<value_q>() > 2 ||
                          !std::is_same_v<storage_of<key_q>, storage_of<value_q>>),
                         float, storage_of<key_q>>;
  /// Whether the window storage holds every value of an identity side exactly.
  template <class Q, class W>
  static constexpr bool window_holds() {
    if constexpr (!Q::kIsIdentity) return true;
    else return std::is_same_v<W, float> || std::is_same_v<W, typename Q::storage>;
  }
  using selector = typename find_policy<kind::selector, FullPrecisionWindow<0, 0, default_window_storage>, P...>::type;

  static constexpr int kRequired = key_q::kRequiredBlockTokens != 0 ? key_q::kRequiredBlockTokens
                                                                     : value_q::kRequiredBlockTokens;
  using block = typename find_policy<kind::block_layout, BlockTokens<kRequired != 0 ? kRequired : 32>, P...>::type;

  // GEAR's corrections (void when absent), applied to every quantized side. Block-scope outliers
  // and the residual live in each block's correction region; stream-scope outliers in a side table.
  using outliers = typename find_policy<kind::outlier_filter, void, P...>::type;
  using residual = typename find_policy<kind::residual, void, P...>::type;
  using streaming = typename find_policy<kind::streaming, void, P...>::type;  // void: block mode
  static constexpr bool kCorrected = !std::is_void_v<outliers> || !std::is_void_v<residual>;
  static constexpr bool kStreamScope = [] {
    if constexpr (std::is_void_v<outliers>) return false;
    else if constexpr (requires { outliers::kStreamScope; }) return bool(outliers::kStreamScope);
    else return false;
  }();
  using block_outliers = std::conditional_t<kStreamScope, void, outliers>;
  using stream_outliers = std::conditional_t<kStreamScope, outliers, void>;
  template <bool Keys>
  static constexpr bool block_corrected() {
    if constexpr (!std::is_void_v<residual>) return true;
    else if constexpr (std::is_void_v<block_outliers>) return false;
    else return block_outliers::on(Keys);
  }
  template <class Q, bool Keys>
  using correction_of = std::conditional_t<block_corrected<Keys>() && !Q::kIsIdentity,
                                           BlockCorrection<block_outliers, residual, Keys>, NoCorrection>;
  using key_corr = correction_of<key_q, true>;
  using value_corr = correction_of<value_q, false>;
  using rotation = typename find_policy<kind::rotation, NoRotation, P...>::type;  // NoRotation: none
  using loader = typename find_policy<kind::loader, void, P...>::type;  // void: fp rows
};

/// The checks every cache composition passes (the static_asserts read as the error messages).
template <class... P>
struct cache_checks {
  using R = resolve_policies<P...>;
  static_assert(R::kOk);  // the messages come from detail::check_policies
  static_assert(std::is_void_v<typename R::outliers> || requires { R::outliers::per_side(1); },
                "kvc: the outlier-filter policy must be kvc::OutlierFilter<s> (or provide its interface)");
  static_assert(std::is_void_v<typename R::residual> || requires { R::residual::rank(true, 1, 1); },
                "kvc: the residual policy must be kvc::LowRankResidual<...> (or provide its interface)");
  static_assert(!R::kCorrected || !(R::key_q::kIsIdentity && R::value_q::kIsIdentity),
                "kvc: OutlierFilter / LowRankResidual correct a quantized backbone; this cache quantizes neither "
                "keys nor values");
  static_assert(Selector<typename R::selector>,
                "kvc: the selector policy must provide the selector interface (quantized_blocks, capacity_blocks, "
                "fp_slots, fp_slot, positions, append_token: see kvc::FullPrecisionWindow, kvc::LogWindow)");
  static constexpr bool kQuantizedFpValues = selector_quantizes_values<typename R::selector>();
  static_assert(!kQuantizedFpValues || (!R::value_q::kIsIdentity && R::value_q::kGroupTokens == 1),
                "kvc::PartialLogWindow quantizes a value on its own when it leaves the value window: the value "
                "quantizer must group per token (e.g. values<GroupQuantizer<2, 64, Axis::kToken>>), not per channel "
                "or identity");
  static_assert(!kQuantizedFpValues || (std::is_same_v<typename R::value_corr, NoCorrection> && !R::kStreamScope &&
                                        std::is_void_v<typename R::streaming>),
                "kvc::PartialLogWindow: GEAR's corrections and LiteralMode need each value's exact row when its "
                "block is compressed; correct keys only (OutlierFilter on keys) or use LogWindow");
  static_assert(detail::count_kind<kind::adaptive_quantizer, P...> == 0,
                "kvc::QaqQuantizer gives every token its own width, changed every step: its cache is "
                "CompressedKVCache<QaqQuantizer<...>> (mixed-bit buckets, <kvc/qaq/qaq_cache.hpp>), first, with at most "
                "a Rotation<...> after it: no selector, block size, second quantizer or GEAR correction");
  // AlignedLoader beside other policies loads the selector's full-precision slots (aligned/slot_planes.hpp);
  // alone it is AlignedKV's own cache (<kvc/aligned/aligned_cache.hpp>, a specialisation).
  static_assert(std::is_void_v<typename R::loader> || requires(const float* f, const std::uint8_t* b, std::uint8_t* t) {
                  R::loader::key_tiers(f, 1, 1, b, t);
                  R::loader::value_tier(f, std::size_t(1), 1, static_cast<const int*>(nullptr));
                  R::loader::kTopK;
                },
                "kvc: the loader policy must be kvc::AlignedLoader<...> (or provide its interface: key_tiers, "
                "estimate_reference, value_tier)");
  static_assert(std::is_void_v<typename R::loader> || std::is_same_v<typename R::selector::storage, half_t>,
                "kvc::AlignedLoader splits fp16 bit patterns: the full-precision window it loads must be stored in "
                "fp16 (FullPrecisionWindow<Recent, Sink, half_t>, LogWindow<..., half_t>: the default storage)");
  static_assert(std::is_void_v<typename R::loader> || !kQuantizedFpValues,
                "kvc::AlignedLoader loads exact fp16 slots; kvc::PartialLogWindow keeps some of its values as "
                "quantized rows: use LogWindow (LogQuant) or FullPrecisionWindow (KIVI) with the loader");
  static_assert(std::is_void_v<typename R::loader> || !(R::key_q::kIsIdentity && R::value_q::kIsIdentity),
                "kvc::AlignedLoader over a cache that quantizes nothing: use CompressedKVCache<AlignedLoader<...>> "
                "(<kvc/aligned/aligned_cache.hpp>), AlignedKV's own cache");
  static_assert(requires(const std::uint32_t* t, float* x) {
                  R::rotation::head_words(1);
                  R::rotation::make_tables(1, 1, 1, nullptr);
                  R::rotation::rotate(true, t, 0, 1, x);
                },
                "kvc: the rotation policy must be kvc::Rotation<KeyTransform, ValueTransform> (e.g. "
                "kvc::Rotation<kvc::Hadamard<>>, kvc::RotateKeys<kvc::Hadamard<>>)");
  static_assert(std::is_void_v<typename R::streaming> || std::is_same_v<typename R::streaming, LiteralMode>,
                "kvc: the streaming policy must be kvc::LiteralMode (block mode is the default: no policy)");
  static_assert(std::is_void_v<typename R::streaming> || R::kCorrected,
                "kvc::LiteralMode recompresses GEAR's corrections: add kvc::OutlierFilter and/or "
                "kvc::LowRankResidual");
  static_assert(masked_rows<typename R::selector>() < R::block::kTokens,
                "kvc::AlignedSinkWindow<Recent, Sink>: the sink sits in block 0, so Sink must be smaller than the "
                "block (BlockTokens<B>)");
  static_assert(masked_rows<typename R::selector>() == 0 || std::is_void_v<typename R::streaming>,
                "kvc::AlignedSinkWindow: LiteralMode recompresses the whole history without block 0's row mask; "
                "use block mode or FullPrecisionWindow<Recent, Sink>");
  static_assert(!R::kStreamScope || !std::is_void_v<typename R::streaming>,
                "kvc: OutlierScope::kStream selects outliers over the whole history, which only kvc::LiteralMode "
                "recompresses; block mode compresses each block once (use OutlierScope::kBlock)");

  static constexpr bool kOk = true;
};

/// CacheRules::rotated_input's default hook: rows are rotated as given.
struct NoPreRotation {
  void operator()(int, int, float*) const noexcept {}
};

/// The runtime rules of a cache of layout L, shared by the host and device containers (host code):
/// config validation, the input range, and the checks an append makes before it writes anything.
template <class L>
struct CacheRules {
  using KF = typename L::key_format;
  using VF = typename L::value_format;
  static constexpr bool kCorrected = KF::kCorrected || VF::kCorrected || L::kStreamOutliers;

  /// Validates `cfg` (throws kvc::Error) and returns the quantized blocks a stream can hold.
  static int validate(const CacheConfig& cfg) {
    KVC_CHECK(cfg.layers > 0 && cfg.batch > 0 && cfg.kv_heads > 0 && cfg.head_dim > 0 && cfg.capacity > 0,
              Errc::kInvalidArgument, "cache config needs positive layers, batch, kv_heads, head_dim and capacity (got ",
              cfg.layers, ", ", cfg.batch, ", ", cfg.kv_heads, ", ", cfg.head_dim, ", ", cfg.capacity, ")");
    KVC_CHECK(cfg.head_dim % 16 == 0, Errc::kInvalidArgument, "head_dim ", cfg.head_dim, " is not a multiple of 16");
    check_groups<typename KF::quantizer>(cfg, "key");
    check_groups<typename VF::quantizer>(cfg, "value");
    check_correction<KF>(cfg, "key");
    check_correction<VF>(cfg, "value");
    check_rotation(cfg);
    return L::selector::capacity_blocks(cfg.capacity, L::kBlockTokens);
  }
  /// Rejects a head_dim the rotation's transform cannot serve (also QAQ's caches, whose own setup checks the rest).
  static void check_rotation(const CacheConfig& cfg) {
    KVC_CHECK(L::rotation::supports(cfg.head_dim), Errc::kInvalidArgument, "the rotation's transform does not serve head_dim ",
              cfg.head_dim, " (kvc::Hadamard: head_dim / its largest power-of-two factor must be <= 64)");
  }

  /// Largest |x| an input may hold: the window storage's range, and for quantized sides what fp16
  /// metadata can span (1-bit endpoint steps equal the whole range, so half of it). With GEAR's
  /// corrections, half of that again: an outlier stores x - x^ in fp16, up to twice the input range.
  static constexpr float input_limit() noexcept {
    const float limit = std::min({StorageTraits<typename L::window_t>::kMax, side_limit<typename KF::quantizer>(),
                                  side_limit<typename VF::quantizer>()});
    return kCorrected ? limit / 2 : limit;
  }

  static void check_index(const CacheConfig& cfg, int layer, int seq) {
    KVC_CHECK(layer >= 0 && layer < cfg.layers, Errc::kInvalidArgument, "layer ", layer, " out of range [0, ",
              cfg.layers, ")");
    KVC_CHECK(seq >= 0 && seq < cfg.batch, Errc::kInvalidArgument, "sequence ", seq, " out of range [0, ", cfg.batch,
              ")");
  }

  /// The checks of append(layer, seq, k, v) on a sequence holding n tokens, except the values' (the
  /// views may be device memory): shapes, token counts, capacity. Returns the token count.
  static int check_append_shape(const CacheConfig& cfg, int layer, int seq, int n, KVView k, KVView v) {
    check_index(cfg, layer, seq);
    KVC_CHECK(k.dim1 == cfg.kv_heads && k.dim2 == cfg.head_dim, Errc::kInvalidArgument, "keys have shape [", k.dim0,
              "][", k.dim1, "][", k.dim2, "], expected [tokens][", cfg.kv_heads, "][", cfg.head_dim, "]");
    KVC_CHECK(v.dim1 == cfg.kv_heads && v.dim2 == cfg.head_dim, Errc::kInvalidArgument, "values have shape [", v.dim0,
              "][", v.dim1, "][", v.dim2, "], expected [tokens][", cfg.kv_heads, "][", cfg.head_dim, "]");
    KVC_CHECK(k.dim0 == v.dim0, Errc::kInvalidArgument, "keys hold ", k.dim0, " tokens but values hold ", v.dim0);
    KVC_CHECK(k.dim0 >= 0, Errc::kInvalidArgument, "negative token count ", k.dim0);
    if (k.dim0 == 0) return 0;
    KVC_CHECK(k.data != nullptr && v.data != nullptr, Errc::kInvalidArgument, "null key or value data");
    KVC_CHECK(std::int64_t(n) + k.dim0 <= cfg.capacity, Errc::kCapacityExceeded, "appending ", k.dim0,
              " tokens to layer ", layer, " sequence ", seq, " holding ", n, " exceeds the capacity of ", cfg.capacity,
              " tokens");
    return k.dim0;
  }

  /// Throws for the first non-finite or out-of-range element of host view x (what: "key"/"value").
  static void check_values(KVView x, const char* what) {
    for (int t = 0; t < x.dim0; ++t)
      for (int h = 0; h < x.dim1; ++h)
        for (int c = 0; c < x.dim2; ++c) check_value(x.row(t, h)[c], what, t, h, c);
  }
  /// The rotated copy of host view x ([tokens][kv_heads][head_dim], contiguous in `buf`) that a rotated
  /// cache stores, each row through its head's transform (keys: the key side's); throws for the first
  /// non-finite input element, then for the first rotated element beyond the storable range (naming the
  /// rotated channel). Without a rotation on that side: checks x and returns it. pre(t, h, row) sees each
  /// finite row of a rotated side just before its rotation and may change it (QAQ takes its outliers there:
  /// qaq/split_outliers.hpp); it may throw (nothing is stored yet).
  template <class Pre = NoPreRotation>
  static KVView rotated_input(KVView x, bool keys, const std::uint32_t* layer_tables, std::vector<float>& buf,
                              Pre&& pre = {}) {
    const char* what = keys ? "key" : "value";
    using Rot = typename L::rotation;
    if (!(keys ? Rot::kKeys : Rot::kValues)) {
      check_values(x, what);
      return x;
    }
    const int d = x.dim2;
    buf.resize(x.size());
    for (int t = 0; t < x.dim0; ++t)
      for (int h = 0; h < x.dim1; ++h) {
        const float* src = x.row(t, h);
        float* dst = buf.data() + (std::size_t(t) * x.dim1 + h) * d;
        for (int c = 0; c < d; ++c) {
          check_finite(src[c], what, t, h, c);
          dst[c] = src[c];
        }
        pre(t, h, dst);
        Rot::rotate(keys, layer_tables, h, d, dst);
        for (int c = 0; c < d; ++c)
          if (!(std::fabs(dst[c]) <= input_limit())) rotated_out_of_range(what, t, h, c, dst[c]);
      }
    return KVView::contiguous(buf.data(), x.dim0, x.dim1, d);
  }
  /// The error of a rotated element beyond the storable range (host and device appends).
  [[noreturn]] static void rotated_out_of_range(const char* what, int t, int h, int c, float x) {
    fail(Errc::kOutOfRange, what, " token ", t, " head ", h, " rotated channel ", c, " = ", x,
         " exceeds the storable magnitude ", input_limit(), " (the rotation spreads a row's norm over its channels)");
  }
  /// The error of a non-finite element (nothing when it is finite).
  static void check_finite(float x, const char* what, int t, int h, int c) {
    KVC_CHECK(std::isfinite(x), Errc::kNonFinite, what, " token ", t, " head ", h, " channel ", c, " is ", x,
              " (NaN/Inf rejected)");
  }
  /// The error of one element (nothing when it is storable).
  static void check_value(float x, const char* what, int t, int h, int c) {
    check_finite(x, what, t, h, c);
    KVC_CHECK(std::fabs(x) <= input_limit(), Errc::kOutOfRange, what, " token ", t, " head ", h, " channel ", c, " = ",
              x, " exceeds the storable magnitude ", input_limit());
  }

  /// Bytes holding live data of one layer whose `cfg.batch` sequences hold lengths[s] tokens: codes,
  /// fp16 scales and zeros, block padding, correction regions, stream-scope outlier entries with their
  /// block offsets, full-precision tokens, the layer's rotation tables (when rotated and not empty).
  /// One fused decode step over the layer reads exactly these (with an AlignedLoader over the slots, the slots'
  /// planes at their tiers instead: aligned::ReadStats).
  static std::size_t stored_bytes(const CacheConfig& cfg, const int* lengths) {
    constexpr int B = L::kBlockTokens;
    const int d = cfg.head_dim;
    std::size_t total = 0;
    if (std::any_of(lengths, lengths + cfg.batch, [](int n) { return n > 0; }))
      total += L::rotation_bytes(cfg.kv_heads, d);
    for (int s = 0; s < cfg.batch; ++s) {
      const int nb = L::selector::quantized_blocks(lengths[s], B);
      const std::size_t fp_tokens = std::size_t(detail::fp_tokens<typename L::selector>(lengths[s], B));
      std::size_t table = 0;  // per side: the entries and the nb + 1 offsets the kernel reads
      if constexpr (L::kStreamOutliers)
        if (nb > 0) {
          const std::size_t offsets = (std::size_t(nb) + 1) * sizeof(std::uint32_t);
          if (L::kKeyStreamOutliers) table += L::stream_outliers::bytes(nb * B, d, true) + offsets;
          if (L::kValueStreamOutliers) table += L::stream_outliers::bytes(nb * B, d, false) + offsets;
        }
      // The slots' full-precision keys and exact values; PartialLogWindow's other values as quantized rows.
      const std::size_t exact_values = std::size_t(L::exact_fp_values(lengths[s]));
      const std::size_t rows = stream_slot_bytes(lengths[s], d) + (fp_tokens - exact_values) * L::value_row_bytes(d);
      total += std::size_t(cfg.kv_heads) * (nb * (KF::block_bytes(d) + VF::block_bytes(d)) + rows + table);
    }
    return total;
  }
  /// The part of stored_bytes(cfg, lengths) in the selector's full-precision slots at window_t: every slot's key and
  /// the values kept exact (what an AlignedLoader over the slots reads as planes instead).
  static std::size_t slot_bytes(const CacheConfig& cfg, const int* lengths) {
    std::size_t total = 0;
    for (int s = 0; s < cfg.batch; ++s) total += stream_slot_bytes(lengths[s], cfg.head_dim);
    return std::size_t(cfg.kv_heads) * total;
  }

 private:
  /// One stream of n tokens: its slots' keys and exact values, d elements of window_t each.
  static std::size_t stream_slot_bytes(int n, int d) {
    const std::size_t slots = std::size_t(detail::fp_tokens<typename L::selector>(n, L::kBlockTokens));
    return (slots + std::size_t(L::exact_fp_values(n))) * std::size_t(d) * sizeof(typename L::window_t);
  }
  template <class Q>
  static constexpr float side_limit() noexcept {
    if constexpr (Q::kIsIdentity) return StorageTraits<typename Q::storage>::kMax;
    else return Q::kBits == 1 ? half_t::kMax / 2 : half_t::kMax;
  }
  template <class Q>
  static void check_groups(const CacheConfig& cfg, const char* side) {
    if constexpr (!Q::kIsIdentity && Q::kGroupChannels != 0) {
      KVC_CHECK(cfg.head_dim % Q::kGroupChannels == 0, Errc::kInvalidArgument, side, " quantizer groups of ",
                Q::kGroupChannels, " channels do not divide head_dim ", cfg.head_dim);
    }
  }
  /// Rejects correction parameters the head dimension cannot serve (rank, 16-bit outlier indices).
  template <class F>
  static void check_correction(const CacheConfig& cfg, const char* side) {
    using C = typename F::correction;
    if constexpr (C::kActive) {
      const int B = L::kBlockTokens, d = cfg.head_dim;
      KVC_CHECK(C::rank(B, d) <= std::min(B, d), Errc::kInvalidArgument, side, " low-rank residual rank ",
                C::rank(B, d), " exceeds min(block tokens, head_dim) = min(", B, ", ", d, ")");
      KVC_CHECK(C::outliers(B, d) == 0 || std::int64_t(B) * d <= 65536, Errc::kInvalidArgument, side,
                " outliers use 16-bit in-block indices, but a block holds ", std::int64_t(B) * d,
                " > 65536 entries (BlockTokens x head_dim)");
    }
  }
};

/// Whole-cache accounting of a host cache C (config(), length(layer, seq), stored_bytes(layer)): shared by
/// CompressedKVCache and QAQ's cache.
template <class C>
std::size_t stored_bytes_all_layers(const C& c) {
  std::size_t total = 0;
  for (int l = 0; l < c.config().layers; ++l) total += c.stored_bytes(l);
  return total;
}
/// K and V elements held (tokens x 2 x kv_heads x head_dim).
template <class C>
std::size_t cached_elements(const C& c) {
  std::size_t n = 0;
  for (int l = 0; l < c.config().layers; ++l)
    for (int s = 0; s < c.config().batch; ++s) n += std::size_t(c.length(l, s));
  return n * 2u * c.config().kv_heads * c.config().head_dim;
}
/// Stored bits per K/V element, everything stored_bytes counts (0 when empty).
template <class C>
double bits_per_cached_element(const C& c) {
  const std::size_t e = cached_elements(c);
  return e ? 8.0 * static_cast<double>(stored_bytes_all_layers(c)) / static_cast<double>(e) : 0.0;
}
}  // namespace detail
}  // namespace kvc
