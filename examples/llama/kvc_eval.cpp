// kvc-eval: perplexity and next-token fidelity of a real LM (SmolLM2-135M, GGUF) when every past
// position is read back from a kvc compressed cache, for each scheme of the registry.
//
//   kvc-eval [--model GGUF] [--text FILE] [--tokens N] [--schemes a,b,...|all] [--json FILE]
//            [--markdown FILE] [--dump-logits DIR [--dump-logits-n N]] [--dump-kv FILE
//            [--dump-kv-layers 0,15,29]] [--max-delta-ppl name=x,...] [--max-kl name=x,...]
//            [--expect-worse a:b,...] [--attention fast|exact|reference]
//            [--no-layer-error] [--coverage FILE.json [--coverage-from N]]
//            [--qaq-calibration FILE] [--qaq-calibration-tokens N] [--list]
//
// --attention: how the engine attends over each scheme's cache (the same cache contents in every mode;
// every run, the fp32 baseline included, uses the mode):
//   fast       kvc::decode_attention with default options (the default; what a user's engine runs)
//   exact      kvc::decode_attention with AttentionOptions::precision = kvc::Precision::kExact
//   reference  kvc::reference::decode_attention (double) over CompressedKVCache::dequantize() of the
//              layer, redone at every position: the cache's contents attended exactly, so ΔPPL/KL are
//              the compression's alone. O(T^2) per layer: measured ~15 s per scheme for 512 tokens
//              (3x fast), 2-4.5 min per scheme for 2048 (est. ~50 min for `--schemes all`)
//
// --coverage FILE.json: LogQuant's attention-coverage analysis (coverage.hpp) on the exact run: per
// layer, the share of attention mass on the tokens LogQuant2 / KIVI at the same budget keep in fp16,
// over positions t >= --coverage-from (default 256); also writes FILE.md, and LogQuant2's kept positions
// after 2000 tokens for plot_logquant.py.
//
// QAQ schemes (qaq_eval.hpp: qaq:KS:VS, qaq-n1:KS:VS, qaq-a0:KS:VS, qaq-rot:KS:VS, qaq-rotk:KS:VS,
// qaq-rotv:KS:VS, qaq-a0-rot:KS:VS, qaq-a0n1-rot:KS:VS, qaq-a0n1-rot-lm:KS:VS, qaq-lm:KS:VS, qaq-uB,
// qaq-uB-rot, qaq-uB-lm, qaq-uB-a0-rot and qaq-uB-a0-rot-lm) need the ||q||^2 calibration:
// --qaq-calibration FILE loads it (written by an earlier run: a mismatched model shape is an error), else it is computed by an exact run over the --qaq-calibration-tokens
// (default 1024) tokens that follow the evaluated ones in the text (disjoint from them) and, with FILE, saved
// there.
//
// Metrics per scheme, against the fp32 cache run (the exact reference) on the same tokens:
//   ppl        exp(mean NLL of token t+1 given tokens <= t), t = 0..T-2
//   delta_ppl  ppl - ppl(fp32)
//   kl         mean over positions of KL(p_fp32 || p_scheme) of the next-token distributions (nats)
//   top1       fraction of positions whose argmax next token equals the fp32 run's
//   layer_rel_err[l]  ||attn_l - exact attn_l|| / ||exact attn_l|| over all positions, where the exact
//              attention reads an fp32 copy of the SAME run's K/V (the cache's own error in layer l)
//   bits_per_element  the cache's stored bits per K/V element after the run (everything counted)
//   key_widths, value_widths  (JSON, QAQ schemes only) tokens per code width 0..8 over all layers
//   moved      (JSON, QAQ schemes only) of the records each width update re-derives, the shares lowered and
//              raised: {key lowered, key raised, value lowered, value raised}, over the whole run
// Exit status: 0, or 1 when a --max-delta-ppl / --max-kl / --expect-worse check fails, 2 on bad
// usage or input. (KL is the steadier regression guard: ΔPPL over a few hundred tokens moves by
// several 1e-2 for perturbations whose KL is ~2e-4, in either direction.)
#include <llama/bpe.hpp>
#include <llama/coverage.hpp>
#include <llama/gguf.hpp>
#include <llama/llama_model.hpp>
#include <llama/scheme_registry.hpp>

