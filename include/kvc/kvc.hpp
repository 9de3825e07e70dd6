/// \file kvc.hpp
/// Umbrella header: the whole host-side library.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/bit_packing.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/cpu_features.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>
#include <kvc/quant/codec.hpp>
#include <kvc/quant/group_quantizer.hpp>
#include <kvc/quant/no_quantizer.hpp>
#include <kvc/quant/uniform_quantizer.hpp>
#include <kvc/select/full_precision_window.hpp>
#include <kvc/select/log_window.hpp>
#include <kvc/gear/gear.hpp>
#include <kvc/qaq/bit_width.hpp>
#include <kvc/qaq/calibration.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>
#include <kvc/qaq/record_format.hpp>
#include <kvc/cache/cache_layout.hpp>
#include <kvc/cache/compressed_kv_cache.hpp>
#include <kvc/attention/decode_attention.hpp>
#include <kvc/attention/reference.hpp>
#include <kvc/qaq/qaq_cache.hpp>
#include <kvc/qaq/decode_attention.hpp>
#include <kvc/aligned/aligned_loader.hpp>
#include <kvc/aligned/aligned_cache.hpp>
#include <kvc/aligned/decode_attention.hpp>
#include <kvc/schemes.hpp>
