/// \file kv_dump.hpp
/// `kvc::io`: a dump of real keys, values and queries of chosen model layers (written by the llama
/// engine, read by the error tables, examples and benchmarks), its writer and its loader. Host only.
///
/// File format, version 1. Every integer and float is little-endian; there is no padding other than
/// the string padding below, so every float array starts at a 4-byte-aligned offset.
///
///   offset  bytes  field
///   0       8      magic "KVCDUMP\0" (4B 56 43 44 55 4D 50 00)
///   8       4      u32 version = 1
///   12      4      u32 n_layers   dumped layers, >= 1
///   16      4      u32 tokens     tokens per layer, >= 1
///   20      4      u32 q_heads    query heads, >= 1, a multiple of kv_heads (recorded even without queries)
///   24      4      u32 kv_heads   >= 1
///   28      4      u32 head_dim   >= 1
///   32      4      u32 flags      bit 0: pre-RoPE keys present; bit 1: queries present; others must be 0
///   36      4      f32 rope_theta (finite, >= 0; 0 when unknown)
///   40      4      u32 Lm, then Lm bytes: the model name (UTF-8, no terminator; Lm <= 65535),
///                  then (4 - Lm % 4) % 4 zero bytes
///   ..      4      u32 Ls, then Ls bytes: the text / source description, same rules, same padding
///   ..      4*n    u32 model layer index of each dumped layer (distinct, < 2^31), in file order
///   then, for each dumped layer in that order, float32 arrays, row-major:
///           4*N    K, post-RoPE  [tokens][kv_heads][head_dim]  N = tokens * kv_heads * head_dim
///           4*N    K, pre-RoPE   [tokens][kv_heads][head_dim]  only if flags bit 0
///           4*N    V             [tokens][kv_heads][head_dim]
///           4*M    Q, post-RoPE  [tokens][q_heads][head_dim]   only if flags bit 1; M = tokens * q_heads * head_dim
///   last    8      u64 FNV-1a-64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3) of every
///                  preceding byte of the file
///
/// The file length is therefore exactly determined by the header and the two string lengths; a file
/// of any other length is rejected before any array is allocated. Every float is finite (the writer
/// refuses NaN/Inf, the reader rejects them). Token t of every array is the same sequence position
/// t (0-based); Q at position t is the query that attends to positions 0..t (causal). Q is the raw
/// projection after RoPE, not multiplied by the softmax scale (decode attention applies
/// 1/sqrt(head_dim)); query head h reads KV head h / (q_heads / kv_heads), as in kvc::decode_attention.
/// Pre-RoPE keys are the key projections before the rotary embedding (for pre-RoPE quantization).
/// Model layer indices are 0-based.
///
/// Errors (kvc::Error, messages name the file and the problem):
///  - write_kv_dump: Errc::kInvalidArgument for an inconsistent KVDump (sizes, shapes, duplicate
///    layers), Errc::kNonFinite for NaN/Inf, both before anything is written; Errc::kIo when the
///    file cannot be written. It writes `path + ".tmp"` and renames it over `path`, so `path` is never
///    left half-written.
///  - read_kv_dump: Errc::kIo when the file cannot be opened or read; Errc::kCorruptFile for a bad
///    magic or version, a truncated file, header fields or sizes inconsistent with the file length,
///    a checksum mismatch, or non-finite values. It never allocates more than the file size allows.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/error.hpp>
#include <kvc/core/view.hpp>
#include <kvc/io/cache_dir.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

namespace kvc::io {

/// One dumped layer. Arrays are float32 [tokens][heads][head_dim] row-major (see the file comment);
/// `k_pre_rope` and `q` are empty when the dump does not carry them (then empty in every layer).
struct KVDumpLayer {
  int layer = 0;                  ///< index of the layer in the model
  std::vector<float> k;           ///< post-RoPE keys    [tokens][kv_heads][head_dim]
  std::vector<float> k_pre_rope;  ///< pre-RoPE keys     [tokens][kv_heads][head_dim], or empty
  std::vector<float> v;           ///< values            [tokens][kv_heads][head_dim]
  std::vector<float> q;           ///< post-RoPE queries [tokens][q_heads][head_dim], or empty
};

/// Keys, values (and optionally pre-RoPE keys and queries) of some layers of one model over one text.
struct KVDump {
  std::string model;   ///< model name, e.g. "SmolLM2-135M"
  std::string source;  ///< what text produced the dump (free form)
  int tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  float rope_theta = 0;  ///< RoPE base (0 when unknown)
  std::vector<KVDumpLayer> layers;

