/// \file llama_model.hpp
/// A llama-architecture forward pass on the CPU whose attention reads every past position back from
/// a kvc::CompressedKVCache through kvc's fused decode attention, as a user's engine would (or, with
/// ForwardOptions::attention, through its exact mode or the double-precision reference over the cache's
/// dequantized contents).
///
/// Teacher-forced evaluation runs layer by layer: each layer's Q/K/V projections and MLP are batched
/// over all T positions (Eigen GEMMs on OpenMP threads), while attention runs position by position:
/// for t = 0..T-1, append K/V of t to the layer's cache, then attend q_t over the cache (positions
/// <= t). Each layer's cache evolves exactly as in token-by-token decoding (a layer's cache only ever
/// sees its own layer's appends, in position order), so the result equals a decode loop's; the
/// batching only changes the order in which independent work is done.
///
/// Weights: GGUF linear weights are [out][in] rows (dims[0] = in is the fastest), dequantised once to
/// fp32 at load. llama.cpp's converter permutes the rows of attn_q/attn_k so that in GGUF space RoPE
/// rotates ADJACENT pairs (x[2i], x[2i+1]) of each head by position * theta^(-2i/head_dim).
/// Host only (Eigen, OpenMP).
#pragma once

#include <llama/gguf.hpp>

#include <kvc/kvc.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::llama {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct LlamaConfig {
  int layers = 0, d_model = 0, heads = 0, kv_heads = 0, head_dim = 0, d_ff = 0, vocab = 0;
  float rope_theta = 10000.0f, rms_eps = 1e-5f;
};

struct LlamaLayer {
  RowMatrix wq, wk, wv, wo, w_gate, w_up, w_down;  ///< [out][in]
  Eigen::RowVectorXf attn_norm, ffn_norm;
};

/// What a forward pass reports to its observer for one layer (all [T][heads][head_dim], row-major).
struct LayerTrace {
  int layer = 0;
  const RowMatrix* q = nullptr;           ///< post-RoPE queries  [T][heads*head_dim]
  const RowMatrix* k = nullptr;           ///< post-RoPE keys     [T][kv_heads*head_dim]
  const RowMatrix* k_pre_rope = nullptr;  ///< pre-RoPE keys
  const RowMatrix* v = nullptr;           ///< values
  const RowMatrix* attn = nullptr;        ///< attention outputs read from the cache [T][heads*head_dim]
};

/// How forward() attends over the cache. Every mode reads the SAME cache contents (the same scheme,
/// the same appends); only the attention arithmetic differs.
enum class AttentionMode {
  kFast,       ///< kvc::decode_attention with default options (what a user's engine runs)
  kExact,      ///< kvc::decode_attention with AttentionOptions::precision = Precision::kExact
  kReference,  ///< kvc::reference::decode_attention (double) over CompressedKVCache::dequantize(): the
               ///< cache's contents attended exactly. O(T) per token and layer, so O(T^2) per layer
};

[[nodiscard]] inline const char* attention_mode_name(AttentionMode m) noexcept {
  switch (m) {
    case AttentionMode::kFast: return "fast";
    case AttentionMode::kExact: return "exact";
    case AttentionMode::kReference: return "reference";
  }
  return "?";
}

/// "fast" / "exact" / "reference", or nothing for any other string.
[[nodiscard]] inline std::optional<AttentionMode> parse_attention_mode(std::string_view s) noexcept {
  for (AttentionMode m : {AttentionMode::kFast, AttentionMode::kExact, AttentionMode::kReference})
    if (s == attention_mode_name(m)) return m;
  return std::nullopt;
}

/// Options of LlamaModel::forward().
struct ForwardOptions {
  AttentionMode attention = AttentionMode::kFast;
  std::function<void(const LayerTrace&)> observe;  ///< called after each layer's attention (optional)
  std::function<void(int layer)> progress;         ///< called after each finished layer (optional)
};

