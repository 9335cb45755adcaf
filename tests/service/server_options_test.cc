#include "service/server_options.h"

#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

TEST(KvCacheMemoryTest, ParsesSizesFractionsAndAuto) {
  EXPECT_TRUE(ParseKvCacheMemory("auto")->automatic);
  EXPECT_EQ(ParseKvCacheMemory("512MiB")->bytes, 512LL << 20);
  EXPECT_EQ(ParseKvCacheMemory("2GB")->bytes, 2000000000LL);
  EXPECT_EQ(ParseKvCacheMemory("1048576")->bytes, 1048576);
  EXPECT_DOUBLE_EQ(ParseKvCacheMemory("0.25")->fraction, 0.25);
  for (const char* bad : {"", "lots", "-1", "12parsecs", "0"}) {
    EXPECT_FALSE(ParseKvCacheMemory(bad).ok()) << bad;
  }
}

TEST(KvCacheMemoryTest, AutoIsBoundedByBatchAndByMemory) {
  const KvCacheMemory automatic{.automatic = true};
  // 16 sequences x 128 blocks of 1 KiB = 2 MiB, well under a quarter of 1 GiB.
  EXPECT_EQ(KvCacheBlocks(automatic, 1024, 128, 16, 1LL << 30), 16 * 128);
  // The same with 4 MiB of memory: a quarter (1 MiB) is the limit.
  EXPECT_EQ(KvCacheBlocks(automatic, 1024, 128, 16, 4LL << 20), 1024);
  EXPECT_EQ(KvCacheBlocks({.bytes = 10240}, 1024, 128, 16, 1LL << 30), 10);
  EXPECT_EQ(KvCacheBlocks({.fraction = 0.5}, 1024, 128, 16, 1LL << 20), 512);
}

TEST(DeviceFlagsTest, ParsesDeviceDtypeAndFaultInjection) {
  EXPECT_EQ(*ParseDevice("auto"), Device::kAuto);
  EXPECT_EQ(*ParseDevice("cpu"), Device::kCpu);
  EXPECT_EQ(*ParseDevice("cuda"), Device::kCuda);
  EXPECT_EQ(*ParseDevice("null"), Device::kNull);
  EXPECT_FALSE(ParseDevice("gpu").ok());
  EXPECT_FALSE(ParseDevice("none").ok());
  EXPECT_FALSE(ParseDtype("auto")->has_value());
  EXPECT_EQ(**ParseDtype("bf16"), engine::Precision::kBf16);
  EXPECT_EQ(**ParseDtype("fp16"), engine::Precision::kFp16);
  EXPECT_EQ(**ParseDtype("fp32"), engine::Precision::kFp32);
  EXPECT_FALSE(ParseDtype("int8").ok());
  EXPECT_FALSE(ParseOverlapSteps("auto")->has_value());
  EXPECT_TRUE(**ParseOverlapSteps("on"));
  EXPECT_FALSE(**ParseOverlapSteps("off"));
  EXPECT_FALSE(ParseOverlapSteps("true").ok());
  EXPECT_EQ(*ParseFaultInjection(""), -1);
  EXPECT_EQ(*ParseFaultInjection("device_lost_after_steps:0"), 0);
  EXPECT_EQ(*ParseFaultInjection("device_lost_after_steps:25"), 25);
  for (const char* bad : {"device_lost_after_steps:", "device_lost_after_steps:-1",
                          "device_lost_after_steps:x", "oom_after_steps:3", "25"}) {
    EXPECT_FALSE(ParseFaultInjection(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace coalesce::service