  /// Whether the layers carry pre-RoPE keys / queries (what the first layer has; validate() checks
  /// that every layer agrees).
  [[nodiscard]] bool has_pre_rope_keys() const noexcept {
    return !layers.empty() && !layers.front().k_pre_rope.empty();
  }
  [[nodiscard]] bool has_queries() const noexcept { return !layers.empty() && !layers.front().q.empty(); }

  /// Floats of one K or V array (tokens * kv_heads * head_dim) and of one Q array.
  [[nodiscard]] std::size_t kv_floats() const noexcept {
    return std::size_t(std::max(tokens, 0)) * std::size_t(std::max(kv_heads, 0)) * std::size_t(std::max(head_dim, 0));
  }
  [[nodiscard]] std::size_t q_floats() const noexcept {
    return std::size_t(std::max(tokens, 0)) * std::size_t(std::max(q_heads, 0)) * std::size_t(std::max(head_dim, 0));
  }

  /// Post-RoPE keys of dumped layer `i` (file order, not the model layer): [tokens][kv_heads][head_dim].
  [[nodiscard]] KVView keys(std::size_t i) const { return kv_view(i, &KVDumpLayer::k, "keys"); }
  /// Pre-RoPE keys of dumped layer `i`; throws Errc::kInvalidArgument if the dump has none.
  [[nodiscard]] KVView keys_pre_rope(std::size_t i) const {
    return kv_view(i, &KVDumpLayer::k_pre_rope, "pre-RoPE keys");
  }
  /// Values of dumped layer `i`: [tokens][kv_heads][head_dim].
  [[nodiscard]] KVView values(std::size_t i) const { return kv_view(i, &KVDumpLayer::v, "values"); }
  /// The post-RoPE query of position `token` of dumped layer `i`, as one sequence: [1][q_heads][head_dim]
  /// (what decode attention takes). Throws Errc::kInvalidArgument if the dump has no queries.
  [[nodiscard]] QueryView queries(std::size_t i, int token) const {
    check_index(i);
    const KVDumpLayer& l = layers[i];
    KVC_CHECK(!l.q.empty(), Errc::kInvalidArgument, "KV dump layer ", i, " (model layer ", l.layer,
              ") has no queries");
    KVC_CHECK(l.q.size() == q_floats(), Errc::kInvalidArgument, "KV dump layer ", i, " (model layer ", l.layer,
              "): queries hold ", l.q.size(), " floats, expected tokens * q_heads * head_dim = ", q_floats());
    KVC_CHECK(token >= 0 && token < tokens, Errc::kInvalidArgument, "KV dump query token ", token,
              " out of range [0, ", tokens, ")");
    return QueryView::contiguous(l.q.data() + std::size_t(token) * std::size_t(q_heads) * std::size_t(head_dim), 1,
                                 q_heads, head_dim);
  }

  /// Position in `layers` of model layer `model_layer`; throws Errc::kInvalidArgument if not dumped.
  [[nodiscard]] std::size_t index_of(int model_layer) const {
    for (std::size_t i = 0; i < layers.size(); ++i)
      if (layers[i].layer == model_layer) return i;
    std::string have;
    for (const auto& l : layers) have += (have.empty() ? "" : ", ") + std::to_string(l.layer);
    ::kvc::detail::fail(Errc::kInvalidArgument, "model layer ", model_layer, " is not in the KV dump (it holds layers ",
                 have.empty() ? std::string("none") : have, ")");
  }
  /// The dumped layer holding model layer `model_layer`; throws Errc::kInvalidArgument if absent.
  [[nodiscard]] const KVDumpLayer& layer(int model_layer) const { return layers[index_of(model_layer)]; }

  /// Throws kvc::Error unless the dump can be written: Errc::kInvalidArgument for bad shapes, array
  /// sizes, layer indices or string lengths (every layer must agree on carrying pre-RoPE keys and
  /// queries), Errc::kNonFinite for a NaN/Inf anywhere.
  void validate() const;

