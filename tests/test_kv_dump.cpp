// kvc::io KV dumps: exact round trips, the byte layout the header documents, every truncation and
// every flipped byte rejected as corrupt, header inconsistencies, I/O errors, write-side validation
// (nothing written), views onto the right elements, and a dump fed through a cache and decode
// attention giving exactly what the original arrays give.
#include "test_util.hpp"

#include <kvc/io/kv_dump.hpp>

#include <bit>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace {

using namespace kvc_test;
using kvc::Errc;
using kvc::io::KVDump;
using kvc::io::KVDumpLayer;
namespace fs = std::filesystem;

using Bytes = std::vector<unsigned char>;

/// A unique scratch directory per test (ctest runs tests of the three builds in parallel).
class KvDumpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::random_device rd;
    dir_ = fs::path(::testing::TempDir()) /
           ("kvc_kv_dump_" + std::string(kvc::simd_path_name()) + "_" + info->name() + "_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static Bytes load(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  static void save(const std::string& p, const Bytes& b, std::size_t n) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(n));
  }
  static void save(const std::string& p, const Bytes& b) { save(p, b, b.size()); }

  fs::path dir_;
};

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------
std::uint64_t fnv1a(const unsigned char* p, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}
std::uint32_t rd32(const Bytes& b, std::size_t off) {
  return std::uint32_t(b[off]) | std::uint32_t(b[off + 1]) << 8 | std::uint32_t(b[off + 2]) << 16 |
         std::uint32_t(b[off + 3]) << 24;
}
std::uint64_t rd64(const Bytes& b, std::size_t off) { return rd32(b, off) | std::uint64_t(rd32(b, off + 4)) << 32; }
void wr32(Bytes& b, std::size_t off, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[off + i] = static_cast<unsigned char>(v >> (8 * i));
}
/// Recomputes the trailing checksum, so a deliberately inconsistent header gets past it.
void rehash(Bytes& b) {
  const std::uint64_t h = fnv1a(b.data(), b.size() - 8);
  for (int i = 0; i < 8; ++i) b[b.size() - 8 + i] = static_cast<unsigned char>(h >> (8 * i));
}
float rdf(const Bytes& b, std::size_t off) { return std::bit_cast<float>(rd32(b, off)); }

/// Arrays whose every element tells where it is: array a, dumped layer i, token t, head h, channel c.
/// Unique (and exact in float) for a < 10, i < 10, t < 100, h < 10, c < 100.
float tag(int a, int i, int t, int h, int c) { return float(a * 1000000 + i * 100000 + t * 1000 + h * 100 + c) * 0.5f; }

KVDump tagged_dump(int tokens, int q_heads, int kv_heads, int d, std::vector<int> model_layers, bool pre, bool qs,
                   std::string model = "SmolLM2-135M", std::string source = "unit test, \xc3\xa9t\xc3\xa9") {
  KVDump x;
  x.model = std::move(model);
  x.source = std::move(source);
  x.tokens = tokens;
  x.q_heads = q_heads;
  x.kv_heads = kv_heads;
  x.head_dim = d;
  x.rope_theta = 100000.0f;
  for (std::size_t i = 0; i < model_layers.size(); ++i) {
    KVDumpLayer l;
    l.layer = model_layers[i];
    auto fill = [&](std::vector<float>& v, int a, int heads) {
      v.resize(std::size_t(tokens) * heads * d);
      for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h)
          for (int c = 0; c < d; ++c) v[(std::size_t(t) * heads + h) * d + c] = tag(a, int(i), t, h, c);
    };
    fill(l.k, 1, kv_heads);
    if (pre) fill(l.k_pre_rope, 2, kv_heads);
    fill(l.v, 3, kv_heads);
    if (qs) fill(l.q, 4, q_heads);
    x.layers.push_back(std::move(l));
  }
  return x;
}

/// The small file the corruption tests mutate: 2 layers, 3 tokens, 2/1 heads, head_dim 4, everything.
KVDump small_dump() { return tagged_dump(3, 2, 1, 4, {5, 2}, true, true, "m", "src"); }

