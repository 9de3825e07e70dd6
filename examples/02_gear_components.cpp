// 02_gear_components: GEAR's component error table (paper Fig. 2a) on REAL keys, values and queries:
// what the quantized backbone, the sparse outliers and the low-rank residual each recover, alone and
// combined, at 4 and 2 bits.
//
//   02_gear_components [dump-file]
//
// Data and command line as in 01_real_kv_errors: the dump (kvc/io/kv_dump.hpp) holds the post-RoPE
// keys, values and queries of some layers of a model over one text, written by the llama engine in
// examples/llama (kvc-eval --dump-kv ...). Default file: $KVC_KV_DUMP, else
// ~/.cache/kvc/smollm2_kv_dump.bin. Without an argument or KVC_KV_DUMP, a missing default dump is not
// an error: the program says how to make one and exits 0 (it is a demo). A file named explicitly that
// is missing exits 2; a corrupt dump, or one the table cannot use (head_dim not a multiple of 64, fewer
// than 64 tokens), exits 1.
//
// Only the first T = 64 * floor(tokens / 64) tokens are used, so every configuration holds whole
// 64-token blocks: no fp16 tail enters the bits or the errors (the "fp16 tail" column checks it).
//
// Rows. Every block is 64 tokens x head_dim of one KV head; "s" is the outlier fraction, "r" the rank.
//   fp16               CompressedKVCache fp16 (schemes::Fp16): the storage floor, for scale
//   outliers only      X~ = S: the signed top and bottom s/2 (s = 2 %) entries of each block kept (in
//                      fp16, as the cache stores them), zero elsewhere (select_outliers, the cache's own
//                      selection); bits = stored outliers x 32 (16-bit index + fp16 value) / elements
//   low-rank only      X~ = A B^T, the rank-r (r = 2) power-iteration fit of each block (power_iteration
//                      + HostLinalg, 3 iterations, QR each, as LowRankResidual's defaults), factors
//                      rounded to fp16; bits = r (n + d) 16 / (n d)
//   quant only         KiviWith<B, 64, 64, 0>: keys per channel over the 64-token block, values per token
//                      in 64-channel groups, no fp16 window
//   outliers + quant   KiviWith<B, 64, 64, 0, OutlierFilter<200>>
//   quant + low-rank   KiviWith<B, 64, 64, 0, LowRankResidual<Rank<2>>>
//   GEAR               KiviWith<B, 64, 64, 0, OutlierFilter<200>, LowRankResidual<Rank<2>>>
//   Gear4, OutlierQuant4, LowRankQuant4   the paper's configuration and its ablations (schemes.hpp):
//                      per-block 4-bit backbone; s = 2 %, rho = 2 % | s = 5 % | rho = 5 %
// Cache rows report the cache's own bits_per_element() and dequantize(); the two backbone-free rows
// are attended through an fp32 cache that holds their X~.
//
// Columns:
//   bits/el     stored bits per K/V element once all T tokens are in, everything counted: codes, fp16
//               metadata, corrections and the layout's block padding (cache_layout.hpp: correction
//               region 16-byte aligned, block 64-byte aligned; for Gear4 ~0.12 bits/el is padding)
//   K rel, V rel  ||X~ - X||_F / ||X||_F with the sums pooled over all dumped layers, KV heads and tokens
//               (one Frobenius norm over the whole dump, not a mean of per-layer ratios)
//   attn rel    decode attention with the dump's real query of position t over the compressed cache
//               holding tokens 0..t, against the same over an exact fp32 cache: ||o~ - o|| / ||o||
//               over all query heads of a position, averaged over the positions t = 63, 127, ..., T-1
//               and the layers. Both sides use Precision::kExact (float FMAs over decoded codes), so
//               the column measures the compression, not the fast kernel's int8 query rounding.
//               With a dump without queries the column is '-'.
#include <kvc/gear/host_linalg.hpp>
#include <kvc/gear/power_iteration.hpp>
#include "dump_cli.hpp"

#include <kvc/io/kv_dump.hpp>
#include <kvc/kvc.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace {

constexpr int kBlock = 64;     // tokens per block: KIVI's key group, GEAR's n_b, every row's unit
constexpr int kLowRank = 2;    // the rank of "low-rank only" and of LowRankResidual<Rank<2>>
using Outliers = kvc::OutlierFilter<200>;  // s = 2 %

