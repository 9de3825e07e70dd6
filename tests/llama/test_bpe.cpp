// Byte-level BPE tokenizer: UTF-8 decoding and code point classes, the "smollm" pre-tokenizer
// (splits checked against HF tokenizers by hand), BPE merging on a tiny synthetic vocabulary, and
// the real SmolLM2 tokenizer against ids from HF tokenizers (bpe_fixture.hpp).
#include "bpe_fixture.hpp"
#include "llama_test_util.hpp"

#include <llama/bpe.hpp>
#include <llama/gguf.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using kvc::Errc;
using kvc::llama::BpeTokenizer;
using kvc::llama::GgufFile;
using kvc::llama::pretokenize_smollm;
using kvc_test::expect_error;
using kvc_test::GgufWriter;
namespace uni = kvc::llama::unicode;

using Ids = std::vector<std::int32_t>;
using Pieces = std::vector<std::string_view>;

std::uint64_t fnv1a_ids(const Ids& ids) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (std::int32_t id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    for (int k = 0; k < 4; ++k) h = (h ^ ((u >> (8 * k)) & 0xFFu)) * 0x100000001b3ULL;
  }
  return h;
}
std::uint64_t fnv1a_bytes(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

// ---- UTF-8 and code point classes ---------------------------------------------------------------

TEST(BpeUnicode, DecodeUtf8) {
  using P = std::pair<std::uint32_t, int>;
  EXPECT_EQ(uni::decode_utf8("A", 0), (P{0x41, 1}));
  EXPECT_EQ(uni::decode_utf8("\xC3\xA9", 0), (P{0xE9, 2}));
  EXPECT_EQ(uni::decode_utf8("\xE4\xB8\x96", 0), (P{0x4E16, 3}));
  EXPECT_EQ(uni::decode_utf8("\xF0\x9F\x8E\x89", 0), (P{0x1F389, 4}));
  EXPECT_EQ(uni::decode_utf8("x\xF4\x8F\xBF\xBF", 1), (P{0x10FFFF, 4}));
  const P bad{uni::kInvalid, 1};
  EXPECT_EQ(uni::decode_utf8("\x80", 0), bad);              // lone continuation byte
  EXPECT_EQ(uni::decode_utf8("\xC3", 0), bad);              // truncated
  EXPECT_EQ(uni::decode_utf8("\xE4\xB8", 0), bad);          // truncated
  EXPECT_EQ(uni::decode_utf8("\xC3(", 0), bad);             // bad continuation
  EXPECT_EQ(uni::decode_utf8("\xC0\xAF", 0), bad);          // overlong
  EXPECT_EQ(uni::decode_utf8("\xE0\x80\xAF", 0), bad);      // overlong
  EXPECT_EQ(uni::decode_utf8("\xED\xA0\x80", 0), bad);      // surrogate
  EXPECT_EQ(uni::decode_utf8("\xF4\x90\x80\x80", 0), bad);  // > U+10FFFF
  EXPECT_EQ(uni::decode_utf8("\xFF", 0), bad);
}

TEST(BpeUnicode, Classify) {
  using C = uni::CpClass;
  for (char c = 'a'; c <= 'z'; ++c) EXPECT_EQ(uni::classify(static_cast<std::uint32_t>(c)), C::kLetter);
  for (char c = 'A'; c <= 'Z'; ++c) EXPECT_EQ(uni::classify(static_cast<std::uint32_t>(c)), C::kLetter);
  for (char c = '0'; c <= '9'; ++c) EXPECT_EQ(uni::classify(static_cast<std::uint32_t>(c)), C::kNumber);
  for (std::uint32_t c : {0x09u, 0x0Au, 0x0Bu, 0x0Cu, 0x0Du, 0x20u}) EXPECT_EQ(uni::classify(c), C::kSpace) << c;
  for (std::uint32_t c : {0x00u, 0x1Cu, 0x1Fu, 0x21u, 0x27u, 0x40u, 0x5Bu, 0x60u, 0x7Bu, 0x7Fu}) {
    EXPECT_EQ(uni::classify(c), C::kOther) << c;
  }
  // Latin-1: letters, the two symbols inside the letter range, superscripts and fractions, NBSP
  for (std::uint32_t c : {0xAAu, 0xB5u, 0xBAu, 0xC0u, 0xE9u, 0xDFu, 0xFFu}) {
    EXPECT_EQ(uni::classify(c), C::kLetter) << c;
  }
  for (std::uint32_t c : {0xD7u, 0xF7u, 0xA1u, 0xBFu, 0xADu}) EXPECT_EQ(uni::classify(c), C::kOther) << c;
  for (std::uint32_t c : {0xB2u, 0xB3u, 0xB9u, 0xBDu}) EXPECT_EQ(uni::classify(c), C::kNumber) << c;
  for (std::uint32_t c : {0x85u, 0xA0u, 0x1680u, 0x2000u, 0x200Au, 0x2028u, 0x202Fu, 0x205Fu, 0x3000u}) {
    EXPECT_EQ(uni::classify(c), C::kSpace) << c;
  }
  EXPECT_EQ(uni::classify(0x200B), C::kOther);  // zero width space is not \s
  EXPECT_EQ(uni::classify(0x03A9), C::kLetter);  // Ω
  EXPECT_EQ(uni::classify(0x0436), C::kLetter);  // ж
  EXPECT_EQ(uni::classify(0x4E16), C::kLetter);  // 世
  EXPECT_EQ(uni::classify(0x3042), C::kLetter);  // あ
  EXPECT_EQ(uni::classify(0xD55C), C::kLetter);  // 한
  EXPECT_EQ(uni::classify(0x0663), C::kNumber);  // Arabic-Indic 3
  EXPECT_EQ(uni::classify(0x216B), C::kNumber);  // Ⅻ
  EXPECT_EQ(uni::classify(0xFF11), C::kNumber);  // fullwidth 1
  EXPECT_EQ(uni::classify(0x0301), C::kOther);   // combining acute
  EXPECT_EQ(uni::classify(0x3001), C::kOther);   // ideographic comma
  EXPECT_EQ(uni::classify(0x1F389), C::kOther);  // 🎉
  EXPECT_EQ(uni::classify(0x2014), C::kOther);   // em dash
  EXPECT_EQ(uni::classify(uni::kInvalid), C::kOther);
}

// ---- pre-tokenizer ------------------------------------------------------------------------------------

TEST(BpePretokenize, MatchesTheSmolLMPattern) {
  // Expected splits are HF tokenizers' (Digits(individual) + ByteLevel regex) for the same strings.
  EXPECT_EQ(pretokenize_smollm("Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(pretokenize_smollm("a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(pretokenize_smollm("x   "), (Pieces{"x", "   "}));
  EXPECT_EQ(pretokenize_smollm(" 2024"), (Pieces{" ", "2", "0", "2", "4"}));
  EXPECT_EQ(pretokenize_smollm("v1.2 \xC2\xB2"), (Pieces{"v", "1", ".", "2", " ", "\xC2\xB2"}));
  EXPECT_EQ(pretokenize_smollm("don't I'm"), (Pieces{"don", "'t", " I", "'m"}));
  EXPECT_EQ(pretokenize_smollm("'S 've"), (Pieces{"'", "S", " '", "ve"}));
  EXPECT_EQ(pretokenize_smollm("x'''s"), (Pieces{"x", "'''", "s"}));
  EXPECT_EQ(pretokenize_smollm("a\n\nb"), (Pieces{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pretokenize_smollm("\t\tx  \n y"), (Pieces{"\t", "\t", "x", "  \n", " y"}));
  EXPECT_EQ(pretokenize_smollm("Wow!!! ok"), (Pieces{"Wow", "!!!", " ok"}));
  EXPECT_EQ(pretokenize_smollm("a \xC2\xA0" "b"), (Pieces{"a", " ", "\xC2\xA0", "b"}));
  EXPECT_EQ(pretokenize_smollm("a\xE3\x80\x80\xE3\x80\x80" "b"), (Pieces{"a", "\xE3\x80\x80", "\xE3\x80\x80", "b"}));
  EXPECT_EQ(pretokenize_smollm("h\xC3\xA9llo \xD0\xBC\xD0\xB8\xD1\x80"),
            (Pieces{"h\xC3\xA9llo", " \xD0\xBC\xD0\xB8\xD1\x80"}));
  EXPECT_EQ(pretokenize_smollm("\xFF\xFE z"), (Pieces{"\xFF\xFE", " z"}));
  EXPECT_TRUE(pretokenize_smollm("").empty());
}

TEST(BpePretokenize, PiecesTileTheInput) {
  std::mt19937 rng(7);
  const std::vector<std::string> atoms = {"a",  "Z",  "7",  " ",  "  ",  "\n",          "\t",
                                          "'",  "'s", "!",  "\xC3\xA9",     "\xE4\xB8\x96", "\xF0\x9F\x8E\x89",
                                          "\xC2\xA0", "\xFF", "\xC3", "\xE2\x80"};
  for (int iter = 0; iter < 2000; ++iter) {
    std::string s;
    const int n = static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) s += atoms[rng() % atoms.size()];
    const Pieces p = pretokenize_smollm(s);
    std::string joined;
    for (std::string_view v : p) {
      EXPECT_FALSE(v.empty());
      EXPECT_EQ(v.data(), s.data() + joined.size());  // views into the input, in order
      joined += v;
    }
    EXPECT_EQ(joined, s);
  }
}

// ---- BPE on a tiny synthetic vocabulary (no model file needed) --------------------------------------

std::string byte_char(unsigned b) {  // GPT-2 byte -> character, in UTF-8
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  std::uint32_t cp = b;
  if (!printable) {
    cp = 256;
    for (unsigned x = 0; x < b; ++x) {
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174)) ++cp;
    }
  }
  std::string s;
  uni::append_utf8(s, cp);
  return s;
}

struct TinyVocab {
  // ids 0..255: the byte characters (id == byte value); 256: "<s>" (control); then merge results.
  std::vector<std::string> tokens;
  std::vector<std::string> merges = {"h e", "l l", "he ll", "hell o", "\xC4\xA0 w", "b c", "a b", "a a"};
  std::vector<std::int32_t> types;
  std::string model = "gpt2", pre = "smollm";
  std::int64_t bos = 256;
  TinyVocab() {
    for (unsigned b = 0; b < 256; ++b) tokens.push_back(byte_char(b));
    tokens.push_back("<s>");
    for (const char* t : {"he", "ll", "hell", "hello", "\xC4\xA0w", "bc", "ab", "aa"}) tokens.push_back(t);
    types.assign(tokens.size(), 1);
    types[256] = 3;
  }
  std::vector<std::byte> build() const {
    GgufWriter w;
    w.kv_str("tokenizer.ggml.model", model)
        .kv_str("tokenizer.ggml.pre", pre)
        .kv_str_array("tokenizer.ggml.tokens", tokens)
        .kv_i32_array("tokenizer.ggml.token_type", types)
        .kv_str_array("tokenizer.ggml.merges", merges)
        .kv_u32("tokenizer.ggml.bos_token_id", static_cast<std::uint32_t>(bos))
        .kv_u32("tokenizer.ggml.eos_token_id", 256)
        .kv_bool("tokenizer.ggml.add_bos_token", true);
    return w.build();
  }
};
enum : std::int32_t { kS = 256, kHe, kLl, kHell, kHello, kSpW, kBc, kAb, kAa };

TEST(BpeTiny, MergesByRankLeftmostFirst) {
  const GgufFile f = GgufFile::from_bytes(TinyVocab{}.build(), "tiny.gguf");
  const BpeTokenizer t = BpeTokenizer::from_gguf(f);
  EXPECT_EQ(t.vocab_size(), 265);
  EXPECT_EQ(t.bos_id(), 256);
  EXPECT_EQ(t.eos_id(), 256);
  EXPECT_TRUE(t.add_bos());
  EXPECT_EQ(t.encode("hello"), (Ids{kHello}));
  EXPECT_EQ(t.encode("hellohello"), (Ids{kHello, kHello}));
  EXPECT_EQ(t.encode("hell"), (Ids{kHell}));
  EXPECT_EQ(t.encode("help"), (Ids{kHe, 'l', 'p'}));
  EXPECT_EQ(t.encode("hello world"), (Ids{kHello, kSpW, 'o', 'r', 'l', 'd'}));
  EXPECT_EQ(t.encode("abc"), (Ids{'a', kBc}));        // "b c" (rank 5) beats "a b" (rank 6)
  EXPECT_EQ(t.encode("abd"), (Ids{kAb, 'd'}));
  EXPECT_EQ(t.encode("aaa"), (Ids{kAa, 'a'}));        // ties: leftmost first
  EXPECT_EQ(t.encode("aaaaa"), (Ids{kAa, kAa, 'a'}));
  EXPECT_EQ(t.encode("hi\n"), (Ids{'h', 'i', '\n'}));  // non-printable bytes map through their characters
  EXPECT_EQ(t.encode(std::string_view("\0\xFF", 2)), (Ids{0, 255}));
  EXPECT_EQ(t.encode(""), Ids{});
  EXPECT_EQ(t.encode("x<s>y"), (Ids{'x', '<', 's', '>', 'y'}));
  EXPECT_EQ(t.encode_with_special("x<s>y<s>"), (Ids{'x', kS, 'y', kS}));
  EXPECT_EQ(t.encode_with_special("<s>"), (Ids{kS}));
  EXPECT_EQ(t.encode_with_special("<s"), (Ids{'<', 's'}));

  EXPECT_EQ(t.decode(Ids{kHello, kSpW, 'o'}), "hello wo");
  EXPECT_EQ(t.decode(Ids{kS, 'a', '\n', kS}), "<s>a\n<s>");
  EXPECT_EQ(t.decode(Ids{kS, 'a', kS}, /*skip_special=*/true), "a");
  EXPECT_EQ(t.token(kSpW), "\xC4\xA0w");
  EXPECT_EQ(t.piece(kSpW), " w");
  EXPECT_EQ(t.token(' '), "\xC4\xA0");
  EXPECT_EQ(t.piece(' '), " ");
  EXPECT_EQ(t.piece('\n'), "\n");
  EXPECT_TRUE(t.is_special(kS));
  EXPECT_FALSE(t.is_special(kHe));
  EXPECT_EQ(t.token_type(kS), BpeTokenizer::kControl);
  EXPECT_EQ(t.find_token("hello"), kHello);
  EXPECT_EQ(t.find_token("<s>"), kS);
  EXPECT_EQ(t.find_token("nope"), -1);
  expect_error([&] { (void)t.decode(Ids{265}); }, Errc::kInvalidArgument, "token id 265 is outside the vocabulary");
  expect_error([&] { (void)t.token(-1); }, Errc::kInvalidArgument, "token id -1");
}

TEST(BpeTiny, BadTokenizerMetadata) {
  const auto make = [](const TinyVocab& v) {
    const GgufFile f = GgufFile::from_bytes(v.build(), "tok.gguf");
    (void)BpeTokenizer::from_gguf(f);
  };
  TinyVocab v;
  v.model = "llama";
  expect_error([&] { make(v); }, Errc::kInvalidArgument, "unsupported tokenizer model 'llama'");
  v = TinyVocab{};
  v.pre = "llama3";
  expect_error([&] { make(v); }, Errc::kInvalidArgument, "unsupported pre-tokenizer 'llama3'");
  v = TinyVocab{};
  v.merges.push_back("hello");
  expect_error([&] { make(v); }, Errc::kCorruptFile, "merge #8 'hello' is not two tokens");
  v = TinyVocab{};
  v.merges.push_back("a  b");
  expect_error([&] { make(v); }, Errc::kCorruptFile, "merge #8");
  v = TinyVocab{};
  v.merges.push_back("q z");  // "qz" is not in the vocabulary
  expect_error([&] { make(v); }, Errc::kCorruptFile, "merge #8 'q z' uses or makes a token not in the vocabulary");
  v = TinyVocab{};
  v.types.pop_back();
  expect_error([&] { make(v); }, Errc::kCorruptFile, "token_type has 264 entries for 265 tokens");
  v = TinyVocab{};
  v.bos = 265;
  expect_error([&] { make(v); }, Errc::kCorruptFile, "bos_token_id = 265 is not a token id");
  GgufWriter no_pre;
  no_pre.kv_str("tokenizer.ggml.model", "gpt2");
  const GgufFile f = GgufFile::from_bytes(no_pre.build(), "nopre.gguf");
  expect_error([&] { (void)BpeTokenizer::from_gguf(f); }, Errc::kInvalidArgument,
               "no metadata key 'tokenizer.ggml.pre'");
}

// ---- the real SmolLM2 tokenizer -------------------------------------------------------------------------

class RealTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = kvc_test::model_path();
    if (path.empty()) return;
    const GgufFile f = GgufFile::open(path);
    tok_ = std::make_unique<BpeTokenizer>(BpeTokenizer::from_gguf(f));
  }
  static void TearDownTestSuite() { tok_.reset(); }
  void SetUp() override {
    if (!tok_) GTEST_SKIP() << kvc_test::kNoModel;
  }
  static const BpeTokenizer& tok() { return *tok_; }
  static inline std::unique_ptr<BpeTokenizer> tok_;
};

