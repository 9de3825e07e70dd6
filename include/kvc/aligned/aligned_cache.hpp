/// \file aligned_cache.hpp
/// `kvc::CompressedKVCache<AlignedLoader<...>>`: AlignedKV's cache (SPEC §3.3, §3.9), a host container of
/// fp16 K/V in bit planes.
///
/// Per (layer, sequence, KV head) stream:
///  - keys of every complete block of Block tokens, channel-major within the block (one channel's Block tokens
///    contiguous: Rule 1 decides per channel): hi8 [blocks][d][Block] bytes, mid4 and lo4 [blocks][d][Block / 2]
///    (two tokens a byte, aligned/aligned_loader.hpp);
///  - values of those tokens token-major (Rule 2 decides per token): hi8 [tokens][d], mid4 and lo4 [tokens][d / 2];
///  - the newest tokens of the incomplete block (< Block) in fp16 staging, K and V [tokens][d], read whole
///    (SPEC §3.3: "staged tokens use normal FP16 math"); a full block moves into the planes at the append
///    that completes it;
///  - Kmax[c], Vmax[c]: the largest fp16 exponent field of |K_tc|, |V_tc| over every token (staged ones too).
/// Accounting: the planes hold exactly the fp16 bits, so bits_per_element() is 16 plus the two exponent bytes
/// per channel and stream; decode_read_bytes() is what a decode step reads at most (every plane): the bytes it
/// actually reads depend on the query and are reported by decode_attention's aligned::ReadStats.
/// Host only.
#pragma once

#include <kvc/config.hpp>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/cache/compressed_kv_cache.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvc {

template <int KLo, int KHi, int VLo, int VHi, int TopK, int Block>
class CompressedKVCache<AlignedLoader<KLo, KHi, VLo, VHi, TopK, Block>> {
 public:
  using loader = AlignedLoader<KLo, KHi, VLo, VHi, TopK, Block>;
  static constexpr int kBlockTokens = Block;

  /// One stream's storage (see the file comment).
  struct Stream {
    std::vector<std::uint8_t> khi, kmid, klo;  ///< [blocks][d][Block], [blocks][d][Block / 2] x 2
    std::vector<std::uint8_t> vhi, vmid, vlo;  ///< [blocks * Block][d], [blocks * Block][d / 2] x 2
    std::vector<half_t> kst, vst;              ///< staging, [tokens][d] each
    std::vector<std::uint8_t> kmax, vmax;      ///< [d] fp16 exponent fields of the largest |K|, |V| per channel
    [[nodiscard]] int blocks(int d) const noexcept { return int(khi.size() / (std::size_t(d) * Block)); }
    [[nodiscard]] int staged(int d) const noexcept { return int(kst.size() / std::size_t(d)); }
  };

  /// cfg as for every cache: positive sizes, head_dim a multiple of 16.
  explicit CompressedKVCache(const CacheConfig& cfg) : cfg_(cfg) {
    (void)detail::Fp16Rules::validate(cfg);
    streams_.resize(std::size_t(cfg.layers) * cfg.batch * cfg.kv_heads);
    for (Stream& s : streams_) s.kmax.assign(std::size_t(cfg.head_dim), 0), s.vmax.assign(std::size_t(cfg.head_dim), 0);
    lengths_.assign(std::size_t(cfg.layers) * cfg.batch, 0);
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] int length(int layer, int seq) const {
    check_index(layer, seq);
    return lengths_[std::size_t(layer) * cfg_.batch + seq];
  }
  [[nodiscard]] const Stream& stream(int layer, int seq, int head) const {
    check_index(layer, seq);
    KVC_CHECK(head >= 0 && head < cfg_.kv_heads, Errc::kInvalidArgument, "KV head ", head, " out of range [0, ",
              cfg_.kv_heads, ")");
    return streams_[index(layer, seq, head)];
  }