template <int B, class... Corrections>
using Backbone = kvc::schemes::KiviWith<B, kBlock, kBlock, 0, Corrections...>;
template <int B>
using OutlierQuant = Backbone<B, Outliers>;
template <int B>
using QuantLowRank = Backbone<B, kvc::LowRankResidual<kvc::Rank<kLowRank>>>;
template <int B>
using Gear = Backbone<B, Outliers, kvc::LowRankResidual<kvc::Rank<kLowRank>>>;

/// One configuration, accumulated over the dumped layers.
struct Row {
  const char* name = "";
  const char* backbone = "";
  double bits_sum = 0.0;                  // per-layer bits/el, summed (layers hold equally many elements)
  double k_err2 = 0.0, k_ref2 = 0.0;      // sum (x~ - x)^2 and sum x^2 over all layers
  double v_err2 = 0.0, v_ref2 = 0.0;
  double attn_sum = 0.0;                  // per-(layer, position) relative errors, summed
  int attn_n = 0, layers = 0, tail_tokens = 0;
  std::string error;  // non-empty when the configuration rejected the data
};

/// The dumped layer `i` restricted to its first T tokens, and the fp32 reference outputs.
struct Layer {
  kvc::KVView K, V;  // [T][kv_heads][head_dim]
  std::vector<int> positions;
  std::vector<std::vector<float>> ref;  // [position][q_heads * head_dim], empty without queries
};

const kvc::AttentionOptions kExactAttention = [] {
  kvc::AttentionOptions o;
  o.precision = kvc::Precision::kExact;
  return o;
}();

/// sum (a - ref)^2 and sum ref^2 over n floats, added to err2 / ref2.
void accumulate(const float* a, const float* ref, std::size_t n, double& err2, double& ref2) {
  for (std::size_t e = 0; e < n; ++e) {
    const double diff = double(a[e]) - ref[e];
    err2 += diff * diff;
    ref2 += double(ref[e]) * ref[e];
  }
}

/// ||a - ref|| / ||ref|| (absolute when ref is 0).
double rel_err(const float* a, const float* ref, std::size_t n) {
  double e = 0.0, r = 0.0;
  accumulate(a, ref, n, e, r);
  return r > 0.0 ? std::sqrt(e / r) : std::sqrt(e);
}

/// What one configuration did on one layer.
struct LayerResult {
  double bits = 0.0;
  double k_err2 = 0.0, k_ref2 = 0.0, v_err2 = 0.0, v_ref2 = 0.0;
  double attn_sum = 0.0;
  int attn_n = 0, tail_tokens = 0;
};

void add(Row& row, const LayerResult& r) {
  row.bits_sum += r.bits;
  row.k_err2 += r.k_err2, row.k_ref2 += r.k_ref2;
  row.v_err2 += r.v_err2, row.v_ref2 += r.v_ref2;
  row.attn_sum += r.attn_sum;
  row.attn_n += r.attn_n;
  row.tail_tokens = std::max(row.tail_tokens, r.tail_tokens);
  ++row.layers;
}

