/// \file reference.hpp
/// `kvc::reference`: scalar double-precision oracles. Slow and obviously correct; every fused CPU and
/// CUDA path is tested against them. Host only.
#pragma once

#include <kvc/config.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kvc::reference {

/// Exact decode attention of one sequence.
/// q: [H][d]; K, V: [T][H_kv][d] (what the cache holds, or the original data); out: [H][d].
/// Query head h reads KV head h / (H / H_kv). scale <= 0 means 1/sqrt(d).
inline void decode_attention(const float* q, int H, const float* K, const float* V, int T, int H_kv, int d,
                             float* out, double scale = 0.0) {
  if (scale <= 0.0) scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int g = H / H_kv;
  std::vector<double> s(static_cast<std::size_t>(T));
  for (int h = 0; h < H; ++h) {
    const int kh = h / g;
    double mx = -HUGE_VAL;
    for (int t = 0; t < T; ++t) {
      double dot = 0.0;
      const float* k = K + (static_cast<std::size_t>(t) * H_kv + kh) * d;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[h * d + c]) * k[c];
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double sum = 0.0;
    for (int t = 0; t < T; ++t) sum += (s[t] = std::exp(s[t] - mx));
    for (int c = 0; c < d; ++c) {
      double o = 0.0;
      for (int t = 0; t < T; ++t) o += s[t] * V[(static_cast<std::size_t>(t) * H_kv + kh) * d + c];
      out[h * d + c] = static_cast<float>(o / sum);
    }
  }
}

/// Softmax probabilities of one query head over T keys (for error bounds in tests).
inline std::vector<double> attention_probabilities(const float* q, const float* K, int T, int H_kv, int kh, int d,
                                                   double scale = 0.0) {
  if (scale <= 0.0) scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s(static_cast<std::size_t>(T));
  double mx = -HUGE_VAL, sum = 0.0;
  for (int t = 0; t < T; ++t) {
    double dot = 0.0;
    const float* k = K + (static_cast<std::size_t>(t) * H_kv + kh) * d;
    for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
    s[t] = dot * scale;
    mx = std::max(mx, s[t]);
  }
  for (auto& x : s) sum += (x = std::exp(x - mx));
  for (auto& x : s) x /= sum;
  return s;
}
}  // namespace kvc::reference
