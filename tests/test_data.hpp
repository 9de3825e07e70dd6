// Data helpers of the kvc test suites that need no SIMD attention code (so nvcc compiles them too:
// tests/cuda includes this, not test_util.hpp): numeric helpers, a structured random K/V generator,
// the schemes under test and their names, cache filling, per-element error bounds read from a cache's own metadata, state snapshots.
#pragma once

#include <kvc/cache/compressed_kv_cache.hpp>
#include <kvc/schemes.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace kvc_test {

// ------------------------------------------------------------------------------------------------
// Schemes under test. Adding a scheme to a typed suite is one line in its type list (plus a name).
// ------------------------------------------------------------------------------------------------
namespace sch {
using kvc::Axis;
using Fp32 = kvc::schemes::Fp32;
using Fp16 = kvc::schemes::Fp16;
using Int8 = kvc::schemes::Int8;
using Kivi4 = kvc::schemes::Kivi4;
using Kivi2 = kvc::schemes::Kivi2;
using Kivi3 = kvc::schemes::Kivi<3>;
using Kivi1 = kvc::schemes::Kivi<1>;
using Kivi8 = kvc::schemes::Kivi<8>;
/// One (lo, step) per block of 32 tokens x head_dim (int-dot keys folded into the query).
using Tensor4 = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kTensor>>;
/// Midpoint codec, per-token groups of 32 channels on both sides (int-dot keys with per-token
/// scales: the query is rounded to int8 once per item), 32-token window.
using MidTok4 = kvc::CompressedKVCache<kvc::GroupQuantizer<4, 32, Axis::kToken, kvc::MidpointCodec>,
                                       kvc::FullPrecisionWindow<32>>;
/// Midpoint KIVI (3-bit per-channel keys, 2-bit per-token values), policies in a different order.
using MidKivi = kvc::CompressedKVCache<kvc::FullPrecisionWindow<64>,
                                       kvc::values<kvc::GroupQuantizer<2, 32, Axis::kToken, kvc::MidpointCodec>>,
                                       kvc::keys<kvc::GroupQuantizer<3, 32, Axis::kChannel, kvc::MidpointCodec>>>;
/// 64-token blocks, 2-bit per-channel groups on BOTH sides (values per channel: int-dot path).
using Chan64 = kvc::CompressedKVCache<kvc::BlockTokens<64>, kvc::GroupQuantizer<2, 64, Axis::kChannel>>;
/// KIVI-2 with a 4-token StreamingLLM sink and a 16-token window.
using Sink = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, Axis::kChannel>>,
                                    kvc::values<kvc::GroupQuantizer<2, 32, Axis::kToken>>,
                                    kvc::FullPrecisionWindow<16, 4>>;
/// KIVI-4 with the same sink and window on the block grid (AlignedSinkWindow: block 0's first 4 rows masked).
using SinkGrid = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, 32, Axis::kChannel>>,
                                        kvc::values<kvc::GroupQuantizer<4, 32, Axis::kToken>>,
                                        kvc::AlignedSinkWindow<16, 4>>;
/// 6-bit per-token keys and 5-bit per-channel values (float-FMA paths, odd plane splits), fp32 window.
using Mixed56 = kvc::CompressedKVCache<kvc::keys<kvc::UniformQuantizer<6>>,
                                       kvc::values<kvc::GroupQuantizer<5, 32, Axis::kChannel>>,
                                       kvc::FullPrecisionWindow<8, 0, float>>;
/// 16-channel value groups: value layouts that admit head dims 80 and 112 (32-channel groups do not).
using Kivi4G16 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, 32, Axis::kChannel>>,
                                        kvc::values<kvc::GroupQuantizer<4, 16, Axis::kToken>>,
                                        kvc::FullPrecisionWindow<32>>;
using Kivi2G16 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, Axis::kChannel>>,
                                        kvc::values<kvc::GroupQuantizer<2, 16, Axis::kToken>>,
                                        kvc::FullPrecisionWindow<32, 4>>;
/// 128-token blocks (GEAR-KIVI-4's): 4-bit per-channel keys with 2-bit values, and 2-bit keys with 4-bit values; the
/// fused AVX-512 key loop runs such a block in passes over part of its tokens (DecodeKernel::fused_key_pass).
using Kivi4B128 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<4, 128, Axis::kChannel>>,
                                         kvc::values<kvc::GroupQuantizer<2, 32, Axis::kToken>>,
                                         kvc::FullPrecisionWindow<32>>;
using Kivi2B128 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 128, Axis::kChannel>>,
                                         kvc::values<kvc::GroupQuantizer<4, 32, Axis::kToken>>>;
/// LogQuant (LogWindow selector): the paper's configurations, and small windows whose evictions cross
/// block boundaries often: W < B (several eviction events per block) and W > B (one event fills
/// one or two blocks), 3-bit for the float-free int-dot path on odd bits (as PartialW40 below).
using LogQuant2 = kvc::schemes::LogQuant2;
using LogQuant4 = kvc::schemes::LogQuant4;
using LogW3 = kvc::schemes::LogQuant<2, 3, 32>;
/// PartialLogQuant (keys LogWindow, values a plain window): the paper's configuration (W = 64 = G) and a
/// 3-bit W > B one (an eviction event fills a block and a part; values quantized as rows then blocks).
using PartialLogQuant2 = kvc::schemes::PartialLogQuant2;
using PartialW40 = kvc::schemes::PartialLogQuant<3, 40, 32>;
/// GEAR's corrections on a LogQuant backbone (selectors and corrections compose).
using LogGear = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, Axis::kChannel>>,
                                       kvc::values<kvc::GroupQuantizer<2, 32, Axis::kToken>>, kvc::LogWindow<5>,
                                       kvc::OutlierFilter<100>, kvc::LowRankResidual<kvc::Rank<1>>>;
}  // namespace sch