 private:
  void check_index(std::size_t i) const {
    KVC_CHECK(i < layers.size(), Errc::kInvalidArgument, "KV dump layer index ", i, " out of range [0, ",
              layers.size(), ")");
  }
  KVView kv_view(std::size_t i, std::vector<float> KVDumpLayer::*arr, const char* what) const {
    check_index(i);
    const KVDumpLayer& l = layers[i];
    const std::vector<float>& a = l.*arr;
    KVC_CHECK(!a.empty(), Errc::kInvalidArgument, "KV dump layer ", i, " (model layer ", l.layer, ") has no ", what);
    KVC_CHECK(a.size() == kv_floats(), Errc::kInvalidArgument, "KV dump layer ", i, " (model layer ", l.layer, "): ",
              what, " hold ", a.size(), " floats, expected tokens * kv_heads * head_dim = ", kv_floats());
    return KVView::contiguous(a.data(), tokens, kv_heads, head_dim);
  }
};

/// Where the examples and benchmarks look for a dump by default: $KVC_KV_DUMP if set and non-empty,
/// else cache_dir()/smollm2_kv_dump.bin.
inline std::string default_kv_dump_path() {
  if (const char* p = std::getenv("KVC_KV_DUMP"); p != nullptr && *p != '\0') return p;
  return cache_dir() + "/smollm2_kv_dump.bin";
}

namespace detail {

inline constexpr char kDumpMagic[8] = {'K', 'V', 'C', 'D', 'U', 'M', 'P', '\0'};
inline constexpr std::uint32_t kDumpVersion = 1;
inline constexpr std::uint32_t kDumpFlagPreRope = 1u, kDumpFlagQueries = 2u;
inline constexpr std::uint32_t kDumpMaxString = 65535;
inline constexpr std::uint64_t kDumpFixedHeader = 40;  ///< magic .. rope_theta
inline constexpr std::size_t kDumpChunkFloats = std::size_t(1) << 16;

/// FNV-1a, 64 bit.
struct Fnv1a64 {
  std::uint64_t h = 0xcbf29ce484222325ull;
  void update(const void* p, std::size_t n) noexcept {
    const auto* b = static_cast<const unsigned char*>(p);
    std::uint64_t x = h;
    for (std::size_t i = 0; i < n; ++i) x = (x ^ b[i]) * 0x100000001b3ull;
    h = x;
  }
};

inline void put_u32(unsigned char* p, std::uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void put_u64(unsigned char* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline std::uint32_t get_u32(const unsigned char* p) noexcept {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::uint32_t(p[i]) << (8 * i);
  return v;
}
inline std::uint64_t get_u64(const unsigned char* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(p[i]) << (8 * i);
  return v;
}
inline std::uint32_t padding4(std::uint64_t n) noexcept { return static_cast<std::uint32_t>((4 - n % 4) % 4); }

/// a * b, or false on overflow.
inline bool mul_u64(std::uint64_t a, std::uint64_t b, std::uint64_t& r) noexcept {
  if (a != 0 && b > UINT64_MAX / a) return false;
  r = a * b;
  return true;
}
inline bool add_u64(std::uint64_t a, std::uint64_t b, std::uint64_t& r) noexcept {
  if (b > UINT64_MAX - a) return false;
  r = a + b;
  return true;
}

/// Byte-swaps float bits in place (big-endian hosts only; the file is little-endian).
inline void swap_floats(float* x, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, 4);
    u = (u >> 24) | ((u >> 8) & 0xff00u) | ((u << 8) & 0xff0000u) | (u << 24);
    std::memcpy(x + i, &u, 4);
  }
}

struct FileCloser {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

inline std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

/// Sequential writer that hashes everything it writes; throws Errc::kIo naming `path`.
class DumpWriter {
 public:
  DumpWriter(std::FILE* f, const std::string& path) : f_(f), path_(path) {}
  void bytes(const void* p, std::size_t n) {
    hash_.update(p, n);
    raw(p, n);
  }
  void u32(std::uint32_t v) {
    unsigned char b[4];
    put_u32(b, v);
    bytes(b, 4);
  }
  void f32(float v) { u32(std::bit_cast<std::uint32_t>(v)); }
  void string(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    bytes(s.data(), s.size());
    const unsigned char zeros[4] = {};
    bytes(zeros, padding4(s.size()));
  }
  void floats(const std::vector<float>& a) {
    if constexpr (std::endian::native == std::endian::little) {
      bytes(a.data(), a.size() * sizeof(float));
    } else {
      std::vector<float> chunk;
      for (std::size_t i = 0; i < a.size(); i += kDumpChunkFloats) {
        const std::size_t n = std::min(kDumpChunkFloats, a.size() - i);
        chunk.assign(a.begin() + std::ptrdiff_t(i), a.begin() + std::ptrdiff_t(i + n));
        swap_floats(chunk.data(), n);
        bytes(chunk.data(), n * sizeof(float));
      }
    }
  }
  /// The checksum of everything written so far (itself not hashed).
  void checksum() {
    unsigned char b[8];
    put_u64(b, hash_.h);
    raw(b, 8);
  }

