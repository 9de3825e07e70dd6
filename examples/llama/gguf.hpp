/// \file gguf.hpp
/// A reader for GGUF v3 model files (the llama.cpp container format) with dequantisation of the
/// common tensor types to float. Part of the llama example engine, not of the kvc library.
///
/// Format (all integers little-endian):
///   header   "GGUF" u32 version(=3) u64 tensor_count u64 kv_count
///   kv       string key, u32 value_type, value           (kv_count times)
///   tensor   string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset   (tensor_count times)
///   padding  to `general.alignment` (default 32), then the data section; every tensor offset is
///            relative to the data section and a multiple of the alignment.
///   string = u64 length + bytes (no terminator); array = u32 element type, u64 count, elements.
/// ne[0] is the fastest-varying dimension: a 2-D weight with ne = {in, out} is stored as `out` rows
/// of `in` contiguous elements (row r, column c at element r * ne[0] + c), and quantisation blocks
/// run along ne[0].
///
/// GgufFile::open reads the whole file into memory (one std::vector, no mmap: portable, and the
/// bytes stay valid for the GgufFile's lifetime, also across moves). Every count, length, offset and
/// size is validated against the file size before anything is allocated or read, so a malformed file
/// throws kvc::Error (never crashes or allocates more than a small multiple of its own size):
///   Errc::kIo              the file cannot be opened or read
///   Errc::kCorruptFile     bad magic, unsupported version, truncation, offsets/sizes past the end,
///                          misalignment, bad lengths, duplicate keys/tensors, overlapping tensors
///   Errc::kInvalidArgument a missing key/tensor, a metadata value of the wrong type, a tensor type
///                          this reader cannot dequantise (the file still opens; dequantize throws)
///   Errc::kOutOfRange      an integer value that does not fit std::int64_t
#pragma once

#include <kvc/core/error.hpp>
#include <kvc/core/numeric.hpp>
#include <kvc/io/cache_dir.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvc::llama {

/// ggml tensor types by their on-disk id. Only F32, F16, BF16, Q4_0, Q4_1 and Q8_0 can be
/// dequantised; the others are named so that errors can say what a file contains.
enum class GgmlType : std::uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

/// Block geometry of a ggml type: `block_size` elements are stored in `block_bytes` bytes.
/// `known` is false for ids this reader has never heard of (then the sizes are 0).
struct GgmlTypeInfo {
  const char* name;
  std::int64_t block_size;
  std::size_t block_bytes;
  bool known;
  bool dequantizable;
};

inline GgmlTypeInfo type_info(GgmlType t) noexcept {
  switch (t) {
    case GgmlType::F32: return {"F32", 1, 4, true, true};
    case GgmlType::F16: return {"F16", 1, 2, true, true};
    case GgmlType::Q4_0: return {"Q4_0", 32, 18, true, true};
    case GgmlType::Q4_1: return {"Q4_1", 32, 20, true, true};
    case GgmlType::Q5_0: return {"Q5_0", 32, 22, true, false};
    case GgmlType::Q5_1: return {"Q5_1", 32, 24, true, false};
    case GgmlType::Q8_0: return {"Q8_0", 32, 34, true, true};
    case GgmlType::Q8_1: return {"Q8_1", 32, 40, true, false};
    case GgmlType::Q2_K: return {"Q2_K", 256, 84, true, false};
    case GgmlType::Q3_K: return {"Q3_K", 256, 110, true, false};
    case GgmlType::Q4_K: return {"Q4_K", 256, 144, true, false};
    case GgmlType::Q5_K: return {"Q5_K", 256, 176, true, false};
    case GgmlType::Q6_K: return {"Q6_K", 256, 210, true, false};
    case GgmlType::Q8_K: return {"Q8_K", 256, 292, true, false};
    case GgmlType::IQ2_XXS: return {"IQ2_XXS", 256, 66, true, false};
    case GgmlType::IQ2_XS: return {"IQ2_XS", 256, 74, true, false};
    case GgmlType::IQ3_XXS: return {"IQ3_XXS", 256, 98, true, false};
    case GgmlType::IQ1_S: return {"IQ1_S", 256, 50, true, false};
    case GgmlType::IQ4_NL: return {"IQ4_NL", 32, 18, true, false};
    case GgmlType::IQ3_S: return {"IQ3_S", 256, 110, true, false};
    case GgmlType::IQ2_S: return {"IQ2_S", 256, 82, true, false};
    case GgmlType::IQ4_XS: return {"IQ4_XS", 256, 136, true, false};
    case GgmlType::I8: return {"I8", 1, 1, true, false};
    case GgmlType::I16: return {"I16", 1, 2, true, false};
    case GgmlType::I32: return {"I32", 1, 4, true, false};
    case GgmlType::I64: return {"I64", 1, 8, true, false};
    case GgmlType::F64: return {"F64", 1, 8, true, false};
    case GgmlType::IQ1_M: return {"IQ1_M", 256, 56, true, false};
    case GgmlType::BF16: return {"BF16", 1, 2, true, true};
    case GgmlType::TQ1_0: return {"TQ1_0", 256, 54, true, false};
    case GgmlType::TQ2_0: return {"TQ2_0", 256, 66, true, false};
    case GgmlType::MXFP4: return {"MXFP4", 32, 17, true, false};
  }
  return {"unknown", 0, 0, false, false};
}