TEST_F(RealTokenizer, Vocabulary) {
  EXPECT_EQ(tok().vocab_size(), 49152);
  EXPECT_EQ(tok().bos_id(), 1);
  EXPECT_EQ(tok().eos_id(), 2);
  EXPECT_FALSE(tok().add_bos());
  EXPECT_EQ(tok().token(1), "<|im_start|>");
  EXPECT_EQ(tok().token(2), "<|im_end|>");
  EXPECT_TRUE(tok().is_special(0));
  EXPECT_TRUE(tok().is_special(16));
  EXPECT_FALSE(tok().is_special(17));
  EXPECT_EQ(tok().token(905), "\xC4\xA0world");
  EXPECT_EQ(tok().piece(905), " world");
  EXPECT_EQ(tok().find_token("<|im_end|>"), 2);
  EXPECT_EQ(tok().decode(Ids{1, 19556, 2}), "<|im_start|>Hello<|im_end|>");
  EXPECT_EQ(tok().decode(Ids{1, 19556, 2}, /*skip_special=*/true), "Hello");
}

TEST_F(RealTokenizer, MatchesHfTokenizers) {
  const auto& cases = kvc_test::bpe_fixture::cases();
  ASSERT_GE(cases.size(), 30u);
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.text.substr(0, 60)));
    const Ids ids = tok().encode(c.text);
    EXPECT_EQ(ids, c.ids);
    EXPECT_EQ(tok().decode(ids), c.text);
  }
}

