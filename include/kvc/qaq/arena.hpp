// kvc: nvcc-safe
/// \file arena.hpp
/// QAQ's device storage of one stream side (kvc::cuda::DeviceQaqCache): the width buckets of the host cache
/// (qaq_cache.hpp) back to back, ascending width, in one arena:
///   [bucket BMin: n[0] records][bucket BMin + 1: n[1] records] ... [bucket BMax: n[W - 1] records]
/// Records are RecordFormat<Q>'s, so a bucket is the host bucket's bytes. A stream side of capacity C needs at
/// most C records of BMax bytes; new tokens (width BMax) go to the end of the last bucket, so appends never
/// move a record. `slot(i)` numbers the records across buckets: the split plan of the attention kernels
/// walks [0, T) without knowing the widths. Host+device.
#pragma once

#include <kvc/config.hpp>
#include <kvc/qaq/record_format.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::qaq {

template <class Q>
struct Arena {
  using record = RecordFormat<Q>;
  static constexpr int kMinBits = Q::kMinBits;
  static constexpr int kWidths = Q::kMaxBits - Q::kMinBits + 1;
  /// Bytes of one stream side's arena for `capacity` tokens (rounded up to 16 for vector access).
  KVC_HOST_DEVICE static constexpr std::size_t bytes(int d, int capacity, int id_bytes) noexcept {
    return (std::size_t(capacity) * record::bytes(d, Q::kMaxBits, id_bytes) + 15) / 16 * 16;
  }
  /// Byte offset of bucket b given the record counts n[0, kWidths) of the side.
  KVC_HOST_DEVICE static std::size_t bucket_offset(const std::uint32_t* n, int b, int d, int id_bytes) noexcept {
    std::size_t o = 0;
    for (int w = kMinBits; w < b; ++w) o += std::size_t(n[w - kMinBits]) * record::bytes(d, w, id_bytes);
    return o;
  }
  /// Where record i (in [0, sum n)) lives: its width and byte offset.
  struct Slot {
    int width;
    std::size_t offset;
  };
  KVC_HOST_DEVICE static Slot slot(const std::uint32_t* n, std::uint32_t i, int d, int id_bytes) noexcept {
    int w = kMinBits;
    for (; w < Q::kMaxBits && i >= n[w - kMinBits]; ++w) i -= n[w - kMinBits];
    return {w, bucket_offset(n, w, d, id_bytes) + std::size_t(i) * record::bytes(d, w, id_bytes)};
  }
};
}  // namespace kvc::qaq
