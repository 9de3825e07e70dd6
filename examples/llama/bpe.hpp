/// \file bpe.hpp
/// GPT-2 style byte-level BPE tokenizer read from a GGUF file (tokenizer.ggml.model = "gpt2"), with
/// the "smollm" pre-tokenizer of SmolLM/SmolLM2. Part of the llama example engine.
///
/// Encoding, as HF `tokenizers` does it for SmolLM2 (checked against it in tests/llama/test_bpe.cpp):
///   1. pre-tokenize: every numeric code point (\p{N}) becomes a piece of its own; the rest is split
///      by the GPT-2 pattern
///        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
///      (written out by hand below: no std::regex);
///   2. map each byte of a piece to its GPT-2 "byte character" (printable bytes map to themselves,
///      the 68 others to U+0100.., e.g. ' ' -> 'Ġ' U+0120, '\n' -> 'Ċ' U+010A);
///   3. starting from one symbol per byte, repeatedly merge the adjacent pair with the lowest merge
///      rank (leftmost first on ties) until no pair has a merge; emit the symbols' ids.
/// Control tokens (<|im_start|>, ...) are not recognised by encode(); encode_with_special() does.
/// decode() is the exact inverse on bytes: decode(encode(s)) == s for any byte string s, valid
/// UTF-8 or not (invalid bytes are kept, classified as punctuation by the pre-tokenizer), except
/// that bytes with no byte token in the vocabulary are dropped, as HF tokenizers drops them
/// (SmolLM2 lacks 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5..0xFF: never in UTF-8
/// text but for six rare control characters).
#pragma once

#include "gguf.hpp"

#include <kvc/core/error.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvc::llama {