/// Tokens a selector keeps in full precision before it quantizes anything beyond whole blocks: a window's
/// sink + window, LogWindow's 3W (lengths built on it cross the selector's boundaries).
template <class Sel>
constexpr int fp_span() {
  if constexpr (requires { Sel::kWindow; }) return 3 * Sel::kWindow;
  else return Sel::kSink + Sel::kRecent;
}

template <class C>
inline constexpr const char* scheme_name = "unnamed";
template <> inline constexpr const char* scheme_name<sch::Fp32> = "Fp32";
template <> inline constexpr const char* scheme_name<sch::SinkGrid> = "SinkGrid";
template <> inline constexpr const char* scheme_name<sch::Fp16> = "Fp16";
template <> inline constexpr const char* scheme_name<sch::Int8> = "Int8";
template <> inline constexpr const char* scheme_name<sch::Kivi4> = "Kivi4";
template <> inline constexpr const char* scheme_name<sch::Kivi2> = "Kivi2";
template <> inline constexpr const char* scheme_name<sch::Kivi3> = "Kivi3";
template <> inline constexpr const char* scheme_name<sch::Kivi1> = "Kivi1";
template <> inline constexpr const char* scheme_name<sch::Kivi8> = "Kivi8";
template <> inline constexpr const char* scheme_name<sch::Tensor4> = "Tensor4";
template <> inline constexpr const char* scheme_name<sch::MidTok4> = "MidTok4";
template <> inline constexpr const char* scheme_name<sch::MidKivi> = "MidKivi";
template <> inline constexpr const char* scheme_name<sch::Chan64> = "Chan64";
template <> inline constexpr const char* scheme_name<sch::Sink> = "Sink";
template <> inline constexpr const char* scheme_name<sch::Mixed56> = "Mixed56";
template <> inline constexpr const char* scheme_name<sch::Kivi4G16> = "Kivi4G16";
template <> inline constexpr const char* scheme_name<sch::Kivi2G16> = "Kivi2G16";
template <> inline constexpr const char* scheme_name<sch::Kivi4B128> = "Kivi4B128";
template <> inline constexpr const char* scheme_name<sch::Kivi2B128> = "Kivi2B128";
template <> inline constexpr const char* scheme_name<sch::LogQuant2> = "LogQuant2";
template <> inline constexpr const char* scheme_name<sch::LogQuant4> = "LogQuant4";
template <> inline constexpr const char* scheme_name<sch::LogW3> = "LogW3";
template <> inline constexpr const char* scheme_name<sch::LogGear> = "LogGear";
template <> inline constexpr const char* scheme_name<sch::PartialLogQuant2> = "PartialLogQuant2";
template <> inline constexpr const char* scheme_name<sch::PartialW40> = "PartialW40";

