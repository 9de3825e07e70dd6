/// \file compressed_kv_cache.hpp
/// `kvc::CompressedKVCache<Policy...>`: the host container of a compressed KV cache
/// (layers x sequences x KV heads x tokens x head_dim), composed from policies in any order.
#pragma once

#include <kvc/config.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/cache/policies.hpp>
#include <kvc/core/aligned_buffer.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>
#include <kvc/gear/block_correction.hpp>
#include <kvc/gear/host_linalg.hpp>
#include <kvc/gear/literal_mode.hpp>
#include <kvc/quant/codec.hpp>
#include <kvc/quant/no_quantizer.hpp>
#include <kvc/select/full_precision_window.hpp>
#include <kvc/select/log_window.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvc {

namespace cuda {
template <class... P>
class DeviceKVCache;  // cuda/include/kvc/cuda/device_kv_cache.cuh: transfers read and write the host arenas
}  // namespace cuda

/// A compressed KV cache composed from policies, in any order:
///  - a quantizer for both sides, or `keys<Q>` and/or `values<Q>` (default: fp16, uncompressed);
///  - a selector (default: no full-precision window), e.g. `FullPrecisionWindow<128>`;
///  - `BlockTokens<N>` (default: the quantizer's per-channel group size, else 32);
///  - GEAR's `OutlierFilter`, `LowRankResidual`, `LiteralMode`; a `Rotation<...>` of K/V before quantization.
/// Example (KIVI-2, group 32, 128-token window):
///   CompressedKVCache<keys<GroupQuantizer<2, 32, Axis::kChannel>>,
///                     values<GroupQuantizer<2, 32, Axis::kToken>>, FullPrecisionWindow<128>>
/// Errors: every method that takes input validates all of it first and throws kvc::Error, leaving the
/// cache unchanged. Not thread-safe for concurrent appends to the same (layer, sequence).
template <class... P>
class CompressedKVCache {
  using R = detail::resolve_policies<P...>;
  static_assert(detail::cache_checks<P...>::kOk);  // the messages come from detail::cache_checks
 public:
  using key_quantizer = typename R::key_q;
  using value_quantizer = typename R::value_q;
  using selector = typename R::selector;
  static constexpr int kBlockTokens = R::block::kTokens;
  using outlier_filter = typename R::outliers;  ///< void when absent
  using residual = typename R::residual;        ///< void when absent
  using stream_outliers = typename R::stream_outliers;  ///< void unless OutlierScope::kStream
  static constexpr bool kLiteral = !std::is_void_v<typename R::streaming>;  ///< GEAR Algorithm 1 streaming
  using rotation = typename R::rotation;  ///< NoRotation when absent
  using layout = CacheLayout<key_quantizer, value_quantizer, selector, kBlockTokens, typename R::key_corr,
                             typename R::value_corr, stream_outliers, rotation, typename R::loader>;
  using params_type = typename layout::Params;
  using key_format = typename layout::key_format;
  using value_format = typename layout::value_format;
  using window_t = typename layout::window_t;
  using rules = detail::CacheRules<layout>;

  static_assert(key_quantizer::kRequiredBlockTokens == 0 || key_quantizer::kRequiredBlockTokens == kBlockTokens,
                "kvc: the key quantizer's per-channel group size must equal the block size (BlockTokens<Group>)");
  static_assert(value_quantizer::kRequiredBlockTokens == 0 || value_quantizer::kRequiredBlockTokens == kBlockTokens,
                "kvc: the value quantizer's per-channel group size must equal the block size (BlockTokens<Group>)");
  static_assert(R::template window_holds<key_quantizer, window_t>() &&
                    R::template window_holds<value_quantizer, window_t>(),
                "kvc: the full-precision window's storage cannot hold the identity quantizer's values exactly; "
                "use FullPrecisionWindow<R, S, T> with the same T (or float)");

