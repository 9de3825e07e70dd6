// GGUF reader: synthetic files built in memory (every metadata type, every dequantisable tensor
// type against hand-computed values, every way a file can be malformed), and the real SmolLM2
// model checked against values from the gguf Python package (gguf_fixture.hpp).
#include "gguf_fixture.hpp"
#include "llama_test_util.hpp"

#include <llama/gguf.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using kvc::Errc;
using kvc::llama::dequantize_row;
using kvc::llama::GgmlType;
using kvc::llama::GgufFile;
using kvc::llama::GgufTensorInfo;
using kvc_test::Bytes;
using kvc_test::expect_error;
using kvc_test::GgufWriter;
using VT = kvc::llama::GgufValueType;

// ---- hand-made quantisation blocks ------------------------------------------------------------

// Two Q4_0 blocks. Block 0: d = 0.5, byte j = j | (15 - j) << 4  ->  x[j] = 0.5 (j - 8), x[16 + j] = 0.5 (7 - j).
// Block 1: d = -0.25, every byte 0x8F  ->  x[j] = -0.25 * 7, x[16 + j] = -0.25 * 0.
std::vector<std::byte> q4_0_blocks(std::vector<float>& expect) {
  Bytes b;
  b.u16(0x3800);
  for (int j = 0; j < 16; ++j) b.u8(static_cast<std::uint8_t>(j | (15 - j) << 4));
  b.u16(0xB400);
  for (int j = 0; j < 16; ++j) b.u8(0x8F);
  expect.assign(64, 0.0f);
  for (int j = 0; j < 16; ++j) {
    expect[j] = 0.5f * static_cast<float>(j - 8);
    expect[16 + j] = 0.5f * static_cast<float>(7 - j);
    expect[32 + j] = -1.75f;
    expect[48 + j] = -0.0f;
  }
  return b.b;
}

// Two Q4_1 blocks. Block 0: d = 0.25, m = -1, byte j = j | (j ^ 5) << 4  ->  x[j] = 0.25 j - 1,
// x[16 + j] = 0.25 (j ^ 5) - 1. Block 1: d = 2, m = 0.5, every byte 0xF0  ->  x[j] = 0.5, x[16 + j] = 30.5.
std::vector<std::byte> q4_1_blocks(std::vector<float>& expect) {
  Bytes b;
  b.u16(0x3400).u16(0xBC00);
  for (int j = 0; j < 16; ++j) b.u8(static_cast<std::uint8_t>(j | (j ^ 5) << 4));
  b.u16(0x4000).u16(0x3800);
  for (int j = 0; j < 16; ++j) b.u8(0xF0);
  expect.assign(64, 0.0f);
  for (int j = 0; j < 16; ++j) {
    expect[j] = 0.25f * static_cast<float>(j) - 1.0f;
    expect[16 + j] = 0.25f * static_cast<float>(j ^ 5) - 1.0f;
    expect[32 + j] = 0.5f;
    expect[48 + j] = 30.5f;
  }
  return b.b;
}

// Two Q8_0 blocks. Block 0: d = 0.125, q[j] = -128 + 8 j (j < 31), q[31] = 127.
// Block 1: d = -1.5, q[j] = j - 16.
std::vector<std::byte> q8_0_blocks(std::vector<float>& expect) {
  Bytes b;
  expect.assign(64, 0.0f);
  b.u16(0x3000);
  for (int j = 0; j < 32; ++j) {
    const int q = j < 31 ? -128 + 8 * j : 127;
    b.u8(static_cast<std::uint8_t>(static_cast<std::int8_t>(q)));
    expect[j] = 0.125f * static_cast<float>(q);
  }
  b.u16(0xBE00);
  for (int j = 0; j < 32; ++j) {
    b.u8(static_cast<std::uint8_t>(static_cast<std::int8_t>(j - 16)));
    expect[32 + j] = -1.5f * static_cast<float>(j - 16);
  }
  return b.b;
}

void expect_floats_eq(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "element " << i;
    } else {
      EXPECT_EQ(got[i], want[i]) << "element " << i;
      EXPECT_EQ(std::signbit(got[i]), std::signbit(want[i])) << "element " << i;
    }
  }
}

// A small valid file with a little of everything; the last tensor ends the file.
std::vector<std::byte> small_file() {
  std::vector<float> unused;
  Bytes f32;
  for (float v : {1.0f, -2.0f, 0.5f, 3.25f}) f32.f32(v);
  GgufWriter w;
  w.kv_str("general.architecture", "llama")
      .kv_u32("general.alignment", 32)
      .kv_str_array("tokens", {"a", "bc", ""})
      .kv_f32("eps", 1e-5f)
      .kv_bool("flag", true)
      .tensor("norm", {4}, GgmlType::F32, f32.b)
      .tensor("w", {32, 2}, GgmlType::Q4_1, q4_1_blocks(unused));
  return w.build();
}

// ---- metadata ------------------------------------------------------------------------------------

