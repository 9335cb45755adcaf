#include "service/server_options.h"

#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

// --device is the engine's backend factory's (engine/factory/backend_factory.h).
using engine::Device;
using engine::ParseDevice;

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
  EXPECT_FALSE(ParseKvCacheDtype("auto")->has_value());
  EXPECT_EQ(**ParseKvCacheDtype("fp32"), engine::KvDtype::kFp32);
  EXPECT_EQ(**ParseKvCacheDtype("bf16"), engine::KvDtype::kBf16);
  EXPECT_EQ(**ParseKvCacheDtype("fp16"), engine::KvDtype::kFp16);
  EXPECT_EQ(**ParseKvCacheDtype("int8"), engine::KvDtype::kInt8);
  // fp8 is a name the flag takes; which backend holds it is the plan's to say.
  EXPECT_EQ(**ParseKvCacheDtype("fp8"), engine::KvDtype::kFp8);
  for (const char* bad : {"", "int4", "INT8", "e4m3", "float32"}) {
    absl::StatusOr<std::optional<engine::KvDtype>> parsed = ParseKvCacheDtype(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find("--kv_cache_dtype="), std::string::npos);
    EXPECT_NE(parsed.status().message().find("int8"), std::string::npos);
  }
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