  explicit CompressedKVCache(const CacheConfig& cfg) : cfg_(cfg) {
    cap_blocks_ = rules::validate(cfg);
    if constexpr (layout::kStreamOutliers) {
      KVC_CHECK(std::int64_t(kBlockTokens) * cfg.head_dim <= 65536, Errc::kInvalidArgument,
                "outliers use 16-bit in-block indices, but a block holds ", std::int64_t(kBlockTokens) * cfg.head_dim,
                " > 65536 entries (BlockTokens x head_dim)");
      out_cap_ = std::max(stream_outliers::count(cap_blocks_ * kBlockTokens, cfg.head_dim, true),
                          stream_outliers::count(cap_blocks_ * kBlockTokens, cfg.head_dim, false));
    }
    const std::size_t streams = std::size_t(cfg.layers) * cfg.batch * cfg.kv_heads;
    const std::size_t d = std::size_t(cfg.head_dim);
    k_blocks_ = AlignedBuffer<std::byte>(streams * cap_blocks_ * key_format::block_bytes(cfg.head_dim));
    v_blocks_ = AlignedBuffer<std::byte>(streams * cap_blocks_ * value_format::block_bytes(cfg.head_dim));
    k_fp_ = AlignedBuffer<window_t>(streams * layout::kFpStride * d);
    v_fp_ = AlignedBuffer<window_t>(streams * layout::kFpStride * d);
    v_fq_ = AlignedBuffer<std::byte>(streams * layout::kFpSlots * layout::value_row_bytes(cfg.head_dim));
    lengths_.assign(std::size_t(cfg.layers) * cfg.batch, 0);
    if constexpr (layout::kKeyStreamOutliers) k_out_ = OutlierTable(streams, cap_blocks_, out_cap_);
    if constexpr (layout::kValueStreamOutliers) v_out_ = OutlierTable(streams, cap_blocks_, out_cap_);
    if constexpr (layout::kRotated) {
      rot_ = AlignedBuffer<std::uint32_t>(cfg.layers * layout::rotation_words(cfg.kv_heads, cfg.head_dim));
      rotation::make_tables(cfg.layers, cfg.kv_heads, cfg.head_dim, rot_.data());
    }
    if constexpr (kWarmStart) {
      warm_k_.assign(streams * d * key_format::correction::rank(kBlockTokens, cfg.head_dim), 0.0f);
      warm_v_.assign(streams * d * value_format::correction::rank(kBlockTokens, cfg.head_dim), 0.0f);
    }
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] int length(int layer, int seq) const {
    check_index(layer, seq);
    return lengths_[std::size_t(layer) * cfg_.batch + seq];
  }
  /// Quantized blocks of (layer, seq).
  [[nodiscard]] int quantized_blocks(int layer, int seq) const {
    return selector::quantized_blocks(length(layer, seq), kBlockTokens);
  }

  /// Appends `k.dim0` tokens (prefill: many; decode: one) to sequence `seq` of `layer`.
  /// k, v: [tokens][kv_heads][head_dim], finite, and within what the storage represents (fp16: 65504).
  /// Token by token, the selector's rule (append_token) writes it to a full-precision slot and says which
  /// rows to move and which blocks are complete; those are quantized at once (each token exactly once).
  void append(int layer, int seq, KVView k, KVView v) {
    check_index(layer, seq);
    int& n = lengths_[std::size_t(layer) * cfg_.batch + seq];
    if (rules::check_append_shape(cfg_, layer, seq, n, k, v) == 0) return;
    const params_type p = params(layer);
    std::vector<float> k_rot, v_rot;  // Rotation: the rows as stored (R k, R v)
    k = rules::rotated_input(k, true, p.rotation, k_rot);
    v = rules::rotated_input(v, false, p.rotation, v_rot);

    const int B = kBlockTokens;
    const int blocks_before = selector::quantized_blocks(n, B);
    std::vector<float> pending;  // LiteralMode: exact rows of the blocks completed by this append
    AppendOps ops{*this, p, layer, seq, k, v, 0, pending};
    for (int t = 0; t < k.dim0; ++t) {
      ops.token = t;
      selector::append_token(n, B, ops);
      ++n;
    }
    if constexpr (kLiteral) {
      if (!pending.empty()) flush_literal(p, layer, seq, blocks_before, selector::quantized_blocks(n, B), pending);
    }
  }

  /// Forgets sequence `seq` in every layer (its storage is reused by the next append).
  void clear(int seq) {
    check_index(0, seq);
    for (int l = 0; l < cfg_.layers; ++l) lengths_[std::size_t(l) * cfg_.batch + seq] = 0;
  }

