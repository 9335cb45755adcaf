// The server's backend (service/backend_factory.h): the engine's, from
// ServerOptions, and the fault injector of --fault_injection. Runs without a
// GPU.
#include "service/backend_factory.h"

#include <memory>
#include <vector>

#include "engine/model/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/fault_injection.h"

namespace coalesce::service {
namespace {

using ::testing::HasSubstr;

// stories260K's end-of-sequence id, which the null backend must never emit.
const std::vector<int32_t> kEos = {2};

std::shared_ptr<const engine::Model> TinyModel() {
  static const auto model = [] {
    absl::StatusOr<engine::Model> m = engine::BuildSyntheticModel("synthetic:tiny");
    EXPECT_TRUE(m.ok()) << m.status();
    return std::make_shared<const engine::Model>(*std::move(m));
  }();
  return model;
}

TEST(FaultInjectionTest, StepsWorkUntilTheCountThenTheDeviceIsLostForGood) {
  ServerOptions o;
  o.device = engine::Device::kCpu;
  o.kv_cache_memory = "1MiB";
  o.fault_device_lost_after_steps = 2;
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend = CreateBackend(o, TinyModel(), kEos);
  ASSERT_TRUE(backend.ok()) << backend.status();
  engine::Backend& b = **backend;
  EXPECT_EQ(b.name(), "cpu");
  EXPECT_THAT(b.Describe(), HasSubstr("TESTING"));

  // One sequence, one token per step, in block 0.
  const std::vector<int32_t> table = {0};
  std::vector<engine::SampleSpec> sampling(1);
  std::vector<int32_t> next(1);
  int32_t token = 1;
  for (int pos = 0; pos < 4; ++pos) {
    const std::vector<int32_t> tokens = {token};
    const std::vector<engine::SequenceStep> seqs = {{1, pos, table}};
    absl::Status status = b.StepAndSample({tokens, seqs}, sampling, std::span<int32_t>(next));
    if (pos < 2) {
      ASSERT_TRUE(status.ok()) << status;
      token = next[0];
    } else {
      EXPECT_EQ(status.code(), engine::kDeviceLostCode) << "step " << pos;
      EXPECT_THAT(std::string(status.message()), HasSubstr("--fault_injection"));
    }
  }
}

}  // namespace
}  // namespace coalesce::service