void expect_same(const KVDump& a, const KVDump& b) {
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.source, b.source);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.q_heads, b.q_heads);
  EXPECT_EQ(a.kv_heads, b.kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(a.rope_theta), std::bit_cast<std::uint32_t>(b.rope_theta));
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    EXPECT_EQ(a.layers[i].layer, b.layers[i].layer);
    EXPECT_TRUE(bytes_equal(a.layers[i].k, b.layers[i].k)) << "layer " << i;
    EXPECT_TRUE(bytes_equal(a.layers[i].k_pre_rope, b.layers[i].k_pre_rope)) << "layer " << i;
    EXPECT_TRUE(bytes_equal(a.layers[i].v, b.layers[i].v)) << "layer " << i;
    EXPECT_TRUE(bytes_equal(a.layers[i].q, b.layers[i].q)) << "layer " << i;
  }
}

// ------------------------------------------------------------------------------------------------
// Round trips and the byte layout
// ------------------------------------------------------------------------------------------------
TEST_F(KvDumpTest, RoundTripEveryFlagCombinationAndStringPadding) {
  int n = 0;
  for (bool pre : {false, true})
    for (bool qs : {false, true}) {
      // model names of 0..3 bytes mod 4 exercise every padding length
      const std::string model(std::size_t(n) + 4 * std::size_t(n), 'x'), source(std::size_t(3 - n), 'y');
      const KVDump x = tagged_dump(5, 6, 2, 16, {0, 29, 7}, pre, qs, model, source);
      const std::string p = path("rt" + std::to_string(n++) + ".bin");
      kvc::io::write_kv_dump(p, x);
      EXPECT_FALSE(fs::exists(p + ".tmp"));
      const KVDump y = kvc::io::read_kv_dump(p);
      SCOPED_TRACE("pre " + std::to_string(pre) + " queries " + std::to_string(qs));
      expect_same(x, y);
      EXPECT_EQ(y.has_pre_rope_keys(), pre);
      EXPECT_EQ(y.has_queries(), qs);
      if (!pre) KVC_EXPECT_ERROR((void)y.keys_pre_rope(0), Errc::kInvalidArgument, "has no pre-RoPE keys");
      if (!qs) KVC_EXPECT_ERROR((void)y.queries(0, 0), Errc::kInvalidArgument, "has no queries");
    }
  // real-looking values (denormals, negative zero, extremes) survive bit for bit
  KVDump x = tagged_dump(2, 1, 1, 16, {3}, false, false);
  x.layers[0].k[0] = -0.0f;
  x.layers[0].k[1] = std::numeric_limits<float>::denorm_min();
  x.layers[0].k[2] = std::numeric_limits<float>::max();
  x.layers[0].v[3] = -std::numeric_limits<float>::max();
  kvc::io::write_kv_dump(path("special.bin"), x);
  expect_same(x, kvc::io::read_kv_dump(path("special.bin")));
}