/// gtest name generator for typed suites over cache schemes.
struct SchemeNames {
  template <class T>
  static std::string GetName(int) {
    return scheme_name<T>;
  }
};

// ------------------------------------------------------------------------------------------------
// Small numeric helpers
// ------------------------------------------------------------------------------------------------
inline float fp16_round(float x) { return kvc::half_t::from_float(x).to_float(); }

template <class W>
inline float storage_round(float x) {
  return kvc::StorageTraits<W>::load(kvc::StorageTraits<W>::store(x));
}

/// max_i |a_i|; NaN if any element is NaN (a tolerance derived from it then fails every check).
inline double max_abs(const std::vector<float>& a) {
  double m = 0.0;
  for (float x : a) {
    if (std::isnan(x)) return std::numeric_limits<double>::quiet_NaN();
    m = std::max(m, std::fabs(static_cast<double>(x)));
  }
  return m;
}
/// max_i |a_i - b_i|; +inf if any difference is NaN (so a NaN never passes a tolerance check).
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double e = std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(e)) return HUGE_VAL;
    m = std::max(m, e);
  }
  return m;
}
/// Root mean square of a - b (NaN if any element is NaN).
inline double rms_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return a.empty() ? 0.0 : std::sqrt(s / double(a.size()));
}
inline double rms(const std::vector<float>& a) { return rms_diff(a, std::vector<float>(a.size(), 0.0f)); }
inline bool all_finite(const std::vector<float>& a) {
  return std::all_of(a.begin(), a.end(), [](float x) { return std::isfinite(x); });
}
inline bool bytes_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// Float slack of a reconstruction lo + step*code (a few ulps of the magnitudes involved).
inline float recon_slack(float x, float lo, float step, int bits) {
  return 6e-7f * (std::fabs(x) + std::fabs(lo) + step * static_cast<float>(1 << bits)) + 1e-30f;
}

// ------------------------------------------------------------------------------------------------
// Random K/V with realistic structure
// ------------------------------------------------------------------------------------------------
struct GenOptions {
  int outlier_channels = 3;     ///< per KV head, key channels with large magnitude (KIVI's observation)
  float outlier_scale = 12.0f;  ///< their std multiplier
  float key_offset = 1.0f;      ///< std of the per-channel key offsets
  float value_scale = 1.0f;
  float value_offset = 0.2f;    ///< std of the per-channel value offsets
};

/// K and V of T tokens, [T][H][d] row-major.
struct KV {
  int T = 0, H = 0, d = 0;
  std::vector<float> k, v;

  KV() = default;
  KV(int t, int h, int dd) : T(t), H(h), d(dd), k(std::size_t(t) * h * dd), v(std::size_t(t) * h * dd) {}
  std::size_t at(int t, int h, int c) const { return (std::size_t(t) * H + h) * d + c; }
  kvc::KVView kview(int t0, int n) const { return kvc::KVView::contiguous(k.data() + at(t0, 0, 0), n, H, d); }
  kvc::KVView vview(int t0, int n) const { return kvc::KVView::contiguous(v.data() + at(t0, 0, 0), n, H, d); }
  /// Tokens [0, n) as a new KV.
  KV prefix(int n) const {
    KV r(n, H, d);
    std::copy_n(k.begin(), r.k.size(), r.k.begin());
    std::copy_n(v.begin(), r.v.size(), r.v.begin());
    return r;
  }
};