 private:
  void raw(const void* p, std::size_t n) {
    if (n == 0) return;
    errno = 0;
    const std::size_t w = std::fwrite(p, 1, n, f_);
    KVC_CHECK(w == n, Errc::kIo, "cannot write KV dump ", path_, ": ", errno ? errno_text(errno) : "short write");
  }
  std::FILE* f_;
  const std::string& path_;
  Fnv1a64 hash_;
};

/// Sequential reader over a file of known size that hashes everything it reads; a read past the end
/// throws Errc::kCorruptFile ("truncated").
class DumpReader {
 public:
  DumpReader(std::FILE* f, const std::string& path, std::uint64_t size) : f_(f), path_(path), size_(size) {}
  [[nodiscard]] std::uint64_t pos() const noexcept { return pos_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] std::uint64_t hash() const noexcept { return hash_.h; }
  void bytes(void* p, std::size_t n, const char* what) {
    raw(p, n, what);
    hash_.update(p, n);
  }
  std::uint32_t u32(const char* what) {
    unsigned char b[4];
    bytes(b, 4, what);
    return get_u32(b);
  }
  std::uint64_t u64_unhashed(const char* what) {
    unsigned char b[8];
    raw(b, 8, what);
    return get_u64(b);
  }
  std::string string(const char* what) {
    const std::uint32_t n = u32(what);
    KVC_CHECK(n <= kDumpMaxString, Errc::kCorruptFile, "KV dump ", path_, " is corrupt: ", what, " length ", n,
              " exceeds ", kDumpMaxString, " bytes");
    need(std::uint64_t(n) + padding4(n), what);  // before allocating
    std::string s(n, '\0');
    bytes(s.data(), n, what);
    unsigned char pad[4] = {};
    const std::uint32_t np = padding4(n);
    bytes(pad, np, what);
    for (std::uint32_t i = 0; i < np; ++i)
      KVC_CHECK(pad[i] == 0, Errc::kCorruptFile, "KV dump ", path_, " is corrupt: non-zero padding after the ", what);
    return s;
  }
  void floats(float* dst, std::size_t n, const char* what) {
    bytes(dst, n * sizeof(float), what);
    if constexpr (std::endian::native != std::endian::little) swap_floats(dst, n);
  }