  /// The trivially-copyable view of one layer that attention kernels read.
  [[nodiscard]] params_type params(int layer) const {
    KVC_CHECK(layer >= 0 && layer < cfg_.layers, Errc::kInvalidArgument, "layer ", layer, " out of range [0, ",
              cfg_.layers, ")");
    const std::size_t per_layer_streams = std::size_t(cfg_.batch) * cfg_.kv_heads;
    const std::size_t s0 = layer * per_layer_streams, d = std::size_t(cfg_.head_dim);
    auto* self = const_cast<CompressedKVCache*>(this);
    return params_type{cfg_.batch,
                       cfg_.kv_heads,
                       cfg_.head_dim,
                       cap_blocks_,
                       lengths_.data() + std::size_t(layer) * cfg_.batch,
                       self->k_blocks_.data() + s0 * cap_blocks_ * key_format::block_bytes(cfg_.head_dim),
                       self->v_blocks_.data() + s0 * cap_blocks_ * value_format::block_bytes(cfg_.head_dim),
                       self->k_fp_.data() + s0 * layout::kFpStride * d,
                       self->v_fp_.data() + s0 * layout::kFpStride * d,
                       out_cap_,
                       self->k_out_.offsets(s0),
                       self->k_out_.indices(s0),
                       self->k_out_.values(s0),
                       self->v_out_.offsets(s0),
                       self->v_out_.indices(s0),
                       self->v_out_.values(s0),
                       layout::kQuantizedFpValues
                           ? self->v_fq_.data() + s0 * layout::kFpSlots * layout::value_row_bytes(cfg_.head_dim)
                           : nullptr,
                       layout::kRotated ? rot_.data() + layer * layout::rotation_words(cfg_.kv_heads, cfg_.head_dim)
                                        : nullptr};
  }

  /// Bytes holding live data of one layer: codes, fp16 scales and zeros (lo, step), block padding,
  /// correction regions, stream-scope outlier entries with their block offsets, full-precision tokens
  /// (PartialLogWindow: their quantized value rows where the value left its window). One fused decode step over the layer reads exactly these bytes.
  [[nodiscard]] std::size_t stored_bytes(int layer) const {
    check_index(layer, 0);
    return rules::stored_bytes(cfg_, lengths_.data() + std::size_t(layer) * cfg_.batch);
  }
  [[nodiscard]] std::size_t stored_bytes() const { return detail::stored_bytes_all_layers(*this); }
  /// Bytes of the cache that one decode step over `layer` reads (every live byte, once).
  [[nodiscard]] std::size_t decode_read_bytes(int layer) const { return stored_bytes(layer); }
  /// Elements (K and V) held in the cache.
  [[nodiscard]] std::size_t elements() const { return detail::cached_elements(*this); }
  /// Stored bits per K/V element, everything counted (0 when empty).
  [[nodiscard]] double bits_per_element() const { return detail::bits_per_cached_element(*this); }
  /// Bytes reserved for the configured capacity.
  [[nodiscard]] std::size_t allocated_bytes() const {
    return k_blocks_.size() + v_blocks_.size() +
           (k_fp_.size() + v_fp_.size()) * sizeof(window_t) + v_fq_.size() +
           k_out_.bytes() + v_out_.bytes() + lengths_.size() * sizeof(int) + rot_.size() * sizeof(std::uint32_t);
  }