class LlamaModel {
 public:
  static LlamaModel load(const GgufFile& f) {
    KVC_CHECK(f.get_string("general.architecture") == "llama", Errc::kInvalidArgument,
              "model architecture is '", f.get_string("general.architecture"), "', this engine runs 'llama'");
    LlamaModel m;
    LlamaConfig& c = m.cfg_;
    c.layers = int(f.get_int("llama.block_count"));
    c.d_model = int(f.get_int("llama.embedding_length"));
    c.heads = int(f.get_int("llama.attention.head_count"));
    c.kv_heads = int(f.get_int("llama.attention.head_count_kv"));
    c.d_ff = int(f.get_int("llama.feed_forward_length"));
    c.rope_theta = f.has_key("llama.rope.freq_base") ? float(f.get_float("llama.rope.freq_base")) : 10000.0f;
    c.rms_eps = float(f.get_float("llama.attention.layer_norm_rms_epsilon"));
    KVC_CHECK(c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.d_model % c.heads == 0 && c.heads % c.kv_heads == 0,
              Errc::kInvalidArgument, "inconsistent llama hyper-parameters: ", c.layers, " layers, d_model ",
              c.d_model, ", ", c.heads, " heads, ", c.kv_heads, " KV heads");
    c.head_dim = c.d_model / c.heads;
    KVC_CHECK(c.head_dim % 2 == 0, Errc::kInvalidArgument, "odd head_dim ", c.head_dim);

    const GgufTensorInfo& emb = f.tensor("token_embd.weight");
    c.vocab = int(emb.rows());
    m.embedding_ = matrix(f, "token_embd.weight", c.vocab, c.d_model);
    // Tied embeddings: the output projection is the embedding unless the file has its own.
    m.output_ = f.has_tensor("output.weight") ? matrix(f, "output.weight", c.vocab, c.d_model) : RowMatrix();
    m.output_norm_ = vector(f, "output_norm.weight", c.d_model);
    const int q_out = c.heads * c.head_dim, kv_out = c.kv_heads * c.head_dim;
    m.layers_.resize(std::size_t(c.layers));
    for (int l = 0; l < c.layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      LlamaLayer& L = m.layers_[std::size_t(l)];
      L.wq = matrix(f, b + "attn_q.weight", q_out, c.d_model);
      L.wk = matrix(f, b + "attn_k.weight", kv_out, c.d_model);
      L.wv = matrix(f, b + "attn_v.weight", kv_out, c.d_model);
      L.wo = matrix(f, b + "attn_output.weight", c.d_model, q_out);
      L.w_gate = matrix(f, b + "ffn_gate.weight", c.d_ff, c.d_model);
      L.w_up = matrix(f, b + "ffn_up.weight", c.d_ff, c.d_model);
      L.w_down = matrix(f, b + "ffn_down.weight", c.d_model, c.d_ff);
      L.attn_norm = vector(f, b + "attn_norm.weight", c.d_model);
      L.ffn_norm = vector(f, b + "ffn_norm.weight", c.d_model);
    }
    return m;
  }

  [[nodiscard]] const LlamaConfig& config() const noexcept { return cfg_; }

  /// A kvc cache configuration for one sequence of up to `capacity` tokens of this model.
  [[nodiscard]] CacheConfig cache_config(int capacity) const {
    return CacheConfig{cfg_.layers, /*batch=*/1, cfg_.kv_heads, cfg_.head_dim, capacity};
  }