  /// Appends k.dim0 tokens (prefill or one decode token). k, v: [tokens][kv_heads][head_dim], finite,
  /// |x| <= 65504 (fp16). Validates everything first: an error leaves the cache unchanged.
  void append(int layer, int seq, KVView k, KVView v) {
    check_index(layer, seq);
    int& n = lengths_[std::size_t(layer) * cfg_.batch + seq];
    if (detail::check_fp16_append(cfg_, layer, seq, n, k, v) == 0) return;
    const int d = cfg_.head_dim;
    for (int h = 0; h < cfg_.kv_heads; ++h) {
      Stream& s = streams_[index(layer, seq, h)];
      for (int t = 0; t < k.dim0; ++t) {
        for (int c = 0; c < d; ++c) {
          const half_t kx = half_t::from_float(k.row(t, h)[c]), vx = half_t::from_float(v.row(t, h)[c]);
          s.kst.push_back(kx);
          s.vst.push_back(vx);
          s.kmax[std::size_t(c)] = std::uint8_t(std::max(int(s.kmax[std::size_t(c)]), aligned::fp16_field(kx.bits)));
          s.vmax[std::size_t(c)] = std::uint8_t(std::max(int(s.vmax[std::size_t(c)]), aligned::fp16_field(vx.bits)));
        }
        if (s.staged(d) == Block) flush(s);
      }
    }
    n += k.dim0;
  }

  /// Forgets sequence `seq` in every layer.
  void clear(int seq) {
    check_index(0, seq);
    for (int l = 0; l < cfg_.layers; ++l) {
      lengths_[std::size_t(l) * cfg_.batch + seq] = 0;
      for (int h = 0; h < cfg_.kv_heads; ++h) {
        Stream& s = streams_[index(l, seq, h)];
        s = Stream{};
        s.kmax.assign(std::size_t(cfg_.head_dim), 0), s.vmax.assign(std::size_t(cfg_.head_dim), 0);
      }
    }
  }

  /// The fp16 bits of token t of a stream at full precision, reassembled from the planes (or the staging);
  /// side 0 keys, 1 values. out: [d].
  void row_bits(const Stream& s, int side, int t, std::uint16_t* out) const {
    const int d = cfg_.head_dim, full = s.blocks(d) * Block;
    if (t >= full) {
      const half_t* r = (side == 0 ? s.kst : s.vst).data() + std::size_t(t - full) * d;
      for (int c = 0; c < d; ++c) out[c] = r[c].bits;
      return;
    }
    for (int c = 0; c < d; ++c) {
      std::size_t hi, nib;
      if (side == 0) {
        const std::size_t col = std::size_t(t / Block) * d + std::size_t(c);
        hi = col * Block + std::size_t(t % Block);
        nib = col * (Block / 2) + std::size_t(t % Block) / 2;
      } else {
        hi = std::size_t(t) * d + std::size_t(c);
        nib = std::size_t(t) * (d / 2) + std::size_t(c) / 2;
      }
      const bool high = (side == 0 ? t % Block : c) % 2 != 0;
      const auto& mid = side == 0 ? s.kmid : s.vmid;
      const auto& lo = side == 0 ? s.klo : s.vlo;
      auto nibble = [&](const std::vector<std::uint8_t>& p) { return std::uint8_t(high ? p[nib] >> 4 : p[nib] & 0xFu); };
      out[c] = aligned::assemble((side == 0 ? s.khi : s.vhi)[hi], nibble(mid), nibble(lo), 16);
    }
  }