namespace unicode {

/// What the pre-tokenizer's regex sees in a code point.
enum class CpClass : std::uint8_t { kLetter, kNumber, kSpace, kOther };

/// Decodes one UTF-8 sequence at s[i]. Returns the code point and its byte length; an invalid,
/// overlong, surrogate or truncated sequence yields kInvalid with length 1 (one byte consumed).
inline constexpr std::uint32_t kInvalid = 0xFFFFFFFFu;
inline std::pair<std::uint32_t, int> decode_utf8(std::string_view s, std::size_t i) noexcept {
  const auto b = [&](std::size_t k) { return static_cast<std::uint32_t>(static_cast<unsigned char>(s[k])); };
  const std::uint32_t c0 = b(i);
  if (c0 < 0x80) return {c0, 1};
  int len = 0;
  std::uint32_t cp = 0;
  std::uint32_t min = 0;
  if ((c0 & 0xE0) == 0xC0) { len = 2; cp = c0 & 0x1F; min = 0x80; }
  else if ((c0 & 0xF0) == 0xE0) { len = 3; cp = c0 & 0x0F; min = 0x800; }
  else if ((c0 & 0xF8) == 0xF0) { len = 4; cp = c0 & 0x07; min = 0x10000; }
  else return {kInvalid, 1};
  if (s.size() - i < static_cast<std::size_t>(len)) return {kInvalid, 1};
  for (int k = 1; k < len; ++k) {
    const std::uint32_t c = b(i + static_cast<std::size_t>(k));
    if ((c & 0xC0) != 0x80) return {kInvalid, 1};
    cp = (cp << 6) | (c & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {kInvalid, 1};
  return {cp, len};
}

/// Appends the UTF-8 encoding of a valid code point.
inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

namespace detail {
struct CpRange {
  std::uint32_t lo, hi;
};
// General categories L* and N* inside the exactly classified blocks (kExactBlocks below), generated
// from Python's unicodedata (Unicode 14.0):
//   [(lo, hi) for maximal runs c in EXACT with unicodedata.category(chr(c))[0] == 'L' (resp. 'N')]
inline constexpr CpRange kLetters[] = {
    {0x00AA, 0x00AA}, {0x00B5, 0x00B5}, {0x00BA, 0x00BA}, {0x00C0, 0x00D6}, {0x00D8, 0x00F6},
    {0x00F8, 0x02C1}, {0x02C6, 0x02D1}, {0x02E0, 0x02E4}, {0x02EC, 0x02EC}, {0x02EE, 0x02EE},
    {0x0370, 0x0374}, {0x0376, 0x0377}, {0x037A, 0x037D}, {0x037F, 0x037F}, {0x0386, 0x0386},
    {0x0388, 0x038A}, {0x038C, 0x038C}, {0x038E, 0x03A1}, {0x03A3, 0x03F5}, {0x03F7, 0x0481},
    {0x048A, 0x052F}, {0x0531, 0x0556}, {0x0559, 0x0559}, {0x0560, 0x0588}, {0x05D0, 0x05EA},
    {0x05EF, 0x05F2}, {0x0620, 0x064A}, {0x066E, 0x066F}, {0x0671, 0x06D3}, {0x06D5, 0x06D5},
    {0x06E5, 0x06E6}, {0x06EE, 0x06EF}, {0x06FA, 0x06FC}, {0x06FF, 0x06FF}, {0x0904, 0x0939},
    {0x093D, 0x093D}, {0x0950, 0x0950}, {0x0958, 0x0961}, {0x0971, 0x097F}, {0x0E01, 0x0E30},
    {0x0E32, 0x0E33}, {0x0E40, 0x0E46}, {0x1E00, 0x1F15}, {0x1F18, 0x1F1D}, {0x1F20, 0x1F45},
    {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D},
    {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4},
    {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4},
    {0x1FF6, 0x1FFC}, {0x2071, 0x2071}, {0x207F, 0x207F}, {0x2090, 0x209C}, {0x2102, 0x2102},
    {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124},
    {0x2126, 0x2126}, {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2139}, {0x213C, 0x213F},
    {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x3005, 0x3006}, {0x3031, 0x3035},
    {0x303B, 0x303C}, {0x3041, 0x3096}, {0x309D, 0x309F}, {0x30A1, 0x30FA}, {0x30FC, 0x30FF},
    {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0xFF66, 0xFFBE}, {0xFFC2, 0xFFC7}, {0xFFCA, 0xFFCF},
    {0xFFD2, 0xFFD7}, {0xFFDA, 0xFFDC},
};
inline constexpr CpRange kNumbers[] = {
    {0x00B2, 0x00B3}, {0x00B9, 0x00B9}, {0x00BC, 0x00BE}, {0x0660, 0x0669}, {0x06F0, 0x06F9},
    {0x0966, 0x096F}, {0x0E50, 0x0E59}, {0x2070, 0x2070}, {0x2074, 0x2079}, {0x2080, 0x2089},
    {0x2150, 0x2182}, {0x2185, 0x2189}, {0x2460, 0x249B}, {0x24EA, 0x24FF}, {0x2776, 0x2793},
    {0x3007, 0x3007}, {0x3021, 0x3029}, {0x3038, 0x303A}, {0xFF10, 0xFF19},
};
/// Blocks classified exactly by the two tables: Latin-1 .. Arabic, Devanagari, Thai, Latin Extended
/// Additional + Greek Extended, General Punctuation .. Miscellaneous Symbols and Arrows (incl.
/// letterlike symbols, number forms, enclosed alphanumerics, dingbats), CJK Symbols + Hiragana +
/// Katakana, Halfwidth and Fullwidth Forms.
inline constexpr CpRange kExactBlocks[] = {
    {0x0080, 0x06FF}, {0x0900, 0x097F}, {0x0E00, 0x0E7F}, {0x1E00, 0x1FFF},
    {0x2000, 0x2BFF}, {0x3000, 0x30FF}, {0xFF00, 0xFFEF},
};
/// Outside the exact blocks, whole blocks of (mostly) letters count as letters. This is the
/// approximation: combining marks, symbols and digits inside these blocks are misclassified
/// (e.g. Bengali vowel signs count as letters, Bengali digits as letters rather than numbers).
inline constexpr CpRange kLetterBlocks[] = {
    {0x0700, 0x08FF},    // Syriac, Arabic Supplement, Thaana, NKo, Samaritan, Mandaic, Arabic Ext
    {0x0980, 0x0DFF},    // Bengali .. Sinhala
    {0x0E80, 0x1DFF},    // Lao, Tibetan, Myanmar, Georgian, Hangul Jamo, Ethiopic, Cherokee, ..., Phonetic Ext
    {0x2C00, 0x2DFF},    // Glagolitic, Latin Extended-C, Coptic, Georgian Supplement, Tifinagh, Ethiopic Ext
    {0x3100, 0x31FF},    // Bopomofo, Hangul Compatibility Jamo, Katakana Phonetic Extensions
    {0x3400, 0x4DBF},    // CJK Unified Ideographs Extension A
    {0x4E00, 0x9FFF},    // CJK Unified Ideographs
    {0xA000, 0xABFF},    // Yi, Lisu, Vai, Cyrillic Ext-B, Bamum, ..., Latin Ext-D/E, Cherokee Supplement
    {0xAC00, 0xD7FF},    // Hangul Syllables, Hangul Jamo Extended-B
    {0xF900, 0xFDFF},    // CJK Compatibility Ideographs, Alphabetic/Arabic Presentation Forms-A
    {0xFE70, 0xFEFF},    // Arabic Presentation Forms-B
    {0x10000, 0x1BFFF},  // historic scripts of the SMP, Kana Supplement
    {0x1D400, 0x1D7CD},  // Mathematical Alphanumeric Symbols (letters)
    {0x20000, 0x3FFFF},  // CJK Extensions B.., Compatibility Supplement
};
inline constexpr CpRange kNumberBlocks[] = {
    {0x1D7CE, 0x1D7FF},  // Mathematical digits
    {0x1F100, 0x1F10C},  // digits with full stop / comma
};

template <std::size_t N>
constexpr bool in_ranges(const CpRange (&r)[N], std::uint32_t cp) noexcept {
  std::size_t lo = 0, hi = N;  // first range with hi >= cp
  while (lo < hi) {
    const std::size_t mid = (lo + hi) / 2;
    if (r[mid].hi < cp) lo = mid + 1; else hi = mid;
  }
  return lo < N && r[lo].lo <= cp;
}
}  // namespace detail

/// White_Space (exactly: the regex's \s): \t \n \v \f \r, space, U+0085, U+00A0, U+1680,
/// U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
constexpr bool is_space(std::uint32_t cp) noexcept {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

/// Letter / number / whitespace / other, as \p{L}, \p{N} and \s see it. Exact for ASCII and for
/// the blocks in detail::kExactBlocks (Unicode 14); an approximation by whole blocks elsewhere
/// (detail::kLetterBlocks; everything else, e.g. emoji and symbols, is "other"). Invalid UTF-8
/// (kInvalid) is "other".
constexpr CpClass classify(std::uint32_t cp) noexcept {
  if (cp < 0x80) {
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CpClass::kLetter;
    if (cp >= '0' && cp <= '9') return CpClass::kNumber;
    return is_space(cp) ? CpClass::kSpace : CpClass::kOther;
  }
  if (is_space(cp)) return CpClass::kSpace;
  if (detail::in_ranges(detail::kExactBlocks, cp)) {
    if (detail::in_ranges(detail::kLetters, cp)) return CpClass::kLetter;
    if (detail::in_ranges(detail::kNumbers, cp)) return CpClass::kNumber;
    return CpClass::kOther;
  }
  if (detail::in_ranges(detail::kLetterBlocks, cp)) return CpClass::kLetter;
  if (detail::in_ranges(detail::kNumberBlocks, cp)) return CpClass::kNumber;
  return CpClass::kOther;
}

}  // namespace unicode

/// Splits text into the pieces the "smollm" pre-tokenizer produces (views into `text`, in order,
/// covering it exactly). Texts of 4 GiB or more are refused (Errc::kInvalidArgument).
inline std::vector<std::string_view> pretokenize_smollm(std::string_view text) {
  using unicode::CpClass;
  KVC_CHECK(text.size() < std::numeric_limits<std::uint32_t>::max(), Errc::kInvalidArgument,
            "pretokenize: text of ", text.size(), " bytes is too long");
  struct Cp {
    std::uint32_t cp;
    std::uint32_t begin;  // byte offset
    CpClass cls;
  };
  std::vector<Cp> cps;
  cps.reserve(text.size() + 1);
  for (std::size_t i = 0; i < text.size();) {
    const auto [cp, len] = unicode::decode_utf8(text, i);
    cps.push_back({cp, static_cast<std::uint32_t>(i), unicode::classify(cp)});
    i += static_cast<std::size_t>(len);
  }
  cps.push_back({0, static_cast<std::uint32_t>(text.size()), CpClass::kOther});  // sentinel: end offset
  const std::size_t n = cps.size() - 1;

  std::vector<std::string_view> out;
  const auto emit = [&](std::size_t a, std::size_t b) {
    out.push_back(text.substr(cps[a].begin, cps[b].begin - cps[a].begin));
  };

  // The GPT-2 pattern on [b, e), a run without numbers (those were split off individually).
  const auto split_run = [&](std::size_t b, std::size_t e) {
    const auto cls = [&](std::size_t k) { return k < e ? cps[k].cls : CpClass::kNumber; /* never matches */ };
    const auto ch = [&](std::size_t k) { return k < e ? cps[k].cp : 0u; };
    std::size_t i = b;
    while (i < e) {
      const std::uint32_t c = cps[i].cp;
      // 's|'t|'re|'ve|'m|'ll|'d
      if (c == '\'') {
        const std::uint32_t c1 = ch(i + 1), c2 = ch(i + 2);
        std::size_t len = 0;
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') len = 2;
        else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) len = 3;
        if (len != 0) {
          emit(i, i + len);
          i += len;
          continue;
        }
      }
      // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional space then a run of one class
      const std::size_t start = (c == ' ' && i + 1 < e && cls(i + 1) != CpClass::kSpace) ? i + 1 : i;
      const CpClass k = cls(start);
      if (k != CpClass::kSpace) {
        std::size_t j = start + 1;
        while (j < e && cps[j].cls == k) ++j;
        emit(i, j);
        i = j;
        continue;
      }
      // '\s+(?!\S)|\s+': a whitespace run; if more than one and not at the end, leave the last
      // whitespace for the next match (it may prefix a word).
      std::size_t j = i + 1;
      while (j < e && cps[j].cls == CpClass::kSpace) ++j;
      if (j < e && j - i > 1) --j;
      emit(i, j);
      i = j;
    }
  };

  std::size_t run = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (cps[i].cls == CpClass::kNumber) {
      if (run < i) split_run(run, i);
      emit(i, i + 1);
      run = i + 1;
    }
  }
  if (run < n) split_run(run, n);
  return out;
}

class BpeTokenizer {
 public:
  /// GGUF token types (tokenizer.ggml.token_type).
  enum TokenType : std::int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