 private:
  void need(std::uint64_t n, const char* what) const {
    KVC_CHECK(n <= size_ - pos_, Errc::kCorruptFile, "KV dump ", path_, " is truncated: reading the ", what,
              " needs ", n, " bytes at offset ", pos_, " but the file holds ", size_, " bytes");
  }
  void raw(void* p, std::size_t n, const char* what) {
    if (n == 0) return;
    need(n, what);
    const std::size_t r = std::fread(p, 1, n, f_);
    KVC_CHECK(r == n, std::ferror(f_) ? Errc::kIo : Errc::kCorruptFile, "KV dump ", path_,
              std::ferror(f_) ? ": read error in the " : " is truncated: it ended inside the ", what, " at offset ",
              pos_ + r);
    pos_ += n;
  }
  std::FILE* f_;
  const std::string& path_;
  std::uint64_t size_, pos_ = 0;
  Fnv1a64 hash_;
};

/// Checks every value of `a` is finite; `code` decides whether that is a bad argument or a bad file.
inline void check_finite_array(const std::vector<float>& a, int heads, int head_dim, Errc code,
                               const std::string& where, std::size_t i, int model_layer, const char* what) {
  for (std::size_t e = 0; e < a.size(); ++e)
    if (!std::isfinite(a[e])) {
      const std::size_t row = std::size_t(heads) * std::size_t(head_dim);
      ::kvc::detail::fail(code, where, "layer ", i, " (model layer ", model_layer, ") ", what, " token ", e / row,
                          " head ",
           (e % row) / std::size_t(head_dim), " channel ", e % std::size_t(head_dim), " is ", a[e],
           " (NaN/Inf not allowed)");
    }
}

}  // namespace detail

inline void KVDump::validate() const {
  using detail::kDumpMaxString;
  KVC_CHECK(model.size() <= kDumpMaxString && source.size() <= kDumpMaxString, Errc::kInvalidArgument,
            "KV dump: model name (", model.size(), " bytes) and source (", source.size(), " bytes) may hold at most ",
            kDumpMaxString, " bytes each");
  KVC_CHECK(tokens > 0 && q_heads > 0 && kv_heads > 0 && head_dim > 0, Errc::kInvalidArgument,
            "KV dump needs positive tokens, q_heads, kv_heads and head_dim (got ", tokens, ", ", q_heads, ", ",
            kv_heads, ", ", head_dim, ")");
  KVC_CHECK(q_heads % kv_heads == 0, Errc::kInvalidArgument, "KV dump: q_heads ", q_heads,
            " is not a multiple of kv_heads ", kv_heads);
  KVC_CHECK(std::isfinite(rope_theta) && rope_theta >= 0.0f, Errc::kInvalidArgument, "KV dump: rope_theta ",
            rope_theta, " is not a finite non-negative number");
  KVC_CHECK(!layers.empty(), Errc::kInvalidArgument, "KV dump has no layers");
  const bool pre = has_pre_rope_keys(), qs = has_queries();
  const std::size_t n = kv_floats(), nq = q_floats();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const KVDumpLayer& l = layers[i];
    KVC_CHECK(l.layer >= 0, Errc::kInvalidArgument, "KV dump layer ", i, ": negative model layer index ", l.layer);
    for (std::size_t j = 0; j < i; ++j)
      KVC_CHECK(layers[j].layer != l.layer, Errc::kInvalidArgument, "KV dump layers ", j, " and ", i,
                " are both model layer ", l.layer);
    auto size_ok = [&](const std::vector<float>& a, std::size_t want, const char* what, const char* shape) {
      KVC_CHECK(a.size() == want, Errc::kInvalidArgument, "KV dump layer ", i, " (model layer ", l.layer, "): ", what,
                " hold ", a.size(), " floats, expected ", shape, " = ", want);
    };
    size_ok(l.k, n, "keys", "tokens * kv_heads * head_dim");
    size_ok(l.v, n, "values", "tokens * kv_heads * head_dim");
    size_ok(l.k_pre_rope, pre ? n : 0,
            pre ? "pre-RoPE keys" : "pre-RoPE keys (absent in layer 0, so in every layer)",
            "tokens * kv_heads * head_dim");
    size_ok(l.q, qs ? nq : 0, qs ? "queries" : "queries (absent in layer 0, so in every layer)",
            "tokens * q_heads * head_dim");
  }
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const KVDumpLayer& l = layers[i];
    detail::check_finite_array(l.k, kv_heads, head_dim, Errc::kNonFinite, "KV dump: ", i, l.layer, "key");
    detail::check_finite_array(l.k_pre_rope, kv_heads, head_dim, Errc::kNonFinite, "KV dump: ", i, l.layer,
                               "pre-RoPE key");
    detail::check_finite_array(l.v, kv_heads, head_dim, Errc::kNonFinite, "KV dump: ", i, l.layer, "value");
    detail::check_finite_array(l.q, q_heads, head_dim, Errc::kNonFinite, "KV dump: ", i, l.layer, "query");
  }
}