  /// Reconstructs what the cache holds for (layer, seq) into k, v: [length][kv_heads][head_dim], every
  /// row at its token position (selector::positions), in the original basis (a Rotation's rows
  /// un-rotated). For tests and debugging; attention never does this.
  void dequantize(int layer, int seq, float* k, float* v) const {
    const int n = length(layer, seq);
    const params_type p = params(layer);
    const int B = kBlockTokens, nb = selector::quantized_blocks(n, B), d = cfg_.head_dim, H = cfg_.kv_heads;
    const int nfp = detail::fp_tokens<selector>(n, B);
    std::vector<int> pos(static_cast<std::size_t>(detail::stored_rows<selector>(n, B)));
    selector::positions(n, B, pos.data());
    std::vector<float> kx(std::size_t(B) * d), vx(kx.size());
    for (int h = 0; h < H; ++h) {
      for (int blk = 0; blk < nb; ++blk) {
        reconstruct_block<key_format>(p, seq, h, blk, kx.data());
        reconstruct_block<value_format>(p, seq, h, blk, vx.data());
        for (int t = 0; t < B; ++t) {
          if (pos[std::size_t(blk) * B + t] < 0) continue;  // AlignedSinkWindow: a masked row holds no token
          const std::size_t row = (std::size_t(pos[std::size_t(blk) * B + t]) * H + h) * d;
          std::copy_n(kx.data() + std::size_t(t) * d, d, k + row);
          std::copy_n(vx.data() + std::size_t(t) * d, d, v + row);
        }
      }
      for (int i = 0; i < nfp; ++i) {
        const std::size_t row = (std::size_t(pos[std::size_t(nb) * B + i]) * H + h) * d;
        for (int c = 0; c < d; ++c) {
          k[row + c] = p.fp_element(Side::kKey, seq, h, i, c);
          v[row + c] = p.fp_element(Side::kValue, seq, h, i, c);
        }
      }
      if constexpr (layout::kRotated)
        for (int t = 0; t < n; ++t) {
          const std::size_t row = (std::size_t(t) * H + h) * d;
          rotation::unrotate(true, p.rotation, h, d, k + row);
          rotation::unrotate(false, p.rotation, h, d, v + row);
        }
    }
  }

  /// Largest |x| an input may hold (detail::CacheRules::input_limit).
  [[nodiscard]] static constexpr float input_limit() noexcept { return rules::input_limit(); }

 private:
  void check_index(int layer, int seq) const { rules::check_index(cfg_, layer, seq); }

  /// What selector::append_token does to one sequence, applied to every KV head and both sides:
  /// write(slot) stores input token `token`, move(from, to) copies a slot's rows, compress(blk, slot_of)
  /// quantizes block blk from the slots slot_of(0..B-1) (LiteralMode: stashes them for the flush),
  /// quantize_value(slot) quantizes the slot's value into its quantized value row (PartialLogWindow; the
  /// fp16 row stays in the slot, unread by attention, as the source of the block's identical codes).
  struct AppendOps {
    CompressedKVCache& c;
    const params_type& p;
    int layer, seq;
    KVView k, v;
    int token;
    std::vector<float>& pending;  // LiteralMode: [block][head][side][B][d]
    mutable std::vector<float> row = {};  // quantize_value's fp32 copy of a value row