TEST_F(KvDumpTest, FileLayoutMatchesTheDocumentedFormat) {
  const KVDump x = tagged_dump(3, 4, 2, 8, {11, 4}, true, true, "abcde", "xy");
  const std::string p = path("layout.bin");
  kvc::io::write_kv_dump(p, x);
  const Bytes b = load(p);
  ASSERT_GE(b.size(), 48u);
  EXPECT_EQ(std::memcmp(b.data(), "KVCDUMP\0", 8), 0);
  EXPECT_EQ(rd32(b, 8), 1u);    // version
  EXPECT_EQ(rd32(b, 12), 2u);   // n_layers
  EXPECT_EQ(rd32(b, 16), 3u);   // tokens
  EXPECT_EQ(rd32(b, 20), 4u);   // q_heads
  EXPECT_EQ(rd32(b, 24), 2u);   // kv_heads
  EXPECT_EQ(rd32(b, 28), 8u);   // head_dim
  EXPECT_EQ(rd32(b, 32), 3u);   // flags: pre-RoPE keys | queries
  EXPECT_EQ(rdf(b, 36), 100000.0f);
  EXPECT_EQ(rd32(b, 40), 5u);   // "abcde" + 3 bytes of padding
  EXPECT_EQ(std::memcmp(b.data() + 44, "abcde\0\0\0", 8), 0);
  EXPECT_EQ(rd32(b, 52), 2u);   // "xy" + 2 bytes of padding
  EXPECT_EQ(std::memcmp(b.data() + 56, "xy\0\0", 4), 0);
  EXPECT_EQ(rd32(b, 60), 11u);  // model layer indices
  EXPECT_EQ(rd32(b, 64), 4u);
  const std::size_t N = 3 * 2 * 8, M = 3 * 4 * 8, data = 68, per_layer = 4 * (3 * N + M);
  ASSERT_EQ(b.size(), data + 2 * per_layer + 8);
  // dumped layer 1: K, K pre-RoPE, V, Q in [token][head][dim] order
  const std::size_t l1 = data + per_layer;
  EXPECT_EQ(rdf(b, l1 + 4 * ((2 * 2 + 1) * 8 + 7)), tag(1, 1, 2, 1, 7));
  EXPECT_EQ(rdf(b, l1 + 4 * (N + (1 * 2 + 0) * 8 + 3)), tag(2, 1, 1, 0, 3));
  EXPECT_EQ(rdf(b, l1 + 4 * (2 * N + (0 * 2 + 1) * 8 + 5)), tag(3, 1, 0, 1, 5));
  EXPECT_EQ(rdf(b, l1 + 4 * (3 * N + (2 * 4 + 3) * 8 + 6)), tag(4, 1, 2, 3, 6));
  EXPECT_EQ(rdf(b, data), tag(1, 0, 0, 0, 0));
  EXPECT_EQ(rd64(b, b.size() - 8), fnv1a(b.data(), b.size() - 8));
  // without the optional arrays the file shrinks accordingly and flags are 0
  const KVDump y = tagged_dump(3, 4, 2, 8, {11, 4}, false, false, "abcd", "");
  kvc::io::write_kv_dump(p, y);
  const Bytes c = load(p);
  EXPECT_EQ(rd32(c, 32), 0u);
  EXPECT_EQ(c.size(), 40 + 4 + 4 + 4 + 8 + 2 * 4 * (2 * N) + 8);
}

// ------------------------------------------------------------------------------------------------
// Corrupt files
// ------------------------------------------------------------------------------------------------
TEST_F(KvDumpTest, EveryTruncationIsCorrupt) {
  const std::string good = path("good.bin"), p = path("cut.bin");
  kvc::io::write_kv_dump(good, small_dump());
  const Bytes b = load(good);
  ASSERT_GT(b.size(), 400u);
  for (std::size_t n = 0; n < b.size(); ++n) {
    save(p, b, n);
    SCOPED_TRACE("length " + std::to_string(n));
    KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, p);
  }
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "truncated or sizes inconsistent");
  save(p, b, 5);
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "is truncated");
  // one byte too many is as wrong as one too few
  Bytes longer = b;
  longer.push_back(0);
  save(p, longer);
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "implies");
}

TEST_F(KvDumpTest, EveryFlippedByteIsCorrupt) {
  const std::string good = path("good.bin"), p = path("flip.bin");
  kvc::io::write_kv_dump(good, small_dump());
  const Bytes b = load(good);
  for (std::size_t i = 0; i < b.size(); ++i)
    for (int bit : {0x01, 0x80}) {
      Bytes c = b;
      c[i] ^= static_cast<unsigned char>(bit);
      save(p, c);
      SCOPED_TRACE("byte " + std::to_string(i) + " bit " + std::to_string(bit));
      KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, p);
    }
  // in the data or the checksum itself: reported as a checksum mismatch
  for (std::size_t i : {b.size() - 100, b.size() - 9, b.size() - 1}) {
    Bytes c = b;
    c[i] ^= 0x10;
    save(p, c);
    KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "checksum mismatch");
  }
}

TEST_F(KvDumpTest, BadMagicAndVersion) {
  const std::string good = path("good.bin"), p = path("bad.bin");
  kvc::io::write_kv_dump(good, small_dump());
  const Bytes b = load(good);
  Bytes c = b;
  c[3] = 'X';
  save(p, c);
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "bad magic");
  save(p, Bytes{'G', 'G', 'U', 'F', 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "bad magic");
  for (std::uint32_t v : {0u, 2u, 0x01000000u}) {
    c = b;
    wr32(c, 8, v);
    rehash(c);
    save(p, c);
    KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, "unsupported version " + std::to_string(v));
  }
}