  /// Teacher-forced forward pass over `tokens` with `cache` (empty, sequence 0 is used).
  /// Returns the final RMS-normalised hidden states [T][d_model]; `logits()` turns rows into logits.
  /// `fo.attention` picks how attention reads the cache; `fo.observe` / `fo.progress` are optional hooks.
  /// Only the per-token loop over the cache is a template: the rest of a layer is compiled once
  /// (kvc-eval instantiates this for 151 cache types).
  template <class Cache>
  RowMatrix forward(const std::vector<std::int32_t>& tokens, Cache& cache, const ForwardOptions& fo = {}) const {
    KVC_CHECK(cache.config().layers == cfg_.layers && cache.config().kv_heads == cfg_.kv_heads &&
                  cache.config().head_dim == cfg_.head_dim,
              Errc::kInvalidArgument, "cache shape does not match the model");
    for (int l = 0; l < cfg_.layers; ++l)
      KVC_CHECK(cache.length(l, 0) == 0, Errc::kInvalidArgument, "forward() needs an empty cache (layer ", l,
                " holds ", cache.length(l, 0), " tokens)");
    Pass p = begin_pass(tokens, fo);
    const int T = int(tokens.size()), hd = cfg_.head_dim;
    AttentionOptions opt;
    opt.num_threads = 1;  // one query token per call: parallel regions would cost more than they save
    if (fo.attention == AttentionMode::kExact) opt.precision = Precision::kExact;
    for (int l = 0; l < cfg_.layers; ++l) {
      attention_inputs(l, p);
      for (int t = 0; t < T; ++t) {
        cache.append(l, 0, KVView::contiguous(p.k.row(t).data(), 1, cfg_.kv_heads, hd),
                     KVView::contiguous(p.v.row(t).data(), 1, cfg_.kv_heads, hd));
        if (fo.attention == AttentionMode::kReference) {
          cache.dequantize(l, 0, p.k_deq.data(), p.v_deq.data());
          reference::decode_attention(p.q.row(t).data(), cfg_.heads, p.k_deq.data(), p.v_deq.data(), t + 1,
                                      cfg_.kv_heads, hd, p.attn.row(t).data(), opt.scale);
        } else {
          decode_attention(cache, l, QueryView::contiguous(p.q.row(t).data(), 1, cfg_.heads, hd),
                           OutputView::contiguous(p.attn.row(t).data(), 1, cfg_.heads, hd), opt);
        }
      }
      finish_layer(l, p, fo);
    }
    rms_norm(p.x, output_norm_, p.xn);
    return std::move(p.xn);
  }

  /// Logits [rows][vocab] of final hidden states `h` (rows [first, first + n)).
  void logits(const RowMatrix& h, int first, int n, RowMatrix& out) const {
    const RowMatrix& w = output_.size() ? output_ : embedding_;
    out.noalias() = h.middleRows(first, n) * w.transpose();
  }

 private:
  /// cos/sin of position t and pair i at [t * head_dim/2 + i]; angle t * theta^(-2i/head_dim), in double.
  struct RopeTable {
    std::vector<float> cos, sin;
  };

  /// A forward pass's activations ([T][...] row-major).
  struct Pass {
    RowMatrix x, xn, q, k, k_pre, v, attn, gate, up;
    std::vector<float> k_deq, v_deq;  ///< kReference: the layer's dequantized cache [T][kv_heads][head_dim]
    RopeTable rope;                   ///< shared by q and k of every layer
  };

  /// Checks the tokens, embeds them and sizes the buffers.
  Pass begin_pass(const std::vector<std::int32_t>& tokens, const ForwardOptions& fo) const {
    const int T = int(tokens.size()), d = cfg_.d_model;
    KVC_CHECK(T > 0, Errc::kInvalidArgument, "no tokens to evaluate");
    Pass p;
    p.x.resize(T, d);
    for (int t = 0; t < T; ++t) {
      KVC_CHECK(tokens[std::size_t(t)] >= 0 && tokens[std::size_t(t)] < cfg_.vocab, Errc::kInvalidArgument,
                "token id ", tokens[std::size_t(t)], " at position ", t, " is outside the vocabulary of ",
                cfg_.vocab);
      p.x.row(t) = embedding_.row(tokens[std::size_t(t)]);
    }
    p.rope = make_rope_table(T);
    p.xn.resize(T, d);
    p.attn.resize(T, cfg_.heads * cfg_.head_dim);
    // kReference: rebuilt at every position (blocks are quantized when they leave the fp window, so the
    // contents change as t grows).
    if (fo.attention == AttentionMode::kReference) {
      p.k_deq.resize(std::size_t(T) * cfg_.kv_heads * cfg_.head_dim);
      p.v_deq.resize(p.k_deq.size());
    }
    return p;
  }