  /// What the cache holds for (layer, seq), exactly the appended values rounded to fp16; k, v:
  /// [length][kv_heads][head_dim] (tests, the oracle).
  void dequantize(int layer, int seq, float* k, float* v) const {
    const int d = cfg_.head_dim, H = cfg_.kv_heads, T = length(layer, seq);
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(d));
    for (int h = 0; h < H; ++h) {
      const Stream& s = streams_[index(layer, seq, h)];
      for (int side = 0; side < 2; ++side)
        for (int t = 0; t < T; ++t) {
          row_bits(s, side, t, bits.data());
          float* out = (side == 0 ? k : v) + (std::size_t(t) * H + h) * d;
          for (int c = 0; c < d; ++c) out[c] = detail::half_bits_to_float(bits[std::size_t(c)]);
        }
    }
  }

  /// Bytes of one layer: the planes, the staging and the two exponent bytes per channel and stream.
  [[nodiscard]] std::size_t stored_bytes(int layer) const {
    check_index(layer, 0);
    std::size_t total = 0;
    for (int s = 0; s < cfg_.batch; ++s)
      for (int h = 0; h < cfg_.kv_heads; ++h) {
        const Stream& st = streams_[index(layer, s, h)];
        total += st.khi.size() + st.kmid.size() + st.klo.size() + st.vhi.size() + st.vmid.size() + st.vlo.size() +
                 (st.kst.size() + st.vst.size()) * sizeof(half_t) + st.kmax.size() + st.vmax.size();
      }
    return total;
  }
  [[nodiscard]] std::size_t stored_bytes() const { return detail::stored_bytes_all_layers(*this); }
  /// The most one decode step over `layer` reads (every plane at tier 16); what it actually reads is
  /// reported by decode_attention's aligned::ReadStats.
  [[nodiscard]] std::size_t decode_read_bytes(int layer) const { return stored_bytes(layer); }
  [[nodiscard]] std::size_t elements() const { return detail::cached_elements(*this); }
  [[nodiscard]] double bits_per_element() const { return detail::bits_per_cached_element(*this); }

 private:
  [[nodiscard]] std::size_t index(int layer, int seq, int head) const noexcept {
    return (std::size_t(layer) * cfg_.batch + seq) * cfg_.kv_heads + head;
  }
  void check_index(int layer, int seq) const { detail::Fp16Rules::check_index(cfg_, layer, seq); }
  /// Moves a full staging block into the planes: keys channel-major, values token-major; nibbles of elements
  /// 2j and 2j + 1 share byte j.
  void flush(Stream& s) const {
    const int d = cfg_.head_dim;
    const std::size_t k0 = s.khi.size(), n0 = s.kmid.size(), v0 = s.vhi.size(), w0 = s.vmid.size();
    s.khi.resize(k0 + std::size_t(d) * Block);
    s.kmid.resize(n0 + std::size_t(d) * Block / 2, 0);
    s.klo.resize(n0 + std::size_t(d) * Block / 2, 0);
    s.vhi.resize(v0 + std::size_t(d) * Block);
    s.vmid.resize(w0 + std::size_t(d) * Block / 2, 0);
    s.vlo.resize(w0 + std::size_t(d) * Block / 2, 0);
    for (int t = 0; t < Block; ++t)
      for (int c = 0; c < d; ++c) {
        const std::uint16_t kb = s.kst[std::size_t(t) * d + c].bits, vb = s.vst[std::size_t(t) * d + c].bits;
        const std::size_t col = std::size_t(c) * Block + std::size_t(t);
        const int ks = (t % 2) * 4, vs = (c % 2) * 4;
        s.khi[k0 + col] = aligned::hi8(kb);
        s.kmid[n0 + col / 2] |= std::uint8_t(aligned::mid4(kb) << ks);
        s.klo[n0 + col / 2] |= std::uint8_t(aligned::lo4(kb) << ks);
        const std::size_t row = std::size_t(t) * d + std::size_t(c);
        s.vhi[v0 + row] = aligned::hi8(vb);
        s.vmid[w0 + row / 2] |= std::uint8_t(aligned::mid4(vb) << vs);
        s.vlo[w0 + row / 2] |= std::uint8_t(aligned::lo4(vb) << vs);
      }
    s.kst.clear();
    s.vst.clear();
  }

  CacheConfig cfg_;
  std::vector<Stream> streams_;
  std::vector<int> lengths_;
};
}  // namespace kvc
