// kvc: nvcc-safe
/// \file bit_packing.hpp
/// Packing of 1..8-bit codes into bit planes laid out for SIMD unpacking.
///
/// Layout ("plane packing"). A code stream of n codes (n a multiple of kPackQuantum) is cut into
/// 64-code chunks. A b-bit code is split into planes of width 8, or 4/2/1 following the binary digits
/// of b (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1), low bits first. In a plane of width w, 8/w consecutive
/// chunks share one 64-byte vector: byte j of vector m holds bit-field i (bits [i*w, i*w+w)) =
/// the plane's bits of code (m*(8/w) + i)*64 + j. Unpacking a plane is therefore one shift and one
/// mask per chunk on a 64-byte (or 2x32-byte) register, and the packed size is exactly n*b/8 bytes.
#pragma once

#include <kvc/config.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc {

/// Code counts must be multiples of this (64-byte chunks, up to 8 chunks per 1-bit plane vector).
inline constexpr std::size_t kPackQuantum = 512;

/// Width of plane p of a b-bit code (0 when p is past the last plane). Host+device.
KVC_HOST_DEVICE constexpr int plane_width(int bits, int p) noexcept {
  if (bits == 8) return p == 0 ? 8 : 0;
  int seen = 0;
  for (int w = 4; w >= 1; w >>= 1) {
    if (bits & w) {
      if (seen == p) return w;
      ++seen;
    }
  }
  return 0;
}
/// Bit offset of plane p inside the code (planes are stored low bits first).
KVC_HOST_DEVICE constexpr int plane_offset(int bits, int p) noexcept {
  int off = 0;
  for (int i = 0; i < p; ++i) off += plane_width(bits, i);
  return off;
}
KVC_HOST_DEVICE constexpr int plane_count(int bits) noexcept {
  int c = 0;
  while (plane_width(bits, c) != 0) ++c;
  return c;
}
/// Packed size in bytes of n codes of `bits` bits.
KVC_HOST_DEVICE constexpr std::size_t packed_bytes(std::size_t n, int bits) noexcept { return n * bits / 8; }

/// Random access to code `idx` of a packed stream of n codes. Host+device; O(planes).
KVC_HOST_DEVICE std::uint8_t packed_code_at(const std::uint8_t* packed, std::size_t n, int bits,
                                            std::size_t idx) noexcept {
  const std::size_t chunk = idx / 64, j = idx % 64;
  std::uint32_t code = 0;
  std::size_t base = 0;
  for (int p = 0, off = 0; p < plane_count(bits); ++p) {
    const int w = plane_width(bits, p);
    const std::size_t per = 8u / static_cast<unsigned>(w);
    const std::size_t m = chunk / per, i = chunk % per;
    const std::uint32_t byte = packed[base + m * 64 + j];
    code |= ((byte >> (i * w)) & ((1u << w) - 1u)) << off;
    base += n * static_cast<std::size_t>(w) / 8;
    off += w;
  }
  return static_cast<std::uint8_t>(code);
}

/// Packs n codes (each < 2^bits, n % kPackQuantum == 0) into packed_bytes(n, bits) bytes.
/// Host+device; the caller guarantees the preconditions (the cache checks them once at construction).
/// Cooperative form: the call with (lane, lanes) writes the output bytes k*64 + j of each plane with
/// (k*64 + j) % lanes == lane; `lanes` callers with lanes 0..lanes-1 write every byte exactly once.
KVC_HOST_DEVICE void pack_codes(const std::uint8_t* codes, std::size_t n, int bits, std::uint8_t* out,
                                unsigned lane = 0, unsigned lanes = 1) noexcept {
  std::size_t base = 0;
  for (int p = 0, off = 0; p < plane_count(bits); ++p) {
    const int w = plane_width(bits, p);
    const unsigned per = 8u / static_cast<unsigned>(w);
    const std::uint32_t mask = (1u << w) - 1u;
    const std::size_t plane_bytes = n * static_cast<std::size_t>(w) / 8;
    for (std::size_t k = lane; k < plane_bytes; k += lanes) {
      const std::size_t m = k / 64, j = k % 64;
      std::uint32_t byte = 0;
      for (unsigned i = 0; i < per; ++i) byte |= ((codes[(m * per + i) * 64 + j] >> off) & mask) << (i * w);
      out[base + k] = static_cast<std::uint8_t>(byte);
    }
    base += plane_bytes;
    off += w;
  }
}

/// Unpacks n codes into one byte each (portable; the SIMD kernels inline their own version).
/// Same preconditions as pack_codes: the first plane writes every code, later planes OR into it.
KVC_HOST_DEVICE void unpack_codes(const std::uint8_t* packed, std::size_t n, int bits, std::uint8_t* codes) noexcept {
  std::size_t base = 0;
  for (int p = 0, off = 0; p < plane_count(bits); ++p) {
    const int w = plane_width(bits, p);
    const unsigned per = 8u / static_cast<unsigned>(w);
    const std::uint32_t mask = (1u << w) - 1u;
    const std::size_t vectors = n / (64u * per);
    for (std::size_t m = 0; m < vectors; ++m)
      for (unsigned i = 0; i < per; ++i)
        for (std::size_t j = 0; j < 64; ++j) {
          const auto v = static_cast<std::uint8_t>(((packed[base + m * 64 + j] >> (i * w)) & mask) << off);
          std::uint8_t& c = codes[(m * per + i) * 64 + j];
          c = p == 0 ? v : static_cast<std::uint8_t>(c | v);
        }
    base += n * static_cast<std::size_t>(w) / 8;
    off += w;
  }
}

/// Dense LSB-first packing (token rows: PartialLogQuant's value rows, QAQ's records): code c of `bits`
/// bits at bit offset c * bits. or_dense_code ORs code (< 2^bits) in: the bytes it touches start zeroed.
KVC_HOST_DEVICE void or_dense_code(std::uint8_t* p, int c, int bits, unsigned code) noexcept {
  const int bit = c * bits, at = bit >> 3, sh = bit & 7;
  p[at] = static_cast<std::uint8_t>(p[at] | (code << sh));
  if (sh + bits > 8) p[at + 1] = static_cast<std::uint8_t>(p[at + 1] | (code >> (8 - sh)));
}
/// Code c of a dense LSB-first stream of `bits`-bit codes.
KVC_HOST_DEVICE int dense_code_at(const std::uint8_t* p, int c, int bits) noexcept {
  const int bit = c * bits, at = bit >> 3, sh = bit & 7;
  unsigned v = p[at] >> sh;
  if (sh + bits > 8) v |= unsigned(p[at + 1]) << (8 - sh);
  return int(v & ((1u << bits) - 1u));
}
}  // namespace kvc
