// 03_aligned_real_kv: AlignedKV (kvc::AlignedLoader<>) on REAL keys, values and queries: how many bytes its
// decode attention reads, and what the truncation does to QK^T, SV and the attention output.
//
//   03_aligned_real_kv [dump-file [max-read-fraction max-attn-error]]
//   03_aligned_real_kv --sweep [dump-file]
//   03_aligned_real_kv --window [dump-file [max-attn-error]]
//
// With the two limits (the test suite's use), exits 3 when the bytes read over all layers exceed
// max-read-fraction of fp16's or the mean attention error exceeds max-attn-error.
// --sweep measures AlignedLoader's tier thresholds (template parameters, SPEC A1) around the default 4 / 8
// binades: one summary row per threshold set (bytes read, bits, attention error, Table 1's tails).
// --window measures AlignedLoader over other schemes' fp16 slots (schemes::AlignedWindow<Kivi2>, <LogQuant2>):
// the slot planes' bytes read against the same slots in fp16, the step's bytes against the plain scheme's
// decode_read_bytes, and the attention output's error against the plain scheme's (exits 3 when a scheme's mean
// error exceeds max-attn-error).
//
// The dump (kvc/io/kv_dump.hpp, written by kvc-eval --dump-kv) holds post-RoPE keys, values and queries of some
// layers. For every dumped layer the cache is built as an engine builds it (at query position t it holds tokens
// 0..t), and at every 64th position (and the last) decode attention runs with the real query. Reported:
//   per layer   the bytes read against fp16's (every plane byte plus nothing else), the average leading bits
//               loaded per planar element, and the attention output's error against fp16 attention (kvc::reference
//               in double over the cache's fp16 contents): ||o - o_fp16|| / ||o_fp16|| per query head, mean and worst
//   Table 1     the paper's distribution of relative errors (paper Table 1, SPEC §3.8) over every position, head
//               and token: QK^T with the keys at Rule 1's tiers, S V with the values at Rule 2's tiers against the
//               same (exact fp16) probabilities; in double, both results then rounded to fp16 as the paper's fp16
//               GEMM outputs are ("0": the same fp16 result); QK^T over tokens of complete blocks only (staged
//               tokens are read whole, so exact by construction)
//   Fig. 9      the average leading bits loaded per planar element by context length, all layers
#include "dump_cli.hpp"

#include <kvc/aligned/decode_attention.hpp>
#include <kvc/attention/reference.hpp>
#include <kvc/io/kv_dump.hpp>
#include <kvc/schemes.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int kEvery = 64;
constexpr int kContextBins = 6;  // t < 128, 256, 512, 1024, 2048, more

/// Relative-error histogram with the paper's bins: 0, (0, 1/1024), [1/1024, 1/512), [1/512, 1/256),
/// [1/256, 1/128), >= 1/128.
struct Bins {
  std::array<double, 6> n{};
  void add(double rel) {
    const int b = rel == 0.0 ? 0 : rel < 1.0 / 1024 ? 1 : rel < 1.0 / 512 ? 2 : rel < 1.0 / 256 ? 3 : rel < 1.0 / 128 ? 4 : 5;
    n[std::size_t(b)] += 1.0;
  }
  /// Percent of the outputs in bin b.
  double share(int b) const {
    double total = 0.0;
    for (double x : n) total += x;
    return 100.0 * n[std::size_t(b)] / total;
  }
  void print(const char* name) const {
    std::printf("| %s | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.2f%% |\n", name, share(0), share(1), share(2), share(3),
                share(4), share(5));
  }
};

double fp16(double x) { return kvc::half_t::from_float(float(x)).to_float(); }
float trunc(float x, int tier) {
  return kvc::detail::half_bits_to_float(kvc::aligned::truncate(kvc::half_t::from_float(x).bits, tier));
}
double rel(double a, double ref) { return ref != 0.0 ? std::fabs(a - ref) / std::fabs(ref) : (a == 0.0 ? 0.0 : 1.0); }