TEST_F(KvDumpTest, InconsistentHeadersAreCorrupt) {
  const std::string good = path("good.bin"), p = path("bad.bin");
  kvc::io::write_kv_dump(good, small_dump());
  const Bytes b = load(good);
  auto expect_corrupt = [&](auto&& mutate, const std::string& msg) {
    Bytes c = b;
    mutate(c);
    rehash(c);  // only the inconsistency itself is wrong
    save(p, c);
    KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(p), Errc::kCorruptFile, msg);
  };
  // sizes that do not match the file length (n_layers, tokens, kv_heads, head_dim, flags)
  expect_corrupt([](Bytes& c) { wr32(c, 12, 3); }, "3 layers x 3 tokens");
  expect_corrupt([](Bytes& c) { wr32(c, 16, 4); }, "truncated or sizes inconsistent");
  expect_corrupt([](Bytes& c) { wr32(c, 16, 2); }, "truncated or sizes inconsistent");
  expect_corrupt([](Bytes& c) { wr32(c, 20, 4); }, "implies");  // more query heads: larger Q arrays
  expect_corrupt([](Bytes& c) { wr32(c, 28, 8); }, "implies");
  expect_corrupt([](Bytes& c) { wr32(c, 32, 1); }, "implies");  // queries dropped from the flags
  // sizes whose products overflow: rejected before anything is allocated
  expect_corrupt([](Bytes& c) {
    wr32(c, 12, 0x7fffffff);
    wr32(c, 16, 0x7fffffff);
    wr32(c, 20, 0x7fffffff);
    wr32(c, 24, 0x7fffffff);
    wr32(c, 28, 0x7fffffff);
  }, "more than 2^64");
  expect_corrupt([](Bytes& c) { wr32(c, 16, 0x40000000); }, "implies");
  // field values that are invalid in themselves
  expect_corrupt([](Bytes& c) { wr32(c, 16, 0); }, "must lie in [1, 2^31)");
  expect_corrupt([](Bytes& c) { wr32(c, 24, 0x80000000u); }, "must lie in [1, 2^31)");
  expect_corrupt([](Bytes& c) { wr32(c, 20, 3); wr32(c, 24, 2); }, "q_heads 3 is not a multiple of kv_heads 2");
  expect_corrupt([](Bytes& c) { wr32(c, 32, 7); }, "unknown flags 0x7");
  expect_corrupt([](Bytes& c) { wr32(c, 36, 0x7fc00000u); }, "rope_theta");
  expect_corrupt([](Bytes& c) { wr32(c, 36, std::bit_cast<std::uint32_t>(-1.0f)); }, "rope_theta");
  expect_corrupt([](Bytes& c) { wr32(c, 40, 70000); }, "model name length 70000 exceeds");
  expect_corrupt([](Bytes& c) { wr32(c, 40, 0x7fffff00u); }, "exceeds");
  expect_corrupt([](Bytes& c) { wr32(c, 40, 600); }, "is truncated");  // fits the limit, not the file
  expect_corrupt([](Bytes& c) { c[45] = 'z'; }, "non-zero padding after the model name");
  // layer indices: duplicates, >= 2^31
  expect_corrupt([](Bytes& c) { wr32(c, 60, 5); }, "dumped layers 0 and 1 are both model layer 5");
  expect_corrupt([](Bytes& c) { wr32(c, 56, 0x80000000u); }, "is >= 2^31");
  // a NaN/Inf with a valid checksum (no writer of this format produces one)
  expect_corrupt([](Bytes& c) { wr32(c, 64 + 4 * 5, 0x7f800000u); },
                 "layer 0 (model layer 5) key token 1 head 0 channel 1");
  expect_corrupt([&](Bytes& c) { wr32(c, c.size() - 12, 0xffc00001u); }, "query token 2 head 1 channel 3");
  // and the untouched file still reads
  EXPECT_NO_THROW((void)kvc::io::read_kv_dump(good));
}

