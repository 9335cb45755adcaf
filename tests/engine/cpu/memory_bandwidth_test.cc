// The bandwidth probe (cpu/memory_bandwidth.h): its passes count the bytes
// they read, on any number of threads and streams, and say nothing (0, not
// infinity or NaN) of a buffer too small for one step of each stream. No
// speed is asserted: the machine is shared.
#include "engine/cpu/memory_bandwidth.h"

#include <gtest/gtest.h>

#include <cmath>

namespace coalesce::engine {
namespace {

TEST(MemoryReadProbeTest, EveryPassMeasuresAFiniteRate) {
  for (const int threads : {1, 2, 3}) {
    for (const int streams : {1, 8, 64}) {
      MemoryReadProbe probe(threads, streams, size_t{8} << 20);
      for (int pass = 0; pass < 3; ++pass) {
        const double rate = probe.Pass();
        EXPECT_TRUE(std::isfinite(rate)) << threads << " threads, " << streams << " streams";
        // More than a megabyte a second and less than a petabyte: a pass
        // that counted no bytes, or its seconds as bytes, is outside.
        EXPECT_GT(rate, 1e6) << threads << " threads, " << streams << " streams";
        EXPECT_LT(rate, 1e15) << threads << " threads, " << streams << " streams";
      }
    }
  }
}

TEST(MemoryReadProbeTest, ABufferTooSmallForItsStreamsReadsNothing) {
  // 64 streams of 16 floats each need 4 KiB; 1 KiB is under one step.
  MemoryReadProbe probe(1, 64, 1024);
  EXPECT_EQ(probe.Pass(), 0.0);
}

TEST(MemoryReadProbeTest, TheBestOfFivePassesIsARate) {
  const double rate = MeasureMemoryReadBandwidth(2, 8);
  EXPECT_GT(rate, 1e6);
  EXPECT_LT(rate, 1e15);
}

}  // namespace
}  // namespace coalesce::engine