  /// Builds the tokenizer from tokenizer.ggml.{model, pre, tokens, merges, token_type,
  /// bos_token_id, eos_token_id, add_bos_token}. Model must be "gpt2" and pre "smollm"
  /// (else Errc::kInvalidArgument); inconsistent vocab/merges give Errc::kCorruptFile.
  static BpeTokenizer from_gguf(const GgufFile& f) {
    const std::string model = f.get_string("tokenizer.ggml.model");
    KVC_CHECK(model == "gpt2", Errc::kInvalidArgument, "gguf '", f.name(), "': unsupported tokenizer model '",
              model, "' (only 'gpt2' byte-level BPE is supported)");
    const std::string pre = f.get_string("tokenizer.ggml.pre");
    KVC_CHECK(pre == "smollm", Errc::kInvalidArgument, "gguf '", f.name(), "': unsupported pre-tokenizer '", pre,
              "' (only 'smollm' is supported)");

    BpeTokenizer t;
    t.tokens_ = f.get_string_array("tokenizer.ggml.tokens");
    const std::size_t n = t.tokens_.size();
    KVC_CHECK(n > 0 && n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
              Errc::kCorruptFile, "gguf '", f.name(), "': tokenizer.ggml.tokens has ", n, " entries");
    t.types_.assign(n, kNormal);
    if (f.has_key("tokenizer.ggml.token_type")) {
      const std::vector<std::int64_t> types = f.get_int_array("tokenizer.ggml.token_type");
      KVC_CHECK(types.size() == n, Errc::kCorruptFile, "gguf '", f.name(), "': tokenizer.ggml.token_type has ",
                types.size(), " entries for ", n, " tokens");
      for (std::size_t i = 0; i < n; ++i) {
        t.types_[i] = static_cast<std::int32_t>(std::clamp<std::int64_t>(types[i], -1, 7));
      }
    }
    const auto optional_id = [&](const char* key) -> std::int32_t {
      if (!f.has_key(key)) return -1;
      const std::int64_t id = f.get_int(key);
      KVC_CHECK(id >= 0 && id < static_cast<std::int64_t>(n), Errc::kCorruptFile, "gguf '", f.name(), "': ", key,
                " = ", id, " is not a token id (vocabulary of ", n, ")");
      return static_cast<std::int32_t>(id);
    };
    t.bos_ = optional_id("tokenizer.ggml.bos_token_id");
    t.eos_ = optional_id("tokenizer.ggml.eos_token_id");
    t.add_bos_ = f.has_key("tokenizer.ggml.add_bos_token") && f.get_bool("tokenizer.ggml.add_bos_token");

    t.ids_.reserve(n);
    for (std::size_t i = 0; i < n; ++i) t.ids_.emplace(t.tokens_[i], static_cast<std::int32_t>(i));  // first wins

    // Byte <-> byte character (GPT-2): printable Latin-1 bytes map to themselves, the other 68 to
    // U+0100 + k in byte order.
    std::array<std::uint32_t, 256> byte_char{};
    t.char_byte_.fill(-1);
    std::uint32_t next = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      byte_char[b] = printable ? b : next++;
      t.char_byte_[byte_char[b]] = static_cast<std::int16_t>(b);
    }
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::string s;
      unicode::append_utf8(s, byte_char[b]);
      const auto it = t.ids_.find(s);
      t.byte_token_[b] = it == t.ids_.end() ? -1 : it->second;
    }

