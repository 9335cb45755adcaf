#include "service/shutdown.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace coalesce::service {

void ShutdownTrigger::Request(int exit_code, std::string why) {
  absl::MutexLock lock(&mu_);
  if (!reason_.has_value()) reason_ = ShutdownReason{exit_code, std::move(why)};
}

ShutdownReason ShutdownTrigger::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::optional<ShutdownReason>* reason) { return reason->has_value(); }, &reason_));
  return *reason_;
}

void DeviceLossWatcher::OnEngineFailure(const absl::Status& status, bool device_lost) {
  ForwardingObserver::OnEngineFailure(status, device_lost);
  if (!device_lost) return;
  Log(LogLevel::kError,
      absl::StrCat("device lost (", status.ToString(),
                   "): every request has failed; reporting NOT_SERVING and exiting with code ",
                   kExitDeviceLost, " after a short drain"));
  trigger_->Request(kExitDeviceLost, absl::StrCat("device lost: ", status.message()));
}

}  // namespace coalesce::service