/// Writes `dump` to `path` in the format above (via `path + ".tmp"` and a rename). Validates the
/// whole dump first (KVDump::validate); Errc::kIo if the file cannot be written (the temporary file
/// is removed, `path` untouched).
inline void write_kv_dump(const std::string& path, const KVDump& dump) {
  dump.validate();
  const std::string tmp = path + ".tmp";
  detail::FilePtr f(std::fopen(tmp.c_str(), "wb"));
  KVC_CHECK(f != nullptr, Errc::kIo, "cannot open ", tmp, " for writing the KV dump ", path, ": ",
            detail::errno_text(errno));
  try {
    detail::DumpWriter w(f.get(), tmp);
    w.bytes(detail::kDumpMagic, sizeof detail::kDumpMagic);
    w.u32(detail::kDumpVersion);
    w.u32(static_cast<std::uint32_t>(dump.layers.size()));
    w.u32(static_cast<std::uint32_t>(dump.tokens));
    w.u32(static_cast<std::uint32_t>(dump.q_heads));
    w.u32(static_cast<std::uint32_t>(dump.kv_heads));
    w.u32(static_cast<std::uint32_t>(dump.head_dim));
    w.u32((dump.has_pre_rope_keys() ? detail::kDumpFlagPreRope : 0u) |
          (dump.has_queries() ? detail::kDumpFlagQueries : 0u));
    w.f32(dump.rope_theta);
    w.string(dump.model);
    w.string(dump.source);
    for (const auto& l : dump.layers) w.u32(static_cast<std::uint32_t>(l.layer));
    for (const auto& l : dump.layers) {
      w.floats(l.k);
      w.floats(l.k_pre_rope);  // empty when absent
      w.floats(l.v);
      w.floats(l.q);
    }
    w.checksum();
    errno = 0;
    const int flushed = std::fflush(f.get());
    KVC_CHECK(flushed == 0, Errc::kIo, "cannot write KV dump ", tmp, ": ", detail::errno_text(errno));
    std::FILE* raw = f.release();
    errno = 0;
    KVC_CHECK(std::fclose(raw) == 0, Errc::kIo, "cannot close KV dump ", tmp, ": ", detail::errno_text(errno));
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    KVC_CHECK(!ec, Errc::kIo, "cannot rename ", tmp, " to ", path, ": ", ec.message());
  } catch (...) {
    f.reset();
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }
}