/// Builds a `Cache` over `L.K`, `L.V` (T tokens) the way an engine does while decoding: at query
/// position t it holds tokens 0..t, appended in order, and attends with the dump's real query of t.
/// The outputs go to `outs` if given and are compared with `L.ref` if that is non-empty; after all
/// tokens, the cache's bits and its reconstruction (dequantize) are measured against the exact data
/// (Kx, Vx). Throws kvc::Error when the cache rejects the data.
template <class Cache>
LayerResult measure(const kvc::io::KVDump& dump, std::size_t i, const Layer& L, const kvc::KVView& Kx,
                    const kvc::KVView& Vx, std::vector<std::vector<float>>* outs = nullptr) {
  const int T = L.K.dim0, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  const std::size_t q_size = std::size_t(Hq) * d;
  Cache cache(kvc::CacheConfig{/*layers=*/1, /*batch=*/1, H, d, /*capacity=*/T});
  LayerResult r;
  std::vector<float> out(q_size);
  int len = 0;
  for (std::size_t p = 0; p < L.positions.size(); ++p) {
    const int t = L.positions[p];
    cache.append(0, 0, kvc::KVView{L.K.row(len, 0), t + 1 - len, H, d, L.K.stride0, L.K.stride1},
                 kvc::KVView{L.V.row(len, 0), t + 1 - len, H, d, L.V.stride0, L.V.stride1});
    len = t + 1;
    if (!dump.has_queries()) continue;
    kvc::decode_attention(cache, 0, dump.queries(i, t), kvc::OutputView::contiguous(out.data(), 1, Hq, d),
                          kExactAttention);
    if (outs) outs->push_back(out);
    if (!L.ref.empty()) {
      r.attn_sum += rel_err(out.data(), L.ref[p].data(), q_size);
      ++r.attn_n;
    }
  }
  std::vector<float> kh(std::size_t(T) * H * d), vh(kh.size());
  cache.dequantize(0, 0, kh.data(), vh.data());
  accumulate(kh.data(), Kx.data, kh.size(), r.k_err2, r.k_ref2);
  accumulate(vh.data(), Vx.data, vh.size(), r.v_err2, r.v_ref2);
  r.bits = cache.bits_per_element();
  r.tail_tokens = T - cache.quantized_blocks(0, 0) * Cache::kBlockTokens;
  return r;
}

/// A cache row: `Cache` on layer i, added to `row` (or its error recorded, the layer left out).
template <class Cache>
void cache_row(const kvc::io::KVDump& dump, std::size_t i, const Layer& L, Row& row) {
  try {
    add(row, measure<Cache>(dump, i, L, L.K, L.V));
  } catch (const kvc::Error& e) {
    if (row.error.empty()) row.error = e.what();
  }
}

/// Approximates one block x ([n][d] row-major, n = kBlock) of KV head `head`, side `keys`, into y.
using BlockFit = std::function<void(const float* x, int n, int d, int head, int block, bool keys, float* y)>;

/// X~ of a whole [T][H][d] array, block by block and head by head.
std::vector<float> approximate(const kvc::KVView& X, bool keys, const BlockFit& fit) {
  const int T = X.dim0, H = X.dim1, d = X.dim2;
  std::vector<float> out(std::size_t(T) * H * d), x(std::size_t(kBlock) * d), y(x.size());
  for (int h = 0; h < H; ++h)
    for (int b = 0; b < T / kBlock; ++b) {
      for (int t = 0; t < kBlock; ++t) std::copy_n(X.row(b * kBlock + t, h), d, x.data() + std::size_t(t) * d);
      fit(x.data(), kBlock, d, h, b, keys, y.data());
      for (int t = 0; t < kBlock; ++t)
        std::copy_n(y.data() + std::size_t(t) * d, d, out.data() + (std::size_t(b * kBlock + t) * H + h) * d);
    }
  return out;
}

/// A backbone-free row: X~ from `fit`, attended through an fp32 cache holding X~ (which reproduces it
/// exactly), errors against the exact data; `bits` is the row's storage cost, computed by the caller.
void approx_row(const kvc::io::KVDump& dump, std::size_t i, const Layer& L, const BlockFit& fit, double bits,
                Row& row) {
  const std::vector<float> ka = approximate(L.K, true, fit), va = approximate(L.V, false, fit);
  const int T = L.K.dim0, H = dump.kv_heads, d = dump.head_dim;
  Layer approx{kvc::KVView::contiguous(ka.data(), T, H, d), kvc::KVView::contiguous(va.data(), T, H, d),
               L.positions, L.ref};
  try {
    LayerResult r = measure<kvc::schemes::Fp32>(dump, i, approx, L.K, L.V);
    r.bits = bits;  // what the approximation stores, not the fp32 cache that replays it
    add(row, r);
  } catch (const kvc::Error& e) {
    if (row.error.empty()) row.error = e.what();
  }
}

float fp16(float x) { return kvc::half_t::from_float(x).to_float(); }

/// "outliers only": the block's s/2 largest and s/2 smallest signed entries, in fp16; zero elsewhere.
void outliers_only(const float* x, int n, int d, int, int, bool, float* y) {
  const std::size_t size = std::size_t(n) * d;
  std::fill_n(y, size, 0.0f);
  for (std::uint32_t e : kvc::select_outliers(x, size, std::size_t(Outliers::per_side(n * d)))) y[e] = fp16(x[e]);
}

