// The oracle of AlignedLoader over a scheme's fp16 slots (aligned/slot_planes.hpp), shared by the CPU suite
// (test_aligned_window.cpp) and the CUDA one (cuda/test_cuda_attention.cu): the cache's rows with its window truncated
// as the decode kernels' rules decide. Host code only (no SIMD layer: nvcc compiles it too).
#pragma once

#include "test_data.hpp"

#include <kvc/aligned/aligned_loader.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace kvc_test {

/// The window of (layer, seq) truncated as the kernel's rules decide (DecodeKernel::aligned_window, and the CUDA
/// kernel's aligned_fp_tokens), from the same AlignedLoader functions: key tiers per channel from the query scaled by
/// `scale` (the kernels' softmax scale times log2 e) and the live slots' Kmax,
/// value tiers per chunk of Block slots (a softmax partition) from the chunk's probabilities. Counts the tiers,
/// and adds to `read` the planes' bytes and elements the kernel reads for them (the Kmax scan: hi8 of every
/// slot's key; each chunk holding a live slot: its B slots' key nibbles at their channels' tiers; hi8 of every
/// live value row, plus its nibbles at its tier).
template <class Cache>
Dequant<Cache> truncated_window(const Cache& c, int layer, int seq, const float* q, int Hq, float scale,
                                std::size_t (&tiers)[3], kvc::aligned::ReadStats& read) {
  using Sel = typename Cache::selector;
  using Loader = typename Cache::layout::loader;
  constexpr int B = Cache::kBlockTokens;
  const auto& cfg = c.config();
  const int n = c.length(layer, seq), d = cfg.head_dim, H = cfg.kv_heads, g = Hq / H;
  auto r = dequantize(c, layer, seq);
  const int nb = Sel::quantized_blocks(n, B), nfp = kvc::detail::fp_tokens<Sel>(n, B);
  std::vector<int> pos(static_cast<std::size_t>(kvc::detail::stored_rows<Sel>(n, B)));
  Sel::positions(n, B, pos.data());
  std::vector<std::pair<int, int>> live;  // (slot, position), in slot order
  for (int i = 0; i < nfp; ++i) live.emplace_back(Sel::fp_slot(n, i, B), pos[std::size_t(nb) * B + i]);
  std::sort(live.begin(), live.end());
  // A rotated cache stores (and the kernel reads) rotated rows, and rotates the scaled query the same way:
  // the rules see those. Rotating dequantize()'s rows back recovers the stored fp16 rows (rounding to fp16
  // absorbs the transforms' fp32 error); the truncated rows are un-rotated again for the oracle.
  using Rot = typename Cache::rotation;
  const auto prm = c.params(layer);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h) {
      float* kr = r.k.data() + (std::size_t(t) * H + h) * d;
      float* vr = r.v.data() + (std::size_t(t) * H + h) * d;
      if constexpr (Rot::kKeys) Rot::rotate(true, prm.rotation, h, d, kr);
      if constexpr (Rot::kValues) Rot::rotate(false, prm.rotation, h, d, vr);
    }
  auto bits = [&](const std::vector<float>& x, int t, int h, int ch) {
    return kvc::half_t::from_float(x[(std::size_t(t) * H + h) * d + ch]).bits;
  };
  auto tier_index = [](int t) { return t == 8 ? 0 : t == 12 ? 1 : 2; };
  for (int kh = 0; kh < H; ++kh) {
    std::vector<float> qs(std::size_t(g) * d);
    for (int i = 0; i < g * d; ++i) qs[std::size_t(i)] = q[std::size_t(kh) * g * d + i] * scale;
    if constexpr (Rot::kKeys)
      for (int h = 0; h < g; ++h) Rot::rotate(true, prm.rotation, kh, d, qs.data() + std::size_t(h) * d);
    std::vector<std::uint8_t> kmax(std::size_t(d), 0), vmax(std::size_t(d), 0), ktier(static_cast<std::size_t>(d));
    for (auto [slot, t] : live)
      for (int ch = 0; ch < d; ++ch) {
        kmax[std::size_t(ch)] = std::max<std::uint8_t>(kmax[std::size_t(ch)], kvc::aligned::fp16_field(bits(r.k, t, kh, ch)));
        vmax[std::size_t(ch)] = std::max<std::uint8_t>(vmax[std::size_t(ch)], kvc::aligned::fp16_field(bits(r.v, t, kh, ch)));
      }
    Loader::key_tiers(qs.data(), g, d, kmax.data(), ktier.data());
    if (nfp > 0) {
      std::set<int> chunks;
      for (auto [slot, t] : live) chunks.insert(slot / B);
      read.key_bytes += std::size_t(d) * Cache::layout::kFpStride;
      read.value_bytes += std::size_t(nfp) * d;
      for (int ch = 0; ch < d; ++ch) {
        const int kt = ktier[std::size_t(ch)];
        read.key_tiers[tier_index(kt)] += chunks.size() * B;
        read.key_bytes += chunks.size() * B * std::size_t(kt - 8) / 8;
      }
    }
    for (auto [slot, t] : live)
      for (int ch = 0; ch < d; ++ch) {
        const std::size_t at = (std::size_t(t) * H + kh) * d + ch;
        r.k[at] = kvc::detail::half_bits_to_float(kvc::aligned::truncate(bits(r.k, t, kh, ch), ktier[std::size_t(ch)]));
        ++tiers[tier_index(ktier[std::size_t(ch)])];
      }
    for (std::size_t i0 = 0; i0 < live.size();) {
      std::size_t i1 = i0;
      while (i1 < live.size() && live[i1].first / B == live[i0].first / B) ++i1;
      const int m = int(i1 - i0);
      std::vector<float> p(std::size_t(g) * m);
      std::vector<int> ref(static_cast<std::size_t>(g));
      std::vector<float> est(static_cast<std::size_t>(d));
      for (int h = 0; h < g; ++h) {
        std::vector<double> sc(static_cast<std::size_t>(m));
        double mx = -1e300, sum = 0.0;
        for (int k = 0; k < m; ++k) {
          double a = 0.0;
          for (int ch = 0; ch < d; ++ch)
            a += double(qs[std::size_t(h) * d + ch]) * r.k[(std::size_t(live[i0 + k].second) * H + kh) * d + ch];
          sc[std::size_t(k)] = a;
          mx = std::max(mx, a);
        }
        for (int k = 0; k < m; ++k) sum += std::exp2(sc[std::size_t(k)] - mx);
        for (int k = 0; k < m; ++k) p[std::size_t(h) * m + k] = float(std::exp2(sc[std::size_t(k)] - mx) / sum);
        // AlignedLoader::estimate_reference, spelled out (nvcc compiles this too: no host lambda in a host+device call)
        const float* ph = p.data() + std::size_t(h) * m;
        int cand[Loader::kTopK];
        const int nc = Loader::top_candidates(ph, m, cand);
        std::fill(est.begin(), est.end(), 0.0f);
        for (int i = 0; i < nc; ++i)
          for (int ch = 0; ch < d; ++ch)
            est[std::size_t(ch)] += ph[cand[i]] * std::fabs(kvc::detail::half_bits_to_float(
                                                   kvc::aligned::truncate(bits(r.v, live[i0 + std::size_t(cand[i])].second, kh, ch), 8)));
        ref[std::size_t(h)] = Loader::value_reference(est.data(), d, vmax.data());
      }
      for (int k = 0; k < m; ++k) {
        const int tier = Loader::value_tier(p.data() + k, std::size_t(m), g, ref.data());
        ++tiers[tier_index(tier)];
        read.value_tiers[tier_index(tier)] += std::size_t(d);
        read.value_bytes += std::size_t(d) * (tier - 8) / 8;
        const int t = live[i0 + std::size_t(k)].second;
        for (int ch = 0; ch < d; ++ch)
          r.v[(std::size_t(t) * H + kh) * d + ch] = kvc::detail::half_bits_to_float(kvc::aligned::truncate(bits(r.v, t, kh, ch), tier));
      }
      i0 = i1;
    }
  }
  // Every row back to the original basis: the window's truncated rows and the blocks' (re-rotated) rows alike.
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h) {
      float* kr = r.k.data() + (std::size_t(t) * H + h) * d;
      float* vr = r.v.data() + (std::size_t(t) * H + h) * d;
      if constexpr (Rot::kKeys) Rot::unrotate(true, prm.rotation, h, d, kr);
      if constexpr (Rot::kValues) Rot::unrotate(false, prm.rotation, h, d, vr);
    }
  return r;
}
/// What a kernel reported reading (`got`) against the replication (`want`: truncated_window's counts summed over the
/// attended sequences) and `other`, the bytes it reads whole: planes and tiers equal, nothing of AlignedKV's own
/// cache (estimate, staging, metadata) counted.
inline ::testing::AssertionResult same_reads(const kvc::aligned::ReadStats& got, const kvc::aligned::ReadStats& want,
                                             std::size_t other) {
  auto fail = [](const char* what, std::size_t g, std::size_t w) {
    return ::testing::AssertionFailure() << what << ": " << g << " reported, " << w << " replicated";
  };
  if (got.key_bytes != want.key_bytes) return fail("key_bytes", got.key_bytes, want.key_bytes);
  if (got.value_bytes != want.value_bytes) return fail("value_bytes", got.value_bytes, want.value_bytes);
  static const char* const kKey[3] = {"key_tiers[8]", "key_tiers[12]", "key_tiers[16]"};
  static const char* const kValue[3] = {"value_tiers[8]", "value_tiers[12]", "value_tiers[16]"};
  for (int i = 0; i < 3; ++i) {
    if (got.key_tiers[i] != want.key_tiers[i]) return fail(kKey[i], got.key_tiers[i], want.key_tiers[i]);
    if (got.value_tiers[i] != want.value_tiers[i]) return fail(kValue[i], got.value_tiers[i], want.value_tiers[i]);
  }
  if (got.estimate_bytes + got.staged_bytes + got.meta_bytes != 0)
    return fail("estimate + staged + meta bytes", got.estimate_bytes + got.staged_bytes + got.meta_bytes, 0);
  if (got.other_bytes != other) return fail("other_bytes", got.other_bytes, other);
  return ::testing::AssertionSuccess();
}
}  // namespace kvc_test