// ------------------------------------------------------------------------------------------------
// I/O errors and write-side validation
// ------------------------------------------------------------------------------------------------
TEST_F(KvDumpTest, UnreadableAndUnwritablePathsAreIoErrors) {
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(path("missing.bin")), Errc::kIo, "missing.bin");
  KVC_EXPECT_ERROR((void)kvc::io::read_kv_dump(dir_.string()), Errc::kIo, "not a regular file");
  const std::string nodir = path("no/such/dir/dump.bin");
  KVC_EXPECT_ERROR(kvc::io::write_kv_dump(nodir, small_dump()), Errc::kIo, "no/such/dir/dump.bin.tmp");
  EXPECT_FALSE(fs::exists(nodir + ".tmp"));
  // the target is a directory: the temporary file is written, the rename fails and it is removed
  const std::string d = path("a_directory");
  fs::create_directories(fs::path(d) / "x");
  KVC_EXPECT_ERROR(kvc::io::write_kv_dump(d, small_dump()), Errc::kIo, "cannot rename");
  EXPECT_FALSE(fs::exists(d + ".tmp"));
  EXPECT_TRUE(fs::is_directory(d));
  // the temporary name is occupied by a directory
  const std::string blocked = path("blocked.bin");
  fs::create_directories(blocked + ".tmp");
  KVC_EXPECT_ERROR(kvc::io::write_kv_dump(blocked, small_dump()), Errc::kIo, "cannot open");
  EXPECT_FALSE(fs::exists(blocked));
}

TEST_F(KvDumpTest, WriteValidatesBeforeWritingAnything) {
  const std::string p = path("v.bin");
  const KVDump good = small_dump();
  auto expect_rejected = [&](auto&& mutate, Errc code, const std::string& msg) {
    KVDump x = good;
    mutate(x);
    KVC_EXPECT_ERROR(x.validate(), code, msg);
    KVC_EXPECT_ERROR(kvc::io::write_kv_dump(p, x), code, msg);
    EXPECT_FALSE(fs::exists(p)) << msg;
    EXPECT_FALSE(fs::exists(p + ".tmp")) << msg;
  };
  using E = Errc;
  expect_rejected([](KVDump& x) { x.layers[1].k.pop_back(); }, E::kInvalidArgument,
                  "layer 1 (model layer 2): keys hold 11 floats, expected tokens * kv_heads * head_dim = 12");
  expect_rejected([](KVDump& x) { x.layers[0].v.push_back(1.0f); }, E::kInvalidArgument, "values hold 13 floats");
  expect_rejected([](KVDump& x) { x.layers[1].k_pre_rope.clear(); }, E::kInvalidArgument, "pre-RoPE keys hold 0");
  expect_rejected([](KVDump& x) { x.layers[0].k_pre_rope.clear(); }, E::kInvalidArgument,
                  "absent in layer 0, so in every layer");
  expect_rejected([](KVDump& x) { x.layers[1].q.resize(12); }, E::kInvalidArgument,
                  "queries hold 12 floats, expected tokens * q_heads * head_dim = 24");
  expect_rejected([](KVDump& x) { x.tokens = 4; }, E::kInvalidArgument, "keys hold 12 floats");
  expect_rejected([](KVDump& x) { x.tokens = 0; }, E::kInvalidArgument, "positive tokens");
  expect_rejected([](KVDump& x) { x.head_dim = -4; }, E::kInvalidArgument, "positive tokens");
  expect_rejected([](KVDump& x) { x.q_heads = 3; x.kv_heads = 2; }, E::kInvalidArgument, "not a multiple");
  expect_rejected([](KVDump& x) { x.layers.clear(); }, E::kInvalidArgument, "has no layers");
  expect_rejected([](KVDump& x) { x.layers[1].layer = 5; }, E::kInvalidArgument, "both model layer 5");
  expect_rejected([](KVDump& x) { x.layers[0].layer = -1; }, E::kInvalidArgument, "negative model layer");
  expect_rejected([](KVDump& x) { x.rope_theta = HUGE_VALF; }, E::kInvalidArgument, "rope_theta");
  expect_rejected([](KVDump& x) { x.model.assign(70000, 'm'); }, E::kInvalidArgument, "at most 65535 bytes");
  expect_rejected([](KVDump& x) { x.layers[1].v[5] = std::numeric_limits<float>::quiet_NaN(); }, E::kNonFinite,
                  "layer 1 (model layer 2) value token 1 head 0 channel 1");
  expect_rejected([](KVDump& x) { x.layers[0].q[23] = -HUGE_VALF; }, E::kNonFinite, "query token 2 head 1 channel 3");
  // a failed write leaves an existing file as it was
  kvc::io::write_kv_dump(p, good);
  const Bytes before = load(p);
  KVDump bad = good;
  bad.layers[0].k[0] = HUGE_VALF;
  KVC_EXPECT_ERROR(kvc::io::write_kv_dump(p, bad), Errc::kNonFinite, "NaN/Inf");
  EXPECT_EQ(load(p), before);
  // and a good write replaces it
  KVDump other = tagged_dump(7, 2, 2, 8, {1}, false, true);
  kvc::io::write_kv_dump(p, other);
  expect_same(other, kvc::io::read_kv_dump(p));
}

