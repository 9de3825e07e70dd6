/// \file setup_checks.hpp
/// The checks every QAQ cache (host: qaq_cache.hpp, device: kvc::cuda::DeviceQaqCache) makes of its setup,
/// written once so both throw the same kvc::Error. Host only.
#pragma once

#include <kvc/cache/policies.hpp>
#include <kvc/core/error.hpp>
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/calibration.hpp>

#include <cmath>

namespace kvc::qaq {

/// Error targets must be finite and positive (SPEC Q1).
inline void check_targets(Targets t) {
  KVC_CHECK(std::isfinite(t.key_sigma_s) && t.key_sigma_s > 0.0 && std::isfinite(t.value_sigma_x) && t.value_sigma_x > 0.0,
            Errc::kInvalidArgument, "QAQ targets must be finite and positive (sigma_S ", t.key_sigma_s, ", sigma_X ",
            t.value_sigma_x, ")");
}

/// cfg as for every cache, head_dim a multiple of 16 and <= max_head_dim (uint8 outlier channels); the
/// calibration of the same layers, KV heads and head_dim with every entry finite and positive.
inline void check_setup(const CacheConfig& cfg, const QueryNormCalibration& calib, int max_head_dim) {
  KVC_CHECK(cfg.layers > 0 && cfg.batch > 0 && cfg.kv_heads > 0 && cfg.head_dim > 0 && cfg.capacity > 0,
            Errc::kInvalidArgument, "cache config needs positive layers, batch, kv_heads, head_dim and capacity (got ",
            cfg.layers, ", ", cfg.batch, ", ", cfg.kv_heads, ", ", cfg.head_dim, ", ", cfg.capacity, ")");
  KVC_CHECK(cfg.head_dim % 16 == 0 && cfg.head_dim <= max_head_dim, Errc::kInvalidArgument, "QAQ: head_dim ",
            cfg.head_dim, " must be a multiple of 16 and at most ", max_head_dim, " (uint8 outlier channels)");
  calib.check_shape(cfg.layers, cfg.kv_heads, cfg.head_dim);
  for (float q : calib.qnorm2)
    KVC_CHECK(std::isfinite(q) && q > 0.0f, Errc::kInvalidArgument, "QAQ calibration holds ", q,
              " (entries must be finite and positive: set every layer)");
}
}  // namespace kvc::qaq
