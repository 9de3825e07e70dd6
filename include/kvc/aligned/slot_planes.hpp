// kvc: nvcc-safe
/// \file slot_planes.hpp
/// AlignedKV over another scheme's fp16 parts: `CompressedKVCache<..., Selector, AlignedLoader<...>>` keeps the
/// selector's full-precision slots (KIVI's window and sink, LogQuant's log-distributed set) in AlignedKV's bit
/// planes instead of fp16 rows, and its decode attention reads each of their elements at the tier the loader's
/// rules give (aligned/aligned_loader.hpp; the kernel side is DecodeKernel::aligned_window).
///
/// Per stream and side a region of `stride` slots x d fp16 elements (stride = the selector's slots rounded up
/// to the block size, so the kernel reads whole chunks of slots), split as in the AlignedKV cache:
///   keys   channel-major over the slots (Rule 1 decides per channel): hi8 [d][stride], mid4 / lo4 [d][stride / 2];
///   values slot-major (Rule 2 decides per token):                     hi8 [stride][d], mid4 / lo4 [stride][d / 2].
/// Element i of a plane (i = c * stride + slot for keys, slot * d + c for values) has its hi8 byte at i and its
/// nibbles in byte i / 2 of the nibble planes (low nibble for even i). 2 x stride x d bytes: what fp16 rows take.
/// Host+device.
#pragma once

#include <kvc/config.hpp>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/core/numeric.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::aligned {

/// Addressing of one stream side's slot planes (see the file comment).
struct SlotPlanes {
  std::uint8_t* base;  ///< the region: hi8, then mid4, then lo4
  int stride;          ///< slots per plane row (even)
  int d;               ///< head_dim (even)
  bool keys;           ///< channel-major (keys) or slot-major (values)

  [[nodiscard]] KVC_HOST_DEVICE std::size_t elements() const noexcept { return std::size_t(stride) * d; }
  [[nodiscard]] KVC_HOST_DEVICE std::uint8_t* hi() const noexcept { return base; }
  [[nodiscard]] KVC_HOST_DEVICE std::uint8_t* mid() const noexcept { return base + elements(); }
  [[nodiscard]] KVC_HOST_DEVICE std::uint8_t* lo() const noexcept { return base + elements() + elements() / 2; }
  [[nodiscard]] KVC_HOST_DEVICE std::size_t index(int slot, int c) const noexcept {
    return keys ? std::size_t(c) * stride + slot : std::size_t(slot) * d + c;
  }
  /// The fp16 bits of element (slot, c) as a reader of `tier` leading bits sees them; reads only the planes the
  /// tier needs (hi8; mid4 from tier 12; lo4 at 16).
  [[nodiscard]] KVC_HOST_DEVICE std::uint16_t bits(int slot, int c, int tier = 16) const noexcept {
    const std::size_t i = index(slot, c);
    const int sh = int(i % 2) * 4;
    const std::uint8_t m = tier > 8 ? std::uint8_t(mid()[i / 2] >> sh & 0xFu) : std::uint8_t(0);
    const std::uint8_t l = tier == 16 ? std::uint8_t(lo()[i / 2] >> sh & 0xFu) : std::uint8_t(0);
    return assemble(hi()[i], m, l, tier);
  }
  KVC_HOST_DEVICE void set_bits(int slot, int c, std::uint16_t b) const noexcept {
    const std::size_t i = index(slot, c);
    const int sh = int(i % 2) * 4;
    const unsigned keep = 0xF0u >> sh;  // the other element's nibble of the shared byte
    hi()[i] = hi8(b);
    mid()[i / 2] = std::uint8_t((mid()[i / 2] & keep) | unsigned(mid4(b)) << sh);
    lo()[i / 2] = std::uint8_t((lo()[i / 2] & keep) | unsigned(lo4(b)) << sh);
  }
  /// Stores row `slot` (d values, rounded to fp16 as StorageTraits<half_t> does).
  KVC_HOST_DEVICE void store_row(int slot, const float* x) const noexcept {
    for (int c = 0; c < d; ++c) set_bits(slot, c, half_t::from_float(x[c]).bits);
  }
  /// Row `slot` at full precision, as floats.
  KVC_HOST_DEVICE void load_row(int slot, float* x) const noexcept {
    for (int c = 0; c < d; ++c) x[c] = detail::half_bits_to_float(bits(slot, c));
  }
  KVC_HOST_DEVICE void copy_row(int from, int to) const noexcept {
    for (int c = 0; c < d; ++c) set_bits(to, c, bits(from, c));
  }
};

/// n consecutive elements (n even, the first at an even plane index) read at `Tier` leading bits into out[0, n)
/// as fp16: hi: their n hi8 bytes, mid / lo: the n / 2 nibble bytes (only the planes the tier needs are
/// read). The kernel-side decode of slot planes (a run of one key channel's slots, or one value row).
template <int Tier>
KVC_HOST_DEVICE void assemble_run(const std::uint8_t* hi, const std::uint8_t* mid, const std::uint8_t* lo, int n,
                                  half_t* out) noexcept {
  static_assert(Tier == 8 || Tier == 12 || Tier == 16);
  for (int j = 0; j < n / 2; ++j) {
    unsigned e = unsigned(hi[2 * j]) << 8, o = unsigned(hi[2 * j + 1]) << 8;
    if constexpr (Tier == 8) {
      e |= 0x80u, o |= 0x80u;
    } else {
      const unsigned m = mid[j];
      e |= (m & 0xFu) << 4, o |= m & 0xF0u;
      if constexpr (Tier == 12) {
        e |= 0x8u, o |= 0x8u;
      } else {
        const unsigned l = lo[j];
        e |= l & 0xFu, o |= l >> 4;
      }
    }
    out[2 * j] = half_t{std::uint16_t(e)};
    out[2 * j + 1] = half_t{std::uint16_t(o)};
  }
}
/// assemble_run with a run-time tier (8, 12 or 16).
KVC_HOST_DEVICE void assemble_run(int tier, const std::uint8_t* hi, const std::uint8_t* mid, const std::uint8_t* lo,
                                  int n, half_t* out) noexcept {
  if (tier == 8) assemble_run<8>(hi, mid, lo, n, out);
  else if (tier == 12) assemble_run<12>(hi, mid, lo, n, out);
  else assemble_run<16>(hi, mid, lo, n, out);
}
}  // namespace kvc::aligned