TEST_F(RealTokenizer, SpecialTokensMatchHfTokenizers) {
  for (const auto& c : kvc_test::bpe_fixture::special_cases()) {
    SCOPED_TRACE(std::string(c.text));
    const Ids ids = tok().encode_with_special(c.text);
    EXPECT_EQ(ids, c.ids);
    EXPECT_EQ(tok().decode(ids), c.text);
  }
  // encode() does not parse them
  EXPECT_EQ(tok().encode("<|im_end|>"), (Ids{44, 108, 306, 79, 486, 108, 46}));
}

TEST_F(RealTokenizer, WholeGpl3File) {
  namespace fx = kvc_test::bpe_fixture;
  std::ifstream in(std::string(fx::kGplPath), std::ios::binary);
  if (!in) GTEST_SKIP() << fx::kGplPath << " not found";
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() != fx::kGplBytes || fnv1a_bytes(text) != fx::kGplFnv) {
    GTEST_SKIP() << fx::kGplPath << " differs from the file the fixture was made from";
  }
  // The fixture's 2000-character case is this file's beginning
  const std::string_view head = fx::cases().back().text;
  EXPECT_EQ(text.substr(0, head.size()), head);

  Ids ids = tok().encode(text);  // warm-up run
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kReps = 5;
  for (int r = 0; r < kReps; ++r) ids = tok().encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kReps;
  std::cout << "[ timing   ] encode(GPL-3, " << text.size() << " bytes) -> " << ids.size() << " tokens in "
            << s * 1e3 << " ms\n";
  EXPECT_EQ(ids.size(), fx::kGplTokens);
  EXPECT_EQ(fnv1a_ids(ids), fx::kGplIdsFnv);
  EXPECT_EQ(tok().decode(ids), text);
  EXPECT_LT(s, 1.0);
}