/// "low-rank only": A B^T from kLowRank-rank power iteration on the block, A and B rounded to fp16.
void low_rank_only(const float* x, int n, int d, int head, int block, bool keys, float* y) {
  const int r = kLowRank;
  std::vector<float> cm(std::size_t(n) * d), A(std::size_t(n) * r), B(std::size_t(d) * r);
  for (int t = 0; t < n; ++t)  // column-major n x d, as power_iteration takes it
    for (int c = 0; c < d; ++c) cm[std::size_t(c) * n + t] = x[std::size_t(t) * d + c];
  kvc::HostLinalg la;
  const std::uint64_t seed = (std::uint64_t(head) * 0x9E3779B1ull + std::uint64_t(block)) * 2u + (keys ? 0u : 1u);
  kvc::power_iteration(la, cm.data(), n, d, n, r, /*iters=*/3, /*every_qr=*/true, A.data(), B.data(),
                       /*warm=*/false, seed);
  for (float& a : A) a = fp16(a);
  for (float& b : B) b = fp16(b);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) {
      float s = 0.0f;
      for (int j = 0; j < r; ++j) s += A[std::size_t(j) * n + t] * B[std::size_t(j) * d + c];
      y[std::size_t(t) * d + c] = s;
    }
}

void print_row(const Row& r, bool queries) {
  if (!r.error.empty()) {
    std::printf("| %s | %s | error: %s | | | | |\n", r.name, r.backbone, r.error.c_str());
    return;
  }
  auto rel = [](double e2, double r2) { return r2 > 0.0 ? std::sqrt(e2 / r2) : std::sqrt(e2); };
  char attn[32] = "-";
  if (queries && r.attn_n > 0) std::snprintf(attn, sizeof attn, "%.3e", r.attn_sum / r.attn_n);
  std::printf("| %s | %s | %.3f | %.3e | %.3e | %s | %d |\n", r.name, r.backbone, r.bits_sum / r.layers,
              rel(r.k_err2, r.k_ref2), rel(r.v_err2, r.v_ref2), attn, r.tail_tokens);
}

}  // namespace