// ------------------------------------------------------------------------------------------------
// Views
// ------------------------------------------------------------------------------------------------
TEST_F(KvDumpTest, ViewsIndexTheRightElements) {
  constexpr int T = 5, Hq = 6, H = 2, d = 16;
  kvc::io::write_kv_dump(path("views.bin"), tagged_dump(T, Hq, H, d, {9, 4, 17}, true, true));
  const KVDump x = kvc::io::read_kv_dump(path("views.bin"));
  for (std::size_t i = 0; i < 3; ++i) {
    const kvc::KVView k = x.keys(i), kp = x.keys_pre_rope(i), v = x.values(i);
    for (const kvc::KVView& view : {k, kp, v}) {
      EXPECT_EQ(view.dim0, T);
      EXPECT_EQ(view.dim1, H);
      EXPECT_EQ(view.dim2, d);
    }
    EXPECT_EQ(k.data, x.layers[i].k.data());
    for (int t = 0; t < T; ++t) {
      const kvc::QueryView q = x.queries(i, t);
      EXPECT_EQ(q.dim0, 1);
      EXPECT_EQ(q.dim1, Hq);
      EXPECT_EQ(q.dim2, d);
      for (int h = 0; h < Hq; ++h)
        for (int c = 0; c < d; ++c) {
          EXPECT_EQ(q.row(0, h)[c], tag(4, int(i), t, h, c));
          if (h < H) {
            EXPECT_EQ(k.row(t, h)[c], tag(1, int(i), t, h, c));
            EXPECT_EQ(kp.row(t, h)[c], tag(2, int(i), t, h, c));
            EXPECT_EQ(v.row(t, h)[c], tag(3, int(i), t, h, c));
          }
        }
    }
  }
  EXPECT_EQ(x.index_of(4), 1u);
  EXPECT_EQ(&x.layer(17), &x.layers[2]);
  EXPECT_EQ(x.layer(9).layer, 9);
  KVC_EXPECT_ERROR((void)x.layer(5), Errc::kInvalidArgument,
                   "model layer 5 is not in the KV dump (it holds layers 9, 4, 17)");
  KVC_EXPECT_ERROR((void)x.keys(3), Errc::kInvalidArgument, "index 3 out of range [0, 3)");
  KVC_EXPECT_ERROR((void)x.queries(0, T), Errc::kInvalidArgument, "query token 5 out of range [0, 5)");
  KVC_EXPECT_ERROR((void)x.queries(0, -1), Errc::kInvalidArgument, "out of range");
  KVDump y = x;
  y.layers[1].v.pop_back();  // a hand-built, inconsistent dump never yields a view past its data
  KVC_EXPECT_ERROR((void)y.values(1), Errc::kInvalidArgument, "values hold");
}