TEST_F(RealTokenizer, InvalidUtf8AndRandomBytesRoundTrip) {
  // Bytes without a byte token in the vocabulary are dropped, as HF tokenizers does. SmolLM2 lacks
  // 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5..0xFF; everything else round-trips.
  std::string missing;
  for (unsigned b = 0; b < 256; ++b) {
    if (tok().find_token(byte_char(b)) < 0) missing += static_cast<char>(b);
  }
  EXPECT_EQ(missing, "\x04\x06\x13\x14\x16\x1D\xC0\xC1\xF1\xF2\xF5\xF6\xF7\xF8\xF9\xFA\xFB\xFC\xFD\xFE\xFF");
  const auto encodable = [&](const std::string& s) {
    std::string out;
    for (char c : s) {
      if (missing.find(c) == std::string::npos) out += c;
    }
    return out;
  };
  const std::vector<std::string> bad = {"\xFF", "\xC3", "a\xE2\x82", "\xED\xA0\x80", "\xC0\xAF", "\xF4\x90\x80\x80",
                                        "x \xFF\xFE y", std::string("\0\0\0", 3), "\xE4\xB8\xE4\xB8\x96", "\x80\x80"};
  for (const std::string& s : bad) {
    SCOPED_TRACE(::testing::PrintToString(s));
    const Ids ids = tok().encode(s);
    EXPECT_EQ(tok().decode(ids), encodable(s));
    EXPECT_EQ(tok().encode_with_special(s), ids);
  }
  EXPECT_TRUE(tok().encode("\xFF").empty());
  EXPECT_EQ(tok().decode(tok().encode("\xE4\xB8\xE4\xB8\x96")), "\xE4\xB8\xE4\xB8\x96");
  std::mt19937 rng(99);
  for (int iter = 0; iter < 500; ++iter) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    const Ids ids = tok().encode(s);
    for (std::int32_t id : ids) ASSERT_TRUE(id >= 17 && id < tok().vocab_size()) << id;
    ASSERT_EQ(tok().decode(ids), encodable(s));
  }
}

}  // namespace