/// ||out_h - ref_h|| / ||ref_h|| of every query head h of one step ([Hq][d] rows), added to sum / worst / n.
void head_errors(const std::vector<float>& out, const std::vector<float>& ref, int Hq, int d, double& sum,
                 double& worst, int& n) {
  for (int h = 0; h < Hq; ++h) {
    double e = 0.0, r = 0.0;
    for (int c = 0; c < d; ++c) {
      const double x = out[std::size_t(h) * d + c], y = ref[std::size_t(h) * d + c];
      e += (x - y) * (x - y), r += y * y;
    }
    const double x = r > 0.0 ? std::sqrt(e / r) : std::sqrt(e);
    sum += x, worst = std::max(worst, x), ++n;
  }
}

/// Everything one threshold set measures over all dumped layers.
struct Summary {
  Bins qk, sv;
  std::array<double, kContextBins> bits_sum{}, bits_n{};
  std::array<double, 3> key_tiers{}, value_tiers{};
  double read = 0.0, fp16 = 0.0, err_sum = 0.0, err_worst = 0.0;
  int err_n = 0;
};

double avg(const std::array<double, 3>& n) { return (8 * n[0] + 12 * n[1] + 16 * n[2]) / (n[0] + n[1] + n[2]); }

/// Builds every dumped layer's cache position by position and measures AlignedKV with `Loader`'s thresholds;
/// `print`: the per-layer table.
template <class Loader>
Summary measure(const kvc::io::KVDump& dump, bool print) {
  using Cache = kvc::CompressedKVCache<Loader>;
  if (print)
    std::printf("| layer | bytes read / fp16 | average bits (K / V) | attn rel. error mean | worst |\n|---:|---:|---:|---:|---:|\n");
  Summary sum;
  const int T = dump.tokens, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim, g = Hq / H;
  for (std::size_t i = 0; i < dump.layers.size(); ++i) {
    const kvc::KVView K = dump.keys(i), V = dump.values(i);
    Cache cache(kvc::CacheConfig{1, 1, H, d, T});
    int len = 0;
    double read = 0.0, full = 0.0, bits = 0.0, err_sum = 0.0, err_worst = 0.0;
    std::array<double, 3> kt_n{}, vt_n{};
    int npos = 0, nerr = 0;
    std::vector<float> out(std::size_t(Hq) * d), ref(out.size()), kf, vf;
    for (int t = std::min(kEvery, T) - 1;; t = std::min(t + kEvery, T - 1)) {
      cache.append(0, 0, kvc::KVView{K.row(len, 0), t + 1 - len, H, d, K.stride0, K.stride1},
                   kvc::KVView{V.row(len, 0), t + 1 - len, H, d, V.stride0, V.stride1});
      len = t + 1;
      const kvc::QueryView q = dump.queries(i, t);
      kvc::aligned::ReadStats st;
      kvc::decode_attention(cache, 0, q, kvc::OutputView::contiguous(out.data(), 1, Hq, d), {}, &st);
      kf.resize(std::size_t(len) * H * d), vf.resize(kf.size());
      cache.dequantize(0, 0, kf.data(), vf.data());
      kvc::reference::decode_attention(q.data, Hq, kf.data(), vf.data(), len, H, d, ref.data());
      head_errors(out, ref, Hq, d, err_sum, err_worst, nerr);
      read += double(st.total_bytes());
      full += double(len) * H * d * 2 * 2;
      bits += st.average_bits(), ++npos;
      for (int j = 0; j < 3; ++j) kt_n[std::size_t(j)] += double(st.key_tiers[j]), vt_n[std::size_t(j)] += double(st.value_tiers[j]);
      const int cb = t < 128 ? 0 : t < 256 ? 1 : t < 512 ? 2 : t < 1024 ? 3 : t < 2048 ? 4 : 5;
      sum.bits_sum[std::size_t(cb)] += st.average_bits(), sum.bits_n[std::size_t(cb)] += 1.0;
      // Table 1, in double: per KV head its tiers, per query head the exact probabilities
      const int planar = len / Loader::kBlock * Loader::kBlock;
      for (int kh = 0; kh < H; ++kh) {
        std::vector<float> qg(std::size_t(g) * d);
        for (int h = 0; h < g; ++h) std::copy_n(q.row(0, kh * g + h), d, qg.data() + std::size_t(h) * d);
        std::array<std::uint8_t, 256> kt{};
        const auto& sm = cache.stream(0, 0, kh);
        Loader::key_tiers(qg.data(), g, d, sm.kmax.data(), kt.data());
        std::vector<float> p(std::size_t(g) * len);
        std::vector<double> pd(p.size());
        for (int h = 0; h < g; ++h) {
          double m = -1e300;
          for (int u = 0; u < len; ++u) {
            double s = 0.0, s_tr = 0.0;
            for (int c = 0; c < d; ++c) {
              const double qc = qg[std::size_t(h) * d + c];
              const float k = kf[(std::size_t(u) * H + kh) * d + c];
              s += qc * k;
              s_tr += qc * trunc(k, kt[std::size_t(c)]);
            }
            if (u < planar) sum.qk.add(rel(fp16(s_tr), fp16(s)));
            pd[std::size_t(h) * len + u] = s / std::sqrt(double(d));
            m = std::max(m, pd[std::size_t(h) * len + u]);
          }
          double z = 0.0;
          for (int u = 0; u < len; ++u) z += (pd[std::size_t(h) * len + u] = std::exp(pd[std::size_t(h) * len + u] - m));
          for (int u = 0; u < len; ++u) p[std::size_t(h) * len + u] = float(pd[std::size_t(h) * len + u] /= z);
        }
        std::array<int, 64> refs{};
        std::vector<float> est(static_cast<std::size_t>(d));
        for (int h = 0; h < g; ++h)
          refs[std::size_t(h)] = Loader::estimate_reference(
              p.data() + std::size_t(h) * len, len, d, sm.vmax.data(),
              [&](int u, int c) {
                return kvc::aligned::truncate(kvc::half_t::from_float(vf[(std::size_t(u) * H + kh) * d + c]).bits, 8);
              },
              est.data());
        for (int h = 0; h < g; ++h) {
          std::vector<double> o(std::size_t(d), 0.0), o_tr(std::size_t(d), 0.0);
          for (int u = 0; u < len; ++u) {
            const int tier = u < planar ? Loader::value_tier(p.data() + u, std::size_t(len), g, refs.data()) : 16;
            const double w = pd[std::size_t(h) * len + u];
            for (int c = 0; c < d; ++c) {
              const float v = vf[(std::size_t(u) * H + kh) * d + c];
              o[std::size_t(c)] += w * v;
              o_tr[std::size_t(c)] += w * trunc(v, tier);
            }
          }
          for (int c = 0; c < d; ++c) sum.sv.add(rel(fp16(o_tr[std::size_t(c)]), fp16(o[std::size_t(c)])));
        }
      }
      if (t == T - 1) break;
    }
    if (print)
      std::printf("| %d | %.3f | %.2f (%.2f / %.2f) | %.2e | %.2e |\n", dump.layers[i].layer, read / full, bits / npos,
                  avg(kt_n), avg(vt_n), err_sum / nerr, err_worst);
    sum.read += read, sum.fp16 += full, sum.err_sum += err_sum, sum.err_n += nerr;
    sum.err_worst = std::max(sum.err_worst, err_worst);
    for (int j = 0; j < 3; ++j) sum.key_tiers[std::size_t(j)] += kt_n[std::size_t(j)], sum.value_tiers[std::size_t(j)] += vt_n[std::size_t(j)];
  }
  return sum;
}