    /// One side's slot `slot` as floats: stored (rounded to the window's storage: fp16 rows or slot planes), loaded.
    void store_slot(Side side, int h, int slot, const float* x) const {
      if constexpr (layout::kAlignedWindow) p.fp_planes(side, seq, h).store_row(slot, x);
      else convert(x, p.fp_slot_row(side, seq, h, slot), std::size_t(c.cfg_.head_dim));
    }
    void load_slot(Side side, int h, int slot, float* x) const {
      if constexpr (layout::kAlignedWindow) p.fp_planes(side, seq, h).load_row(slot, x);
      else convert(p.fp_slot_row(side, seq, h, slot), x, std::size_t(c.cfg_.head_dim));
    }
    void write(int slot) const {
      for (int h = 0; h < c.cfg_.kv_heads; ++h) {
        store_slot(Side::kKey, h, slot, k.row(token, h));
        store_slot(Side::kValue, h, slot, v.row(token, h));
      }
    }
    void move(int from, int to) const {
      const std::size_t d = std::size_t(c.cfg_.head_dim);
      for (int h = 0; h < c.cfg_.kv_heads; ++h)
        for (Side side : {Side::kKey, Side::kValue}) {
          if constexpr (layout::kAlignedWindow) p.fp_planes(side, seq, h).copy_row(from, to);
          else std::copy_n(p.fp_slot_row(side, seq, h, from), d, p.fp_slot_row(side, seq, h, to));
        }
      if constexpr (layout::kQuantizedFpValues)
        for (int h = 0; h < c.cfg_.kv_heads; ++h)
          std::copy_n(p.value_row_slot(seq, h, from), layout::value_row_bytes(c.cfg_.head_dim),
                      p.value_row_slot(seq, h, to));
    }
    void quantize_value(int slot) const {
      if constexpr (layout::kQuantizedFpValues) {
        const int d = c.cfg_.head_dim;
        row.resize(std::size_t(d));
        for (int h = 0; h < c.cfg_.kv_heads; ++h) {
          load_slot(Side::kValue, h, slot, row.data());
          layout::value_row_format::quantize(row.data(), d, p.value_row_slot(seq, h, slot));
        }
      }
    }
    template <class SlotOf>
    void compress(int blk, SlotOf slot_of) const {
      constexpr int B = kBlockTokens;
      const int d = c.cfg_.head_dim, H = c.cfg_.kv_heads;
      if constexpr (kLiteral) {
        // The block's exact rows [head][side][B][d], before later tokens reuse their slots.
        const std::size_t at = pending.size();
        pending.resize(at + std::size_t(H) * 2 * B * d);
        for (int h = 0; h < H; ++h)
          for (int sd = 0; sd < 2; ++sd)
            for (int r = 0; r < B; ++r)
              load_slot(sd == 0 ? Side::kKey : Side::kValue, h, slot_of(r),
                        pending.data() + at + ((std::size_t(h) * 2 + sd) * B + r) * d);
      } else {
        std::vector<float> x(std::size_t(B) * d);
        for (int h = 0; h < H; ++h)
          for (Side side : {Side::kKey, Side::kValue}) {
            for (int r = 0; r < B; ++r)
              load_slot(side, h, slot_of(r), x.data() + std::size_t(r) * d);
            if (side == Side::kKey) c.compress_block<key_format>(x.data(), layer, seq, h, blk, p.key_block(seq, h, blk), {});
            else c.compress_block<value_format>(x.data(), layer, seq, h, blk, p.value_block(seq, h, blk), {});
          }
      }
    }
  };

  /// Compresses the exact block x ([B][d] row-major) into `dst`: with an outlier filter, the
  /// outliers are selected first (per block, or given: `so`, this block's share of the stream-scope
  /// selection, in-block indices ascending, whose entries go to so.idx/so.val) and the backbone's
  /// statistics taken over the inliers; with corrections, the region after the backbone is fitted
  /// to what the backbone and the outliers left (SPEC §1.3).
  struct StreamShare {
    const std::uint32_t* pos = nullptr;  // in-block indices, ascending
    int n = 0;
    std::uint16_t* idx = nullptr;  // where the entries go
    half_t* val = nullptr;
  };
  template <class F>
  void compress_block(const float* x, int layer, int seq, int head, int blk, std::byte* dst, StreamShare so) {
    constexpr int B = kBlockTokens;
    constexpr Side side = F::kSide;
    const int d = cfg_.head_dim;
    const std::size_t elems = std::size_t(B) * d;
    if constexpr (F::kIdentity) {
      F::store_identity(x, d, dst);
    } else {
      using Q = typename F::quantizer;
      using C = typename F::correction;
      std::vector<std::uint32_t> out_idx;
      if constexpr (C::kActive && C::kOutliers) out_idx = select_outliers(x, elems, std::size_t(C::outliers(B, d) / 2));
      // The outlier positions (this block's own, or its share of the stream's), excluded from the
      // backbone's statistics.
      const std::uint32_t* pos = so.n > 0 ? so.pos : out_idx.data();
      const std::size_t npos = so.n > 0 ? std::size_t(so.n) : out_idx.size();
      std::vector<std::uint8_t> outlier;
      if (npos > 0) {
        outlier.assign(elems, 0);
        for (std::size_t o = 0; o < npos; ++o) outlier[pos[o]] = 1;
      }
      std::vector<std::uint8_t> codes(elems);
      F::quantize_groups(x, d, codes.data(), dst, outlier.empty() ? nullptr : outlier.data());
      pack_codes(codes.data(), codes.size(), Q::kBits, reinterpret_cast<std::uint8_t*>(dst));
      if (!C::kActive && so.n == 0) return;
      std::vector<float> xhat(elems);
      F::decode_backbone(dst, d, xhat.data());
      for (int o = 0; o < so.n; ++o) {  // stream-scope outliers store x - x^ like block-scope ones
        const std::uint32_t i = so.pos[o];
        so.idx[o] = static_cast<std::uint16_t>(i);
        so.val[o] = half_t::from_float(x[i] - xhat[i]);
        xhat[i] += so.val[o].to_float();  // so the residual fit sees x - x^ - S
      }
      if constexpr (C::kActive) {
        float* basis = nullptr;
        if constexpr (kWarmStart) {
          const std::size_t r = std::size_t(C::rank(B, d)), stream = (std::size_t(layer) * cfg_.batch + seq) * cfg_.kv_heads + head;
          basis = (side == Side::kKey ? warm_k_.data() : warm_v_.data()) + stream * d * r;
        }
        HostLinalg la;
        C::fit(x, xhat.data(), out_idx.data(), B, d, dst + F::correction_offset(d), la, basis, kWarmStart && blk > 0,
               low_rank_seed(layer, seq, head, blk, side == Side::kKey));
      }
    }
  }

