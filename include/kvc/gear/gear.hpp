/// \file gear.hpp
/// GEAR (SPEC §1): a quantized backbone plus sparse full-precision outliers and a low-rank
/// approximation of the quantization residual, X~ = D^ + S + A B^T. Compose the policies with any
/// quantizer in CompressedKVCache, e.g. (KIVI-2 backbone, 1 % outliers, rank 1, 128-token blocks):
///   CompressedKVCache<keys<GroupQuantizer<2, 128, Axis::kChannel>>, values<GroupQuantizer<2, 64, Axis::kToken>>,
///                     OutlierFilter<100>, LowRankResidual<Rank<1>>>
/// Named configurations: kvc::schemes::Gear4, GearKivi4, GearKivi2, OutlierQuant4, LowRankQuant4.
///  - outlier_filter.hpp     OutlierFilter<s>, select_outliers (O(n), ties by index)
///  - low_rank_residual.hpp  LowRankResidual<KRank, VRank, Iters, Init, EveryQR>, Rho<bp>, Rank<r>
///  - power_iteration.hpp    the fit, once, against a GEMM + thin-QR backend (host: host_linalg.hpp)
///  - block_correction.hpp   the per-block region and the attention epilogues (host+device)
///  - literal_mode.hpp       block mode [default] vs LiteralMode (Algorithm 1: recompress the history)
#pragma once

#include <kvc/gear/block_correction.hpp>
#include <kvc/gear/host_linalg.hpp>
#include <kvc/gear/literal_mode.hpp>
#include <kvc/gear/low_rank_residual.hpp>
#include <kvc/gear/outlier_filter.hpp>
#include <kvc/gear/power_iteration.hpp>
