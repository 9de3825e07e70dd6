// KVC_DISPATCH_TARGET_ONLY (core/cpu_features.hpp), in kvc_tests_native with the rest of that target (-march=native
// when KVC_NATIVE): the build holds the paths the -m flags guarantee the CPU runs, the portable one only without AVX2.
// Not named test_*.cpp: kvc_tests (all paths) must not compile it, unless it is built with the knob too
// (KVC_TESTS_TARGET_ONLY, tests/CMakeLists.txt); a program defines the knob in every TU or none.
#include <kvc/attention/reference.hpp>
#include <kvc/kvc.hpp>

#include "test_data.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {

TEST(DispatchTargetOnly, CompilesThePathsTheTargetRuns) {
  static_assert(kvc::isa_compiled(kvc::Isa::kAuto));
  EXPECT_EQ(kvc::isa_compiled(kvc::Isa::kAvx512), bool(KVC_HAS_AVX512()));
  EXPECT_EQ(kvc::isa_compiled(kvc::Isa::kAvx2), bool(KVC_HAS_AVX2()));
  EXPECT_EQ(kvc::isa_compiled(kvc::Isa::kPortable), !bool(KVC_HAS_AVX2()));  // at least one path
  // -march=native: this CPU runs what the target asks for, so kAuto picks the widest compiled path
  const kvc::Isa want = KVC_HAS_AVX512() ? kvc::Isa::kAvx512 : KVC_HAS_AVX2() ? kvc::Isa::kAvx2 : kvc::Isa::kPortable;
  if (kvc::isa_supported(want) && std::getenv("KVC_FORCE_ISA") == nullptr) {
    EXPECT_EQ(kvc::resolve_isa(kvc::Isa::kAuto), want);
  }
}

// Every path: the compiled ones attend (kExact: the reference attention over the dequantized cache at float
// rounding), the others throw kInvalidArgument naming the knob and leave the output as it was.
TEST(DispatchTargetOnly, CompiledPathsAttendAndTheOthersThrow) {
  using Cache = kvc::schemes::Kivi4;
  const int T = 300, H = 2, Hq = 4, d = 64;
  const kvc_test::KV x = kvc_test::random_kv(T, H, d, 7);
  Cache cache({1, 1, H, d, T});
  cache.append(0, 0, x.kview(0, T), x.vview(0, T));
  const std::vector<float> q = kvc_test::random_query(1, Hq, d, 8);
  const auto deq = kvc_test::dequantize(cache, 0, 0);
  std::vector<float> want(std::size_t(Hq) * d);
  kvc::reference::decode_attention(q.data(), Hq, deq.k.data(), deq.v.data(), T, H, d, want.data());
  int ran = 0;
  for (kvc::Isa isa : {kvc::Isa::kPortable, kvc::Isa::kAvx2, kvc::Isa::kAvx512}) {
    std::vector<float> out(want.size(), 42.0f);
    kvc::AttentionOptions opt;
    opt.isa = isa;
    opt.precision = kvc::Precision::kExact;
    auto attend = [&] {
      kvc::decode_attention(cache, 0, kvc::QueryView::contiguous(q.data(), 1, Hq, d),
                            kvc::OutputView::contiguous(out.data(), 1, Hq, d), opt);
    };
    if (kvc::isa_supported(isa)) {
      attend();
      EXPECT_LE(kvc_test::max_abs_diff(out, want), 1e-5 * kvc_test::max_abs(want)) << kvc::isa_name(isa);
      ++ran;
    } else if (!kvc::isa_compiled(isa)) {
      try {
        attend();
        ADD_FAILURE() << kvc::isa_name(isa) << " ran without being compiled";
      } catch (const kvc::Error& e) {
        EXPECT_EQ(e.code(), kvc::Errc::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find("KVC_DISPATCH_TARGET_ONLY"), std::string::npos) << e.what();
      }
      EXPECT_EQ(out, std::vector<float>(want.size(), 42.0f));
    }
  }
  EXPECT_GE(ran, 1);
}

}  // namespace