inline KV random_kv(int T, int H, int d, std::uint64_t seed, const GenOptions& o = {}) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  KV r(T, H, d);
  std::vector<float> koff(std::size_t(H) * d), kscale(std::size_t(H) * d), voff(std::size_t(H) * d);
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < d; ++c) {
      koff[std::size_t(h) * d + c] = o.key_offset * n01(rng);
      kscale[std::size_t(h) * d + c] = 0.5f + u01(rng);
      voff[std::size_t(h) * d + c] = o.value_offset * n01(rng);
    }
    // Distinct channels: a channel drawn twice got outlier_scale^2 (one drawn three times at 60 went past fp16's
    // range). Redrawing on a collision leaves every data set whose draws do not collide unchanged.
    std::vector<int> picked;
    for (int i = 0; i < std::min(o.outlier_channels, d); ++i) {
      int c;
      do c = static_cast<int>(rng() % static_cast<std::uint64_t>(d));
      while (std::find(picked.begin(), picked.end(), c) != picked.end());
      picked.push_back(c);
      kscale[std::size_t(h) * d + c] *= o.outlier_scale;
      koff[std::size_t(h) * d + c] *= o.outlier_scale * 0.5f;
    }
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < d; ++c) {
        const std::size_t hc = std::size_t(h) * d + c;
        r.k[r.at(t, h, c)] = koff[hc] + kscale[hc] * n01(rng);
        r.v[r.at(t, h, c)] = voff[hc] + o.value_scale * n01(rng);
      }
  return r;
}

inline std::vector<float> random_query(int nseq, int H, int d, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> q(std::size_t(nseq) * H * d);
  for (auto& x : q) x = scale * n01(rng);
  return q;
}

// ------------------------------------------------------------------------------------------------
// Filling caches
// ------------------------------------------------------------------------------------------------
/// Appends all of `x` to (layer, seq) in chunks of `chunk` tokens (0: one call).
template <class Cache>
void append_kv(Cache& c, int layer, int seq, const KV& x, int chunk = 0) {
  if (chunk <= 0) chunk = std::max(1, x.T);
  for (int t = 0; t < x.T; t += chunk) {
    const int n = std::min(chunk, x.T - t);
    c.append(layer, seq, x.kview(t, n), x.vview(t, n));
  }
}

template <class Cache>
struct Dequant {
  std::vector<float> k, v;
};
template <class Cache>
Dequant<Cache> dequantize(const Cache& c, int layer, int seq) {
  const auto& cfg = c.config();
  const std::size_t n = std::size_t(c.length(layer, seq)) * cfg.kv_heads * cfg.head_dim;
  Dequant<Cache> r{std::vector<float>(n), std::vector<float>(n)};
  c.dequantize(layer, seq, r.k.data(), r.v.data());
  return r;
}

/// A cache plus the original data of every (layer, sequence).
template <class Cache>
struct Filled {
  kvc::CacheConfig cfg;
  std::unique_ptr<Cache> cache;
  std::vector<std::vector<KV>> data;  // [layer][seq]
};

