/// \file coverage.hpp
/// LogQuant's attention-coverage analysis (paper §3, Fig. 2-3) on real attention: for each layer, the
/// share of the exact softmax mass of every query position that falls on the tokens a selector keeps
/// in full precision, averaged over query heads and positions. Selectors are asked through their
/// own interface (Selector::positions), so the numbers describe exactly what the caches keep.
#pragma once

#include <llama/llama_model.hpp>

#include <kvc/schemes.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace kvc::llama {

/// One selector's full-precision set as a function of the token count n.
struct CoverageSet {
  std::string name, description;
  /// Writes keep[p] = 1 for the positions p < n kept in full precision, 0 otherwise.
  void (*fill)(int n, std::vector<unsigned char>& keep);
};

namespace detail {
/// The positions Sel (B-token blocks) keeps in full precision with n tokens: the rows after its quantized
/// blocks in storage order; SetOnly: LogWindow's set alone, without its staging rows (kept_count of them).
template <class Sel, int B, bool SetOnly = false>
void fill_selector(int n, std::vector<unsigned char>& keep) {
  std::vector<int> pos(static_cast<std::size_t>(n));
  Sel::positions(n, B, pos.data());
  const int q = Sel::quantized_blocks(n, B) * B;
  int end = n;
  if constexpr (SetOnly) end = q + Sel::kept_count(n);
  keep.assign(static_cast<std::size_t>(n), 0);
  for (int i = q; i < end; ++i) keep[static_cast<std::size_t>(pos[static_cast<std::size_t>(i)])] = 1;
}
}  // namespace detail

/// The sets compared: LogQuant2's (W = 42, G = 64) with and without its staging rows, and KIVI's at the
/// same budget (126 newest, with and without the ring's not-yet-quantized rest).
inline const std::vector<CoverageSet>& coverage_sets() {
  static const std::vector<CoverageSet> sets = {
      {"logquant2", "LogWindow<42> set + staged evictions (G = 64): what LogQuant2 keeps in fp16",
       &detail::fill_selector<LogWindow<42>, 64>},
      {"log-set-126", "LogWindow<42>'s log-distributed set alone (<= 126 tokens)",
       &detail::fill_selector<LogWindow<42>, 64, true>},
      {"kivi2-g64-w126", "KIVI window 126 + not-yet-quantized tail (G = 64): what Kivi2Budget126 keeps in fp16",
       &detail::fill_selector<FullPrecisionWindow<126>, 64>},
      {"recent-126", "the 126 newest tokens alone",
       &detail::fill_selector<FullPrecisionWindow<126>, 1>},
  };
  return sets;
}

/// Per layer and set: mean over query heads and positions t >= `from` of the exact attention mass that
/// query t (attending to keys 0..t) puts on the set's tokens with n = t + 1 tokens cached.
struct CoverageResult {
  int from = 0;
  std::vector<std::vector<double>> mass;  // [layer][set]
};

/// Accumulates coverage layer by layer from LayerTraces (post-RoPE q and k, as the cache stores them).
class CoverageAnalysis {
 public:
  CoverageAnalysis(const LlamaConfig& c, int tokens, int from) : c_(c), tokens_(tokens) {
    r_.from = from;
    r_.mass.assign(std::size_t(c.layers), std::vector<double>(coverage_sets().size(), 0.0));
    // keep_[set][t]: the set with t + 1 tokens (the same for every layer: position rules only).
    keep_.resize(coverage_sets().size());
    for (std::size_t s = 0; s < keep_.size(); ++s) {
      keep_[s].resize(std::size_t(tokens));
      for (int t = 0; t < tokens; ++t) coverage_sets()[s].fill(t + 1, keep_[s][std::size_t(t)]);
    }
  }