  /// Layer l's q, k (post-RoPE), k_pre and v from the residual stream.
  void attention_inputs(int l, Pass& p) const {
    const LlamaLayer& L = layers_[std::size_t(l)];
    rms_norm(p.x, L.attn_norm, p.xn);
    p.q.noalias() = p.xn * L.wq.transpose();
    p.k_pre.noalias() = p.xn * L.wk.transpose();
    p.v.noalias() = p.xn * L.wv.transpose();
    p.k = p.k_pre;
    rope(p.rope, p.q, cfg_.heads);
    rope(p.rope, p.k, cfg_.kv_heads);
  }

  /// After layer l's attention: the observer, the output projection, the SwiGLU MLP, progress.
  void finish_layer(int l, Pass& p, const ForwardOptions& fo) const {
    const LlamaLayer& L = layers_[std::size_t(l)];
    if (fo.observe) fo.observe(LayerTrace{l, &p.q, &p.k, &p.k_pre, &p.v, &p.attn});
    p.x.noalias() += p.attn * L.wo.transpose();
    rms_norm(p.x, L.ffn_norm, p.xn);
    p.gate.noalias() = p.xn * L.w_gate.transpose();
    p.up.noalias() = p.xn * L.w_up.transpose();
    p.gate = p.gate.unaryExpr([](float g) { return g / (1.0f + std::exp(-g)); }).cwiseProduct(p.up);  // SwiGLU
    p.x.noalias() += p.gate * L.w_down.transpose();
    if (fo.progress) fo.progress(l);
  }

  static RowMatrix matrix(const GgufFile& f, const std::string& name, int rows, int cols) {
    const GgufTensorInfo& ti = f.tensor(name);
    KVC_CHECK(ti.rows() == rows && ti.row_length() == cols, Errc::kInvalidArgument, "tensor '", name, "' is [",
              ti.rows(), "][", ti.row_length(), "], expected [", rows, "][", cols, "]");
    RowMatrix m(rows, cols);
    f.dequantize_rows(ti, 0, rows, m.data());
    return m;
  }
  static Eigen::RowVectorXf vector(const GgufFile& f, const std::string& name, int n) {
    const RowMatrix m = matrix(f, name, 1, n);
    return m.row(0);
  }

  void rms_norm(const RowMatrix& x, const Eigen::RowVectorXf& w, RowMatrix& out) const {
    out.resize(x.rows(), x.cols());
    for (Eigen::Index t = 0; t < x.rows(); ++t) {
      const float inv = 1.0f / std::sqrt(x.row(t).squaredNorm() / float(x.cols()) + cfg_.rms_eps);
      out.row(t) = (x.row(t) * inv).cwiseProduct(w);
    }
  }

  RopeTable make_rope_table(int T) const {
    const int half = cfg_.head_dim / 2;
    RopeTable r{std::vector<float>(std::size_t(T) * half), std::vector<float>(std::size_t(T) * half)};
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(double(cfg_.rope_theta), -2.0 * i / cfg_.head_dim);
      for (int t = 0; t < T; ++t) {
        r.cos[std::size_t(t) * half + i] = float(std::cos(double(t) * inv_freq));
        r.sin[std::size_t(t) * half + i] = float(std::sin(double(t) * inv_freq));
      }
    }
    return r;
  }

  /// RoPE on adjacent pairs of every head of each row (row t is position t).
  static void rope(const RopeTable& table, RowMatrix& m, int heads) {
    const int hd = int(m.cols()) / heads, half = hd / 2;
    for (Eigen::Index t = 0; t < m.rows(); ++t)
      for (int i = 0; i < half; ++i) {
        const float c = table.cos[std::size_t(t) * half + i], s = table.sin[std::size_t(t) * half + i];
        for (int h = 0; h < heads; ++h) {
          float* p = m.row(t).data() + h * hd + 2 * i;
          const float x0 = p[0], x1 = p[1];
          p[0] = x0 * c - x1 * s;
          p[1] = x0 * s + x1 * c;
        }
      }
  }

  LlamaConfig cfg_;
  RowMatrix embedding_, output_;
  Eigen::RowVectorXf output_norm_;
  std::vector<LlamaLayer> layers_;
};
}  // namespace kvc::llama