TEST(GgufMetadata, EveryScalarType) {
  GgufWriter w;
  w.kv("u8", VT::kUint8, Bytes{}.u8(200))
      .kv("i8", VT::kInt8, Bytes{}.u8(0xFB))
      .kv("u16", VT::kUint16, Bytes{}.u16(60000))
      .kv("i16", VT::kInt16, Bytes{}.u16(static_cast<std::uint16_t>(-30000)))
      .kv("u32", VT::kUint32, Bytes{}.u32(4000000000u))
      .kv("i32", VT::kInt32, Bytes{}.u32(static_cast<std::uint32_t>(-2000000000)))
      .kv("u64", VT::kUint64, Bytes{}.u64(std::uint64_t{1} << 40))
      .kv("u64big", VT::kUint64, Bytes{}.u64((std::uint64_t{1} << 63) + 5))
      .kv("i64", VT::kInt64, Bytes{}.u64(static_cast<std::uint64_t>(-(std::int64_t{1} << 40))))
      .kv("f32", VT::kFloat32, Bytes{}.f32(1.5f))
      .kv("f64", VT::kFloat64, Bytes{}.f64(-2.25e300))
      .kv("yes", VT::kBool, Bytes{}.u8(1))
      .kv("no", VT::kBool, Bytes{}.u8(0))
      .kv("s", VT::kString, Bytes{}.str("h\xC3\xA9llo"))
      .kv("empty", VT::kString, Bytes{}.str(""));
  const GgufFile f = GgufFile::from_bytes(w.build(), "scalars.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.get_int("u8"), 200);
  EXPECT_EQ(f.get_int("i8"), -5);
  EXPECT_EQ(f.get_int("u16"), 60000);
  EXPECT_EQ(f.get_int("i16"), -30000);
  EXPECT_EQ(f.get_int("u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("i32"), -2000000000LL);
  EXPECT_EQ(f.get_int("u64"), std::int64_t{1} << 40);
  EXPECT_EQ(f.get_int("i64"), -(std::int64_t{1} << 40));
  expect_error([&] { (void)f.get_int("u64big"); }, Errc::kOutOfRange, "u64big");
  EXPECT_DOUBLE_EQ(f.get_float("u64big"), 9223372036854775813.0);
  EXPECT_EQ(f.get_float("f32"), 1.5);
  EXPECT_EQ(f.get_float("f64"), -2.25e300);
  EXPECT_EQ(f.get_float("i16"), -30000.0);  // integers convert
  EXPECT_TRUE(f.get_bool("yes"));
  EXPECT_FALSE(f.get_bool("no"));
  EXPECT_EQ(f.get_string("s"), "h\xC3\xA9llo");
  EXPECT_EQ(f.get_string("empty"), "");
  EXPECT_TRUE(f.has_key("f64"));
  EXPECT_FALSE(f.has_key("f6"));
  EXPECT_EQ(f.key_type("i16"), VT::kInt16);
  EXPECT_EQ(f.key_type("s"), VT::kString);
  const std::vector<std::string> order = {"u8", "i8", "u16", "i16", "u32", "i32", "u64", "u64big",
                                          "i64", "f32", "f64", "yes", "no", "s", "empty"};
  EXPECT_EQ(f.keys(), order);
}

TEST(GgufMetadata, EveryArrayType) {
  const auto arr = [](VT elem, std::uint64_t n, const Bytes& body) {
    Bytes p;
    p.u32(static_cast<std::uint32_t>(elem)).u64(n).raw(body.b);
    return p;
  };
  GgufWriter w;
  w.kv("a_u8", VT::kArray, arr(VT::kUint8, 3, Bytes{}.u8(0).u8(7).u8(255)))
      .kv("a_i8", VT::kArray, arr(VT::kInt8, 2, Bytes{}.u8(0x80).u8(0x7F)))
      .kv("a_u16", VT::kArray, arr(VT::kUint16, 2, Bytes{}.u16(1).u16(65535)))
      .kv("a_i16", VT::kArray, arr(VT::kInt16, 1, Bytes{}.u16(0x8000)))
      .kv("a_u32", VT::kArray, arr(VT::kUint32, 2, Bytes{}.u32(0xFFFFFFFFu).u32(3)))
      .kv("a_i32", VT::kArray, arr(VT::kInt32, 2, Bytes{}.u32(static_cast<std::uint32_t>(-7)).u32(8)))
      .kv("a_u64", VT::kArray, arr(VT::kUint64, 1, Bytes{}.u64(~std::uint64_t{0})))
      .kv("a_i64", VT::kArray, arr(VT::kInt64, 2, Bytes{}.u64(static_cast<std::uint64_t>(-1)).u64(1)))
      .kv("a_f32", VT::kArray, arr(VT::kFloat32, 2, Bytes{}.f32(0.25f).f32(-8.0f)))
      .kv("a_f64", VT::kArray, arr(VT::kFloat64, 1, Bytes{}.f64(1e-300)))
      .kv("a_bool", VT::kArray, arr(VT::kBool, 2, Bytes{}.u8(1).u8(0)))
      .kv("a_str", VT::kArray, arr(VT::kString, 3, Bytes{}.str("x").str("").str("Ġworld")))
      .kv("a_empty", VT::kArray, arr(VT::kInt32, 0, Bytes{}))
      .kv("a_nested", VT::kArray,
          arr(VT::kArray, 2, Bytes{}.u32(static_cast<std::uint32_t>(VT::kUint8)).u64(2).u8(1).u8(2)
                                  .u32(static_cast<std::uint32_t>(VT::kString)).u64(1).str("in")))
      .kv_u32("after", 42);  // parsing resumed at the right place after the nested array
  const GgufFile f = GgufFile::from_bytes(w.build());
  using I = std::vector<std::int64_t>;
  EXPECT_EQ(f.get_int_array("a_u8"), (I{0, 7, 255}));
  EXPECT_EQ(f.get_int_array("a_i8"), (I{-128, 127}));
  EXPECT_EQ(f.get_int_array("a_u16"), (I{1, 65535}));
  EXPECT_EQ(f.get_int_array("a_i16"), (I{-32768}));
  EXPECT_EQ(f.get_int_array("a_u32"), (I{4294967295LL, 3}));
  EXPECT_EQ(f.get_int_array("a_i32"), (I{-7, 8}));
  expect_error([&] { (void)f.get_int_array("a_u64"); }, Errc::kOutOfRange, "a_u64");
  EXPECT_EQ(f.get_int_array("a_i64"), (I{-1, 1}));
  EXPECT_EQ(f.get_float_array("a_f32"), (std::vector<double>{0.25, -8.0}));
  EXPECT_EQ(f.get_float_array("a_f64"), (std::vector<double>{1e-300}));
  EXPECT_EQ(f.get_string_array("a_str"), (std::vector<std::string>{"x", "", "Ġworld"}));
  EXPECT_TRUE(f.get_int_array("a_empty").empty());
  EXPECT_EQ(f.array_size("a_bool"), 2u);
  EXPECT_EQ(f.array_size("a_nested"), 2u);
  EXPECT_EQ(f.key_type("a_nested"), VT::kArray);
  EXPECT_EQ(f.get_int("after"), 42);
  // bool arrays are not integer arrays; arrays of arrays have no element accessor
  expect_error([&] { (void)f.get_int_array("a_bool"); }, Errc::kInvalidArgument, "'a_bool' is an array of bool");
  expect_error([&] { (void)f.get_string_array("a_nested"); }, Errc::kInvalidArgument, "array of array");
  expect_error([&] { (void)f.get_string_array("a_i32"); }, Errc::kInvalidArgument, "array of int32");
  expect_error([&] { (void)f.get_float_array("a_str"); }, Errc::kInvalidArgument, "a_str");
}

TEST(GgufMetadata, WrongTypeAndMissingKey) {
  GgufWriter w;
  w.kv_u32("n", 5).kv_str("s", "x").kv_bool("b", true).kv_f32("f", 2.0f).kv_str_array("arr", {"a"});
  const GgufFile f = GgufFile::from_bytes(w.build(), "types.gguf");
  expect_error([&] { (void)f.get_string("n"); }, Errc::kInvalidArgument, "'n' is uint32, not string");
  expect_error([&] { (void)f.get_int("s"); }, Errc::kInvalidArgument, "'s' is string, not integer");
  expect_error([&] { (void)f.get_int("b"); }, Errc::kInvalidArgument, "'b' is bool");
  expect_error([&] { (void)f.get_int("f"); }, Errc::kInvalidArgument, "'f' is float32");
  expect_error([&] { (void)f.get_bool("n"); }, Errc::kInvalidArgument, "not bool");
  expect_error([&] { (void)f.get_float("s"); }, Errc::kInvalidArgument, "not number");
  expect_error([&] { (void)f.get_string("arr"); }, Errc::kInvalidArgument, "'arr' is an array of string");
  expect_error([&] { (void)f.get_int_array("n"); }, Errc::kInvalidArgument, "'n' is uint32");
  expect_error([&] { (void)f.get_int("nope"); }, Errc::kInvalidArgument, "types.gguf");
  expect_error([&] { (void)f.get_string_array("nope"); }, Errc::kInvalidArgument, "no metadata key 'nope'");
}

// ---- dequantisation ------------------------------------------------------------------------------

TEST(GgufDequant, FloatTypesHandComputed) {
  Bytes f32;
  for (float v : {1.5f, -2.0f, 0.0f, 1e-3f, 1e-40f, -std::numeric_limits<float>::infinity()}) f32.f32(v);
  std::vector<float> out(6);
  dequantize_row(GgmlType::F32, f32.b.data(), out.data(), 6);
  expect_floats_eq(out, {1.5f, -2.0f, 0.0f, 1e-3f, 1e-40f, -std::numeric_limits<float>::infinity()});

  Bytes f16;
  for (std::uint16_t h : {0x3C00, 0xC000, 0x3555, 0x7BFF, 0x0001, 0x8000, 0x7C00}) f16.u16(h);
  out.resize(7);
  dequantize_row(GgmlType::F16, f16.b.data(), out.data(), 7);
  expect_floats_eq(out, {1.0f, -2.0f, 0.333251953125f, 65504.0f, 5.9604644775390625e-8f, -0.0f,
                         std::numeric_limits<float>::infinity()});

  Bytes bf16;
  for (std::uint16_t h : {0x3F80, 0xC040, 0x3E80, 0x0001, 0xFF80}) bf16.u16(h);
  out.resize(5);
  dequantize_row(GgmlType::BF16, bf16.b.data(), out.data(), 5);
  expect_floats_eq(out, {1.0f, -3.0f, 0.25f, std::ldexp(1.0f, -133), -std::numeric_limits<float>::infinity()});
}

TEST(GgufDequant, QuantTypesHandComputed) {
  std::vector<float> want;
  std::vector<float> out(64);
  std::vector<std::byte> q = q4_0_blocks(want);
  ASSERT_EQ(q.size(), 2u * 18u);
  dequantize_row(GgmlType::Q4_0, q.data(), out.data(), 64);
  expect_floats_eq(out, want);

  q = q4_1_blocks(want);
  ASSERT_EQ(q.size(), 2u * 20u);
  dequantize_row(GgmlType::Q4_1, q.data(), out.data(), 64);
  expect_floats_eq(out, want);

  q = q8_0_blocks(want);
  ASSERT_EQ(q.size(), 2u * 34u);
  dequantize_row(GgmlType::Q8_0, q.data(), out.data(), 64);
  expect_floats_eq(out, want);
  EXPECT_EQ(out[0], -16.0f);   // q = -128
  EXPECT_EQ(out[31], 15.875f);  // q = 127

  // Whole blocks only; unsupported types are named
  expect_error([&] { dequantize_row(GgmlType::Q8_0, q.data(), out.data(), 48); }, Errc::kInvalidArgument,
               "not a multiple of the Q8_0 block size 32");
  expect_error([&] { dequantize_row(GgmlType::Q4_K, q.data(), out.data(), 256); }, Errc::kInvalidArgument,
               "unsupported type Q4_K (12)");
}

TEST(GgufDequant, ThroughTheFileRowsAndShapes) {
  std::vector<float> w40, w41, w80;
  Bytes f16;
  for (std::uint16_t h : {0x3C00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600}) f16.u16(h);  // 1..6
  Bytes bf16;
  for (std::uint16_t h : {0x3F80, 0x4000}) bf16.u16(h);
  GgufWriter w;
  w.tensor("q40", {32, 2}, GgmlType::Q4_0, q4_0_blocks(w40))
      .tensor("q41", {64}, GgmlType::Q4_1, q4_1_blocks(w41))
      .tensor("q80", {32, 1, 2}, GgmlType::Q8_0, q8_0_blocks(w80))
      .tensor("h", {3, 2}, GgmlType::F16, f16.b)
      .tensor("bf", {2}, GgmlType::BF16, bf16.b);
  const GgufFile f = GgufFile::from_bytes(w.build());
  ASSERT_EQ(f.tensors().size(), 5u);
  expect_floats_eq(f.dequantize("q40"), w40);
  expect_floats_eq(f.dequantize("q41"), w41);
  expect_floats_eq(f.dequantize("q80"), w80);
  expect_floats_eq(f.dequantize("h"), {1, 2, 3, 4, 5, 6});
  expect_floats_eq(f.dequantize("bf"), {1, 2});

  const GgufTensorInfo& q80 = f.tensor("q80");
  EXPECT_EQ(q80.type, GgmlType::Q8_0);
  EXPECT_EQ(q80.dims, (std::vector<std::int64_t>{32, 1, 2}));
  EXPECT_EQ(q80.n_elements(), 64);
  EXPECT_EQ(q80.n_bytes(), 68u);
  EXPECT_EQ(q80.rows(), 2);
  EXPECT_EQ(q80.row_length(), 32);
  EXPECT_EQ(q80.row_bytes(), 34u);
  const GgufTensorInfo& h = f.tensor("h");
  EXPECT_EQ(h.rows(), 2);
  EXPECT_EQ(h.row_length(), 3);
  EXPECT_EQ(h.n_bytes(), 12u);
  EXPECT_EQ(f.tensor("q41").rows(), 1);
  EXPECT_EQ(f.tensor("q41").n_bytes(), 40u);
  for (const GgufTensorInfo& t : f.tensors()) EXPECT_EQ(t.offset % 32, 0u) << t.name;

  // Row 1 alone, then both rows
  std::vector<float> row(32);
  f.dequantize_rows(q80, 1, 1, row.data());
  expect_floats_eq(row, std::vector<float>(w80.begin() + 32, w80.end()));
  std::vector<float> rows(6);
  f.dequantize_rows(h, 0, 2, rows.data());
  expect_floats_eq(rows, {1, 2, 3, 4, 5, 6});
  f.dequantize_rows(h, 1, 1, rows.data());
  EXPECT_EQ(rows[0], 4.0f);
  EXPECT_EQ(rows[2], 6.0f);
  f.dequantize_rows(h, 2, 0, rows.data());  // empty range at the end is fine

  // The raw bytes are where the infos say
  EXPECT_EQ(std::memcmp(f.tensor_data(h), f16.b.data(), 12), 0);

  expect_error([&] { f.dequantize_rows(q80, 2, 1, row.data()); }, Errc::kInvalidArgument, "'q80' with 2 rows");
  expect_error([&] { f.dequantize_rows(q80, -1, 1, row.data()); }, Errc::kInvalidArgument, "out of range");
  expect_error([&] { f.dequantize_rows(q80, 1, std::numeric_limits<std::int64_t>::max(), row.data()); },
               Errc::kInvalidArgument, "out of range");
  expect_error([&] { (void)f.tensor("nope"); }, Errc::kInvalidArgument, "no tensor 'nope'");
  expect_error([&] { (void)f.dequantize("nope"); }, Errc::kInvalidArgument, "'nope'");
  EXPECT_TRUE(f.has_tensor("bf"));
  EXPECT_FALSE(f.has_tensor("b"));
  GgufTensorInfo forged = q80;
  forged.offset += 32;
  expect_error([&] { (void)f.tensor_data(forged); }, Errc::kInvalidArgument, "not a tensor of this file");
}

TEST(GgufDequant, UnsupportedTensorTypeIsNamed) {
  GgufWriter w;
  w.tensor("x", {256, 2}, GgmlType::Q5_K, std::vector<std::byte>(2 * 176)).tensor("ok", {1}, GgmlType::F32,
                                                                                   Bytes{}.f32(7).b);
  const GgufFile f = GgufFile::from_bytes(w.build(), "k.gguf");  // listing a Q5_K tensor is fine
  EXPECT_EQ(f.tensor("x").type, GgmlType::Q5_K);
  EXPECT_EQ(f.tensor("x").n_bytes(), 352u);
  EXPECT_NE(f.tensor_data(f.tensor("x")), nullptr);
  expect_error([&] { (void)f.dequantize("x"); }, Errc::kInvalidArgument, "tensor 'x' has unsupported type Q5_K (13)");
  std::vector<float> dst(256);
  expect_error([&] { f.dequantize_rows(f.tensor("x"), 0, 1, dst.data()); }, Errc::kInvalidArgument,
               "unsupported type Q5_K (13)");
  EXPECT_EQ(f.dequantize("ok"), std::vector<float>{7.0f});

  // An id ggml never had (or dropped) cannot even be sized: the file is refused
  GgufWriter u;
  u.tensor("y", {32}, 99u, std::vector<std::byte>(32));
  expect_error([&] { (void)GgufFile::from_bytes(u.build()); }, Errc::kInvalidArgument,
               "tensor 'y' has unsupported type unknown (99)");
  EXPECT_STREQ(kvc::llama::to_string(GgmlType::Q4_K), "Q4_K");
  EXPECT_STREQ(kvc::llama::to_string(GgmlType::BF16), "BF16");
  EXPECT_STREQ(kvc::llama::to_string(static_cast<GgmlType>(4)), "unknown");
}

// ---- malformed files ------------------------------------------------------------------------------

TEST(GgufCorrupt, EveryTruncationIsCorruptFile) {
  const std::vector<std::byte> full = small_file();
  const GgufFile ok = GgufFile::from_bytes(full);  // the whole file is valid
  EXPECT_EQ(ok.tensors().size(), 2u);
  EXPECT_EQ(ok.get_string_array("tokens"), (std::vector<std::string>{"a", "bc", ""}));
  EXPECT_EQ(ok.dequantize("norm"), (std::vector<float>{1.0f, -2.0f, 0.5f, 3.25f}));
  for (std::size_t n = 0; n < full.size(); ++n) {
    SCOPED_TRACE("prefix of " + std::to_string(n) + " bytes");
    std::vector<std::byte> prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    expect_error([&] { (void)GgufFile::from_bytes(std::move(prefix), "cut.gguf"); }, Errc::kCorruptFile, "cut.gguf");
  }
}

TEST(GgufCorrupt, BadMagicAndVersions) {
  std::vector<std::byte> f = small_file();
  f[3] = std::byte{'G'};
  expect_error([&] { (void)GgufFile::from_bytes(f, "m.gguf"); }, Errc::kCorruptFile, "'m.gguf': bad magic");
  for (std::uint32_t v : {1u, 2u, 4u}) {
    GgufWriter w;
    w.version = v;
    w.kv_u32("x", 1);
    expect_error([&] { (void)GgufFile::from_bytes(w.build()); }, Errc::kCorruptFile,
                 "unsupported GGUF version " + std::to_string(v));
  }
  GgufWriter be;
  be.version = 0x03000000u;  // version 3 written big-endian
  expect_error([&] { (void)GgufFile::from_bytes(be.build()); }, Errc::kCorruptFile, "big-endian");
}

TEST(GgufCorrupt, AbsurdCountsAndLengthsAllocateNothing) {
  GgufWriter w;
  w.kv_u32("x", 1);
  w.tensor_count_override = std::uint64_t{1} << 60;
  expect_error([&] { (void)GgufFile::from_bytes(w.build()); }, Errc::kCorruptFile, "tensor count");
  w.tensor_count_override.reset();
  w.kv_count_override = ~std::uint64_t{0};
  expect_error([&] { (void)GgufFile::from_bytes(w.build()); }, Errc::kCorruptFile, "metadata count");

  const auto one = [](const std::string& key, VT t, const Bytes& payload) {
    GgufWriter g;
    g.kv(key, t, payload);
    return g.build();
  };
  const auto arr_hdr = [](VT elem, std::uint64_t n) {
    Bytes p;
    p.u32(static_cast<std::uint32_t>(elem)).u64(n);
    return p;
  };
  expect_error([&] { (void)GgufFile::from_bytes(one("a", VT::kArray, arr_hdr(VT::kUint32, std::uint64_t{1} << 60))); },
               Errc::kCorruptFile, "'a' claims 1152921504606846976 array elements");
  expect_error([&] { (void)GgufFile::from_bytes(one("a", VT::kArray, arr_hdr(VT::kString, 1000).u64(1))); },
               Errc::kCorruptFile, "array elements");
  expect_error([&] { (void)GgufFile::from_bytes(one("s", VT::kString, Bytes{}.u64(std::uint64_t{1} << 63))); },
               Errc::kCorruptFile, "has length 9223372036854775808");
  expect_error([&] { (void)GgufFile::from_bytes(one("t", static_cast<VT>(13), Bytes{}.u32(0))); }, Errc::kCorruptFile,
               "'t' has unknown value type 13");
  expect_error([&] { (void)GgufFile::from_bytes(one("a", VT::kArray, arr_hdr(static_cast<VT>(99), 0))); },
               Errc::kCorruptFile, "unknown array element type 99");
  expect_error([&] { (void)GgufFile::from_bytes(one("b", VT::kBool, Bytes{}.u8(2))); }, Errc::kCorruptFile,
               "'b' has bool byte 2");
  Bytes deep;  // arrays of arrays of ... 40 deep
  for (int i = 0; i < 40; ++i) deep.u32(static_cast<std::uint32_t>(VT::kArray)).u64(1);
  deep.u32(static_cast<std::uint32_t>(VT::kUint8)).u64(0);
  expect_error([&] { (void)GgufFile::from_bytes(one("d", VT::kArray, deep)); }, Errc::kCorruptFile,
               "nests arrays deeper");
  GgufWriter empty_key;
  empty_key.kv_u32("", 1);
  expect_error([&] { (void)GgufFile::from_bytes(empty_key.build()); }, Errc::kCorruptFile, "empty key");
}

TEST(GgufCorrupt, BadTensorShapes) {
  const auto build = [](std::vector<std::uint64_t> dims, GgmlType t, std::size_t bytes) {
    GgufWriter w;
    w.tensor("t", std::move(dims), t, std::vector<std::byte>(bytes));
    return w.build();
  };
  expect_error([&] { (void)GgufFile::from_bytes(build({}, GgmlType::F32, 4)); }, Errc::kCorruptFile,
               "'t' has 0 dimensions");
  expect_error([&] { (void)GgufFile::from_bytes(build({1, 1, 1, 1, 1}, GgmlType::F32, 4)); }, Errc::kCorruptFile,
               "'t' has 5 dimensions");
  expect_error([&] { (void)GgufFile::from_bytes(build({4, 0}, GgmlType::F32, 16)); }, Errc::kCorruptFile,
               "bad dimension ne[1] = 0");
  expect_error([&] { (void)GgufFile::from_bytes(build({~std::uint64_t{0}}, GgmlType::F32, 4)); }, Errc::kCorruptFile,
               "bad dimension ne[0]");
  constexpr std::uint64_t k31 = std::uint64_t{1} << 31, k32 = std::uint64_t{1} << 32;
  expect_error([&] { (void)GgufFile::from_bytes(build({k32, k32}, GgmlType::F32, 4)); }, Errc::kCorruptFile,
               "bad dimension ne[1]");
  expect_error([&] { (void)GgufFile::from_bytes(build({k31, k31}, GgmlType::F32, 4)); },
               Errc::kCorruptFile, "extends past the end");
  expect_error([&] { (void)GgufFile::from_bytes(build({16, 2}, GgmlType::Q8_0, 68)); }, Errc::kCorruptFile,
               "row length 16, not a multiple of the Q8_0 block size 32");
}

TEST(GgufCorrupt, TensorPastTheEnd) {
  GgufWriter w;  // declares 8 floats, stores 4
  w.tensor("short", {8}, GgmlType::F32, std::vector<std::byte>(16));
  expect_error([&] { (void)GgufFile::from_bytes(w.build(), "e.gguf"); }, Errc::kCorruptFile,
               "tensor 'short' (F32, 8 elements) at data offset 0 extends past the end");
  GgufWriter far;
  far.tensor("a", {4}, GgmlType::F32, std::vector<std::byte>(16))
      .tensor("far", {4}, GgmlType::F32, {}, std::uint64_t{1} << 40);
  expect_error([&] { (void)GgufFile::from_bytes(far.build()); }, Errc::kCorruptFile, "'far'");
  GgufWriter wrap;  // offset + size wraps around 2^64
  wrap.tensor("a", {4}, GgmlType::F32, std::vector<std::byte>(16))
      .tensor("wrap", {8}, GgmlType::F32, {}, ~std::uint64_t{0} - 31);
  expect_error([&] { (void)GgufFile::from_bytes(wrap.build()); }, Errc::kCorruptFile, "'wrap'");
}

TEST(GgufCorrupt, Alignment) {
  {  // a custom power-of-two alignment is honoured
    GgufWriter w;
    w.alignment = 64;
    w.kv_u32("general.alignment", 64)
        .tensor("a", {4}, GgmlType::F32, Bytes{}.f32(1).f32(2).f32(3).f32(4).b)
        .tensor("b", {2}, GgmlType::F32, Bytes{}.f32(5).f32(6).b);
    const GgufFile f = GgufFile::from_bytes(w.build());
    EXPECT_EQ(f.alignment(), 64u);
    EXPECT_EQ(f.data_offset() % 64, 0u);
    EXPECT_EQ(f.tensor("b").offset, 64u);
    EXPECT_EQ(f.dequantize("b"), (std::vector<float>{5, 6}));
  }
  for (std::uint32_t a : {0u, 48u}) {
    GgufWriter w;
    w.kv_u32("general.alignment", a);
    expect_error([&] { (void)GgufFile::from_bytes(w.build()); }, Errc::kCorruptFile,
                 "general.alignment " + std::to_string(a) + " is not a power of two");
  }
  GgufWriter wrong_type;
  wrong_type.kv("general.alignment", VT::kUint64, Bytes{}.u64(32));
  expect_error([&] { (void)GgufFile::from_bytes(wrong_type.build()); }, Errc::kCorruptFile,
               "general.alignment is uint64, must be uint32");
  GgufWriter misaligned;
  misaligned.tensor("a", {8}, GgmlType::F32, std::vector<std::byte>(32))
      .tensor("odd", {2}, GgmlType::F32, {}, 16);
  expect_error([&] { (void)GgufFile::from_bytes(misaligned.build()); }, Errc::kCorruptFile,
               "tensor 'odd' offset 16 is not a multiple of the alignment 32");
}

TEST(GgufCorrupt, DuplicatesAndOverlaps) {
  GgufWriter dup_t;
  dup_t.tensor("w", {4}, GgmlType::F32, std::vector<std::byte>(16)).tensor("w", {4}, GgmlType::F32,
                                                                           std::vector<std::byte>(16));
  expect_error([&] { (void)GgufFile::from_bytes(dup_t.build()); }, Errc::kCorruptFile, "duplicate tensor 'w'");
  GgufWriter dup_k;
  dup_k.kv_u32("k", 1).kv_str("k", "again");
  expect_error([&] { (void)GgufFile::from_bytes(dup_k.build()); }, Errc::kCorruptFile, "duplicate metadata key 'k'");
  GgufWriter overlap;
  overlap.tensor("big", {16}, GgmlType::F32, std::vector<std::byte>(64)).tensor("inside", {4}, GgmlType::F32, {}, 32);
  expect_error([&] { (void)GgufFile::from_bytes(overlap.build()); }, Errc::kCorruptFile,
               "tensors 'big' and 'inside' overlap");
}

TEST(GgufCorrupt, RandomByteFlipsNeverCrash) {
  const std::vector<std::byte> full = small_file();
  std::mt19937 rng(12345);
  int opened = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    std::vector<std::byte> f = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) f[rng() % f.size()] = static_cast<std::byte>(rng());
    try {
      const GgufFile g = GgufFile::from_bytes(std::move(f));
      ++opened;
      for (const GgufTensorInfo& t : g.tensors()) {
        if (kvc::llama::type_info(t.type).dequantizable) (void)g.dequantize(t.name);
      }
      for (const std::string& k : g.keys()) (void)g.key_type(k);
    } catch (const kvc::Error&) {
      // refusing is fine; anything else (std::bad_alloc, std::length_error, a crash) is not
    }
  }
  EXPECT_GT(opened, 0);  // some flips only touch tensor data or string contents
}

TEST(GgufFileIo, OpenFromDiskAndIoErrors) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("kvc_gguf_test_" + std::to_string(std::random_device{}()) + ".gguf");
  const std::vector<std::byte> bytes = small_file();
  {
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  {
    const GgufFile f = GgufFile::open(p.string());
    EXPECT_EQ(f.name(), p.string());
    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_float("eps")), 1e-5f);
    EXPECT_EQ(f.dequantize("norm"), (std::vector<float>{1.0f, -2.0f, 0.5f, 3.25f}));
    GgufFile moved = GgufFile::open(p.string());
    const std::byte* data = moved.tensor_data(moved.tensor("w"));
    const GgufFile target = std::move(moved);  // tensor pointers survive a move
    EXPECT_EQ(target.tensor_data(target.tensor("w")), data);
  }
  std::filesystem::remove(p);
  expect_error([&] { (void)GgufFile::open(p.string()); }, Errc::kIo, p.string());
  expect_error([&] { (void)GgufFile::open(std::filesystem::temp_directory_path().string()); }, Errc::kIo,
               "cannot open gguf file");
}

