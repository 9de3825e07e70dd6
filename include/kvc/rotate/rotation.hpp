// kvc: nvcc-safe
/// \file rotation.hpp
/// `kvc::Rotation<KeyTransform, ValueTransform>`: an orthonormal transform R of every KV head's rows
/// applied before quantization (QuaRot / SpinQuant / llama.cpp's rotated KV cache): it spreads outlier
/// channels over all channels, so a uniform grid fits better. It composes with every quantizer,
/// selector and GEAR correction of `CompressedKVCache`, because attention is computed in the rotated
/// basis and nothing per token changes:
///   keys:   q . k_t = (R_k q) . (R_k k_t)          the query is rotated once per step and query head;
///   values: o = R_v^T sum_t p_t (R_v v_t)          the output is un-rotated once per step and query head.
/// Keys and values are switched separately: `Rotation<Hadamard<>>` rotates both,
/// `RotateKeys<Hadamard<>>` / `RotateValues<Hadamard<>>` one side (the other is `NoTransform`).
/// Each (layer, KV head, side) has its own transform, drawn from the transform's seed; the cache stores
/// the tables (counted in stored_bytes: they are read by every decode step) and dequantize() returns
/// rows in the original basis.
/// Input limits: a rotated row can have a larger max |x| than the row (up to |x|_2): appends check the
/// rotated rows against the storage's range and name the token, head and rotated channel.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/rotate/hadamard.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc {

/// A transform a Rotation applies to one side (see hadamard.hpp for the interface).
template <class T>
concept Transform = requires(int d, std::uint64_t id, std::uint32_t* t, float* x) {
  { T::kActive } -> std::convertible_to<bool>;
  { T::name() } -> std::convertible_to<const char*>;
  { T::supports(d) } -> std::convertible_to<bool>;
  { T::table_words(d) } -> std::convertible_to<std::size_t>;
  T::make_table(d, id, t);
  T::apply(t, d, x);
  T::apply_transpose(t, d, x);
};

/// Rotation policy: keys through KeyTransform, values through ValueTransform (NoTransform: that side
/// is stored in its original basis). Host+device.
template <Transform KeyTransform, Transform ValueTransform = KeyTransform>
struct Rotation {
  using policy_kind = kind::rotation;
  using key_transform = KeyTransform;
  using value_transform = ValueTransform;
  static constexpr bool kKeys = KeyTransform::kActive;
  static constexpr bool kValues = ValueTransform::kActive;
  static constexpr bool kActive = kKeys || kValues;

  static constexpr bool supports(int d) noexcept { return KeyTransform::supports(d) && ValueTransform::supports(d); }
  /// 32-bit words of one (layer, KV head)'s tables: [key table][value table].
  KVC_HOST_DEVICE static constexpr std::size_t head_words(int d) noexcept {
    return KeyTransform::table_words(d) + ValueTransform::table_words(d);
  }
  /// The table of one side of KV head `head` in a layer's tables ([kv_heads][head_words]).
  KVC_HOST_DEVICE static const std::uint32_t* table(const std::uint32_t* layer_tables, bool keys, int head,
                                                    int d) noexcept {
    return layer_tables + std::size_t(head) * head_words(d) + (keys ? 0u : KeyTransform::table_words(d));
  }
  /// x <- R x (keys: the rotation of keys and queries; values: of values), over x[0, d).
  KVC_HOST_DEVICE static void rotate(bool keys, const std::uint32_t* layer_tables, int head, int d, float* x) noexcept {
    if (keys) KeyTransform::apply(table(layer_tables, true, head, d), d, x);
    else ValueTransform::apply(table(layer_tables, false, head, d), d, x);
  }
  /// x <- R^T x (values: the attention output back in the original basis).
  KVC_HOST_DEVICE static void unrotate(bool keys, const std::uint32_t* layer_tables, int head, int d,
                                       float* x) noexcept {
    if (keys) KeyTransform::apply_transpose(table(layer_tables, true, head, d), d, x);
    else ValueTransform::apply_transpose(table(layer_tables, false, head, d), d, x);
  }
  /// Draws every table of a cache into t[layers][kv_heads][head_words(d)] (host). Stream ids mix layer,
  /// head and side, so no two of them share signs.
  static void make_tables(int layers, int kv_heads, int d, std::uint32_t* t) noexcept {
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        const std::uint64_t id = (std::uint64_t(l) << 32) | (std::uint64_t(h) << 1);
        std::uint32_t* head = t + (std::size_t(l) * kv_heads + h) * head_words(d);
        KeyTransform::make_table(d, id, head);
        ValueTransform::make_table(d, id | 1u, head + KeyTransform::table_words(d));
      }
  }
  static constexpr const char* name() noexcept { return "rotation"; }
};

/// Rotate keys only / values only.
template <Transform T>
using RotateKeys = Rotation<T, NoTransform>;
template <Transform T>
using RotateValues = Rotation<NoTransform, T>;
/// What a cache without a Rotation policy uses (every member a no-op, no tables).
using NoRotation = Rotation<NoTransform, NoTransform>;

}  // namespace kvc
