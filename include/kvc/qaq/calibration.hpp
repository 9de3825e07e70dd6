/// \file calibration.hpp
/// QAQ's calibration artifact (SPEC §2.3, Q5, Q6): per (layer, KV head) a percentile of the squared norm of
/// the scaled query q / sqrt(d_h) (the one that produces the logits), the largest over the query heads of the
/// KV head's GQA group. The key bound substitutes it for ||Q||^2. Computed from queries of a calibration text
/// (kvc-eval: a segment disjoint from the evaluation segment), saved and loaded as a small file. Host only.
///
/// File format, version 1 (little-endian, no padding):
///   offset  bytes  field
///   0       8      magic "KVCQAQC\0"
///   8       4      u32 version = 1
///   12      4      u32 layers      >= 1
///   16      4      u32 kv_heads    >= 1
///   20      4      u32 head_dim    >= 1
///   24      4      f32 percentile  in (0, 100]
///   28      4      u32 queries     calibration queries per head (>= 1)
///   32      4*n    f32 qnorm2[layer][kv_head], n = layers * kv_heads, finite and > 0
///   last    8      u64 FNV-1a-64 of every preceding byte
/// Errors (kvc::Error): Errc::kIo when the file cannot be opened, read or written; Errc::kCorruptFile for a
/// bad magic, version, length, checksum or value; Errc::kInvalidArgument for a calibration whose shape does
/// not match the model (check_shape) or bad inputs to the builder.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/error.hpp>
#include <kvc/io/kv_dump.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace kvc::qaq {

struct QueryNormCalibration {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float percentile = 90.0f;  ///< the paper's upper 10 % quantile
  std::uint32_t queries = 0;
  std::vector<float> qnorm2;  ///< [layers][kv_heads]

  QueryNormCalibration() = default;
  QueryNormCalibration(int layers_, int kv_heads_, int head_dim_, float percentile_ = 90.0f)
      : layers(layers_), kv_heads(kv_heads_), head_dim(head_dim_), percentile(percentile_) {
    KVC_CHECK(layers_ > 0 && kv_heads_ > 0 && head_dim_ > 0, Errc::kInvalidArgument,
              "QAQ calibration needs positive layers, kv_heads and head_dim (got ", layers_, ", ", kv_heads_, ", ",
              head_dim_, ")");
    KVC_CHECK(percentile_ > 0.0f && percentile_ <= 100.0f, Errc::kInvalidArgument, "QAQ calibration percentile ",
              percentile_, " is not in (0, 100]");
    qnorm2.assign(std::size_t(layers_) * kv_heads_, 0.0f);
  }

  [[nodiscard]] float at(int layer, int head) const {
    KVC_CHECK(layer >= 0 && layer < layers && head >= 0 && head < kv_heads, Errc::kInvalidArgument,
              "QAQ calibration: (layer ", layer, ", KV head ", head, ") out of range [0, ", layers, ") x [0, ",
              kv_heads, ")");
    return qnorm2[std::size_t(layer) * kv_heads + head];
  }

  /// Sets one layer from `tokens` raw queries q[t][h][c] (q_heads a multiple of kv_heads): per query head
  /// the nearest-rank percentile of ||q / sqrt(d)||^2 over the tokens, then the largest over each GQA group.
  void set_layer(int layer, const float* q, int tokens, int q_heads) {
    KVC_CHECK(layer >= 0 && layer < layers, Errc::kInvalidArgument, "QAQ calibration: layer ", layer,
              " out of range [0, ", layers, ")");
    KVC_CHECK(tokens > 0 && q != nullptr, Errc::kInvalidArgument, "QAQ calibration: layer ", layer,
              " needs at least one query");
    KVC_CHECK(q_heads > 0 && q_heads % kv_heads == 0, Errc::kInvalidArgument, "QAQ calibration: ", q_heads,
              " query heads are not a multiple of ", kv_heads, " KV heads");
    KVC_CHECK(queries == 0 || queries == std::uint32_t(tokens), Errc::kInvalidArgument,
              "QAQ calibration: layer ", layer, " has ", tokens, " queries, earlier layers ", queries);
    std::vector<float> out(static_cast<std::size_t>(kv_heads), 0.0f), norms(static_cast<std::size_t>(tokens));
    const int group = q_heads / kv_heads;
    const std::size_t rank = std::size_t(std::ceil(double(percentile) / 100.0 * tokens));  // nearest rank, >= 1
    for (int h = 0; h < q_heads; ++h) {
      for (int t = 0; t < tokens; ++t) {
        const float* r = q + (std::size_t(t) * q_heads + h) * head_dim;
        double s = 0.0;
        for (int c = 0; c < head_dim; ++c) {
          KVC_CHECK(std::isfinite(r[c]), Errc::kNonFinite, "QAQ calibration: layer ", layer, " query token ", t,
                    " head ", h, " channel ", c, " is ", r[c]);
          s += double(r[c]) * r[c];
        }
        norms[std::size_t(t)] = float(s / head_dim);
      }
      std::nth_element(norms.begin(), norms.begin() + std::ptrdiff_t(rank - 1), norms.end());
      float& o = out[std::size_t(h / group)];
      o = std::max(o, norms[rank - 1]);
    }
    for (int h = 0; h < kv_heads; ++h)  // an all-zero head would give an infinite key bound: keep it finite
      qnorm2[std::size_t(layer) * kv_heads + h] = std::max(out[std::size_t(h)], 1e-30f);
    queries = std::uint32_t(tokens);
  }