// ---- the real model ---------------------------------------------------------------------------------

class RealModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = kvc_test::model_path();
    if (!path.empty()) file_ = std::make_unique<GgufFile>(GgufFile::open(path));
  }
  static void TearDownTestSuite() { file_.reset(); }
  void SetUp() override {
    if (!file_) GTEST_SKIP() << kvc_test::kNoModel;
  }
  static const GgufFile& f() { return *file_; }

  template <std::size_t N>
  static void expect_close(const float* got, const std::array<float, N>& want, const char* what) {
    for (std::size_t i = 0; i < N; ++i) {
      const float tol = std::max(1e-6f * std::abs(want[i]), 1e-12f);
      EXPECT_NEAR(got[i], want[i], tol) << what << " element " << i;
    }
  }

  static inline std::unique_ptr<GgufFile> file_;
};

TEST_F(RealModel, Metadata) {
  EXPECT_EQ(f().version(), 3u);
  EXPECT_EQ(f().alignment(), 32u);
  EXPECT_EQ(f().get_string("general.architecture"), "llama");
  EXPECT_EQ(f().get_int("llama.block_count"), 30);
  EXPECT_EQ(f().get_int("llama.embedding_length"), 576);
  EXPECT_EQ(f().get_int("llama.feed_forward_length"), 1536);
  EXPECT_EQ(f().get_int("llama.attention.head_count"), 9);
  EXPECT_EQ(f().get_int("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(f().get_int("llama.context_length"), 8192);
  EXPECT_EQ(f().get_int("llama.rope.dimension_count"), 64);
  EXPECT_EQ(f().get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(static_cast<float>(f().get_float("llama.attention.layer_norm_rms_epsilon")), 1e-5f);
  EXPECT_EQ(f().key_type("llama.rope.freq_base"), VT::kFloat32);
  EXPECT_EQ(f().get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f().get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(f().array_size("tokenizer.ggml.tokens"), 49152u);
  EXPECT_EQ(f().array_size("tokenizer.ggml.merges"), 48900u);
  EXPECT_EQ(f().get_int_array("tokenizer.ggml.token_type").size(), 49152u);
  EXPECT_EQ(f().get_int("tokenizer.ggml.bos_token_id"), 1);
  EXPECT_EQ(f().get_int("tokenizer.ggml.eos_token_id"), 2);
  EXPECT_FALSE(f().get_bool("tokenizer.ggml.add_bos_token"));
  const std::vector<std::string> tokens = f().get_string_array("tokenizer.ggml.tokens");
  EXPECT_EQ(tokens[1], "<|im_start|>");
  EXPECT_EQ(tokens[905], "\xC4\xA0world");  // "Ġworld"
  EXPECT_EQ(f().get_string_array("tokenizer.ggml.merges")[0], "\xC4\xA0 t");
  EXPECT_EQ(f().keys().size(), 33u);
  expect_error([&] { (void)f().get_int("llama.rope.freq_base"); }, Errc::kInvalidArgument, "is float32");
}

TEST_F(RealModel, TensorsAndShapes) {
  ASSERT_EQ(f().tensors().size(), 272u);
  const auto check = [&](const std::string& name, std::vector<std::int64_t> dims, GgmlType type) {
    ASSERT_TRUE(f().has_tensor(name)) << name;
    const GgufTensorInfo& t = f().tensor(name);
    EXPECT_EQ(t.dims, dims) << name;
    EXPECT_EQ(t.type, type) << name;
  };
  check("token_embd.weight", {576, 49152}, GgmlType::Q8_0);
  check("output_norm.weight", {576}, GgmlType::F32);
  for (int b = 0; b < 30; ++b) {
    const std::string p = "blk." + std::to_string(b) + ".";
    check(p + "attn_norm.weight", {576}, GgmlType::F32);
    check(p + "ffn_norm.weight", {576}, GgmlType::F32);
    check(p + "attn_q.weight", {576, 576}, GgmlType::Q4_1);
    check(p + "attn_k.weight", {576, 192}, GgmlType::Q4_1);
    check(p + "attn_v.weight", {576, 192}, GgmlType::Q4_1);
    check(p + "attn_output.weight", {576, 576}, GgmlType::Q4_1);
    check(p + "ffn_gate.weight", {576, 1536}, GgmlType::Q4_1);
    check(p + "ffn_up.weight", {576, 1536}, GgmlType::Q4_1);
    check(p + "ffn_down.weight", {1536, 576}, GgmlType::Q4_1);
  }
  EXPECT_FALSE(f().has_tensor("output.weight"));  // tied to token_embd.weight
  const GgufTensorInfo& emb = f().tensor("token_embd.weight");
  EXPECT_EQ(emb.rows(), 49152);
  EXPECT_EQ(emb.row_length(), 576);
  EXPECT_EQ(emb.n_bytes(), 49152u * 18u * 34u);
  EXPECT_EQ(f().tensor("blk.0.ffn_down.weight").rows(), 576);
  EXPECT_EQ(f().tensor("blk.0.ffn_down.weight").row_bytes(), 48u * 20u);
}

TEST_F(RealModel, DequantizedValuesMatchGgufPy) {
  namespace fx = kvc_test::gguf_fixture;
  const std::vector<float> q = f().dequantize("blk.0.attn_q.weight");
  ASSERT_EQ(q.size(), 576u * 576u);
  expect_close(q.data(), fx::kAttnQ0, "blk.0.attn_q.weight");

  std::vector<float> row(1536);
  const GgufTensorInfo& k = f().tensor("blk.0.attn_k.weight");
  f().dequantize_rows(k, fx::kAttnK0LastRowAt.row, 1, row.data());
  expect_close(row.data() + fx::kAttnK0LastRowAt.column, fx::kAttnK0LastRow, "blk.0.attn_k.weight last row");

  f().dequantize_rows(f().tensor("blk.29.ffn_down.weight"), fx::kFfnDown29Row7At.row, 1, row.data());
  expect_close(row.data(), fx::kFfnDown29Row7, "blk.29.ffn_down.weight row 7");

  const GgufTensorInfo& emb = f().tensor("token_embd.weight");
  f().dequantize_rows(emb, fx::kTokenEmbdHelloAt.row, 1, row.data());
  expect_close(row.data(), fx::kTokenEmbdHello, "token_embd.weight row 19556");
  std::vector<float> three(3 * 576);  // the same row in the middle of a multi-row read
  f().dequantize_rows(emb, fx::kTokenEmbdHelloAt.row - 1, 3, three.data());
  EXPECT_TRUE(std::equal(row.begin(), row.begin() + 576, three.begin() + 576));

  const std::vector<float> norm = f().dequantize("output_norm.weight");
  ASSERT_EQ(norm.size(), 576u);
  expect_close(norm.data(), fx::kOutputNorm, "output_norm.weight");

  const std::vector<float> down = f().dequantize("blk.0.ffn_down.weight");
  double sum = 0, abs_sum = 0;
  for (float x : down) {
    sum += x;
    abs_sum += std::abs(x);
  }
  EXPECT_NEAR(sum, fx::kFfnDown0Sum, 1e-6 * fx::kFfnDown0AbsSum);
  EXPECT_NEAR(abs_sum, fx::kFfnDown0AbsSum, 1e-6 * fx::kFfnDown0AbsSum);
}

}  // namespace
