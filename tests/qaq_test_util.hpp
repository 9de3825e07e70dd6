// Helpers shared by the QAQ tests (test_qaq_record.cpp: the width rule, codec, record format and calibration;
// test_qaq.cpp: the mixed-bit cache and its fused attention).
#pragma once

#include <kvc/core/error.hpp>
#include <kvc/qaq/qaq_quantizer.hpp>

#include "test_data.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kvc_test::qaq {

// fp16-representable normal values of standard deviation `scale`.
inline std::vector<float> fp16_row(std::mt19937& rng, int d, float scale) {
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> x(static_cast<std::size_t>(d));
  for (float& v : x) v = kvc::half_t::from_float(n(rng)).to_float();
  return x;
}

/// One token coded by Q at B_max: codes, outlier channels and values, metadata.
struct Coded {
  std::vector<std::uint8_t> codes, idx;
  std::vector<kvc::half_t> val;
  kvc::QuantMeta m;
};

template <class Q>
Coded code(const std::vector<float>& x) {
  const int d = int(x.size());
  Coded c;
  c.codes.resize(std::size_t(d));
  c.idx.resize(std::size_t(Q::outliers(d)));
  c.val.resize(std::size_t(Q::outliers(d)));
  c.m = Q::quantize(x.data(), d, c.codes.data(), c.idx.data(), c.val.data());
  return c;
}

// LogQ: the 2-byte metadata (qaq/meta_format.hpp); LogMeta's steps never go below 2^-14, so the 1e-6 rows
// keep a larger step than fp16's subnormal one, and the bounds still hold against it.
template <int BMin = 1, int BMax = 8, int OutlierPermille = 10, int Window = 5>
using LogQ = kvc::QaqQuantizer<BMin, BMax, OutlierPermille, Window, kvc::qaq::PaperBounds, kvc::qaq::LogMeta>;

using kvc_test::error_of;

}  // namespace kvc_test::qaq
