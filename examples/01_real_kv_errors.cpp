// 01_real_kv_errors: how much each cache scheme perturbs attention on REAL keys, values and queries.
//
//   01_real_kv_errors [dump-file]
//
// The dump (kvc/io/kv_dump.hpp) holds the post-RoPE keys, values and queries of some layers of a
// model over one text; the llama engine in examples/llama writes it (kvc-eval --dump-kv ...). Default
// file: $KVC_KV_DUMP, else ~/.cache/kvc/smollm2_kv_dump.bin. Without an argument or KVC_KV_DUMP, a
// missing default dump is not an error: the program says how to make one and exits 0 (it is a demo).
// A file named explicitly that is missing exits 2; a corrupt dump exits 1.
//
// For every dumped layer and every scheme (fp32, fp16, int8, kivi4, kivi2) the cache is built the way
// an engine builds it during decoding: at query position t it holds tokens 0..t exactly (causal),
// appended in order, and decode attention runs with the real query of position t. Positions: every
// 64th token (t = 63, 127, ...) and the last. Reported per layer and scheme:
//   bits/el    stored bits per K/V element once all tokens are in (codes, scales, zeros, fp16 window)
//   attn mean  ||o - o_fp32|| / ||o_fp32|| over all query heads of a position, averaged over positions;
//              for fp32 itself: against kvc::reference (double precision, on the dumped arrays)
//   attn worst the largest per-head relative error over all positions, and where it happened
//   K rel, V rel  ||x^ - x|| / ||x|| of what the cache holds after all tokens (dequantize)
//   K max, V max  the largest |x^ - x| of one element, and the largest |x| for scale
#include "dump_cli.hpp"

#include <kvc/io/kv_dump.hpp>
#include <kvc/kvc.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace {

constexpr int kEvery = 64;

/// One (layer, scheme) row.
struct Row {
  double bits = 0.0;
  double attn_mean = NAN, attn_worst = NAN;
  int worst_pos = -1, worst_head = -1;
  double k_rel = 0.0, v_rel = 0.0, k_max = 0.0, v_max = 0.0;
  std::string error;  // non-empty when the scheme rejected the data (e.g. |x| > 65504 for fp16)
};

/// ||a - ref|| / ||ref|| (absolute when ref is 0).
double rel_err(const float* a, const float* ref, std::size_t n) {
  double e = 0.0, r = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    e += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  return r > 0.0 ? std::sqrt(e / r) : std::sqrt(e);
}

std::vector<int> query_positions(int tokens) {
  std::vector<int> pos;
  for (int t = kEvery - 1; t < tokens; t += kEvery) pos.push_back(t);
  if (pos.empty() || pos.back() != tokens - 1) pos.push_back(tokens - 1);
  return pos;
}