template <int KLo, int KHi, int VLo, int VHi>
void sweep_row(const kvc::io::KVDump& dump) {
  const Summary r = measure<kvc::AlignedLoader<KLo, KHi, VLo, VHi>>(dump, false);
  std::printf("| %d / %d | %d / %d | %.3f | %.2f / %.2f | %.2e | %.2e | %.2f%% | %.2f%% |\n", KLo, KHi, VLo, VHi,
              r.read / r.fp16, avg(r.key_tiers), avg(r.value_tiers), r.err_sum / r.err_n, r.err_worst, r.qk.share(5),
              r.sv.share(5));
  std::fflush(stdout);
}

/// AlignedLoader<> over Plain's full-precision slots, on every dumped layer built position by position, against
/// Plain itself: one table row. Returns the mean attention error against Plain's.
template <class Plain>
double window_row(const kvc::io::KVDump& dump, const char* name) {
  using Aligned = kvc::schemes::AlignedWindow<Plain>;
  const int T = dump.tokens, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  double planes = 0.0, slots = 0.0, total = 0.0, plain = 0.0, err_sum = 0.0, err_worst = 0.0, bits = 0.0;
  int nerr = 0, npos = 0;
  for (std::size_t i = 0; i < dump.layers.size(); ++i) {
    const kvc::KVView K = dump.keys(i), V = dump.values(i);
    const kvc::CacheConfig cfg{1, 1, H, d, T};
    Plain p(cfg);
    Aligned a(cfg);
    std::vector<float> out(std::size_t(Hq) * d), ref(out.size());
    int len = 0;
    for (int t = std::min(kEvery, T) - 1;; t = std::min(t + kEvery, T - 1)) {
      const kvc::KVView k{K.row(len, 0), t + 1 - len, H, d, K.stride0, K.stride1};
      const kvc::KVView v{V.row(len, 0), t + 1 - len, H, d, V.stride0, V.stride1};
      p.append(0, 0, k, v);
      a.append(0, 0, k, v);
      len = t + 1;
      const kvc::QueryView q = dump.queries(i, t);
      kvc::aligned::ReadStats st;
      kvc::decode_attention(a, 0, q, kvc::OutputView::contiguous(out.data(), 1, Hq, d), {}, &st);
      kvc::decode_attention(p, 0, q, kvc::OutputView::contiguous(ref.data(), 1, Hq, d));
      const int nfp = kvc::detail::fp_tokens<typename Plain::selector>(len, Plain::kBlockTokens);
      planes += double(st.key_bytes + st.value_bytes), slots += double(nfp) * H * d * 2 * 2;
      total += double(st.total_bytes()), plain += double(p.decode_read_bytes(0));
      if (nfp > 0) bits += st.average_bits(), ++npos;
      head_errors(out, ref, Hq, d, err_sum, err_worst, nerr);
      if (t == T - 1) break;
    }
  }
  std::printf("| %s | %.3f | %.2f | %.4f | %.2e | %.2e |\n", name, planes / slots, bits / std::max(npos, 1),
              total / plain, err_sum / nerr, err_worst);
  std::fflush(stdout);
  return err_sum / nerr;
}

}  // namespace

