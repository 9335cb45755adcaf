// TESTING ONLY (--fault_injection): a Backend that behaves exactly like the
// one it wraps for a number of steps, then fails every later step with
// engine::kDeviceLostCode, as a GPU whose context is gone does. It lets the
// end-to-end tests drive the server's device-loss path on a machine without
// a GPU; a production server never has one.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "engine/backend.h"

namespace coalesce::service {

class DeviceLossInjector : public engine::Backend {
 public:
  // Steps [0, steps_before_loss) run on `inner`; every step after fails.
  DeviceLossInjector(std::unique_ptr<engine::Backend> inner, int steps_before_loss);

  absl::Status Step(const engine::StepBatch& batch, std::span<float> logits) override;
  absl::Status StepAndSample(const engine::StepBatch& batch,
                             std::span<const engine::SampleSpec> sampling,
                             std::span<int32_t> tokens) override;
  absl::Status CopyBlocks(std::span<const engine::BlockCopy> copies) override {
    return inner_->CopyBlocks(copies);
  }
  int64_t weight_bytes() const override { return inner_->weight_bytes(); }
  int64_t kv_bytes_per_token() const override { return inner_->kv_bytes_per_token(); }
  const engine::ModelConfig& config() const override { return inner_->config(); }
  const engine::KvCacheConfig& kv_cache() const override { return inner_->kv_cache(); }
  std::string_view name() const override { return inner_->name(); }
  engine::BackendCapabilities capabilities() const override { return inner_->capabilities(); }
  std::string Describe() const override;

 private:
  // Counts one step; the loss once the count is used up.
  absl::Status NextStep();

  const std::unique_ptr<engine::Backend> inner_;
  const int steps_before_loss_;
  int steps_ = 0;  // steps begun; only the engine thread steps
};

}  // namespace coalesce::service