/// Builds a `Cache` for dumped layer `i` incrementally, attends at every query position, and fills a
/// Row. `outs` receives the attention outputs ([position][q_heads][head_dim]); `ref` (when given)
/// are the fp32 outputs to compare against, otherwise the double-precision oracle is the reference.
template <class Cache>
Row run(const kvc::io::KVDump& dump, std::size_t i, const std::vector<int>& positions,
        std::vector<std::vector<float>>* outs, const std::vector<std::vector<float>>* ref) {
  const int T = dump.tokens, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  const std::size_t q_size = std::size_t(Hq) * d;
  const kvc::KVView K = dump.keys(i), V = dump.values(i);
  Row row;
  try {
    Cache cache(kvc::CacheConfig{/*layers=*/1, /*batch=*/1, H, d, /*capacity=*/T});
    double sum = 0.0, worst = -1.0;
    int len = 0;
    std::vector<float> out(q_size), oracle(q_size);
    for (std::size_t p = 0; p < positions.size(); ++p) {
      const int t = positions[p];
      // What the engine would have appended by position t (prefill chunk or decode steps alike:
      // every token is stored, and quantized, exactly once).
      cache.append(0, 0, kvc::KVView{K.row(len, 0), t + 1 - len, H, d, K.stride0, K.stride1},
                   kvc::KVView{V.row(len, 0), t + 1 - len, H, d, V.stride0, V.stride1});
      len = t + 1;
      if (!dump.has_queries()) continue;
      const kvc::QueryView q = dump.queries(i, t);
      kvc::decode_attention(cache, 0, q, kvc::OutputView::contiguous(out.data(), 1, Hq, d));
      const float* r = nullptr;
      if (ref) {
        r = (*ref)[p].data();
      } else {
        kvc::reference::decode_attention(q.data, Hq, K.data, V.data, t + 1, H, d, oracle.data());
        r = oracle.data();
      }
      sum += rel_err(out.data(), r, q_size);
      for (int h = 0; h < Hq; ++h) {
        const double e = rel_err(out.data() + std::size_t(h) * d, r + std::size_t(h) * d, std::size_t(d));
        if (e > worst) {
          worst = e;
          row.worst_pos = t;
          row.worst_head = h;
        }
      }
      if (outs) outs->push_back(out);
    }
    if (dump.has_queries()) {
      row.attn_mean = sum / double(positions.size());
      row.attn_worst = worst;
    }
    row.bits = cache.bits_per_element();
    std::vector<float> kh(std::size_t(T) * H * d), vh(kh.size());
    cache.dequantize(0, 0, kh.data(), vh.data());
    row.k_rel = rel_err(kh.data(), K.data, kh.size());
    row.v_rel = rel_err(vh.data(), V.data, vh.size());
    for (std::size_t e = 0; e < kh.size(); ++e) {
      row.k_max = std::max(row.k_max, std::fabs(double(kh[e]) - K.data[e]));
      row.v_max = std::max(row.v_max, std::fabs(double(vh[e]) - V.data[e]));
    }
  } catch (const kvc::Error& e) {
    row.error = e.what();
  }
  return row;
}

double max_abs(const float* x, std::size_t n) {
  double m = 0.0;
  for (std::size_t e = 0; e < n; ++e) m = std::max(m, std::fabs(double(x[e])));
  return m;
}

void print_row(int layer, const char* scheme, const Row& r) {
  if (!r.error.empty()) {
    std::printf("%5d  %-6s  error: %s\n", layer, scheme, r.error.c_str());
    return;
  }
  char worst[64] = "        -";
  if (!std::isnan(r.attn_worst))
    std::snprintf(worst, sizeof worst, "%9.2e (t=%d, h=%d)", r.attn_worst, r.worst_pos, r.worst_head);
  char mean[32] = "        -";
  if (!std::isnan(r.attn_mean)) std::snprintf(mean, sizeof mean, "%9.2e", r.attn_mean);
  std::printf("%5d  %-6s  %7.2f  %9s  %-27s  %8.2e  %8.2e  %8.2e  %8.2e\n", layer, scheme, r.bits, mean, worst,
              r.k_rel, r.v_rel, r.k_max, r.v_max);
}

}  // namespace