  /// Throws Errc::kInvalidArgument unless this calibration was made for a model of this shape.
  void check_shape(int model_layers, int model_kv_heads, int model_head_dim) const {
    KVC_CHECK(layers == model_layers && kv_heads == model_kv_heads && head_dim == model_head_dim,
              Errc::kInvalidArgument, "QAQ calibration is for ", layers, " layers x ", kv_heads, " KV heads x head_dim ",
              head_dim, ", but the model has ", model_layers, " x ", model_kv_heads, " x ", model_head_dim);
  }
};

namespace detail {
inline constexpr char kCalibMagic[8] = {'K', 'V', 'C', 'Q', 'A', 'Q', 'C', '\0'};
inline constexpr std::uint32_t kCalibVersion = 1;
inline constexpr std::size_t kCalibHeader = 32;
inline constexpr std::uint32_t kCalibMaxEntries = 1u << 20;

inline std::vector<unsigned char> encode_calibration(const QueryNormCalibration& c) {
  std::vector<unsigned char> b(kCalibHeader + 4 * c.qnorm2.size() + 8);
  std::memcpy(b.data(), kCalibMagic, 8);
  io::detail::put_u32(b.data() + 8, kCalibVersion);
  io::detail::put_u32(b.data() + 12, std::uint32_t(c.layers));
  io::detail::put_u32(b.data() + 16, std::uint32_t(c.kv_heads));
  io::detail::put_u32(b.data() + 20, std::uint32_t(c.head_dim));
  io::detail::put_u32(b.data() + 24, std::bit_cast<std::uint32_t>(c.percentile));
  io::detail::put_u32(b.data() + 28, c.queries);
  for (std::size_t i = 0; i < c.qnorm2.size(); ++i)
    io::detail::put_u32(b.data() + kCalibHeader + 4 * i, std::bit_cast<std::uint32_t>(c.qnorm2[i]));
  io::detail::Fnv1a64 h;
  h.update(b.data(), b.size() - 8);
  io::detail::put_u64(b.data() + b.size() - 8, h.h);
  return b;
}
}  // namespace detail