/// "Q4_1", "F32", ...; "unknown" for ids not in GgmlType.
inline const char* to_string(GgmlType t) noexcept { return type_info(t).name; }

/// GGUF metadata value types by their on-disk id.
enum class GgufValueType : std::uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6, kBool = 7,
  kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};

inline const char* to_string(GgufValueType t) noexcept {
  switch (t) {
    case GgufValueType::kUint8: return "uint8";
    case GgufValueType::kInt8: return "int8";
    case GgufValueType::kUint16: return "uint16";
    case GgufValueType::kInt16: return "int16";
    case GgufValueType::kUint32: return "uint32";
    case GgufValueType::kInt32: return "int32";
    case GgufValueType::kFloat32: return "float32";
    case GgufValueType::kBool: return "bool";
    case GgufValueType::kString: return "string";
    case GgufValueType::kArray: return "array";
    case GgufValueType::kUint64: return "uint64";
    case GgufValueType::kInt64: return "int64";
    case GgufValueType::kFloat64: return "float64";
  }
  return "unknown";
}

/// One tensor's header entry.
struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> dims;  ///< ne[0] first: dims[0] is the fastest-varying (row length)
  GgmlType type{};
  std::uint64_t offset = 0;  ///< relative to the data section

  [[nodiscard]] std::int64_t n_elements() const noexcept {
    std::int64_t n = 1;
    for (std::int64_t d : dims) n *= d;
    return n;
  }
  /// Bytes of the tensor's data (whole quantisation blocks).
  [[nodiscard]] std::size_t n_bytes() const noexcept {
    const GgmlTypeInfo ti = type_info(type);
    return ti.block_size > 0 ? static_cast<std::size_t>(n_elements() / ti.block_size) * ti.block_bytes : 0;
  }
  /// Product of dims[1..]: the number of rows of dims[0] elements.
  [[nodiscard]] std::int64_t rows() const noexcept { return dims.empty() ? 0 : n_elements() / dims[0]; }
  [[nodiscard]] std::int64_t row_length() const noexcept { return dims.empty() ? 0 : dims[0]; }
  /// Bytes of one row (row_length() is a multiple of the type's block size in a validated file).
  [[nodiscard]] std::size_t row_bytes() const noexcept {
    const GgmlTypeInfo ti = type_info(type);
    return ti.block_size > 0 ? static_cast<std::size_t>(row_length() / ti.block_size) * ti.block_bytes : 0;
  }
};

namespace gguf_detail {
inline std::uint16_t load_u16le(const std::byte* p) noexcept {
  return static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) | (std::to_integer<unsigned>(p[1]) << 8));
}
inline std::uint32_t load_u32le(const std::byte* p) noexcept {
  return static_cast<std::uint32_t>(load_u16le(p)) | (static_cast<std::uint32_t>(load_u16le(p + 2)) << 16);
}
inline std::uint64_t load_u64le(const std::byte* p) noexcept {
  return static_cast<std::uint64_t>(load_u32le(p)) | (static_cast<std::uint64_t>(load_u32le(p + 4)) << 32);
}
inline float load_f16le(const std::byte* p) noexcept { return half_t{load_u16le(p)}.to_float(); }

/// A metadata value. Integers (and bools) keep their raw 64-bit pattern and are interpreted by
/// `type`; arrays keep their elements in the vector matching their element type.
struct GgufValue {
  GgufValueType type{};
  GgufValueType elem_type{};  ///< arrays only
  std::uint64_t bits = 0;     ///< integer scalars: value (sign-extended for signed types); bool: 0/1
  double real = 0;            ///< float scalars
  std::string str;            ///< string scalars
  std::uint64_t count = 0;    ///< arrays: element count
  std::vector<std::uint64_t> int_elems;  ///< integer/bool arrays (same encoding as `bits`)
  std::vector<double> real_elems;        ///< float arrays
  std::vector<std::string> str_elems;    ///< string arrays (arrays of arrays keep only `count`)
};

