// LogWindow (LogQuant's selection rule, SPEC §4.2) against a literal simulation of Algorithm 1.
#include <kvc/select/log_window.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace {

/// Algorithm 1 as written: FP a list, compaction when |FP| == 3W.
struct Literal {
  int w;
  std::vector<int> fp, evicted;
  void append(int t) {
    if (int(fp.size()) < 3 * w) {
      fp.push_back(t);
      return;
    }
    std::vector<int> keep;
    for (int i = 0; i < 2 * w; i += 2) keep.push_back(fp[i]);
    for (int i = 1; i < 2 * w; i += 2) evicted.push_back(fp[i]);
    for (int i = 2 * w; i < 3 * w; ++i) keep.push_back(fp[i]);
    keep.push_back(t);
    fp = keep;
  }
};

template <int W>
void expect_matches_algorithm_1(int tokens) {
  using LW = kvc::LogWindow<W>;
  typename LW::State s;
  Literal lit{W, {}, {}};
  std::vector<int> evicted, seen(std::size_t(tokens), 0);
  int buf[W];
  for (int t = 0; t < tokens; ++t) {
    const int e = LW::append(s, t, buf);
    evicted.insert(evicted.end(), buf, buf + e);
    lit.append(t);
    ASSERT_EQ(std::vector<int>(s.pos, s.pos + s.size), lit.fp) << "W " << W << " after token " << t;
    ASSERT_EQ(evicted, lit.evicted) << "W " << W << " after token " << t;
    ASSERT_EQ(int(evicted.size()), LW::evicted_count(t + 1));
    ASSERT_EQ(s.size, LW::kept_count(t + 1));
    ASSERT_LE(s.size, LW::kCapacity);
    ASSERT_EQ(s.pos[0], 0) << "position 0 is never evicted";
  }
  for (int p : evicted) ASSERT_EQ(seen[std::size_t(p)]++, 0) << "token " << p << " evicted twice";
}

TEST(LogWindow, EqualsAlgorithm1AfterEveryAppend) {
  expect_matches_algorithm_1<1>(300);
  expect_matches_algorithm_1<2>(500);
  expect_matches_algorithm_1<4>(1000);
  expect_matches_algorithm_1<42>(2100);
}

TEST(LogWindow, PaperExampleW4At100) {
  // SPEC §4.2: W = 4, t = 100: FP = {0, 84, 88, 90, 92, 93, ..., 99} (the list before token 100).
  kvc::LogWindow<4>::State s;
  int buf[4];
  for (int t = 0; t < 100; ++t) kvc::LogWindow<4>::append(s, t, buf);
  std::vector<int> want{0, 84, 88, 90, 92};
  for (int t = 93; t <= 99; ++t) want.push_back(t);
  EXPECT_EQ(std::vector<int>(s.pos, s.pos + s.size), want);
}
}  // namespace