/// Reads a KV dump written by write_kv_dump (format above), checking everything: Errc::kIo if it
/// cannot be opened or read, Errc::kCorruptFile if it is not a valid version-1 dump.
inline KVDump read_kv_dump(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  KVC_CHECK(!ec && fs::exists(st), Errc::kIo, "cannot open KV dump ", path, ": ",
            ec ? ec.message() : std::string("no such file"));
  KVC_CHECK(fs::is_regular_file(st), Errc::kIo, "cannot open KV dump ", path, ": not a regular file");
  const std::uint64_t size = fs::file_size(path, ec);
  KVC_CHECK(!ec, Errc::kIo, "cannot open KV dump ", path, ": ", ec.message());
  detail::FilePtr f(std::fopen(path.c_str(), "rb"));
  KVC_CHECK(f != nullptr, Errc::kIo, "cannot open KV dump ", path, ": ", detail::errno_text(errno));

  auto corrupt = [&path](const auto&... msg) {
    ::kvc::detail::fail(Errc::kCorruptFile, "KV dump ", path, " is corrupt: ", msg...);
  };
  detail::DumpReader r(f.get(), path, size);
  char magic[8];
  r.bytes(magic, 8, "magic");
  if (std::memcmp(magic, detail::kDumpMagic, 8) != 0) corrupt("bad magic (not a kvc KV dump)");
  const std::uint32_t version = r.u32("version");
  if (version != detail::kDumpVersion)
    ::kvc::detail::fail(Errc::kCorruptFile, "KV dump ", path, " has unsupported version ", version,
                        " (this reader reads version ", detail::kDumpVersion, ")");
  const std::uint32_t n_layers = r.u32("header"), tokens = r.u32("header"), q_heads = r.u32("header"),
                      kv_heads = r.u32("header"), head_dim = r.u32("header"), flags = r.u32("header");
  const float rope_theta = std::bit_cast<float>(r.u32("header"));
  const std::uint32_t dims[] = {n_layers, tokens, q_heads, kv_heads, head_dim};
  for (std::uint32_t x : dims)
    if (x == 0 || x > std::uint32_t(INT_MAX))
      corrupt("header fields n_layers ", n_layers, ", tokens ", tokens, ", q_heads ", q_heads, ", kv_heads ", kv_heads,
              ", head_dim ", head_dim, " must lie in [1, 2^31)");
  if (q_heads % kv_heads != 0) corrupt("q_heads ", q_heads, " is not a multiple of kv_heads ", kv_heads);
  if ((flags & ~(detail::kDumpFlagPreRope | detail::kDumpFlagQueries)) != 0)
    corrupt("unknown flags 0x", std::hex, flags);
  if (!std::isfinite(rope_theta) || rope_theta < 0.0f) corrupt("rope_theta ", rope_theta, " is not finite and >= 0");
  KVDump d;
  d.model = r.string("model name");
  d.source = r.string("source description");

  // The exact file length the header implies, before anything large is allocated.
  const bool pre = (flags & detail::kDumpFlagPreRope) != 0, qs = (flags & detail::kDumpFlagQueries) != 0;
  std::uint64_t kv_floats = 0, q_floats = 0, per_layer = 0, expected = 0;
  bool ok = detail::mul_u64(tokens, kv_heads, kv_floats) && detail::mul_u64(kv_floats, head_dim, kv_floats) &&
            detail::mul_u64(tokens, q_heads, q_floats) && detail::mul_u64(q_floats, head_dim, q_floats) &&
            detail::mul_u64(kv_floats, pre ? 3 : 2, per_layer) &&
            detail::add_u64(per_layer, qs ? q_floats : 0, per_layer) &&
            detail::mul_u64(per_layer, 4, per_layer) && detail::mul_u64(per_layer, n_layers, expected) &&
            detail::add_u64(expected, r.pos() + 4ull * n_layers + 8, expected);
  if (!ok || expected != size)
    corrupt("the header (", n_layers, " layers x ", tokens, " tokens, ", q_heads, " query / ", kv_heads,
            " KV heads, head_dim ", head_dim, ", flags ", flags, ") implies ",
            ok ? std::to_string(expected) : std::string("more than 2^64"), " bytes but the file holds ", size,
            " (truncated or sizes inconsistent with the file length)");
  if (kv_floats > SIZE_MAX / 4 || q_floats > SIZE_MAX / 4) corrupt("arrays too large for this machine");

  d.tokens = int(tokens);
  d.q_heads = int(q_heads);
  d.kv_heads = int(kv_heads);
  d.head_dim = int(head_dim);
  d.rope_theta = rope_theta;
  d.layers.resize(n_layers);
  for (std::uint32_t i = 0; i < n_layers; ++i) {
    const std::uint32_t idx = r.u32("layer indices");
    if (idx > std::uint32_t(INT_MAX)) corrupt("model layer index ", idx, " of dumped layer ", i, " is >= 2^31");
    d.layers[i].layer = int(idx);
  }
  // Duplicates checked after the checksum (a flipped byte then reports the checksum).
  for (std::uint32_t i = 0; i < n_layers; ++i) {
    KVDumpLayer& l = d.layers[i];
    auto read = [&](std::vector<float>& a, std::uint64_t n, const char* what) {
      a.resize(std::size_t(n));
      r.floats(a.data(), a.size(), what);
    };
    read(l.k, kv_floats, "keys");
    if (pre) read(l.k_pre_rope, kv_floats, "pre-RoPE keys");
    read(l.v, kv_floats, "values");
    if (qs) read(l.q, q_floats, "queries");
  }
  const std::uint64_t computed = r.hash(), stored = r.u64_unhashed("checksum");
  if (computed != stored) corrupt("checksum mismatch (stored 0x", std::hex, stored, ", computed 0x", computed, ")");
  for (std::size_t i = 0; i < d.layers.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (d.layers[i].layer == d.layers[j].layer)
        corrupt("dumped layers ", j, " and ", i, " are both model layer ", d.layers[i].layer);
  const std::string where = "KV dump " + path + " is corrupt: ";
  for (std::size_t i = 0; i < d.layers.size(); ++i) {
    const KVDumpLayer& l = d.layers[i];
    detail::check_finite_array(l.k, d.kv_heads, d.head_dim, Errc::kCorruptFile, where, i, l.layer, "key");
    detail::check_finite_array(l.k_pre_rope, d.kv_heads, d.head_dim, Errc::kCorruptFile, where, i, l.layer,
                               "pre-RoPE key");
    detail::check_finite_array(l.v, d.kv_heads, d.head_dim, Errc::kCorruptFile, where, i, l.layer, "value");
    detail::check_finite_array(l.q, d.q_heads, d.head_dim, Errc::kCorruptFile, where, i, l.layer, "query");
  }
  return d;
}

}  // namespace kvc::io
