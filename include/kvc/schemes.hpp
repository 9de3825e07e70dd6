/// \file schemes.hpp
/// Named cache schemes: the configurations the benchmarks, examples and quality harness compare.
#pragma once

#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/cache/compressed_kv_cache.hpp>
#include <kvc/gear/literal_mode.hpp>
#include <kvc/gear/low_rank_residual.hpp>
#include <kvc/gear/outlier_filter.hpp>
#include <kvc/quant/group_quantizer.hpp>
#include <kvc/quant/no_quantizer.hpp>
#include <kvc/quant/uniform_quantizer.hpp>
#include <kvc/rotate/rotation.hpp>
#include <kvc/select/full_precision_window.hpp>
#include <kvc/select/log_window.hpp>

namespace kvc::schemes {

/// Uncompressed fp32 cache (32 bits/element).
using Fp32 = CompressedKVCache<NoQuantizer<float>>;
/// Uncompressed fp16 cache (16 bits/element): the baseline.
using Fp16 = CompressedKVCache<NoQuantizer<half_t>>;
/// 8-bit per-token uniform quantization of keys and values (8 + 32/head_dim bits/element).
using Int8 = CompressedKVCache<UniformQuantizer<8, Scope::kToken>>;
/// 4-bit per-token uniform quantization of keys and values (4 + 32/head_dim bits/element): the grid a
/// rotation helps most (Rotated<Int4>).
using Int4 = CompressedKVCache<UniformQuantizer<4, Scope::kToken>>;
/// KIVI: keys per channel over Group-token blocks, values per token in Group-channel groups, the
/// newest `Window` tokens in fp16 (sliding).
template <int Bits, int Group = 32, int Window = 128>
using Kivi = CompressedKVCache<keys<GroupQuantizer<Bits, Group, Axis::kChannel>>,
                               values<GroupQuantizer<Bits, Group, Axis::kToken>>, FullPrecisionWindow<Window>>;
using Kivi4 = Kivi<4>;
using Kivi2 = Kivi<2>;
/// KIVI on `Block`-token key groups and `VGroup`-channel value groups with a `Sink`-token fp16 attention
/// sink on the block grid (AlignedSinkWindow: the sink's rows of block 0 are masked, no grid sees it) and
/// a `Window`-token fp16 window; with Window = 0, only the sink is fp16 at multiples of `Block` tokens.
/// Rotated<KiviGridSink<4>> is the <= 4.6-bit scheme of the SmolLM2 sweep: 4.53 bits, ΔPPL -0.06 (README).
template <int Bits, int Block = 64, int Sink = 4, int Window = 0, int VGroup = 64>
using KiviGridSink = CompressedKVCache<keys<GroupQuantizer<Bits, Block, Axis::kChannel>>,
                                       values<GroupQuantizer<Bits, VGroup, Axis::kToken>>, BlockTokens<Block>,
                                       AlignedSinkWindow<Window, Sink>>;

/// LogQuant (SPEC §4): KIVI's group quantization (keys per channel over `Group`-token blocks, values
/// per token in `Group`-channel groups; G = 64 in the paper, 32 allowed) with LogQuant's log-distributed
/// full-precision set of at most 3W tokens (LogWindow<W>). Evicted tokens are staged in fp16 until a
/// block of `Group` accumulates, then quantized once; the staged rows count in bits_per_element().
template <int Bits, int W = 42, int Group = 64>
using LogQuant = CompressedKVCache<keys<GroupQuantizer<Bits, Group, Axis::kChannel>>,
                                   values<GroupQuantizer<Bits, Group, Axis::kToken>>, LogWindow<W>>;
/// The paper's main configuration: 2-bit, G = 64, W = 42 (R = 128's budget: at most 126 fp16 tokens
/// in the set, plus up to 63 staged).
using LogQuant2 = LogQuant<2>;
using LogQuant4 = LogQuant<4>;
/// PartialLogQuant (SPEC §4.3): keys keep LogQuant's log-distributed set of at most 3W tokens, values only
/// the newest W (PartialLogWindow); a value leaving its window is quantized per token into a row beside
/// its fp16 key, and its block later holds the same codes. The paper's W = floor(R / 2) = 64 for
/// R = 128: at most 3W = 192 fp16 keys and W = 64 fp16 values (<= 2R rows), plus up to G - 1 staged keys.
template <int Bits, int W = 64, int Group = 64>
using PartialLogQuant = CompressedKVCache<keys<GroupQuantizer<Bits, Group, Axis::kChannel>>,
                                          values<GroupQuantizer<Bits, Group, Axis::kToken>>, PartialLogWindow<W>>;
using PartialLogQuant2 = PartialLogQuant<2>;
/// KIVI-2 on LogQuant2's quantizer and budget for the side-by-side: G = 64 groups and blocks, the newest
/// 126 tokens in fp16 (plus up to 63 not yet in a block), same bits per quantized element.
using Kivi2Budget126 = Kivi<2, 64, 126>;

/// GEAR (SPEC §1) in block mode: every completed block of `Block` tokens of one KV head is compressed
/// once: the signed top/bottom s/2 entries kept exact (OutlierFilter), the rest quantized, and the
/// residual's rank-r approximation (LowRankResidual, power iteration) stored in fp16. The ring of at
/// most Block - 1 newest tokens (plus `Window`) is GEAR's fp16 streaming buffer n_b.
/// Paper configuration: per-tensor (one block of one head) 4-bit backbone, s = 2 %, rho = 2 %, n_b = 64.
using Gear4 = CompressedKVCache<UniformQuantizer<4, Scope::kTensor>, OutlierFilter<200>, LowRankResidual<Rho<200>>,
                                BlockTokens<64>>;
/// Gear4 in literal mode (Algorithm 1: the whole history recompressed from its reconstruction at
/// every flush of n_b = 64 tokens; slow, errors compound), outliers still per block.
using Gear4Literal = CompressedKVCache<UniformQuantizer<4, Scope::kTensor>, OutlierFilter<200>,
                                       LowRankResidual<Rho<200>>, BlockTokens<64>, LiteralMode>;
/// Paper mode: literal mode with the outliers selected over the whole history of each KV head
/// (OutlierScope::kStream), for reproducing the paper.
using Gear4Paper = CompressedKVCache<UniformQuantizer<4, Scope::kTensor>, OutlierFilter<200, OutlierScope::kStream>,
                                     LowRankResidual<Rho<200>>, BlockTokens<64>, LiteralMode>;
/// The paper's ablations on the same backbone: outliers only ("Outlier-reduced quantization", s = 5 %)
/// and low-rank only (rho = 5 %).
using OutlierQuant4 = CompressedKVCache<UniformQuantizer<4, Scope::kTensor>, OutlierFilter<500>, BlockTokens<64>>;
using LowRankQuant4 = CompressedKVCache<UniformQuantizer<4, Scope::kTensor>, LowRankResidual<Rho<500>>, BlockTokens<64>>;
/// A KIVI backbone for GEAR's corrections: keys per channel over `Block`-token blocks, values per token
/// in `VGroup`-channel groups, the `Window` newest tokens in fp16, then the correction policies.
template <int Bits, int Block, int VGroup, int Window, class... Corrections>
using KiviWith = CompressedKVCache<keys<GroupQuantizer<Bits, Block, Axis::kChannel>>,
                                   values<GroupQuantizer<Bits, VGroup, Axis::kToken>>, FullPrecisionWindow<Window>,
                                   Corrections...>;
/// GEAR on KIVI-4: 128-token blocks (key groups), 64-channel value groups, 1 % outliers, rank 1, no
/// window beyond the ring (real-model sweep: README).
using GearKivi4 = KiviWith<4, 128, 64, 0, OutlierFilter<100>, LowRankResidual<Rank<1>>>;
/// GEAR on exactly KIVI-2's backbone (group 32, 128-token window): 0.5 % outliers, rank 1 (1 % costs
/// 1.4x KIVI-2's decode time for KL 0.118 instead of 0.139 on SmolLM2; README).
using GearKivi2 = KiviWith<2, 32, 32, 128, OutlierFilter<50>, LowRankResidual<Rank<1>>>;

namespace detail {
template <class Cache, class... Extra>
struct add_policies;
template <class... P, class... Extra>
struct add_policies<CompressedKVCache<P...>, Extra...> {
  using type = CompressedKVCache<P..., Extra...>;
};
}  // namespace detail
/// Scheme `Cache` with its keys and values rotated before quantization (rotate/rotation.hpp; default: a
/// randomized Hadamard transform of both sides). E.g. Rotated<Kivi2>, Rotated<Int4>.
template <class Cache, class Rot = Rotation<Hadamard<>>>
using Rotated = typename detail::add_policies<Cache, Rot>::type;
/// ... values only (per-channel key groups, as KIVI's, already isolate outlier channels).
template <class Cache>
using RotatedValues = Rotated<Cache, RotateValues<Hadamard<>>>;
/// Scheme `Cache` with its full-precision slots (KIVI's window and sink, LogQuant's set) stored as AlignedKV
/// bit planes and read at the precision AlignedKV's rules give (aligned/slot_planes.hpp): the same bytes
/// stored; what a step reads is reported by decode_attention's aligned::ReadStats. E.g. AlignedWindow<Kivi2>,
/// AlignedWindow<LogQuant2>.
template <class Cache, class Loader = AlignedLoader<>>
using AlignedWindow = typename detail::add_policies<Cache, Loader>::type;
}  // namespace kvc::schemes