// ------------------------------------------------------------------------------------------------
// End to end: dump -> file -> cache -> decode attention
// ------------------------------------------------------------------------------------------------
template <class Cache>
void expect_dump_feeds_like_arrays(const KVDump& dump, const std::vector<KV>& orig,
                                   const std::vector<std::vector<float>>& queries) {
  const int T = dump.tokens, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  const int L = static_cast<int>(dump.layers.size());
  Cache from_dump(kvc::CacheConfig{L, 1, H, d, T}), from_arrays(kvc::CacheConfig{L, 1, H, d, T});
  for (int i = 0; i < L; ++i) {
    const kvc::KVView k = dump.keys(std::size_t(i)), v = dump.values(std::size_t(i));
    // causal decode: append what position t sees, attend with the query of position t
    int len = 0;
    for (int t : {0, 40, 63, 150, 199}) {
      const int n = t + 1 - len;
      from_dump.append(i, 0, kvc::KVView{k.row(len, 0), n, H, d, k.stride0, k.stride1},
                       kvc::KVView{v.row(len, 0), n, H, d, v.stride0, v.stride1});
      append_kv(from_arrays, i, 0, [&] {
        KV part(n, H, d);
        std::copy_n(orig[std::size_t(i)].k.begin() + std::ptrdiff_t(orig[std::size_t(i)].at(len, 0, 0)), part.k.size(),
                    part.k.begin());
        std::copy_n(orig[std::size_t(i)].v.begin() + std::ptrdiff_t(orig[std::size_t(i)].at(len, 0, 0)), part.v.size(),
                    part.v.begin());
        return part;
      }());
      len = t + 1;
      std::vector<float> a(std::size_t(Hq) * d), b(a.size());
      kvc::decode_attention(from_dump, i, dump.queries(std::size_t(i), t),
                            kvc::OutputView::contiguous(a.data(), 1, Hq, d));
      const float* qt = queries[std::size_t(i)].data() + std::size_t(t) * Hq * d;
      kvc::decode_attention(from_arrays, i, kvc::QueryView::contiguous(qt, 1, Hq, d),
                            kvc::OutputView::contiguous(b.data(), 1, Hq, d));
      EXPECT_TRUE(bytes_equal(a, b)) << scheme_name<Cache> << " layer " << i << " position " << t;
      // and the cache sees the data exactly (fp32) / within its own bounds (checked elsewhere)
      if constexpr (std::is_same_v<Cache, sch::Fp32>) {
        std::vector<float> ref(a.size());
        kvc::reference::decode_attention(qt, Hq, orig[std::size_t(i)].k.data(), orig[std::size_t(i)].v.data(), t + 1,
                                         H, d, ref.data());
        EXPECT_LT(max_abs_diff(a, ref), 1e-5 * std::max(1.0, max_abs(ref)));
      }
    }
  }
  const auto dk = dequantize(from_dump, L - 1, 0), ak = dequantize(from_arrays, L - 1, 0);
  EXPECT_TRUE(bytes_equal(dk.k, ak.k) && bytes_equal(dk.v, ak.v));
}

TEST_F(KvDumpTest, EndToEndDumpFeedsCacheAndAttentionLikeTheArrays) {
  constexpr int T = 200, H = 3, Hq = 9, d = 64;
  KVDump dump;
  dump.model = "synthetic";
  dump.source = "random_kv, 3 outlier channels per head";
  dump.tokens = T;
  dump.q_heads = Hq;
  dump.kv_heads = H;
  dump.head_dim = d;
  dump.rope_theta = 10000.0f;
  std::vector<KV> orig;
  std::vector<std::vector<float>> queries;
  for (int i = 0; i < 2; ++i) {
    orig.push_back(random_kv(T, H, d, 500 + std::uint64_t(i)));
    queries.push_back(random_query(T, Hq, d, 900 + std::uint64_t(i), 0.5f));
    dump.layers.push_back({3 * i + 1, orig.back().k, {}, orig.back().v, queries.back()});
  }
  const std::string p = path("e2e.bin");
  kvc::io::write_kv_dump(p, dump);
  const KVDump loaded = kvc::io::read_kv_dump(p);
  expect_same(dump, loaded);
  expect_dump_feeds_like_arrays<sch::Fp32>(loaded, orig, queries);
  expect_dump_feeds_like_arrays<sch::Fp16>(loaded, orig, queries);
  expect_dump_feeds_like_arrays<sch::Kivi2>(loaded, orig, queries);
  expect_dump_feeds_like_arrays<sch::Int8>(loaded, orig, queries);
}

TEST(KvDumpPath, DefaultPathFollowsTheEnvironment) {
#if defined(_WIN32)
  GTEST_SKIP() << "POSIX setenv";
#else
  const char* old = std::getenv("KVC_KV_DUMP");
  const std::string saved = old ? old : "";
  ::setenv("KVC_KV_DUMP", "/some/where.bin", 1);
  EXPECT_EQ(kvc::io::default_kv_dump_path(), "/some/where.bin");
  ::setenv("KVC_KV_DUMP", "", 1);
  const std::string def = kvc::io::default_kv_dump_path();
  EXPECT_NE(def.find("smollm2_kv_dump.bin"), std::string::npos) << def;
  if (old) ::setenv("KVC_KV_DUMP", saved.c_str(), 1);
  else ::unsetenv("KVC_KV_DUMP");
#endif
}

}  // namespace
