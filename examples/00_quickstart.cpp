// 00_quickstart: build compressed KV caches, append realistic keys/values, run fused decode attention
// and compare against an uncompressed fp32 cache.
#include <kvc/kvc.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {
constexpr int kKvHeads = 8, kQueryHeads = 32, kHeadDim = 128, kTokens = 2048;

/// Keys with per-channel offsets and a few outlier channels (as real LLM keys have); values Gaussian.
void make_kv(std::vector<float>& k, std::vector<float>& v) {
  std::mt19937 rng(42);
  std::normal_distribution<float> nd;
  std::vector<float> offset(kKvHeads * kHeadDim), gain(kKvHeads * kHeadDim, 1.0f);
  for (int i = 0; i < kKvHeads * kHeadDim; ++i) {
    offset[i] = 0.5f * nd(rng);
    if (i % 29 == 3) gain[i] = 10.0f;
  }
  k.resize(std::size_t(kTokens) * kKvHeads * kHeadDim);
  v.resize(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    const std::size_t ch = i % (kKvHeads * kHeadDim);
    k[i] = offset[ch] + gain[ch] * nd(rng);
    v[i] = nd(rng);
  }
}

template <class Cache>
std::vector<float> attend(const char* name, const std::vector<float>& k, const std::vector<float>& v,
                          const std::vector<float>& q, const std::vector<float>* exact) {
  Cache cache(kvc::CacheConfig{/*layers=*/1, /*batch=*/1, kKvHeads, kHeadDim, /*capacity=*/kTokens + 64});
  // Prefill all but the last token, then one decode-step append.
  cache.append(0, 0, kvc::KVView::contiguous(k.data(), kTokens - 1, kKvHeads, kHeadDim),
               kvc::KVView::contiguous(v.data(), kTokens - 1, kKvHeads, kHeadDim));
  const std::size_t last = std::size_t(kTokens - 1) * kKvHeads * kHeadDim;
  cache.append(0, 0, kvc::KVView::contiguous(k.data() + last, 1, kKvHeads, kHeadDim),
               kvc::KVView::contiguous(v.data() + last, 1, kKvHeads, kHeadDim));

  std::vector<float> out(q.size());
  kvc::decode_attention(cache, 0, kvc::QueryView::contiguous(q.data(), 1, kQueryHeads, kHeadDim),
                        kvc::OutputView::contiguous(out.data(), 1, kQueryHeads, kHeadDim));
  double err = 0.0, ref = 0.0;
  if (exact)
    for (std::size_t i = 0; i < out.size(); ++i) {
      err += (out[i] - (*exact)[i]) * double(out[i] - (*exact)[i]);
      ref += (*exact)[i] * double((*exact)[i]);
    }
  const double fp16_bytes = double(kTokens) * 2 * kKvHeads * kHeadDim * 2;
  std::printf("%-6s  %6.2f bits/element  %8.1f KiB  (%.2fx smaller than fp16)  rel. error vs fp32 %.2e\n", name,
              cache.bits_per_element(), cache.stored_bytes() / 1024.0, fp16_bytes / double(cache.stored_bytes()),
              exact ? std::sqrt(err / ref) : 0.0);
  return out;
}
}  // namespace

int main() {
  std::vector<float> k, v, q(std::size_t(kQueryHeads) * kHeadDim);
  make_kv(k, v);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);

  std::printf("kvc %d.%d.%d quickstart (%s path): %d tokens, %d KV heads, %d query heads, head dim %d\n",
              KVC_VERSION_MAJOR, KVC_VERSION_MINOR, KVC_VERSION_PATCH, kvc::simd_path_name(), kTokens, kKvHeads,
              kQueryHeads, kHeadDim);
  const auto exact = attend<kvc::schemes::Fp32>("fp32", k, v, q, nullptr);
  attend<kvc::schemes::Fp16>("fp16", k, v, q, &exact);
  attend<kvc::schemes::Int8>("int8", k, v, q, &exact);
  attend<kvc::schemes::Kivi4>("kivi4", k, v, q, &exact);
  attend<kvc::schemes::Kivi2>("kivi2", k, v, q, &exact);
  // Policies compose in any order; here 3-bit KIVI with a 4-token attention sink and a 64-token window.
  using Custom = kvc::CompressedKVCache<kvc::FullPrecisionWindow<64, 4>,
                                        kvc::values<kvc::GroupQuantizer<3, 32, kvc::Axis::kToken>>,
                                        kvc::keys<kvc::GroupQuantizer<3, 32, kvc::Axis::kChannel>>>;
  attend<Custom>("kivi3s", k, v, q, &exact);
  return 0;
}