/// Every layer gets its own data; sequence s holds lengths[s] tokens (batch = lengths.size()).
template <class Cache>
Filled<Cache> make_filled(int layers, int kv_heads, int d, const std::vector<int>& lengths, std::uint64_t seed,
                          const GenOptions& gen = {}, int chunk = 0) {
  Filled<Cache> f;
  const int cap = std::max(1, *std::max_element(lengths.begin(), lengths.end()));
  f.cfg = kvc::CacheConfig{layers, static_cast<int>(lengths.size()), kv_heads, d, cap};
  f.cache = std::make_unique<Cache>(f.cfg);
  f.data.resize(std::size_t(layers));
  for (int l = 0; l < layers; ++l)
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      f.data[l].push_back(random_kv(lengths[s], kv_heads, d, seed * 1000003u + std::uint64_t(l) * 7919u + s, gen));
      append_kv(*f.cache, l, static_cast<int>(s), f.data[l].back(), chunk);
    }
  return f;
}

// ------------------------------------------------------------------------------------------------
// Per-element error bounds from the cache's stored metadata
// ------------------------------------------------------------------------------------------------
/// For every element of (layer, seq): is it in a quantized block, and its stored group's step.
struct ElementInfo {
  std::vector<unsigned char> quantized;    // [T][H][d] (keys; values too, except v_quantized's extra rows)
  std::vector<unsigned char> v_quantized;  // values: blocks and PartialLogWindow's quantized value rows
  std::vector<float> k_step, v_step;     // 0 for full-precision tokens and identity blocks
  std::vector<float> k_lo, v_lo;
};

template <class Fmt>
void block_meta(const std::byte* blk, int t, int c, int d, float& lo, float& step) {
  if constexpr (Fmt::kIdentity) {
    lo = 0.0f;
    step = 0.0f;
  } else {
    const int g = Fmt::group_of(t, c, d);
    lo = Fmt::lo_plane(blk, d)[g].to_float();
    step = Fmt::step_plane(blk, d)[g].to_float();
  }
}

template <class Cache>
ElementInfo element_info(const Cache& cache, int layer, int seq) {
  const auto& cfg = cache.config();
  const int n = cache.length(layer, seq), H = cfg.kv_heads, d = cfg.head_dim;
  const int B = Cache::kBlockTokens, nb = cache.quantized_blocks(layer, seq);
  const int nfp = kvc::detail::fp_tokens<typename Cache::selector>(n, B);
  std::vector<int> where(static_cast<std::size_t>(nb * B + nfp));  // position of every stored row (-1: masked)
  Cache::selector::positions(n, B, where.data());
  const auto p = cache.params(layer);
  ElementInfo e;
  const std::size_t sz = std::size_t(n) * H * d;
  e.quantized.assign(sz, 0);
  e.k_step.assign(sz, 0.0f);
  e.v_step.assign(sz, 0.0f);
  e.k_lo.assign(sz, 0.0f);
  e.v_lo.assign(sz, 0.0f);
  for (int row = 0; row < nb * B; ++row) {
    const int blk = row / B, t = row % B, pos = where[std::size_t(row)];
    if (pos < 0) continue;  // AlignedSinkWindow's masked rows hold no token
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < d; ++c) {
        const std::size_t i = (std::size_t(pos) * H + h) * d + c;
        e.quantized[i] = 1;
        block_meta<typename Cache::key_format>(p.key_block(seq, h, blk), t, c, d, e.k_lo[i], e.k_step[i]);
        block_meta<typename Cache::value_format>(p.value_block(seq, h, blk), t, c, d, e.v_lo[i], e.v_step[i]);
      }
  }
  e.v_quantized = e.quantized;
  if constexpr (Cache::layout::kQuantizedFpValues) {
    using RF = typename Cache::layout::value_row_format;
    for (int i = 0; i < nfp; ++i) {
      if (!p.fp_value_quantized(seq, i)) continue;
      const int pos = where[std::size_t(nb * B + i)];
      for (int h = 0; h < H; ++h) {
        const kvc::half_t* m = RF::lo(p.value_row_at(seq, h, i), d);
        for (int c = 0; c < d; ++c) {
          const std::size_t at = (std::size_t(pos) * H + h) * d + c;
          const int g = c / RF::group_channels(d);
          e.v_quantized[at] = 1;
          e.v_lo[at] = m[g].to_float();
          e.v_step[at] = m[RF::groups(d) + g].to_float();
        }
      }
    }
  }
  return e;
}