  void observe(const LayerTrace& tr) {
    const int H = c_.heads, Hkv = c_.kv_heads, d = c_.head_dim, g = H / Hkv, T = tokens_;
    const double scale = 1.0 / std::sqrt(double(d));
    const std::size_t nsets = keep_.size();
    std::vector<double> sum(nsets, 0.0);
#pragma omp parallel
    {
      std::vector<double> local(nsets, 0.0), p(static_cast<std::size_t>(T));
#pragma omp for schedule(dynamic, 16) nowait
      for (int t = r_.from; t < T; ++t)
        for (int h = 0; h < H; ++h) {
          const float* q = tr.q->row(t).data() + std::size_t(h) * d;
          double m = -INFINITY, z = 0.0;
          for (int u = 0; u <= t; ++u) {
            const float* k = tr.k->row(u).data() + std::size_t(h / g) * d;
            double s = 0.0;
            for (int c = 0; c < d; ++c) s += double(q[c]) * double(k[c]);
            p[std::size_t(u)] = s * scale;
            m = std::max(m, p[std::size_t(u)]);
          }
          for (int u = 0; u <= t; ++u) z += (p[std::size_t(u)] = std::exp(p[std::size_t(u)] - m));
          for (std::size_t s = 0; s < nsets; ++s) {
            const auto& keep = keep_[s][std::size_t(t)];
            double on = 0.0;
            for (int u = 0; u <= t; ++u) on += keep[std::size_t(u)] ? p[std::size_t(u)] : 0.0;
            local[s] += on / z;
          }
        }
#pragma omp critical
      for (std::size_t s = 0; s < nsets; ++s) sum[s] += local[s];
    }
    const double count = double(T - r_.from) * H;
    for (std::size_t s = 0; s < nsets; ++s) r_.mass[std::size_t(tr.layer)][s] = count > 0 ? sum[s] / count : 0.0;
  }

  const CoverageResult& result() const { return r_; }

  /// Mean size of each set over the measured positions (tokens kept in fp16).
  double mean_size(std::size_t set) const {
    double n = 0.0;
    for (int t = r_.from; t < tokens_; ++t)
      for (unsigned char k : keep_[set][std::size_t(t)]) n += k;
    return tokens_ > r_.from ? n / double(tokens_ - r_.from) : 0.0;
  }

  /// JSON: per layer and set the covered mass, the sets' mean sizes, and LogQuant2's kept positions
  /// after `show` tokens (the paper's illustration).
  void write_json(const std::string& path, int show) const {
    std::ofstream f(path);
    f << "{\n  \"tokens\": " << tokens_ << ",\n  \"from\": " << r_.from << ",\n  \"sets\": [";
    for (std::size_t s = 0; s < keep_.size(); ++s)
      f << (s ? ", " : "") << "{\"name\": \"" << coverage_sets()[s].name << "\", \"description\": \""
        << coverage_sets()[s].description << "\", \"mean_size\": " << mean_size(s) << "}";
    f << "],\n  \"mass\": [";
    for (std::size_t l = 0; l < r_.mass.size(); ++l) {
      f << (l ? ",\n    " : "\n    ") << "[";
      for (std::size_t s = 0; s < r_.mass[l].size(); ++s) f << (s ? ", " : "") << r_.mass[l][s];
      f << "]";
    }
    std::vector<unsigned char> keep;
    detail::fill_selector<LogWindow<42>, 64, true>(show, keep);
    f << "],\n  \"logquant_kept_after\": " << show << ",\n  \"logquant_kept\": [";
    bool first = true;
    for (int p = 0; p < show; ++p)
      if (keep[std::size_t(p)]) {
        f << (first ? "" : ", ") << p;
        first = false;
      }
    f << "]\n}\n";
    KVC_CHECK(f.good(), Errc::kIo, "cannot write '", path, "'");
  }

  /// Markdown table: layer x set.
  std::string markdown() const {
    std::string s = "| layer |";
    for (const auto& set : coverage_sets()) s += " " + set.name + " |";
    s += "\n|---:|";
    for (std::size_t i = 0; i < coverage_sets().size(); ++i) s += "---:|";
    s += "\n";
    char buf[64];
    std::vector<double> mean(coverage_sets().size(), 0.0);
    for (std::size_t l = 0; l < r_.mass.size(); ++l) {
      s += "| " + std::to_string(l) + " |";
      for (std::size_t i = 0; i < r_.mass[l].size(); ++i) {
        std::snprintf(buf, sizeof buf, " %.3f |", r_.mass[l][i]);
        s += buf;
        mean[i] += r_.mass[l][i] / double(r_.mass.size());
      }
      s += "\n";
    }
    s += "| mean |";
    for (double m : mean) {
      std::snprintf(buf, sizeof buf, " %.3f |", m);
      s += buf;
    }
    s += "\n| fp16 tokens (mean) |";
    for (std::size_t i = 0; i < coverage_sets().size(); ++i) {
      std::snprintf(buf, sizeof buf, " %.1f |", mean_size(i));
      s += buf;
    }
    return s + "\n";
  }

 private:
  LlamaConfig c_;
  int tokens_;
  CoverageResult r_;
  std::vector<std::vector<std::vector<unsigned char>>> keep_;  // [set][t][position]
};
}  // namespace kvc::llama