inline bool is_integer(GgufValueType t) noexcept {
  switch (t) {
    case GgufValueType::kUint8: case GgufValueType::kInt8: case GgufValueType::kUint16:
    case GgufValueType::kInt16: case GgufValueType::kUint32: case GgufValueType::kInt32:
    case GgufValueType::kUint64: case GgufValueType::kInt64: return true;
    default: return false;
  }
}
inline bool is_unsigned(GgufValueType t) noexcept {
  return t == GgufValueType::kUint8 || t == GgufValueType::kUint16 || t == GgufValueType::kUint32 ||
         t == GgufValueType::kUint64;
}
/// On-disk bytes of a fixed-size scalar type; 0 for string/array/unknown.
inline std::size_t scalar_size(GgufValueType t) noexcept {
  switch (t) {
    case GgufValueType::kUint8: case GgufValueType::kInt8: case GgufValueType::kBool: return 1;
    case GgufValueType::kUint16: case GgufValueType::kInt16: return 2;
    case GgufValueType::kUint32: case GgufValueType::kInt32: case GgufValueType::kFloat32: return 4;
    case GgufValueType::kUint64: case GgufValueType::kInt64: case GgufValueType::kFloat64: return 8;
    default: return 0;
  }
}
inline bool is_known(GgufValueType t) noexcept { return static_cast<std::uint32_t>(t) <= 12; }

/// Bounds-checked little-endian cursor over the file bytes; every read past the end throws
/// kCorruptFile naming the file, the offset and what was being read.
class GgufCursor {
 public:
  GgufCursor(const std::byte* data, std::size_t size, const std::string& file) : p_(data), n_(size), file_(file) {}

  [[nodiscard]] std::size_t pos() const noexcept { return pos_; }
  [[nodiscard]] std::size_t remaining() const noexcept { return n_ - pos_; }

  void need(std::uint64_t bytes, const char* what) const {
    KVC_CHECK(bytes <= remaining(), Errc::kCorruptFile, "gguf '", file_, "': truncated at offset ", pos_,
              " reading ", what, " (", bytes, " bytes needed, ", remaining(), " left)");
  }
  const std::byte* take(std::size_t bytes, const char* what) {
    need(bytes, what);
    const std::byte* q = p_ + pos_;
    pos_ += bytes;
    return q;
  }
  std::uint8_t u8(const char* what) { return std::to_integer<std::uint8_t>(*take(1, what)); }
  std::uint16_t u16(const char* what) { return load_u16le(take(2, what)); }
  std::uint32_t u32(const char* what) { return load_u32le(take(4, what)); }
  std::uint64_t u64(const char* what) { return load_u64le(take(8, what)); }
  std::string str(const char* what) {
    const std::uint64_t len = u64(what);
    KVC_CHECK(len <= remaining(), Errc::kCorruptFile, "gguf '", file_, "': ", what, " at offset ", pos_ - 8,
              " has length ", len, " but only ", remaining(), " bytes follow");
    const std::byte* q = take(static_cast<std::size_t>(len), what);
    return std::string(reinterpret_cast<const char*>(q), static_cast<std::size_t>(len));
  }

 private:
  const std::byte* p_;
  std::size_t n_;
  std::size_t pos_ = 0;
  const std::string& file_;
};
}  // namespace gguf_detail