int main(int argc, char** argv) {
  kvc::io::KVDump dump;
  std::string path;
  if (const auto status =
          kvc_examples::load_dump(argc, argv, "02_gear_components", "measures GEAR's components", dump, path)) return *status;

  const int H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  const int T = dump.tokens / kBlock * kBlock;
  std::string layers;
  for (const auto& l : dump.layers) layers += (layers.empty() ? "" : " ") + std::to_string(l.layer);
  std::printf("KV dump %s\n  model %s; source: %s\n", path.c_str(), dump.model.c_str(), dump.source.c_str());
  std::printf("  %d tokens, %d query / %d KV heads, head_dim %d; %zu layers: %s\n", dump.tokens, Hq, H, d,
              dump.layers.size(), layers.c_str());
  if (d % kBlock != 0 || T == 0) {
    std::fprintf(stderr, "02_gear_components: needs head_dim a multiple of %d (KIVI's value groups) and at least "
                 "%d tokens (got head_dim %d, %d tokens)\n", kBlock, kBlock, d, dump.tokens);
    return 1;
  }
  std::vector<int> positions;
  for (int t = kBlock - 1; t < T; t += kBlock) positions.push_back(t);
  std::printf("kvc %d.%d.%d, %s path. Using the first T = %d tokens (%d whole %d-token blocks per head%s).\n",
              KVC_VERSION_MAJOR, KVC_VERSION_MINOR, KVC_VERSION_PATCH, kvc::simd_path_name(), T, T / kBlock,
              kBlock, T == dump.tokens ? "" : "; the rest is dropped so no fp16 tail remains");
  if (dump.has_queries())
    std::printf("attn: the dump's real queries at t = %d, %d, ..., %d (%zu positions), exact-precision decode "
                "attention over the compressed cache of tokens 0..t vs over the fp32 cache.\n",
                positions.front(), positions.size() > 1 ? positions[1] : positions.front(), positions.back(),
                positions.size());
  else
    std::printf("The dump has no queries: the attn column is '-' (reconstruction errors only).\n");
  std::printf("K rel / V rel: ||X~ - X||_F / ||X||_F pooled over all %zu layers, %d KV heads and %d tokens.\n"
              "Outliers: s = 2 %% per block (%d per %dx%d block); low rank: r = %d per block.\n\n",
              dump.layers.size(), H, T, Outliers::count(kBlock, d), kBlock, d, kLowRank);

  // Rows, in print order; the index constants keep the per-layer calls below readable.
  enum : int { kFp16, kOutOnly, kLrOnly, kQ4, kOQ4, kQL4, kG4, kGear4, kOutQuant4, kLrQuant4, kQ2, kOQ2, kQL2, kG2, kRows };
  Row rows[kRows];
  auto name = [&](int r, const char* n, const char* b) {
    rows[r].name = n;
    rows[r].backbone = b;
  };
  name(kFp16, "fp16 (storage floor)", "-");
  name(kOutOnly, "outliers only (s = 2 %)", "-");
  name(kLrOnly, "low-rank only (r = 2)", "-");
  name(kQ4, "quant only", "KIVI 4-bit");
  name(kOQ4, "outliers + quant", "KIVI 4-bit");
  name(kQL4, "quant + low-rank", "KIVI 4-bit");
  name(kG4, "GEAR (outliers + quant + low-rank)", "KIVI 4-bit");
  name(kGear4, "schemes::Gear4 (s = 2 %, rho = 2 %)", "per-block 4-bit");
  name(kOutQuant4, "schemes::OutlierQuant4 (s = 5 %)", "per-block 4-bit");
  name(kLrQuant4, "schemes::LowRankQuant4 (rho = 5 %)", "per-block 4-bit");
  name(kQ2, "quant only", "KIVI 2-bit");
  name(kOQ2, "outliers + quant", "KIVI 2-bit");
  name(kQL2, "quant + low-rank", "KIVI 2-bit");
  name(kG2, "GEAR (outliers + quant + low-rank)", "KIVI 2-bit");

  const double outlier_bits = double(Outliers::count(kBlock, d)) * 32.0 / (double(kBlock) * d);
  const double low_rank_bits = double(kLowRank) * (kBlock + d) * 16.0 / (double(kBlock) * d);
  for (std::size_t i = 0; i < dump.layers.size(); ++i) {
    const kvc::KVView K = dump.keys(i), V = dump.values(i);
    Layer L{kvc::KVView{K.data, T, H, d, K.stride0, K.stride1}, kvc::KVView{V.data, T, H, d, V.stride0, V.stride1},
            positions, {}};
    if (dump.has_queries()) {
      try {
        measure<kvc::schemes::Fp32>(dump, i, L, L.K, L.V, &L.ref);
      } catch (const kvc::Error& e) {
        std::fprintf(stderr, "02_gear_components: the fp32 reference rejected layer %d: %s\n", dump.layers[i].layer,
                     e.what());
        return 1;
      }
    }
    cache_row<kvc::schemes::Fp16>(dump, i, L, rows[kFp16]);
    approx_row(dump, i, L, outliers_only, outlier_bits, rows[kOutOnly]);
    approx_row(dump, i, L, low_rank_only, low_rank_bits, rows[kLrOnly]);
    cache_row<Backbone<4>>(dump, i, L, rows[kQ4]);
    cache_row<OutlierQuant<4>>(dump, i, L, rows[kOQ4]);
    cache_row<QuantLowRank<4>>(dump, i, L, rows[kQL4]);
    cache_row<Gear<4>>(dump, i, L, rows[kG4]);
    cache_row<kvc::schemes::Gear4>(dump, i, L, rows[kGear4]);
    cache_row<kvc::schemes::OutlierQuant4>(dump, i, L, rows[kOutQuant4]);
    cache_row<kvc::schemes::LowRankQuant4>(dump, i, L, rows[kLrQuant4]);
    cache_row<Backbone<2>>(dump, i, L, rows[kQ2]);
    cache_row<OutlierQuant<2>>(dump, i, L, rows[kOQ2]);
    cache_row<QuantLowRank<2>>(dump, i, L, rows[kQL2]);
    cache_row<Gear<2>>(dump, i, L, rows[kG2]);
  }

  std::printf("| configuration | backbone | bits/el | K rel | V rel | attn rel | fp16 tail |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) print_row(r, dump.has_queries());
  return 0;
}
