// Timing after probe passes (tools/bench/probe_pairs.h): one probe pass
// before every pass, the medians and extremes taken over them, and the first
// failed pass ending the run with its status. No speed is asserted beyond
// what sleeps guarantee: the machine is shared.
#include "tools/bench/probe_pairs.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "absl/time/clock.h"

namespace coalesce::bench {
namespace {

TEST(ProbePairsTest, EveryPassFollowsAProbePassAndTheSummariesAreTheirs) {
  engine::MemoryReadProbe probe(1, 8, size_t{1} << 20);
  int calls = 0;
  // Pass i sleeps i + 1 ms: the median pass is at least 4 ms, the fastest at
  // least 1.
  const ProbePairs pairs = TimeAfterProbePasses(probe, 7, [&](int i) {
    EXPECT_EQ(i, calls++);
    absl::SleepFor(absl::Milliseconds(i + 1));
    return absl::OkStatus();
  });
  ASSERT_TRUE(pairs.status.ok()) << pairs.status;
  EXPECT_EQ(calls, 7);
  ASSERT_EQ(pairs.probe_passes.size(), 7u);
  EXPECT_GE(pairs.seconds, 0.004);
  EXPECT_GE(pairs.fastest, 0.001);
  EXPECT_LE(pairs.fastest, pairs.seconds);
  const auto [low, high] =
      std::minmax_element(pairs.probe_passes.begin(), pairs.probe_passes.end());
  EXPECT_EQ(pairs.highest, *high);
  EXPECT_GE(pairs.bandwidth, *low);
  EXPECT_LE(pairs.bandwidth, pairs.highest);
  EXPECT_GT(*low, 0.0);
  EXPECT_DOUBLE_EQ(pairs.MedianShare(1e6), 1e6 / pairs.bandwidth / pairs.seconds);
  EXPECT_DOUBLE_EQ(pairs.BestShare(1e6), 1e6 / pairs.highest / pairs.fastest);
}

TEST(ProbePairsTest, TheFirstFailedPassEndsTheRunWithItsStatus) {
  engine::MemoryReadProbe probe(1, 8, size_t{1} << 20);
  int calls = 0;
  const ProbePairs pairs = TimeAfterProbePasses(probe, 7, [&](int i) {
    ++calls;
    return i == 3 ? absl::InternalError("step 3 failed") : absl::OkStatus();
  });
  EXPECT_EQ(pairs.status, absl::InternalError("step 3 failed"));
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(pairs.probe_passes.size(), 4u);
}

}  // namespace
}  // namespace coalesce::bench