/// Dequantises `n` consecutive elements of type `t` from `src` (whole blocks: `n` must be a multiple
/// of the type's block size) into `dst`. Block layouts (32 elements each):
///   Q4_0: f16 d, 16 bytes of nibbles;          x = d * (q - 8)
///   Q4_1: f16 d, f16 m, 16 bytes of nibbles;   x = d * q + m
///   Q8_0: f16 d, 32 int8;                      x = d * q
/// Byte j of the nibbles holds element j in its low nibble and element j + 16 in its high nibble.
inline void dequantize_row(GgmlType t, const std::byte* src, float* dst, std::int64_t n) {
  const GgmlTypeInfo ti = type_info(t);
  KVC_CHECK(ti.dequantizable, Errc::kInvalidArgument, "dequantize_row: unsupported type ", ti.name, " (",
            static_cast<std::uint32_t>(t), ")");
  KVC_CHECK(n >= 0 && n % ti.block_size == 0, Errc::kInvalidArgument, "dequantize_row: n=", n,
            " is not a multiple of the ", ti.name, " block size ", ti.block_size);
  const std::int64_t blocks = n / ti.block_size;
  switch (t) {
    case GgmlType::F32:
      for (std::int64_t i = 0; i < n; ++i) {
        dst[i] = ::kvc::detail::bits_float(gguf_detail::load_u32le(src + 4 * i));
      }
      break;
    case GgmlType::F16:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = gguf_detail::load_f16le(src + 2 * i);
      break;
    case GgmlType::BF16:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bfloat16_t{gguf_detail::load_u16le(src + 2 * i)}.to_float();
      break;
    case GgmlType::Q4_0:
      for (std::int64_t b = 0; b < blocks; ++b, src += 18, dst += 32) {
        const float d = gguf_detail::load_f16le(src);
        for (int j = 0; j < 16; ++j) {
          const unsigned q = std::to_integer<unsigned>(src[2 + j]);
          dst[j] = d * static_cast<float>(static_cast<int>(q & 0xFu) - 8);
          dst[j + 16] = d * static_cast<float>(static_cast<int>(q >> 4) - 8);
        }
      }
      break;
    case GgmlType::Q4_1:
      for (std::int64_t b = 0; b < blocks; ++b, src += 20, dst += 32) {
        const float d = gguf_detail::load_f16le(src);
        const float m = gguf_detail::load_f16le(src + 2);
        for (int j = 0; j < 16; ++j) {
          const unsigned q = std::to_integer<unsigned>(src[4 + j]);
          dst[j] = d * static_cast<float>(q & 0xFu) + m;
          dst[j + 16] = d * static_cast<float>(q >> 4) + m;
        }
      }
      break;
    case GgmlType::Q8_0:
      for (std::int64_t b = 0; b < blocks; ++b, src += 34, dst += 32) {
        const float d = gguf_detail::load_f16le(src);
        for (int j = 0; j < 32; ++j) {
          dst[j] = d * static_cast<float>(static_cast<std::int8_t>(std::to_integer<std::uint8_t>(src[2 + j])));
        }
      }
      break;
    default: break;  // unreachable: `dequantizable` covers exactly the cases above
  }
}