#include <kvc/io/kv_dump.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <vector>

namespace {
using namespace kvc::llama;
using Clock = std::chrono::steady_clock;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Options {
  std::string model = default_model_path(), text = "/usr/share/common-licenses/GPL-3";
  int tokens = 2048;
  std::vector<std::string> schemes = {"fp16", "int8", "kivi4", "kivi2"};
  std::string json, markdown, dump_logits, dump_kv, coverage, qaq_calibration;
  int qaq_calibration_tokens = 1024;
  int coverage_from = 256;
  int dump_logits_n = 32;
  std::vector<int> dump_kv_layers = {0, 15, 29};
  std::map<std::string, double> max_delta_ppl, max_kl;
  std::vector<std::pair<std::string, std::string>> expect_worse;
  bool layer_error = true;
  AttentionMode attention = AttentionMode::kFast;
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "kvc-eval: %s (see the comment at the top of kvc_eval.cpp)\n", msg.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) usage_error(std::string("missing value after ") + argv[i]);
    return argv[++i];
  };
  auto to_int = [](const std::string& s) {
    try {
      std::size_t pos = 0;
      const int v = std::stoi(s, &pos);
      if (pos == s.size()) return v;
    } catch (const std::exception&) {
    }
    usage_error("not an integer: '" + s + "'");
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model") o.model = value(i);
    else if (a == "--text") o.text = value(i);
    else if (a == "--tokens") o.tokens = to_int(value(i));
    else if (a == "--schemes") {
      const std::string s = value(i);
      o.schemes.clear();
      if (s == "all") {
        for (const SchemeEntry& e : scheme_registry())
          if (e.name != "fp32") o.schemes.push_back(e.name);
      } else {
        o.schemes = split(s, ',');
      }
    } else if (a == "--json") o.json = value(i);
    else if (a == "--markdown") o.markdown = value(i);
    else if (a == "--dump-logits") o.dump_logits = value(i);
    else if (a == "--dump-logits-n") o.dump_logits_n = to_int(value(i));
    else if (a == "--dump-kv") o.dump_kv = value(i);
    else if (a == "--dump-kv-layers") {
      o.dump_kv_layers.clear();
      for (const std::string& s : split(value(i), ',')) o.dump_kv_layers.push_back(to_int(s));
    } else if (a == "--max-delta-ppl" || a == "--max-kl") {
      auto& limits = a == "--max-kl" ? o.max_kl : o.max_delta_ppl;
      for (const std::string& kv : split(value(i), ',')) {
        const auto eq = kv.find('=');
        char* end = nullptr;
        const double x = eq == std::string::npos ? 0.0 : std::strtod(kv.c_str() + eq + 1, &end);
        if (eq == std::string::npos || end == kv.c_str() + eq + 1 || *end != '\0' || !(x > 0))
          usage_error(a + " wants name=positive-number, got '" + kv + "'");
        limits[kv.substr(0, eq)] = x;
      }
    } else if (a == "--expect-worse") {
      for (const std::string& p : split(value(i), ',')) {
        const auto c = p.find(':');
        if (c == std::string::npos) usage_error("--expect-worse wants worse:better, got '" + p + "'");
        o.expect_worse.emplace_back(p.substr(0, c), p.substr(c + 1));
      }
    } else if (a == "--attention") {
      const std::string m = value(i);
      const auto mode = parse_attention_mode(m);
      if (!mode) usage_error("--attention wants fast, exact or reference, got '" + m + "'");
      o.attention = *mode;
    } else if (a == "--no-layer-error") o.layer_error = false;
    else if (a == "--coverage") o.coverage = value(i);
    else if (a == "--coverage-from") o.coverage_from = to_int(value(i));
    else if (a == "--qaq-calibration") o.qaq_calibration = value(i);
    else if (a == "--qaq-calibration-tokens") o.qaq_calibration_tokens = to_int(value(i));
    else if (a == "--list") {
      for (const SchemeEntry& e : scheme_registry()) std::printf("%-12s %s\n", e.name.c_str(), e.description.c_str());
      std::exit(0);
    } else usage_error("unknown argument '" + a + "'");
  }
  if (o.tokens < 2) usage_error("--tokens must be at least 2");
  for (const std::string& s : o.schemes) find_scheme(s);  // unknown names fail before any work
  for (const auto* limits : {&o.max_delta_ppl, &o.max_kl})
    for (const auto& [name, v] : *limits)
      if (std::find(o.schemes.begin(), o.schemes.end(), name) == o.schemes.end())
        usage_error("a --max-delta-ppl/--max-kl limit names '" + name + "', which is not in --schemes");
  for (const auto& [w, b] : o.expect_worse)
    for (const std::string& n : {w, b})
      if (std::find(o.schemes.begin(), o.schemes.end(), n) == o.schemes.end())
        usage_error("--expect-worse names '" + n + "', which is not in --schemes");
  return o;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KVC_CHECK(f.good(), kvc::Errc::kIo, "cannot open text file '", path, "'");
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// Minimal .npy (format 1.0) writer for little-endian float32 / int32 C-order arrays.
template <class T>
void write_npy(const std::string& path, const T* data, const std::vector<std::size_t>& shape) {
  static_assert(sizeof(T) == 4);
  const char* descr = std::is_same_v<T, float> ? "<f4" : "<i4";
  std::string dims;
  std::size_t n = 1;
  for (std::size_t s : shape) {
    dims += std::to_string(s) + ",";
    n *= s;
  }
  if (shape.size() > 1) dims.pop_back();
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  KVC_CHECK(f.good(), kvc::Errc::kIo, "cannot write '", path, "'");
  const unsigned short hlen = static_cast<unsigned short>(header.size());
  f.write("\x93NUMPY\x01\x00", 8);
  f.put(char(hlen & 0xff)).put(char(hlen >> 8));
  f << header;
  f.write(reinterpret_cast<const char*>(data), std::streamsize(n * sizeof(T)));
  KVC_CHECK(f.good(), kvc::Errc::kIo, "writing '", path, "' failed");
}

