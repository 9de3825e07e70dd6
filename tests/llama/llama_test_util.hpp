// Helpers shared by the llama example's tests: where the real model lives, and a small GGUF writer
// that builds synthetic files in memory (written here from the format description, so that the
// reader is not checked against itself).
#pragma once

#include <llama/gguf.hpp>

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvc_test {

/// kvc::llama::default_model_path(), or empty if that file does not exist (tests then GTEST_SKIP).
inline std::string model_path() {
  const std::string p = kvc::llama::default_model_path();
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec) ? p : std::string();
}
inline constexpr const char* kNoModel =
    "real model not found: set KVC_MODEL or run examples/llama/fetch_model.sh (KVC_CACHE_DIR, default "
    "$HOME/.cache/kvc)";

/// Runs `f`, expects a kvc::Error with `code` whose message contains `needle`.
template <class F>
void expect_error(F&& f, kvc::Errc code, std::string_view needle) {
  try {
    f();
    ADD_FAILURE() << "expected kvc::Error containing '" << needle << "', nothing was thrown";
  } catch (const kvc::Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    EXPECT_NE(std::string_view(e.what()).find(needle), std::string_view::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
  }
}

/// Little-endian byte sink.
struct Bytes {
  std::vector<std::byte> b;
  Bytes& u8(std::uint8_t v) { b.push_back(static_cast<std::byte>(v)); return *this; }
  Bytes& u16(std::uint16_t v) { return u8(static_cast<std::uint8_t>(v)).u8(static_cast<std::uint8_t>(v >> 8)); }
  Bytes& u32(std::uint32_t v) { return u16(static_cast<std::uint16_t>(v)).u16(static_cast<std::uint16_t>(v >> 16)); }
  Bytes& u64(std::uint64_t v) { return u32(static_cast<std::uint32_t>(v)).u32(static_cast<std::uint32_t>(v >> 32)); }
  Bytes& f32(float v) { std::uint32_t u; std::memcpy(&u, &v, 4); return u32(u); }
  Bytes& f64(double v) { std::uint64_t u; std::memcpy(&u, &v, 8); return u64(u); }
  Bytes& str(const std::string& s) {
    u64(s.size());
    for (char c : s) u8(static_cast<std::uint8_t>(c));
    return *this;
  }
  Bytes& raw(const std::vector<std::byte>& v) { b.insert(b.end(), v.begin(), v.end()); return *this; }
};

using kvc::llama::GgmlType;
using VT = kvc::llama::GgufValueType;

/// Builds a GGUF file: header, metadata (in insertion order), tensor infos, padding, data.
/// Tensors get consecutive aligned offsets unless one is forced; the last tensor is not padded,
/// so the file ends exactly where its data ends.
class GgufWriter {
 public:
  std::uint32_t version = 3;
  std::size_t alignment = 32;  ///< layout alignment (set general.alignment yourself to change the reader's)
  std::optional<std::uint64_t> tensor_count_override, kv_count_override;

  /// A metadata entry with a raw payload (the value bytes after the type id).
  GgufWriter& kv(const std::string& key, VT type, const Bytes& payload) {
    Bytes e;
    e.str(key).u32(static_cast<std::uint32_t>(type)).raw(payload.b);
    kvs_.push_back(std::move(e.b));
    return *this;
  }
  GgufWriter& kv_u32(const std::string& key, std::uint32_t v) { return kv(key, VT::kUint32, Bytes{}.u32(v)); }
  GgufWriter& kv_i32(const std::string& key, std::int32_t v) {
    return kv(key, VT::kInt32, Bytes{}.u32(static_cast<std::uint32_t>(v)));
  }
  GgufWriter& kv_f32(const std::string& key, float v) { return kv(key, VT::kFloat32, Bytes{}.f32(v)); }
  GgufWriter& kv_bool(const std::string& key, bool v) { return kv(key, VT::kBool, Bytes{}.u8(v ? 1 : 0)); }
  GgufWriter& kv_str(const std::string& key, const std::string& v) { return kv(key, VT::kString, Bytes{}.str(v)); }
  GgufWriter& kv_str_array(const std::string& key, const std::vector<std::string>& v) {
    Bytes p;
    p.u32(static_cast<std::uint32_t>(VT::kString)).u64(v.size());
    for (const auto& s : v) p.str(s);
    return kv(key, VT::kArray, p);
  }
  GgufWriter& kv_i32_array(const std::string& key, const std::vector<std::int32_t>& v) {
    Bytes p;
    p.u32(static_cast<std::uint32_t>(VT::kInt32)).u64(v.size());
    for (std::int32_t x : v) p.u32(static_cast<std::uint32_t>(x));
    return kv(key, VT::kArray, p);
  }

  /// A tensor with its data; `type_id` and `offset` may be forced to test bad files.
  GgufWriter& tensor(const std::string& name, std::vector<std::uint64_t> dims, std::uint32_t type_id,
                     std::vector<std::byte> data, std::optional<std::uint64_t> offset = std::nullopt) {
    tensors_.push_back({name, std::move(dims), type_id, std::move(data), offset});
    return *this;
  }
  GgufWriter& tensor(const std::string& name, std::vector<std::uint64_t> dims, GgmlType type,
                     std::vector<std::byte> data, std::optional<std::uint64_t> offset = std::nullopt) {
    return tensor(name, std::move(dims), static_cast<std::uint32_t>(type), std::move(data), offset);
  }

  [[nodiscard]] std::vector<std::byte> build() const {
    Bytes out;
    out.u8('G').u8('G').u8('U').u8('F').u32(version);
    out.u64(tensor_count_override.value_or(tensors_.size()));
    out.u64(kv_count_override.value_or(kvs_.size()));
    for (const auto& e : kvs_) out.raw(e);
    std::vector<std::uint64_t> offsets;
    std::uint64_t cursor = 0;
    for (const auto& t : tensors_) {
      std::uint64_t off = (cursor + alignment - 1) / alignment * alignment;
      if (t.offset) off = *t.offset;
      else cursor = off + t.data.size();
      offsets.push_back(off);
      out.str(t.name).u32(static_cast<std::uint32_t>(t.dims.size()));
      for (std::uint64_t d : t.dims) out.u64(d);
      out.u32(t.type_id).u64(off);
    }
    while (out.b.size() % alignment != 0) out.u8(0);
    const std::size_t data_start = out.b.size();
    out.b.resize(data_start + cursor);
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].offset || tensors_[i].data.empty()) continue;
      std::memcpy(out.b.data() + data_start + offsets[i], tensors_[i].data.data(), tensors_[i].data.size());
    }
    return out.b;
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> dims;
    std::uint32_t type_id;
    std::vector<std::byte> data;
    std::optional<std::uint64_t> offset;
  };
  std::vector<std::vector<std::byte>> kvs_;
  std::vector<Tensor> tensors_;
};

}  // namespace kvc_test
