/// \file schemes.hpp
/// Named cache schemes: the configurations the benchmarks, examples and quality harness compare.
#pragma once

#include <kvc/cache/compressed_kv_cache.hpp>
#include <kvc/quant/group_quantizer.hpp>
#include <kvc/quant/no_quantizer.hpp>
#include <kvc/quant/uniform_quantizer.hpp>
#include <kvc/select/full_precision_window.hpp>

namespace kvc::schemes {

/// Uncompressed fp32 cache (32 bits/element).
using Fp32 = CompressedKVCache<NoQuantizer<float>>;
/// Uncompressed fp16 cache (16 bits/element): the baseline.
using Fp16 = CompressedKVCache<NoQuantizer<half_t>>;
/// 8-bit per-token uniform quantization of keys and values (8 + 32/head_dim bits/element).
using Int8 = CompressedKVCache<UniformQuantizer<8, Scope::kToken>>;
/// KIVI: keys per channel over Group-token blocks, values per token in Group-channel groups, the
/// newest `Window` tokens in fp16 (sliding).
template <int Bits, int Group = 32, int Window = 128>
using Kivi = CompressedKVCache<keys<GroupQuantizer<Bits, Group, Axis::kChannel>>,
                               values<GroupQuantizer<Bits, Group, Axis::kToken>>, FullPrecisionWindow<Window>>;
using Kivi4 = Kivi<4>;
using Kivi2 = Kivi<2>;
}  // namespace kvc::schemes