    // Decoded bytes of every token (control/user-defined tokens: their text as is).
    t.pieces_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::string& s = t.tokens_[i];
      if (t.types_[i] == kControl || t.types_[i] == kUserDefined) {
        t.pieces_[i] = s;
        if (!s.empty()) t.specials_.push_back(static_cast<std::int32_t>(i));
        continue;
      }
      for (std::size_t k = 0; k < s.size();) {
        const auto [cp, len] = unicode::decode_utf8(s, k);
        if (cp < t.char_byte_.size() && t.char_byte_[cp] >= 0) {
          t.pieces_[i] += static_cast<char>(t.char_byte_[cp]);
        } else {
          t.pieces_[i].append(s, k, static_cast<std::size_t>(len));  // not a byte character: keep it
        }
        k += static_cast<std::size_t>(len);
      }
    }

    const std::vector<std::string> merges = f.get_string_array("tokenizer.ggml.merges");
    KVC_CHECK(merges.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
              Errc::kCorruptFile, "gguf '", f.name(), "': too many merges");
    t.merges_.reserve(merges.size());
    std::string joined;
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const std::string& m = merges[r];
      const std::size_t sp = m.find(' ');
      KVC_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < m.size() && m.find(' ', sp + 1) == std::string::npos,
                Errc::kCorruptFile, "gguf '", f.name(), "': merge #", r, " '", m, "' is not two tokens 'a b'");
      const auto a = t.ids_.find(m.substr(0, sp));
      const auto b = t.ids_.find(m.substr(sp + 1));
      joined.assign(m, 0, sp);
      joined.append(m, sp + 1);
      const auto ab = t.ids_.find(joined);
      KVC_CHECK(a != t.ids_.end() && b != t.ids_.end() && ab != t.ids_.end(), Errc::kCorruptFile, "gguf '",
                f.name(), "': merge #", r, " '", m, "' uses or makes a token not in the vocabulary");
      // A pair listed twice keeps its first (lowest) rank.
      t.merges_.emplace(pair_key(a->second, b->second), Merge{static_cast<std::int32_t>(r), ab->second});
    }
    // Longest special first, so that at one position the longest match wins.
    std::stable_sort(t.specials_.begin(), t.specials_.end(),
                     [&](std::int32_t x, std::int32_t y) { return t.token_text(x).size() > t.token_text(y).size(); });
    return t;
  }

  /// Token ids of `text` (any bytes). Control tokens written in the text are encoded as plain text;
  /// bytes without a byte token in the vocabulary are dropped.
  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3 + 4);
    encode_into(text, out);
    return out;
  }

  /// Like encode(), but control and user-defined tokens that appear literally in the text (e.g.
  /// "<|im_start|>") become their ids; the text between them is encoded as by encode().
  [[nodiscard]] std::vector<std::int32_t> encode_with_special(std::string_view text) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3 + 4);
    std::size_t pos = 0;
    std::vector<std::size_t> next(specials_.size());  // next occurrence of each special at >= pos
    for (std::size_t k = 0; k < specials_.size(); ++k) next[k] = text.find(token_text(specials_[k]));
    while (pos < text.size()) {
      std::size_t best = std::string_view::npos;
      std::int32_t best_id = -1;
      for (std::size_t k = 0; k < specials_.size(); ++k) {  // longest first: only an earlier match beats it
        const std::string& s = token_text(specials_[k]);
        if (next[k] != std::string_view::npos && next[k] < pos) next[k] = text.find(s, pos);
        if (next[k] < best) { best = next[k]; best_id = specials_[k]; }
      }
      if (best == std::string_view::npos) break;
      encode_into(text.substr(pos, best - pos), out);
      out.push_back(best_id);
      pos = best + token_text(best_id).size();
    }
    if (pos < text.size()) encode_into(text.substr(pos), out);
    return out;
  }

  /// Concatenated bytes of the tokens (control tokens as their text unless `skip_special`).
  /// A single token may end inside a multi-byte UTF-8 character: when streaming, buffer bytes
  /// until they form whole characters. Errc::kInvalidArgument for an id outside the vocabulary.
  [[nodiscard]] std::string decode(std::span<const std::int32_t> ids, bool skip_special = false) const {
    std::string out;
    for (std::int32_t id : ids) {
      check_id(id);
      if (skip_special && is_special(id)) continue;
      out += pieces_[static_cast<std::size_t>(id)];
    }
    return out;
  }

  [[nodiscard]] int vocab_size() const noexcept { return static_cast<int>(tokens_.size()); }
  [[nodiscard]] std::int32_t bos_id() const noexcept { return bos_; }  ///< -1 if the file has none
  [[nodiscard]] std::int32_t eos_id() const noexcept { return eos_; }  ///< -1 if the file has none
  /// tokenizer.ggml.add_bos_token (false when absent): whether prompts should start with bos_id().
  [[nodiscard]] bool add_bos() const noexcept { return add_bos_; }
  /// The token's vocabulary string as stored in the GGUF (byte characters: " world" is "Ġworld").
  [[nodiscard]] std::string_view token(std::int32_t id) const {
    check_id(id);
    return tokens_[static_cast<std::size_t>(id)];
  }
  /// The bytes the token decodes to (" world").
  [[nodiscard]] std::string_view piece(std::int32_t id) const {
    check_id(id);
    return pieces_[static_cast<std::size_t>(id)];
  }
  [[nodiscard]] std::int32_t token_type(std::int32_t id) const {
    check_id(id);
    return types_[static_cast<std::size_t>(id)];
  }
  /// Control or user-defined token (e.g. <|im_start|>, <|im_end|>).
  [[nodiscard]] bool is_special(std::int32_t id) const {
    check_id(id);
    const std::int32_t ty = types_[static_cast<std::size_t>(id)];
    return ty == kControl || ty == kUserDefined;
  }
  /// Id of a vocabulary string (as stored, e.g. "<|im_end|>" or "Ġworld"), or -1.
  [[nodiscard]] std::int32_t find_token(std::string_view vocab_string) const {
    const auto it = ids_.find(std::string(vocab_string));
    return it == ids_.end() ? -1 : it->second;
  }

 private:
  struct Merge {
    std::int32_t rank;
    std::int32_t id;
  };
  BpeTokenizer() = default;

  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) noexcept {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  const std::string& token_text(std::int32_t id) const { return tokens_[static_cast<std::size_t>(id)]; }
  void check_id(std::int32_t id) const {
    KVC_CHECK(id >= 0 && static_cast<std::size_t>(id) < tokens_.size(), Errc::kInvalidArgument, "token id ", id,
              " is outside the vocabulary [0, ", tokens_.size(), ")");
  }
  const Merge* find_merge(std::int32_t a, std::int32_t b) const {
    const auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  void encode_into(std::string_view text, std::vector<std::int32_t>& out) const {
    // Word cache for this call: piece -> where its ids already are in `out`.
    std::unordered_map<std::string_view, std::pair<std::size_t, std::size_t>> cache;
    for (std::string_view piece : pretokenize_smollm(text)) {
      if (const auto it = cache.find(piece); it != cache.end()) {
        for (std::size_t k = 0; k < it->second.second; ++k) {
          const std::int32_t id = out[it->second.first + k];
          out.push_back(id);
        }
        continue;
      }
      const std::size_t at = out.size();
      bpe_piece(piece, out);
      cache.emplace(piece, std::make_pair(at, out.size() - at));
    }
  }

  /// Merges the byte symbols of one piece by rank (a min-heap of candidate pairs, each validated
  /// when popped) and appends the resulting ids.
  void bpe_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
    struct Sym {
      std::int32_t id;
      std::int32_t prev, next;  // -1 at the ends; a merged-away symbol has id -1
    };
    struct Cand {
      std::int32_t rank, pos, left, right, id;
      bool operator>(const Cand& o) const noexcept { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::vector<Sym> sym;
    sym.reserve(piece.size());
    for (char c : piece) {
      const std::int32_t id = byte_token_[static_cast<unsigned char>(c)];
      if (id < 0) continue;  // byte missing from the vocabulary: dropped (as HF does without <unk>)
      const auto k = static_cast<std::int32_t>(sym.size());
      sym.push_back({id, k - 1, k + 1});
    }
    if (sym.empty()) return;
    sym.back().next = -1;
    if (sym.size() > 1) {
      std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
      const auto push = [&](std::int32_t pos) {
        if (pos < 0) return;
        const std::int32_t nx = sym[static_cast<std::size_t>(pos)].next;
        if (nx < 0) return;
        const std::int32_t a = sym[static_cast<std::size_t>(pos)].id, b = sym[static_cast<std::size_t>(nx)].id;
        if (const Merge* m = find_merge(a, b)) heap.push({m->rank, pos, a, b, m->id});
      };
      for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(sym.size()); ++i) push(i);
      while (!heap.empty()) {
        const Cand c = heap.top();
        heap.pop();
        Sym& l = sym[static_cast<std::size_t>(c.pos)];
        if (l.id != c.left || l.next < 0) continue;  // stale: the left symbol changed or was merged away
        Sym& r = sym[static_cast<std::size_t>(l.next)];
        if (r.id != c.right) continue;               // stale: the right neighbour changed
        l.id = c.id;
        r.id = -1;
        l.next = r.next;
        if (r.next >= 0) sym[static_cast<std::size_t>(r.next)].prev = c.pos;
        push(l.prev);
        push(c.pos);
      }
    }
    for (std::int32_t i = 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next) {
      out.push_back(sym[static_cast<std::size_t>(i)].id);
    }
  }

  std::vector<std::string> tokens_;
  std::vector<std::string> pieces_;
  std::vector<std::int32_t> types_;
  std::unordered_map<std::string, std::int32_t> ids_;
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::array<std::int32_t, 256> byte_token_{};
  std::array<std::int16_t, 324> char_byte_{};  // byte characters are < U+0144
  std::vector<std::int32_t> specials_;
  std::int32_t bos_ = -1;
  std::int32_t eos_ = -1;
  bool add_bos_ = false;
};

}  // namespace kvc::llama