int main(int argc, char** argv) {
  kvc::io::KVDump dump;
  std::string path;
  double max_read = 0.0, max_err = 0.0;
  const bool sweep = argc >= 2 && std::string(argv[1]) == "--sweep";
  const bool window = argc >= 2 && std::string(argv[1]) == "--window";
  if (sweep || window) ++argv, --argc;
  if (window && argc == 3) {
    max_err = std::atof(argv[2]);
    if (!(max_err > 0.0)) {
      std::fprintf(stderr, "03_aligned_real_kv: the error limit must be a positive number\n");
      return 2;
    }
    argc = 2;
  }
  if (argc == 4 && !sweep && !window) {
    max_read = std::atof(argv[2]), max_err = std::atof(argv[3]);
    if (!(max_read > 0.0) || !(max_err > 0.0)) {
      std::fprintf(stderr, "03_aligned_real_kv: limits must be positive numbers\n");
      return 2;
    }
    argc = 2;
  }
  if (const auto status = kvc_examples::load_dump(argc, argv, "03_aligned_real_kv", "measures AlignedKV", dump, path))
    return *status;
  if (!dump.has_queries()) {
    std::fprintf(stderr, "03_aligned_real_kv: the dump has no queries (AlignedKV's tiers depend on them)\n");
    return 1;
  }
  std::printf("KV dump %s: %s, %d tokens, %d query / %d KV heads, head_dim %d, %zu layers; %s path\n", path.c_str(),
              dump.model.c_str(), dump.tokens, dump.q_heads, dump.kv_heads, dump.head_dim, dump.layers.size(),
              kvc::simd_path_name());
  if (sweep) {
    // Lower thresholds drop more bits; keys and values apart, then together (rows print as they finish).
    std::printf("| keys lo / hi | values lo / hi | bytes read / fp16 | bits K / V | attn rel. error mean | worst | "
                "QK^T >= 1/128 | S V >= 1/128 |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    sweep_row<4, 8, 4, 8>(dump);  // the default
    sweep_row<3, 8, 4, 8>(dump);  // keys: lo (16 -> 12), hi (12 -> 8), both
    sweep_row<4, 6, 4, 8>(dump);
    sweep_row<3, 7, 4, 8>(dump);
    sweep_row<2, 6, 4, 8>(dump);
    sweep_row<4, 8, 3, 8>(dump);  // values alike
    sweep_row<4, 8, 4, 6>(dump);
    sweep_row<4, 8, 3, 7>(dump);
    sweep_row<4, 8, 2, 6>(dump);
    sweep_row<3, 8, 3, 8>(dump);  // both
    sweep_row<3, 7, 3, 7>(dump);
    sweep_row<2, 6, 2, 6>(dump);
    sweep_row<1, 5, 1, 5>(dump);
    return 0;
  }
  if (window) {
    std::printf("| scheme | slot planes read / their fp16 | average bits | step read / plain scheme's | attn rel. error "
                "vs plain, mean | worst |\n|---|---:|---:|---:|---:|---:|\n");
    const double worst = std::max({window_row<kvc::schemes::Kivi2>(dump, "kivi2-aligned"),
                                   window_row<kvc::schemes::Kivi4>(dump, "kivi4-aligned"),
                                   window_row<kvc::schemes::LogQuant2>(dump, "logquant2-aligned")});
    if (max_err > 0.0 && worst > max_err) {
      std::fprintf(stderr, "03_aligned_real_kv: mean attention error against the plain scheme %.2e (limit %.2e)\n",
                   worst, max_err);
      return 3;
    }
    return 0;
  }
  using Loader = kvc::AlignedLoader<>;
  std::printf("AlignedLoader<>: key/value thresholds 4 / 8 binades, top-%d estimate, %d-token key blocks\n\n", Loader::kTopK,
              Loader::kBlock);
  const Summary r = measure<Loader>(dump, true);
  const double read_share = r.read / r.fp16, mean_err = r.err_sum / r.err_n;
  std::printf("| all | %.3f | | %.2e | %.2e |\n\n", read_share, mean_err, r.err_worst);
  std::printf("Table 1 (relative error of each output):\n\n| output | 0 | (0, 1/1024) | [1/1024, 1/512) | [1/512, 1/256) | "
              "[1/256, 1/128) | >= 1/128 |\n|---|---:|---:|---:|---:|---:|---:|\n");
  r.qk.print("QK^T");
  r.sv.print("SV");
  std::printf("\nFig. 9 (average leading bits per planar element by context length t):\n\n| t | bits |\n|---|---:|\n");
  const char* names[kContextBins] = {"< 128", "128-255", "256-511", "512-1023", "1024-2047", ">= 2048"};
  for (int b = 0; b < kContextBins; ++b)
    if (r.bits_n[std::size_t(b)] > 0)
      std::printf("| %s | %.2f |\n", names[b], r.bits_sum[std::size_t(b)] / r.bits_n[std::size_t(b)]);
  if (max_read > 0.0 && (read_share > max_read || mean_err > max_err)) {
    std::fprintf(stderr, "03_aligned_real_kv: read %.3f of fp16's bytes (limit %.3f), mean attention error %.2e (limit %.2e)\n",
                 read_share, max_read, mean_err, max_err);
    return 3;
  }
  return 0;
}