  /// What block `blk` of (seq, head) holds, x[t * d + c]: the block's own decode plus, with
  /// stream-scope outliers, its share of the stream's table.
  template <class F>
  void reconstruct_block(const params_type& p, int seq, int head, int blk, float* x) const {
    constexpr Side side = F::kSide;
    F::decode_block(side == Side::kKey ? p.key_block(seq, head, blk) : p.value_block(seq, head, blk), cfg_.head_dim, x);
    if constexpr (side == Side::kKey ? layout::kKeyStreamOutliers : layout::kValueStreamOutliers) {
      const OutlierSlice sl = p.outliers(side, seq, head, blk);
      for (int o = 0; o < sl.n; ++o) x[sl.idx[o]] += sl.val[o].to_float();
    }
  }

  /// LiteralMode flush (GEAR Algorithm 1): blocks [0, old_blocks) are rebuilt from their
  /// reconstruction, blocks [old_blocks, new_blocks) come exact from `pending` ([block][head][side]
  /// [B][d]), and every block of every head is compressed again.
  void flush_literal(const params_type& p, int layer, int seq, int old_blocks, int new_blocks,
                     const std::vector<float>& pending) {
    constexpr int B = kBlockTokens;
    const int d = cfg_.head_dim, H = cfg_.kv_heads;
    const std::size_t bd = std::size_t(B) * d;
    std::vector<float> x(std::size_t(new_blocks) * bd);
    auto one_side = [&]<class F>(int h) {
      const int sd = F::kSide == Side::kKey ? 0 : 1;  // pending's side index
      for (int b = 0; b < new_blocks; ++b) {
        float* xb = x.data() + std::size_t(b) * bd;
        if (b < old_blocks) reconstruct_block<F>(p, seq, h, b, xb);
        else std::copy_n(pending.data() + ((std::size_t(b - old_blocks) * H + h) * 2 + sd) * bd, bd, xb);
      }
      recompress<F>(p, layer, seq, h, new_blocks, x.data());
    };
    for (int h = 0; h < H; ++h) {
      one_side.template operator()<key_format>(h);
      one_side.template operator()<value_format>(h);
    }
  }