/// Largest |original - dequantized| each element may have: step/2 of its group plus the rounding of
/// the original into the window storage (quantization reads the window), plus float slack.
/// Full-precision tokens: exactly the storage rounding.
template <class Cache>
struct ErrorBounds {
  std::vector<float> k, v;
};
template <class Cache>
ErrorBounds<Cache> error_bounds(const Cache& cache, int layer, int seq, const KV& orig) {
  using W = typename Cache::window_t;
  const ElementInfo e = element_info(cache, layer, seq);
  ErrorBounds<Cache> b{std::vector<float>(e.quantized.size()), std::vector<float>(e.quantized.size())};
  auto one = [&](float x, bool q, float lo, float step, int bits, bool identity, auto elem_tag) {
    using E = decltype(elem_tag);
    const float w = storage_round<W>(x);
    if (!q) return std::fabs(x - w);
    if (identity) return std::fabs(x - storage_round<E>(w));
    return std::fabs(x - w) + 0.5f * step + recon_slack(x, lo, step, bits);
  };
  using KE = std::conditional_t<Cache::key_format::kIdentity, typename Cache::key_format::element, float>;
  using VE = std::conditional_t<Cache::value_format::kIdentity, typename Cache::value_format::element, float>;
  for (std::size_t i = 0; i < e.quantized.size(); ++i) {
    b.k[i] = one(orig.k[i], e.quantized[i], e.k_lo[i], e.k_step[i], Cache::key_format::kBits,
                 Cache::key_format::kIdentity, KE{});
    b.v[i] = one(orig.v[i], e.v_quantized[i], e.v_lo[i], e.v_step[i], Cache::value_format::kBits,
                 Cache::value_format::kIdentity, VE{});
  }
  return b;
}

// ------------------------------------------------------------------------------------------------
// Snapshots (strong exception guarantee)
// ------------------------------------------------------------------------------------------------
template <class Cache>
struct Snapshot {
  std::vector<int> lengths;
  std::vector<std::vector<float>> k, v;
  std::size_t stored = 0;
  double bpe = 0.0;
};
template <class Cache>
Snapshot<Cache> snapshot(const Cache& c) {
  Snapshot<Cache> s;
  const auto& cfg = c.config();
  for (int l = 0; l < cfg.layers; ++l)
    for (int q = 0; q < cfg.batch; ++q) {
      s.lengths.push_back(c.length(l, q));
      auto d = dequantize(c, l, q);
      s.k.push_back(std::move(d.k));
      s.v.push_back(std::move(d.v));
    }
  s.stored = c.stored_bytes();
  s.bpe = c.bits_per_element();
  return s;
}
template <class Cache>
::testing::AssertionResult same_state(const Snapshot<Cache>& a, const Snapshot<Cache>& b) {
  if (a.lengths != b.lengths) return ::testing::AssertionFailure() << "lengths changed";
  for (std::size_t i = 0; i < a.k.size(); ++i)
    if (!bytes_equal(a.k[i], b.k[i]) || !bytes_equal(a.v[i], b.v[i]))
      return ::testing::AssertionFailure() << "dequantized contents of stream " << i << " changed";
  if (a.stored != b.stored) return ::testing::AssertionFailure() << "stored_bytes changed";
  if (std::memcmp(&a.bpe, &b.bpe, sizeof a.bpe) != 0) return ::testing::AssertionFailure() << "bits_per_element changed";
  return ::testing::AssertionSuccess();
}

/// The code of the kvc::Error f throws (the test fails when it throws none, and kCuda is returned); its message
/// in *what when given.
template <class F>
kvc::Errc error_of(F&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const kvc::Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  ADD_FAILURE() << "no kvc::Error thrown";
  return kvc::Errc::kCuda;
}

}  // namespace kvc_test
