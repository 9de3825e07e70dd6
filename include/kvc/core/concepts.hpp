// kvc: nvcc-safe
/// \file concepts.hpp
/// Policy kinds, one concept per kind, and the order-free composition of `Policy...` packs used by
/// `CompressedKVCache<Policy...>`: one policy per kind, defaults for missing kinds, and
/// `static_assert`s that read like error messages for duplicates and non-policies.
#pragma once

#include <kvc/config.hpp>

#include <concepts>
#include <cstddef>
#include <type_traits>

namespace kvc {

/// Tags naming what a policy is. Every policy struct says `using policy_kind = kind::X;`.
namespace kind {
struct quantizer {};        ///< value <-> code for both keys and values (wrap in keys<>/values<> for one side)
struct key_quantizer {};    ///< kvc::keys<Q>
struct value_quantizer {};  ///< kvc::values<Q>
struct selector {};         ///< which tokens stay in full precision (window, sink, ...)
struct block_layout {};     ///< tokens per block
struct outlier_filter {};   ///< sparse full-precision outliers (GEAR, QAQ)
struct residual {};         ///< low-rank residual correction (GEAR)
struct loader {};           ///< how attention reads stored elements (AlignedKV)
struct streaming {};        ///< when compressed blocks are recompressed (GEAR's literal mode)
struct adaptive_quantizer {};  ///< per-token bit-widths chosen every step (QAQ)
struct rotation {};         ///< orthonormal transform of K/V rows before quantization (kvc::Rotation)
}  // namespace kind

template <class P>
concept Policy = requires { typename P::policy_kind; };

template <class P, class K>
concept PolicyOf = Policy<P> && std::same_as<typename P::policy_kind, K>;

/// Grouping axis of a quantizer inside one block (B tokens x d channels of one KV head).
/// kChannel: a group is one channel over `Group` tokens (KIVI keys). kToken: a group is `Group`
/// consecutive channels of one token (KIVI values).
enum class Axis { kToken, kChannel };

/// A quantizer maps a group of values to `kBits`-bit codes plus per-group metadata.
/// Contract the compiler cannot check: for every element, |decode(encode(x)) - x| <= step/2 of its
/// group (plus float rounding), where step is the group's stored step. Host+device (the CPU
/// attention and the CUDA kernels decode with the same struct).
/// Group shape: kGroupTokens tokens x kGroupChannels channels; 0 means "the whole extent"
/// (the whole block of tokens, or the whole head dimension).
template <class Q>
concept Quantizer = PolicyOf<Q, kind::quantizer> && requires {
  { Q::kBits } -> std::convertible_to<int>;
  { Q::kIsIdentity } -> std::convertible_to<bool>;
  { Q::kGroupTokens } -> std::convertible_to<int>;
  { Q::kGroupChannels } -> std::convertible_to<int>;
  { Q::kRequiredBlockTokens } -> std::convertible_to<int>;
  { Q::name() } -> std::convertible_to<const char*>;
};

/// A full-precision token selector decides which tokens are kept uncompressed and in which order
/// tokens enter the quantized blocks. Its state is a pure function of the sequence length (no scores,
/// no query), so one rule serves every layer and head. The interface is documented in
/// select/full_precision_window.hpp (FullPrecisionWindow, LogWindow).
template <class S>
concept Selector = PolicyOf<S, kind::selector> && requires(int n, int* pos) {
  { S::quantized_blocks(n, n) } -> std::convertible_to<int>;
  { S::capacity_blocks(n, n) } -> std::convertible_to<int>;
  { S::fp_slots(n) } -> std::convertible_to<int>;
  { S::fp_slot(n, n, n) } -> std::convertible_to<int>;
  typename S::storage;
  S::positions(n, n, pos);
};

namespace detail {
/// Rows at the start of block 0 that hold no token (AlignedSinkWindow: where its sink sits on the block
/// grid; the kernels mask them out of the softmax); 0 for every other selector. Host+device.
template <class S>
KVC_HOST_DEVICE constexpr int masked_rows() noexcept {
  if constexpr (requires { S::kMaskedRows; }) return S::kMaskedRows;
  else return 0;
}
/// Full-precision tokens of a stream holding n tokens (everything not in a quantized block).
template <class S>
KVC_HOST_DEVICE constexpr int fp_tokens(int n, int block_tokens) noexcept {
  const int nb = S::quantized_blocks(n, block_tokens);
  return n - nb * block_tokens + (nb > 0 ? masked_rows<S>() : 0);
}
/// Stored rows (block rows, masked ones included, then full-precision tokens): what positions() fills.
template <class S>
KVC_HOST_DEVICE constexpr int stored_rows(int n, int block_tokens) noexcept {
  return S::quantized_blocks(n, block_tokens) * block_tokens + fp_tokens<S>(n, block_tokens);
}
}  // namespace detail

/// Apply a quantizer to keys only / values only.
template <Quantizer Q>
struct keys {
  using policy_kind = kind::key_quantizer;
  using type = Q;
};
template <Quantizer Q>
struct values {
  using policy_kind = kind::value_quantizer;
  using type = Q;
};

/// Tokens per block: the unit of storage, quantization and kernel streaming.
template <int Tokens>
struct BlockTokens {
  static_assert(Tokens > 0 && Tokens % 32 == 0, "kvc::BlockTokens<N>: N must be a positive multiple of 32");
  using policy_kind = kind::block_layout;
  static constexpr int kTokens = Tokens;
};

namespace detail {
template <class T>
inline constexpr bool dependent_false = false;

template <class K, class... P>
inline constexpr int count_kind = (0 + ... + (PolicyOf<P, K> ? 1 : 0));

/// The policy of kind K in P..., or Default when there is none.
template <class K, class Default, class... P>
struct find_policy {
  using type = Default;
};
template <class K, class Default, class First, class... Rest>
struct find_policy<K, Default, First, Rest...> {
  using type = std::conditional_t<PolicyOf<First, K>, First, typename find_policy<K, Default, Rest...>::type>;
};

/// Checks shared by every composition: each argument is a kvc policy, no kind appears twice.
template <class... P>
struct check_policies {
  static constexpr bool kAllPolicies = (true && ... && Policy<P>);
  static_assert(kAllPolicies,
                "kvc: every template argument of CompressedKVCache must be a kvc policy (a struct with a "
                "policy_kind member, e.g. kvc::GroupQuantizer<...>, kvc::keys<...>, kvc::FullPrecisionWindow<...>)");
  static constexpr bool kNoDuplicates =
      count_kind<kind::quantizer, P...> <= 1 && count_kind<kind::key_quantizer, P...> <= 1 &&
      count_kind<kind::value_quantizer, P...> <= 1 && count_kind<kind::selector, P...> <= 1 &&
      count_kind<kind::block_layout, P...> <= 1 && count_kind<kind::outlier_filter, P...> <= 1 &&
      count_kind<kind::residual, P...> <= 1 && count_kind<kind::loader, P...> <= 1 &&
      count_kind<kind::streaming, P...> <= 1 && count_kind<kind::adaptive_quantizer, P...> <= 1 &&
      count_kind<kind::rotation, P...> <= 1;
  static_assert(!kAllPolicies || kNoDuplicates,
                "kvc: duplicate policy kind: CompressedKVCache takes at most one policy of each kind "
                "(one quantizer or one keys<>/values<> pair, one selector, one BlockTokens, one Rotation)");
  static constexpr bool kBareQuantizerAlone =
      count_kind<kind::quantizer, P...> == 0 ||
      (count_kind<kind::key_quantizer, P...> == 0 && count_kind<kind::value_quantizer, P...> == 0);
  static_assert(!kAllPolicies || kBareQuantizerAlone,
                "kvc: a bare quantizer applies to both keys and values; do not combine it with kvc::keys<> "
                "or kvc::values<> (wrap it as the other side instead)");
  static constexpr bool kOk = kAllPolicies && kNoDuplicates && kBareQuantizerAlone;
};
}  // namespace detail
}  // namespace kvc