  /// Compresses blocks [0, nb) of one stream side from x ([nb * B][d]); with stream-scope outliers,
  /// selects them over all nb * B * d entries first and rewrites the side's table.
  template <class F>
  void recompress(const params_type& p, int layer, int seq, int head, int nb, const float* x) {
    constexpr int B = kBlockTokens;
    constexpr bool k = F::kSide == Side::kKey;
    const std::size_t bd = std::size_t(B) * cfg_.head_dim;
    auto dst = [&](int b) { return k ? p.key_block(seq, head, b) : p.value_block(seq, head, b); };
    if constexpr (k ? layout::kKeyStreamOutliers : layout::kValueStreamOutliers) {
      const std::size_t per_side = std::size_t(stream_outliers::per_side(static_cast<long long>(nb) * bd, k));
      std::vector<std::uint32_t> all = select_outliers(x, std::size_t(nb) * bd, per_side);  // ascending
      const std::size_t st = std::size_t(p.stream(seq, head));
      std::uint32_t* off = (k ? p.k_out_off : p.v_out_off) + st * (std::size_t(cap_blocks_) + 1);
      std::uint16_t* idx = (k ? p.k_out_idx : p.v_out_idx) + st * std::size_t(out_cap_);
      half_t* val = (k ? p.k_out_val : p.v_out_val) + st * std::size_t(out_cap_);
      std::size_t o = 0;
      off[0] = 0;
      for (int b = 0; b < nb; ++b) {
        const std::size_t begin = o, base = std::size_t(b) * bd;
        for (; o < all.size() && all[o] < base + bd; ++o) all[o] -= std::uint32_t(base);
        off[b + 1] = std::uint32_t(o);
        StreamShare share{all.data() + begin, int(o - begin), idx + begin, val + begin};
        compress_block<F>(x + base, layer, seq, head, b, dst(b), share);
      }
    } else {
      for (int b = 0; b < nb; ++b) compress_block<F>(x + std::size_t(b) * bd, layer, seq, head, b, dst(b), {});
    }
  }

  static constexpr bool kWarmStart = [] {
    if constexpr (std::is_void_v<residual>) return false;
    else return residual::kInit == LowRankInit::kWarm;
  }();

  /// Stream-scope outliers of one side: per stream, nb + 1 block offsets and the entries.
  struct OutlierTable {
    AlignedBuffer<std::uint32_t> off;
    AlignedBuffer<std::uint16_t> idx;
    AlignedBuffer<half_t> val;
    std::size_t per_off = 0, per_entry = 0;
    OutlierTable() = default;
    OutlierTable(std::size_t streams, int cap_blocks, int cap)
        : off(streams * (std::size_t(cap_blocks) + 1)), idx(streams * std::size_t(cap)), val(streams * std::size_t(cap)),
          per_off(std::size_t(cap_blocks) + 1), per_entry(std::size_t(cap)) {}
    std::uint32_t* offsets(std::size_t s0) { return off.size() ? off.data() + s0 * per_off : nullptr; }
    std::uint16_t* indices(std::size_t s0) { return idx.size() ? idx.data() + s0 * per_entry : nullptr; }
    half_t* values(std::size_t s0) { return val.size() ? val.data() + s0 * per_entry : nullptr; }
    std::size_t bytes() const {
      return off.size() * sizeof(std::uint32_t) + idx.size() * sizeof(std::uint16_t) + val.size() * sizeof(half_t);
    }
  };

  template <class... Q>
  friend class cuda::DeviceKVCache;

  CacheConfig cfg_;
  int cap_blocks_ = 0;
  int out_cap_ = 0;  // stream-scope outlier entries per stream and side
  OutlierTable k_out_, v_out_;
  AlignedBuffer<std::byte> k_blocks_, v_blocks_;
  AlignedBuffer<window_t> k_fp_, v_fp_;  // the selector's full-precision slots
  AlignedBuffer<std::byte> v_fq_;        // their quantized value rows (PartialLogWindow)
  std::vector<int> lengths_;
  std::vector<float> warm_k_, warm_v_;  // LowRankInit::kWarm: each stream's last basis B (d x r)
  AlignedBuffer<std::uint32_t> rot_;     // Rotation: [layers][kv_heads][rotation::head_words] transform tables
};

namespace detail {
/// The rules of an fp16 cache, for the caches with containers of their own that store fp16-range inputs (QAQ's
/// mirror, AlignedKV's planes): index, shape, capacity and value checks.
using Fp16Rules = CacheRules<typename CompressedKVCache<NoQuantizer<half_t>>::layout>;
/// The checks of append(layer, seq, k, v) onto n tokens for those caches, all made before anything is written:
/// shapes, capacity, finite values within fp16's range. Returns the token count (0: nothing to append).
inline int check_fp16_append(const CacheConfig& cfg, int layer, int seq, int n, KVView k, KVView v) {
  if (Fp16Rules::check_append_shape(cfg, layer, seq, n, k, v) == 0) return 0;
  Fp16Rules::check_values(k, "key");
  Fp16Rules::check_values(v, "value");
  return k.dim0;
}
}  // namespace detail
}  // namespace kvc