/// Log-softmax of one logit row in double: returns log-probabilities.
void log_softmax(const float* z, int n, std::vector<double>& out) {
  out.resize(std::size_t(n));
  const double mx = *std::max_element(z, z + n);
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += std::exp(double(z[i]) - mx);
  const double lse = mx + std::log(s);
  for (int i = 0; i < n; ++i) out[std::size_t(i)] = double(z[i]) - lse;
}

struct Result {
  std::string name;
  double bits = 0, ppl = 0, delta_ppl = 0, kl = 0, top1 = 0, seconds = 0;
  std::size_t stored_bytes = 0;
  std::vector<double> layer_rel_err;
  std::vector<std::size_t> key_widths, value_widths;  ///< QAQ: tokens per code width 0..8 (all layers)
  std::vector<double> moved;                            ///< QAQ: RunResult::moved
};

/// Compares a run's next-token distributions with the reference run's, chunk by chunk (the logits of
/// a whole run would be T x vocab floats).
void score(const LlamaModel& model, const std::vector<std::int32_t>& tokens, const RowMatrix& hidden,
           const RowMatrix* ref_hidden, Result& r) {
  const int T = int(tokens.size()), V = model.config().vocab, chunk = 64;
  RowMatrix z, zr;
  std::vector<double> lp, lq;
  double nll = 0.0, kl = 0.0;
  int agree = 0;
  for (int first = 0; first < T - 1; first += chunk) {
    const int n = std::min(chunk, T - 1 - first);
    model.logits(hidden, first, n, z);
    if (ref_hidden) model.logits(*ref_hidden, first, n, zr);
    for (int i = 0; i < n; ++i) {
      const int t = first + i;
      log_softmax(z.row(i).data(), V, lq);
      nll -= lq[std::size_t(tokens[std::size_t(t) + 1])];
      if (!ref_hidden) continue;
      log_softmax(zr.row(i).data(), V, lp);
      double k = 0.0;
      for (int j = 0; j < V; ++j) k += std::exp(lp[std::size_t(j)]) * (lp[std::size_t(j)] - lq[std::size_t(j)]);
      kl += k;
      Eigen::Index a = 0, b = 0;
      z.row(i).maxCoeff(&a);
      zr.row(i).maxCoeff(&b);
      agree += a == b;
    }
  }
  r.ppl = std::exp(nll / (T - 1));
  r.kl = ref_hidden ? kl / (T - 1) : 0.0;
  r.top1 = ref_hidden ? double(agree) / (T - 1) : 1.0;
}

