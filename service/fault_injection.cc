#include "service/fault_injection.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace coalesce::service {

DeviceLossInjector::DeviceLossInjector(std::unique_ptr<engine::Backend> inner,
                                       int steps_before_loss)
    : inner_(std::move(inner)), steps_before_loss_(steps_before_loss) {}

absl::Status DeviceLossInjector::NextStep() {
  if (steps_ < steps_before_loss_) {
    ++steps_;
    return absl::OkStatus();
  }
  // Sticky, like a real lost context: every later step fails the same way.
  return absl::Status(engine::kDeviceLostCode,
                      absl::StrCat("injected device loss after ", steps_before_loss_,
                                   " steps (--fault_injection)"));
}

absl::Status DeviceLossInjector::Step(const engine::StepBatch& batch, std::span<float> logits) {
  if (absl::Status status = NextStep(); !status.ok()) return status;
  return inner_->Step(batch, logits);
}

absl::Status DeviceLossInjector::StepAndSample(const engine::StepBatch& batch,
                                               std::span<const engine::SampleSpec> sampling,
                                               std::span<int32_t> tokens) {
  if (absl::Status status = NextStep(); !status.ok()) return status;
  // The inner backend's own StepAndSample (the CUDA one samples on the device).
  return inner_->StepAndSample(batch, sampling, tokens);
}

std::string DeviceLossInjector::Describe() const {
  return absl::StrCat(inner_->Describe(), " [TESTING: device lost after ", steps_before_loss_,
                      " steps]");
}

}  // namespace coalesce::service