int main(int argc, char** argv) {
  kvc::io::KVDump dump;
  std::string path;
  if (const auto status =
          kvc_examples::load_dump(argc, argv, "01_real_kv_errors", "measures the schemes", dump, path)) return *status;

  const int T = dump.tokens, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  std::string layers;
  for (const auto& l : dump.layers) layers += (layers.empty() ? "" : " ") + std::to_string(l.layer);
  std::printf("KV dump %s\n  model %s; source: %s\n", path.c_str(), dump.model.c_str(), dump.source.c_str());
  std::printf("  %d tokens, %d query / %d KV heads, head_dim %d, rope_theta %g; %zu layers: %s\n", T, Hq, H, d,
              double(dump.rope_theta), dump.layers.size(), layers.c_str());
  if (d % 32 != 0) {
    std::fprintf(stderr, "01_real_kv_errors: head_dim %d is not a multiple of 32 (KIVI's channel groups)\n", d);
    return 1;
  }
  const std::vector<int> positions = query_positions(T);
  std::printf("kvc %d.%d.%d, %s path. Query positions t = %d, %d, ..., %d (%zu); at t the cache holds tokens 0..t.\n",
              KVC_VERSION_MAJOR, KVC_VERSION_MINOR, KVC_VERSION_PATCH, kvc::simd_path_name(), positions.front(),
              positions.size() > 1 ? positions[1] : positions.front(), positions.back(), positions.size());
  if (!dump.has_queries())
    std::printf("The dump has no queries: attention columns are '-' (reconstruction errors only).\n");
  std::printf("attn: relative L2 error of the attention output vs the fp32 cache (fp32: vs kvc::reference in\n"
              "double); worst: largest per-head relative error over positions. K/V: reconstruction error of the\n"
              "cache after all %d tokens (relative L2, and largest absolute element error).\n\n",
              T);
  std::printf("%5s  %-6s  %7s  %9s  %-27s  %8s  %8s  %8s  %8s\n", "layer", "scheme", "bits/el", "attn mean",
              "attn worst (position, head)", "K rel", "V rel", "K max", "V max");

  constexpr int kSchemes = 5;
  const char* names[kSchemes] = {"fp32", "fp16", "int8", "kivi4", "kivi2"};
  std::vector<double> sum_mean(kSchemes, 0.0), worst(kSchemes, 0.0), sum_bits(kSchemes, 0.0), sum_k(kSchemes, 0.0),
      sum_v(kSchemes, 0.0);
  std::vector<int> worst_layer(kSchemes, -1), ok_layers(kSchemes, 0);
  for (std::size_t i = 0; i < dump.layers.size(); ++i) {
    const int L = dump.layers[i].layer;
    std::vector<std::vector<float>> fp32_out;
    Row rows[kSchemes];
    rows[0] = run<kvc::schemes::Fp32>(dump, i, positions, &fp32_out, nullptr);
    const bool have_ref = rows[0].error.empty() && dump.has_queries();
    const auto* ref = have_ref ? &fp32_out : nullptr;
    rows[1] = run<kvc::schemes::Fp16>(dump, i, positions, nullptr, ref);
    rows[2] = run<kvc::schemes::Int8>(dump, i, positions, nullptr, ref);
    rows[3] = run<kvc::schemes::Kivi4>(dump, i, positions, nullptr, ref);
    rows[4] = run<kvc::schemes::Kivi2>(dump, i, positions, nullptr, ref);
    for (int s = 0; s < kSchemes; ++s) {
      print_row(L, names[s], rows[s]);
      if (!rows[s].error.empty()) continue;
      ++ok_layers[s];
      sum_bits[s] += rows[s].bits;
      sum_k[s] += rows[s].k_rel;
      sum_v[s] += rows[s].v_rel;
      if (!std::isnan(rows[s].attn_mean)) sum_mean[s] += rows[s].attn_mean;
      if (!std::isnan(rows[s].attn_worst) && rows[s].attn_worst > worst[s]) {
        worst[s] = rows[s].attn_worst;
        worst_layer[s] = L;
      }
    }
    const std::size_t n = dump.kv_floats();
    std::printf("%5s  (largest |K| %.3g, largest |V| %.3g)\n", "", max_abs(dump.layers[i].k.data(), n),
                max_abs(dump.layers[i].v.data(), n));
  }

  std::printf("\nAll layers: mean of the per-layer numbers, and the worst per-head error of any layer.\n");
  std::printf("%-6s  %7s  %9s  %-18s  %8s  %8s\n", "scheme", "bits/el", "attn mean", "attn worst (layer)", "K rel",
              "V rel");
  for (int s = 0; s < kSchemes; ++s) {
    if (ok_layers[s] == 0) {
      std::printf("%-6s  (rejected the data in every layer)\n", names[s]);
      continue;
    }
    const double n = ok_layers[s];
    char w[48] = "-";
    if (worst_layer[s] >= 0) std::snprintf(w, sizeof w, "%9.2e (%d)", worst[s], worst_layer[s]);
    char m[24] = "-";
    if (dump.has_queries()) std::snprintf(m, sizeof m, "%9.2e", sum_mean[s] / n);
    std::printf("%-6s  %7.2f  %9s  %-18s  %8.2e  %8.2e\n", names[s], sum_bits[s] / n, m, w, sum_k[s] / n,
                sum_v[s] / n);
  }
  return 0;
}