/// Writes `c` to `path` (via path + ".tmp" and a rename). Every entry must be finite and > 0 (set_layer
/// for every layer), else Errc::kInvalidArgument before anything is written.
inline void save_calibration(const QueryNormCalibration& c, const std::string& path) {
  KVC_CHECK(c.layers > 0 && c.kv_heads > 0 && c.head_dim > 0 && c.queries > 0 &&
                c.qnorm2.size() == std::size_t(c.layers) * c.kv_heads,
            Errc::kInvalidArgument, "QAQ calibration is incomplete (", c.layers, " layers, ", c.kv_heads, " KV heads, ",
            c.qnorm2.size(), " entries, ", c.queries, " queries)");
  for (std::size_t i = 0; i < c.qnorm2.size(); ++i)
    KVC_CHECK(std::isfinite(c.qnorm2[i]) && c.qnorm2[i] > 0.0f, Errc::kInvalidArgument, "QAQ calibration entry (layer ",
              i / std::size_t(c.kv_heads), ", KV head ", i % std::size_t(c.kv_heads), ") = ", c.qnorm2[i],
              " is not finite and positive (was every layer set?)");
  const std::vector<unsigned char> b = detail::encode_calibration(c);
  const std::string tmp = path + ".tmp";
  {
    io::detail::FilePtr f(std::fopen(tmp.c_str(), "wb"));
    KVC_CHECK(f != nullptr, Errc::kIo, "cannot open ", tmp, " for writing the QAQ calibration: ",
              io::detail::errno_text(errno));
    const bool ok = std::fwrite(b.data(), 1, b.size(), f.get()) == b.size() && std::fflush(f.get()) == 0;
    if (!ok) {
      const int e = errno;
      f.reset();
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      ::kvc::detail::fail(Errc::kIo, "cannot write the QAQ calibration ", tmp, ": ", io::detail::errno_text(e));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KVC_CHECK(!ec, Errc::kIo, "cannot rename ", tmp, " to ", path, ": ", ec.message());
}

/// Reads a calibration written by save_calibration, checking everything (see the file comment).
inline QueryNormCalibration load_calibration(const std::string& path) {
  io::detail::FilePtr f(std::fopen(path.c_str(), "rb"));
  KVC_CHECK(f != nullptr, Errc::kIo, "cannot open QAQ calibration ", path, ": ", io::detail::errno_text(errno));
  auto corrupt = [&](const auto&... why) { ::kvc::detail::fail(Errc::kCorruptFile, "QAQ calibration ", path, " ", why...); };
  unsigned char head[detail::kCalibHeader];
  if (std::fread(head, 1, sizeof head, f.get()) != sizeof head) corrupt("is truncated (shorter than its 32-byte header)");
  if (std::memcmp(head, detail::kCalibMagic, 8) != 0) corrupt("has a bad magic (not a kvc QAQ calibration)");
  const std::uint32_t version = io::detail::get_u32(head + 8);
  if (version != detail::kCalibVersion) corrupt("has unsupported version ", version, " (this reader reads version 1)");
  const std::uint32_t layers = io::detail::get_u32(head + 12), kv_heads = io::detail::get_u32(head + 16),
                      head_dim = io::detail::get_u32(head + 20);
  if (layers == 0 || kv_heads == 0 || head_dim == 0 || layers > detail::kCalibMaxEntries ||
      kv_heads > detail::kCalibMaxEntries || std::uint64_t(layers) * kv_heads > detail::kCalibMaxEntries ||
      head_dim > 65536)
    corrupt("has an impossible shape (", layers, " layers, ", kv_heads, " KV heads, head_dim ", head_dim, ")");
  const std::size_t n = std::size_t(layers) * kv_heads;
  std::vector<unsigned char> b(detail::kCalibHeader + 4 * n + 8);
  std::memcpy(b.data(), head, sizeof head);
  const std::size_t rest = b.size() - sizeof head;
  const std::size_t got = std::fread(b.data() + sizeof head, 1, rest, f.get());
  if (std::ferror(f.get())) ::kvc::detail::fail(Errc::kIo, "read error in QAQ calibration ", path);
  if (got != rest) corrupt("is truncated (", sizeof head + got, " bytes, expected ", b.size(), ")");
  if (std::fgetc(f.get()) != EOF) corrupt("is longer than its header says (", b.size(), " bytes)");
  io::detail::Fnv1a64 h;
  h.update(b.data(), b.size() - 8);
  const std::uint64_t stored = io::detail::get_u64(b.data() + b.size() - 8);
  if (stored != h.h) corrupt("fails its checksum (stored 0x", std::hex, stored, ", computed 0x", h.h, ")");
  QueryNormCalibration c;
  c.layers = int(layers);
  c.kv_heads = int(kv_heads);
  c.head_dim = int(head_dim);
  c.percentile = std::bit_cast<float>(io::detail::get_u32(head + 24));
  c.queries = io::detail::get_u32(head + 28);
  if (!(c.percentile > 0.0f && c.percentile <= 100.0f)) corrupt("has percentile ", c.percentile, " outside (0, 100]");
  if (c.queries == 0) corrupt("was computed from 0 queries");
  c.qnorm2.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    c.qnorm2[i] = std::bit_cast<float>(io::detail::get_u32(b.data() + detail::kCalibHeader + 4 * i));
    if (!(std::isfinite(c.qnorm2[i]) && c.qnorm2[i] > 0.0f))
      corrupt("entry (layer ", i / kv_heads, ", KV head ", i % kv_heads, ") = ", c.qnorm2[i], " is not finite and positive");
  }
  return c;
}
}  // namespace kvc::qaq