class Progress {
 public:
  Progress(std::string name, int layers) : name_(std::move(name)), layers_(layers), tty_(isatty(2)) {}
  void operator()(int layer) const {
    if (!tty_) return;
    const int w = 30, done = (layer + 1) * w / layers_;
    std::fprintf(stderr, "\r  %-12s [%s%s] layer %2d/%d", name_.c_str(), std::string(std::size_t(done), '#').c_str(),
                 std::string(std::size_t(w - done), '.').c_str(), layer + 1, layers_);
    std::fflush(stderr);
  }
  void finish(double seconds) const {
    std::fprintf(stderr, "%s  %-12s done in %.1f s\n", tty_ ? "\r" : "", name_.c_str(), seconds);
  }

 private:
  std::string name_;
  int layers_;
  bool tty_;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string markdown_table(const std::vector<Result>& rs) {
  std::string s =
      "| scheme | bits/el | PPL | ΔPPL | KL (nats) | top-1 agree | attn rel. err (mean / max over layers) |\n"
      "|---|---:|---:|---:|---:|---:|---:|\n";
  for (const Result& r : rs) {
    double mean = 0, mx = 0;
    for (double e : r.layer_rel_err) {
      mean += e;
      mx = std::max(mx, e);
    }
    mean /= std::max<std::size_t>(1, r.layer_rel_err.size());
    s += "| " + r.name + " | " + fmt("%.2f", r.bits) + " | " + fmt("%.4f", r.ppl) + " | " + fmt("%+.4f", r.delta_ppl) +
         " | " + fmt("%.2e", r.kl) + " | " + fmt("%.4f", r.top1) + " | " + fmt("%.2e", mean) + " / " +
         fmt("%.2e", mx) + " |\n";
  }
  return s;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

void write_json(const std::string& path, const Options& o, int T, const std::vector<Result>& rs) {
  std::ofstream f(path);
  KVC_CHECK(f.good(), kvc::Errc::kIo, "cannot write '", path, "'");
  auto num = [](double v) { return std::isfinite(v) ? fmt("%.9g", v) : std::string("null"); };
  f << "{\n  \"model\": \"" << json_escape(std::filesystem::path(o.model).filename().string()) << "\",\n"
    << "  \"text\": \"" << json_escape(o.text) << "\",\n  \"tokens\": " << T << ",\n"
    << "  \"simd_path\": \"" << kvc::simd_path_name() << "\",\n"
    << "  \"attention\": \"" << attention_mode_name(o.attention) << "\",\n"
    << "  \"baseline\": {\"name\": \"" << rs[0].name << "\", \"ppl\": " << num(rs[0].ppl) << "},\n  \"schemes\": [";
  for (std::size_t i = 1; i < rs.size(); ++i) {
    const Result& r = rs[i];
    f << (i > 1 ? "," : "") << "\n    {\"name\": \"" << r.name << "\", \"bits_per_element\": " << num(r.bits)
      << ", \"stored_bytes\": " << r.stored_bytes << ", \"ppl\": " << num(r.ppl)
      << ", \"delta_ppl\": " << num(r.delta_ppl) << ", \"kl\": " << num(r.kl) << ", \"top1\": " << num(r.top1)
      << ", \"seconds\": " << num(r.seconds) << ", \"layer_rel_err\": [";
    for (std::size_t l = 0; l < r.layer_rel_err.size(); ++l) f << (l ? ", " : "") << num(r.layer_rel_err[l]);
    f << "]";
    for (const auto& [key, w] : {std::pair{"key_widths", &r.key_widths}, std::pair{"value_widths", &r.value_widths}}) {
      if (w->empty()) continue;
      f << ", \"" << key << "\": [";
      for (std::size_t b = 0; b < w->size(); ++b) f << (b ? ", " : "") << (*w)[b];
      f << "]";
    }
    if (!r.moved.empty()) {
      f << ", \"moved\": [";
      for (std::size_t i = 0; i < r.moved.size(); ++i) f << (i ? ", " : "") << num(r.moved[i]);
      f << "]";
    }
    f << "}";
  }
  f << "\n  ]\n}\n";
  KVC_CHECK(f.good(), kvc::Errc::kIo, "writing '", path, "' failed");
}

int run(const Options& o) {
  const auto t0 = Clock::now();
  const GgufFile gguf = GgufFile::open(o.model);
  const LlamaModel model = LlamaModel::load(gguf);
  const BpeTokenizer tok = BpeTokenizer::from_gguf(gguf);
  const std::vector<std::int32_t> all_tokens = tok.encode(read_text(o.text));
  KVC_CHECK(int(all_tokens.size()) >= o.tokens, kvc::Errc::kInvalidArgument, "the text '", o.text, "' has only ",
            all_tokens.size(), " tokens; --tokens asks for ", o.tokens);
  const std::vector<std::int32_t> tokens(all_tokens.begin(), all_tokens.begin() + o.tokens);
  const LlamaConfig& c = model.config();
  std::fprintf(stderr,
               "kvc-eval: %s (%d layers, %d/%d heads, head_dim %d, vocab %d), %d of %zu tokens of %s, %s path, "
               "%s attention, loaded in %.1f s\n",
               std::filesystem::path(o.model).filename().c_str(), c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab,
               o.tokens, all_tokens.size(), o.text.c_str(), kvc::simd_path_name(), attention_mode_name(o.attention),
               std::chrono::duration<double>(Clock::now() - t0).count());

  // QAQ's ||q||^2 calibration, on text the evaluation does not see.
  std::optional<kvc::qaq::QueryNormCalibration> qaq_calib;
  if (std::any_of(o.schemes.begin(), o.schemes.end(), [](const std::string& n) { return n.rfind("qaq", 0) == 0; })) {
    if (!o.qaq_calibration.empty() && std::filesystem::exists(o.qaq_calibration)) {
      qaq_calib = kvc::qaq::load_calibration(o.qaq_calibration);
      qaq_calib->check_shape(c.layers, c.kv_heads, c.head_dim);
      std::fprintf(stderr, "  QAQ calibration: loaded %s\n", o.qaq_calibration.c_str());
    } else {
      const std::size_t first = std::size_t(o.tokens), n = std::size_t(o.qaq_calibration_tokens);
      KVC_CHECK(o.qaq_calibration_tokens > 0 && all_tokens.size() >= first + n, kvc::Errc::kInvalidArgument,
                "QAQ calibration needs ", n, " tokens after the ", first, " evaluated ones; the text has ",
                all_tokens.size());
      const std::vector<std::int32_t> calib_tokens(all_tokens.begin() + std::ptrdiff_t(first),
                                                   all_tokens.begin() + std::ptrdiff_t(first + n));
      const auto c0 = Clock::now();
      qaq_calib = calibrate_query_norms(model, calib_tokens);
      std::fprintf(stderr, "  QAQ calibration: tokens [%zu, %zu) in %.1f s\n", first, first + n,
                   std::chrono::duration<double>(Clock::now() - c0).count());
      if (!o.qaq_calibration.empty()) kvc::qaq::save_calibration(*qaq_calib, o.qaq_calibration);
    }
  }

  // The exact reference run (fp32 cache), which also feeds the dumps.
  kvc::io::KVDump dump;
  std::vector<std::string> names = {"fp32"};
  names.insert(names.end(), o.schemes.begin(), o.schemes.end());
  std::vector<Result> results;
  RowMatrix ref_hidden;
  for (const std::string& name : names) {
    if (name == "fp32" && !results.empty()) continue;
    const SchemeEntry e = find_scheme(name);
    const Progress bar(name, c.layers);
    RunHooks hooks;
    hooks.progress = [&](int l) { bar(l); };
    hooks.measure_layer_error = o.layer_error && name != "fp32";
    hooks.attention = o.attention;
    hooks.qaq_calibration = qaq_calib ? &*qaq_calib : nullptr;
    const bool dumping = results.empty() && !o.dump_kv.empty();
    if (dumping) {
      dump.model = std::filesystem::path(o.model).filename().string();
      dump.source = o.text + " (first " + std::to_string(o.tokens) + " tokens)";
      dump.tokens = o.tokens;
      dump.q_heads = c.heads;
      dump.kv_heads = c.kv_heads;
      dump.head_dim = c.head_dim;
      dump.rope_theta = c.rope_theta;
      hooks.observe = [&](const LayerTrace& tr) {
        if (std::find(o.dump_kv_layers.begin(), o.dump_kv_layers.end(), tr.layer) == o.dump_kv_layers.end()) return;
        auto flat = [](const RowMatrix& m) { return std::vector<float>(m.data(), m.data() + m.size()); };
        dump.layers.push_back({tr.layer, flat(*tr.k), flat(*tr.k_pre_rope), flat(*tr.v), flat(*tr.q)});
      };
    }
    // LogQuant's attention-coverage analysis (coverage.hpp) on the exact run's attention.
    std::unique_ptr<CoverageAnalysis> coverage;
    if (results.empty() && !o.coverage.empty()) {
      coverage = std::make_unique<CoverageAnalysis>(c, o.tokens, std::min(o.coverage_from, o.tokens - 1));
      hooks.observe = [&, dump_hook = hooks.observe](const LayerTrace& tr) {
        if (dump_hook) dump_hook(tr);
        coverage->observe(tr);
      };
    }
    const auto s0 = Clock::now();
    SchemeRun run = e.run(model, tokens, hooks);
    if (coverage) {
      coverage->write_json(o.coverage, std::min(2000, o.tokens));
      std::string md_path = o.coverage;
      if (md_path.size() > 5 && md_path.substr(md_path.size() - 5) == ".json") md_path.resize(md_path.size() - 5);
      md_path += ".md";
      char head[256];
      std::snprintf(head, sizeof head,
                    "Attention mass on the full-precision tokens, exact attention of SmolLM2-135M, %d tokens, mean "
                    "over query heads and positions t >= %d\n\n",
                    o.tokens, coverage->result().from);
      const std::string table = head + coverage->markdown();
      std::ofstream f(md_path);
      f << table;
      KVC_CHECK(f.good(), kvc::Errc::kIo, "cannot write '", md_path, "'");
      std::fprintf(stderr, "  wrote %s and %s\n%s", o.coverage.c_str(), md_path.c_str(), table.c_str());
    }
    Result r;
    r.name = name;
    r.bits = run.bits_per_element;
    r.stored_bytes = run.stored_bytes;
    r.key_widths = run.key_widths;
    r.value_widths = run.value_widths;
    r.moved = run.moved;
    if (!r.moved.empty())
      std::fprintf(stderr, "  width updates moved, per update: keys %.2f %% lowered, %.2f %% raised; values %.2f %% lowered, "
                   "%.2f %% raised\n", 100 * r.moved[0], 100 * r.moved[1], 100 * r.moved[2], 100 * r.moved[3]);
    for (std::size_t l = 0; l < run.layer_err2.size(); ++l)
      r.layer_rel_err.push_back(run.layer_ref2[l] > 0 ? std::sqrt(run.layer_err2[l] / run.layer_ref2[l]) : 0.0);
    score(model, tokens, run.hidden, results.empty() ? nullptr : &ref_hidden, r);
    r.seconds = std::chrono::duration<double>(Clock::now() - s0).count();
    bar.finish(r.seconds);
    if (results.empty()) {
      ref_hidden = std::move(run.hidden);
      if (!o.dump_logits.empty()) {
        std::filesystem::create_directories(o.dump_logits);
        const int n = std::min(o.dump_logits_n, o.tokens);
        RowMatrix z;
        model.logits(ref_hidden, 0, n, z);
        write_npy(o.dump_logits + "/logits_exact.npy", z.data(), {std::size_t(n), std::size_t(c.vocab)});
        write_npy(o.dump_logits + "/tokens.npy", all_tokens.data(), {all_tokens.size()});
        std::fprintf(stderr, "  wrote %s/{tokens,logits_exact}.npy (%zu tokens, logits of %d positions)\n",
                     o.dump_logits.c_str(), all_tokens.size(), n);
      }
      if (dumping) {
        KVC_CHECK(dump.layers.size() == o.dump_kv_layers.size(), kvc::Errc::kInvalidArgument,
                  "--dump-kv-layers names layers the model does not have (it has ", c.layers, ")");
        kvc::io::write_kv_dump(o.dump_kv, dump);
        std::fprintf(stderr, "  wrote %s (%zu layers x %d tokens)\n", o.dump_kv.c_str(), dump.layers.size(), o.tokens);
      }
    }
    r.delta_ppl = r.ppl - (results.empty() ? r.ppl : results[0].ppl);
    results.push_back(std::move(r));
  }

  char head[512];
  std::snprintf(head, sizeof head, "SmolLM2-135M (%s), %d tokens of %s, %s path, %s attention\n\n",
                gguf.get_string("general.name").c_str(), o.tokens, o.text.c_str(), kvc::simd_path_name(),
                attention_mode_name(o.attention));
  const std::string report = head + markdown_table(results);
  std::fputs(report.c_str(), stdout);
  if (!o.markdown.empty()) {
    std::ofstream f(o.markdown);
    f << report;
    KVC_CHECK(f.good(), kvc::Errc::kIo, "cannot write '", o.markdown, "'");
  }
  if (!o.json.empty()) write_json(o.json, o, o.tokens, results);

  int failed = 0;
  auto get = [&](const std::string& n) -> const Result& {
    return *std::find_if(results.begin(), results.end(), [&](const Result& r) { return r.name == n; });
  };
  for (const auto& [name, limit] : o.max_delta_ppl) {
    const Result& r = get(name);
    const bool ok = std::isfinite(r.delta_ppl) && std::abs(r.delta_ppl) < limit;
    std::printf("check |ΔPPL(%s)| = %.6f < %g: %s\n", name.c_str(), std::abs(r.delta_ppl), limit, ok ? "ok" : "FAIL");
    failed += !ok;
  }
  for (const auto& [name, limit] : o.max_kl) {
    const Result& r = get(name);
    const bool ok = std::isfinite(r.kl) && r.kl < limit;
    std::printf("check KL(%s) = %.3e < %g: %s\n", name.c_str(), r.kl, limit, ok ? "ok" : "FAIL");
    failed += !ok;
  }
  for (const auto& [worse, better] : o.expect_worse) {
    const Result &w = get(worse), &b = get(better);
    const bool ok = w.delta_ppl > b.delta_ppl && w.kl > b.kl;
    std::printf("check %s worse than %s: ΔPPL %.6f > %.6f and KL %.3e > %.3e: %s\n", worse.c_str(), better.c_str(),
                w.delta_ppl, b.delta_ppl, w.kl, b.kl, ok ? "ok" : "FAIL");
    failed += !ok;
  }
  return failed ? 1 : 0;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvc-eval: error: %s\n", e.what());
    return 2;
  }
}