/// A parsed GGUF file. Move-only (it owns the file bytes).
class GgufFile {
 public:
  /// Reads the whole file into memory and parses it. Errc::kIo if it cannot be opened or read.
  static GgufFile open(const std::string& path) {
    std::error_code ec;
    KVC_CHECK(std::filesystem::is_regular_file(path, ec), Errc::kIo, "cannot open gguf file '", path,
              "': no such regular file");
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    KVC_CHECK(in.is_open(), Errc::kIo, "cannot open gguf file '", path, "'");
    const std::streamoff end = in.tellg();
    KVC_CHECK(end >= 0, Errc::kIo, "cannot determine the size of gguf file '", path, "'");
    in.seekg(0);
    std::vector<std::byte> bytes(static_cast<std::size_t>(end));
    if (!bytes.empty()) in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(end));
    KVC_CHECK(in.good() && in.gcount() == static_cast<std::streamsize>(end), Errc::kIo,
              "cannot read gguf file '", path, "' (", end, " bytes)");
    return from_bytes(std::move(bytes), path);
  }

  /// Parses bytes already in memory; `name` appears in error messages.
  static GgufFile from_bytes(std::vector<std::byte> bytes, std::string name = "<memory>") {
    GgufFile f;
    f.bytes_ = std::move(bytes);
    f.name_ = std::move(name);
    f.parse();
    return f;
  }

  GgufFile(GgufFile&&) noexcept = default;
  GgufFile& operator=(GgufFile&&) noexcept = default;
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] std::uint32_t version() const noexcept { return version_; }
  [[nodiscard]] std::size_t alignment() const noexcept { return alignment_; }
  /// Absolute file offset of the data section.
  [[nodiscard]] std::size_t data_offset() const noexcept { return data_offset_; }

  // ---- metadata ------------------------------------------------------------------------------
  [[nodiscard]] bool has_key(std::string_view key) const { return find_key(key) != nullptr; }
  /// Keys in file order.
  [[nodiscard]] const std::vector<std::string>& keys() const noexcept { return key_order_; }
  [[nodiscard]] GgufValueType key_type(std::string_view key) const { return value(key).type; }

  [[nodiscard]] std::string get_string(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, v.type == GgufValueType::kString, "string");
    return v.str;
  }
  /// Any integer type (not bool). Errc::kOutOfRange for a uint64 above INT64_MAX.
  [[nodiscard]] std::int64_t get_int(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, gguf_detail::is_integer(v.type), "integer");
    return to_int(key, v.type, v.bits);
  }
  /// float32/float64, or any integer type converted.
  [[nodiscard]] double get_float(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, v.type == GgufValueType::kFloat32 || v.type == GgufValueType::kFloat64 ||
                       gguf_detail::is_integer(v.type), "number");
    if (!gguf_detail::is_integer(v.type)) return v.real;
    return gguf_detail::is_unsigned(v.type) ? static_cast<double>(v.bits)
                                       : static_cast<double>(static_cast<std::int64_t>(v.bits));
  }
  [[nodiscard]] bool get_bool(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, v.type == GgufValueType::kBool, "bool");
    return v.bits != 0;
  }
  /// Element count of an array value.
  [[nodiscard]] std::uint64_t array_size(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, v.type == GgufValueType::kArray, "array");
    return v.count;
  }
  [[nodiscard]] std::vector<std::string> get_string_array(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, v.type == GgufValueType::kArray && v.elem_type == GgufValueType::kString, "array of string");
    return v.str_elems;
  }
  /// An array of any integer type.
  [[nodiscard]] std::vector<std::int64_t> get_int_array(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v, v.type == GgufValueType::kArray && gguf_detail::is_integer(v.elem_type), "array of integer");
    std::vector<std::int64_t> out;
    out.reserve(v.int_elems.size());
    for (std::uint64_t b : v.int_elems) out.push_back(to_int(key, v.elem_type, b));
    return out;
  }
  /// An array of float32/float64.
  [[nodiscard]] std::vector<double> get_float_array(std::string_view key) const {
    const gguf_detail::GgufValue& v = value(key);
    expect(key, v,
           v.type == GgufValueType::kArray &&
               (v.elem_type == GgufValueType::kFloat32 || v.elem_type == GgufValueType::kFloat64),
           "array of float");
    return v.real_elems;
  }

  // ---- tensors -------------------------------------------------------------------------------
  [[nodiscard]] const std::vector<GgufTensorInfo>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] bool has_tensor(std::string_view name) const { return tensor_index_.count(std::string(name)) != 0; }
  [[nodiscard]] const GgufTensorInfo& tensor(std::string_view name) const {
    const auto it = tensor_index_.find(std::string(name));
    KVC_CHECK(it != tensor_index_.end(), Errc::kInvalidArgument, "gguf '", name_, "': no tensor '", name, "'");
    return tensors_[it->second];
  }
  /// The tensor's raw bytes (tensor.n_bytes() of them), valid while this GgufFile lives. Only as
  /// aligned as the file's alignment and the allocator's (>= 16) make it: read through memcpy.
  [[nodiscard]] const std::byte* tensor_data(const GgufTensorInfo& t) const {
    check_mine(t);
    return bytes_.data() + data_offset_ + t.offset;
  }

  /// All elements of a tensor as float, dims[0] fastest.
  [[nodiscard]] std::vector<float> dequantize(std::string_view name) const {
    const GgufTensorInfo& t = tensor(name);
    check_dequantizable(t);
    std::vector<float> out(static_cast<std::size_t>(t.n_elements()));
    dequantize_row(t.type, tensor_data(t), out.data(), t.n_elements());
    return out;
  }
  /// Rows [first_row, first_row + n_rows) of a tensor (a row = dims[0] elements) into `dst`, which
  /// must hold n_rows * row_length() floats. E.g. the embedding of token `id`:
  /// `dequantize_rows(f.tensor("token_embd.weight"), id, 1, dst)`.
  void dequantize_rows(const GgufTensorInfo& t, std::int64_t first_row, std::int64_t n_rows, float* dst) const {
    check_mine(t);
    check_dequantizable(t);
    KVC_CHECK(first_row >= 0 && n_rows >= 0 && first_row <= t.rows() && n_rows <= t.rows() - first_row,
              Errc::kInvalidArgument, "gguf '", name_, "': ", n_rows, " rows from row ", first_row,
              " are out of range for tensor '", t.name, "' with ", t.rows(), " rows");
    const std::byte* src = tensor_data(t) + static_cast<std::size_t>(first_row) * t.row_bytes();
    dequantize_row(t.type, src, dst, n_rows * t.row_length());
  }

 private:
  GgufFile() = default;

  static constexpr std::size_t kDefaultAlignment = 32;
  static constexpr int kMaxArrayDepth = 8;
  static constexpr std::uint32_t kMaxDims = 4;

  const gguf_detail::GgufValue* find_key(std::string_view key) const {
    const auto it = kv_.find(std::string(key));
    return it == kv_.end() ? nullptr : &it->second;
  }
  const gguf_detail::GgufValue& value(std::string_view key) const {
    const gguf_detail::GgufValue* v = find_key(key);
    KVC_CHECK(v != nullptr, Errc::kInvalidArgument, "gguf '", name_, "': no metadata key '", key, "'");
    return *v;
  }
  void expect(std::string_view key, const gguf_detail::GgufValue& v, bool ok, const char* wanted) const {
    if (ok) return;
    if (v.type == GgufValueType::kArray) {
      ::kvc::detail::fail(Errc::kInvalidArgument, "gguf '", name_, "': metadata key '", key, "' is an array of ",
                   to_string(v.elem_type), ", not ", wanted);
    }
    ::kvc::detail::fail(Errc::kInvalidArgument, "gguf '", name_, "': metadata key '", key, "' is ", to_string(v.type),
                 ", not ", wanted);
  }
  std::int64_t to_int(std::string_view key, GgufValueType t, std::uint64_t bits) const {
    if (gguf_detail::is_unsigned(t)) {
      KVC_CHECK(bits <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), Errc::kOutOfRange,
                "gguf '", name_, "': metadata key '", key, "' holds ", bits, ", which does not fit int64");
    }
    return static_cast<std::int64_t>(bits);
  }
  void check_mine(const GgufTensorInfo& t) const {
    // Accept only infos that belong to this file (callers could pass a copy of another file's).
    const auto it = tensor_index_.find(t.name);
    KVC_CHECK(it != tensor_index_.end() && tensors_[it->second].offset == t.offset &&
                  tensors_[it->second].type == t.type && tensors_[it->second].dims == t.dims,
              Errc::kInvalidArgument, "gguf '", name_, "': tensor '", t.name, "' is not a tensor of this file");
  }
  void check_dequantizable(const GgufTensorInfo& t) const {
    KVC_CHECK(type_info(t.type).dequantizable, Errc::kInvalidArgument, "gguf '", name_, "': tensor '", t.name,
              "' has unsupported type ", to_string(t.type), " (", static_cast<std::uint32_t>(t.type), ")");
  }

  template <class Signed, class U>
  static std::uint64_t sign_extend(U u) noexcept {
    return static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<Signed>(u)));
  }

  gguf_detail::GgufValue read_value(gguf_detail::GgufCursor& c, GgufValueType type, const std::string& key, int depth) {
    gguf_detail::GgufValue v;
    v.type = type;
    switch (type) {
      case GgufValueType::kUint8: v.bits = c.u8("uint8 value"); break;
      case GgufValueType::kInt8: v.bits = sign_extend<std::int8_t>(c.u8("int8 value")); break;
      case GgufValueType::kUint16: v.bits = c.u16("uint16 value"); break;
      case GgufValueType::kInt16: v.bits = sign_extend<std::int16_t>(c.u16("int16 value")); break;
      case GgufValueType::kUint32: v.bits = c.u32("uint32 value"); break;
      case GgufValueType::kInt32: v.bits = sign_extend<std::int32_t>(c.u32("int32 value")); break;
      case GgufValueType::kUint64: case GgufValueType::kInt64: v.bits = c.u64("int64 value"); break;
      case GgufValueType::kFloat32: v.real = ::kvc::detail::bits_float(c.u32("float32 value")); break;
      case GgufValueType::kFloat64: {
        const std::uint64_t b = c.u64("float64 value");
        std::memcpy(&v.real, &b, sizeof b);
        break;
      }
      case GgufValueType::kBool: {
        const std::size_t at = c.pos();
        v.bits = c.u8("bool value");
        KVC_CHECK(v.bits <= 1, Errc::kCorruptFile, "gguf '", name_, "': key '", key, "' has bool byte ", v.bits,
                  " at offset ", at, " (must be 0 or 1)");
        break;
      }
      case GgufValueType::kString: v.str = c.str("string value"); break;
      case GgufValueType::kArray: {
        KVC_CHECK(depth < kMaxArrayDepth, Errc::kCorruptFile, "gguf '", name_, "': key '", key,
                  "' nests arrays deeper than ", kMaxArrayDepth);
        const std::uint32_t et = c.u32("array element type");
        v.elem_type = static_cast<GgufValueType>(et);
        KVC_CHECK(gguf_detail::is_known(v.elem_type), Errc::kCorruptFile, "gguf '", name_, "': key '", key,
                  "' has unknown array element type ", et);
        v.count = c.u64("array length");
        // Every element needs at least this many bytes: bounds the count (and any allocation).
        std::uint64_t min_elem = gguf_detail::scalar_size(v.elem_type);
        if (v.elem_type == GgufValueType::kString) min_elem = 8;
        if (v.elem_type == GgufValueType::kArray) min_elem = 12;
        KVC_CHECK(v.count <= c.remaining() / min_elem, Errc::kCorruptFile, "gguf '", name_, "': key '", key,
                  "' claims ", v.count, " array elements of type ", to_string(v.elem_type), " but only ",
                  c.remaining(), " bytes follow");
        const auto n = static_cast<std::size_t>(v.count);
        if (v.elem_type == GgufValueType::kString) {
          v.str_elems.reserve(n);
          for (std::size_t i = 0; i < n; ++i) v.str_elems.push_back(c.str("string array element"));
        } else if (v.elem_type == GgufValueType::kArray) {
          // Arrays of arrays are validated and skipped; only their element count is kept.
          for (std::size_t i = 0; i < n; ++i) (void)read_value(c, GgufValueType::kArray, key, depth + 1);
        } else if (v.elem_type == GgufValueType::kFloat32 || v.elem_type == GgufValueType::kFloat64) {
          v.real_elems.reserve(n);
          for (std::size_t i = 0; i < n; ++i) v.real_elems.push_back(read_value(c, v.elem_type, key, depth + 1).real);
        } else {
          v.int_elems.reserve(n);
          for (std::size_t i = 0; i < n; ++i) v.int_elems.push_back(read_value(c, v.elem_type, key, depth + 1).bits);
        }
        break;
      }
    }
    return v;
  }

  void parse() {
    gguf_detail::GgufCursor c(bytes_.data(), bytes_.size(), name_);
    const std::byte* magic = c.take(4, "magic");
    KVC_CHECK(std::memcmp(magic, "GGUF", 4) == 0, Errc::kCorruptFile, "gguf '", name_,
              "': bad magic (not a GGUF file)");
    version_ = c.u32("version");
    KVC_CHECK(version_ == 3, Errc::kCorruptFile, "gguf '", name_, "': unsupported GGUF version ", version_,
              (version_ > 0xFFFFu ? " (a big-endian file?)" : ""), ", only version 3 is supported");
    const std::uint64_t n_tensors = c.u64("tensor count");
    const std::uint64_t n_kv = c.u64("metadata count");
    // Minimal entry sizes: key (8 + 1) + type (4) + 1-byte value; name (8 + 1) + n_dims + 1 dim + type + offset.
    KVC_CHECK(n_kv <= c.remaining() / 14, Errc::kCorruptFile, "gguf '", name_, "': metadata count ", n_kv,
              " is impossible for a file of ", bytes_.size(), " bytes");
    KVC_CHECK(n_tensors <= c.remaining() / 33, Errc::kCorruptFile, "gguf '", name_, "': tensor count ",
              n_tensors, " is impossible for a file of ", bytes_.size(), " bytes");

    for (std::uint64_t i = 0; i < n_kv; ++i) {
      std::string key = c.str("metadata key");
      KVC_CHECK(!key.empty(), Errc::kCorruptFile, "gguf '", name_, "': metadata entry ", i, " has an empty key");
      const std::uint32_t t = c.u32("metadata value type");
      KVC_CHECK(gguf_detail::is_known(static_cast<GgufValueType>(t)), Errc::kCorruptFile, "gguf '", name_, "': key '",
                key, "' has unknown value type ", t);
      gguf_detail::GgufValue v = read_value(c, static_cast<GgufValueType>(t), key, 0);
      KVC_CHECK(kv_.count(key) == 0, Errc::kCorruptFile, "gguf '", name_, "': duplicate metadata key '", key, "'");
      key_order_.push_back(key);
      kv_.emplace(std::move(key), std::move(v));
    }

    alignment_ = kDefaultAlignment;
    if (const gguf_detail::GgufValue* a = find_key("general.alignment")) {
      KVC_CHECK(a->type == GgufValueType::kUint32, Errc::kCorruptFile, "gguf '", name_,
                "': general.alignment is ", to_string(a->type), ", must be uint32");
      KVC_CHECK(a->bits != 0 && (a->bits & (a->bits - 1)) == 0, Errc::kCorruptFile, "gguf '", name_,
                "': general.alignment ", a->bits, " is not a power of two");
      alignment_ = static_cast<std::size_t>(a->bits);
    }

    tensors_.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t i = 0; i < n_tensors; ++i) {
      GgufTensorInfo t;
      t.name = c.str("tensor name");
      KVC_CHECK(!t.name.empty(), Errc::kCorruptFile, "gguf '", name_, "': tensor ", i, " has an empty name");
      const std::uint32_t n_dims = c.u32("tensor n_dims");
      KVC_CHECK(n_dims >= 1 && n_dims <= kMaxDims, Errc::kCorruptFile, "gguf '", name_, "': tensor '", t.name,
                "' has ", n_dims, " dimensions (1..", kMaxDims, " supported)");
      std::uint64_t n_elem = 1;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const std::uint64_t ne = c.u64("tensor dimension");
        // Each dim is positive and the product stays below 2^62: sizes cannot overflow below.
        KVC_CHECK(ne >= 1 && ne <= (std::uint64_t{1} << 62) / n_elem, Errc::kCorruptFile, "gguf '", name_,
                  "': tensor '", t.name, "' has bad dimension ne[", d, "] = ", static_cast<std::int64_t>(ne));
        n_elem *= ne;
        t.dims.push_back(static_cast<std::int64_t>(ne));
      }
      const std::uint32_t type = c.u32("tensor type");
      t.type = static_cast<GgmlType>(type);
      const GgmlTypeInfo ti = type_info(t.type);
      KVC_CHECK(ti.known, Errc::kInvalidArgument, "gguf '", name_, "': tensor '", t.name,
                "' has unsupported type unknown (", type, ")");
      KVC_CHECK(t.dims[0] % ti.block_size == 0, Errc::kCorruptFile, "gguf '", name_, "': tensor '", t.name,
                "' has row length ", t.dims[0], ", not a multiple of the ", ti.name, " block size ", ti.block_size);
      t.offset = c.u64("tensor offset");
      KVC_CHECK(t.offset % alignment_ == 0, Errc::kCorruptFile, "gguf '", name_, "': tensor '", t.name,
                "' offset ", t.offset, " is not a multiple of the alignment ", alignment_);
      KVC_CHECK(tensor_index_.count(t.name) == 0, Errc::kCorruptFile, "gguf '", name_, "': duplicate tensor '",
                t.name, "'");
      tensor_index_.emplace(t.name, tensors_.size());
      tensors_.push_back(std::move(t));
    }

    // The data section starts at the next multiple of the alignment.
    const std::size_t header_end = c.pos();
    data_offset_ = header_end + (alignment_ - header_end % alignment_) % alignment_;
    if (tensors_.empty()) return;
    KVC_CHECK(data_offset_ <= bytes_.size(), Errc::kCorruptFile, "gguf '", name_, "': truncated: the data section",
              " starts at offset ", data_offset_, " but the file has ", bytes_.size(), " bytes");
    const std::uint64_t data_size = bytes_.size() - data_offset_;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> extents;  // [offset, end) per tensor
    extents.reserve(tensors_.size());
    for (const GgufTensorInfo& t : tensors_) {
      const GgmlTypeInfo ti = type_info(t.type);
      const std::uint64_t blocks = static_cast<std::uint64_t>(t.n_elements() / ti.block_size);
      // Compare by division first: blocks * block_bytes could overflow for a hostile file.
      const bool fits = blocks <= data_size / ti.block_bytes && t.offset <= data_size &&
                        blocks * ti.block_bytes <= data_size - t.offset;
      KVC_CHECK(fits, Errc::kCorruptFile, "gguf '", name_, "': tensor '", t.name, "' (", to_string(t.type), ", ",
                t.n_elements(), " elements) at data offset ", t.offset, " extends past the end of the file (",
                data_size, " data bytes)");
      extents.emplace_back(t.offset, t.offset + blocks * ti.block_bytes);
    }
    std::vector<std::size_t> order(tensors_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return extents[a] < extents[b]; });
    for (std::size_t k = 1; k < order.size(); ++k) {
      const auto& prev = extents[order[k - 1]];
      const auto& cur = extents[order[k]];
      KVC_CHECK(cur.first >= prev.second, Errc::kCorruptFile, "gguf '", name_, "': tensors '",
                tensors_[order[k - 1]].name, "' and '", tensors_[order[k]].name, "' overlap");
    }
  }

  std::vector<std::byte> bytes_;
  std::string name_;
  std::uint32_t version_ = 0;
  std::size_t alignment_ = kDefaultAlignment;
  std::size_t data_offset_ = 0;
  std::unordered_map<std::string, gguf_detail::GgufValue> kv_;
  std::vector<std::string> key_order_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, std::size_t> tensor_index_;
};

/// The model the engine, kvc-eval and the tests use by default: $KVC_MODEL if set and non-empty,
/// else kvc::io::cache_dir()/SmolLM2-135M-Instruct.Q4_1.gguf (where fetch_model.sh puts it).
inline std::string default_model_path() {
  if (const char* m = std::getenv("KVC_MODEL"); m != nullptr && *m != '\0') return m;
  return io::cache_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace kvc::llama
