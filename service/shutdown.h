// Why the server stops, whichever comes first: SIGTERM/SIGINT (drain within
// --grace_period, exit 0) or a lost device (every request already failed by
// the engine loop; NOT_SERVING, a short drain, exit kExitDeviceLost, so that
// Kubernetes restarts the container).
#pragma once

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "batcher/observer.h"

namespace coalesce::service {

// The exit code after a lost device (1 is any other runtime failure, 2 a bad
// flag).
inline constexpr int kExitDeviceLost = 3;
// The drain after a lost device, at most (and at most --grace_period): the
// failed streams only need to send their final status.
inline constexpr absl::Duration kDeviceLostDrain = absl::Seconds(5);
// After the drain, how long the generations it ended have to send their
// final message (finish_reason CANCELLED, with usage) before gRPC cancels
// what is left (a client that does not read).
inline constexpr absl::Duration kFinalMessageTime = absl::Seconds(5);
// Once every call has ended, how long the server keeps its connections
// before it exits. gRPC leaves each open for its client to close (it has had
// GOAWAY): a connection the server closed while the client had not yet read
// its last frames would be reset, and the client would lose them.
inline constexpr absl::Duration kCloseLinger = absl::Milliseconds(500);

struct ShutdownReason {
  int exit_code = 0;
  std::string why;  // for the log: "Terminated", "device lost: ..."
};

// A one-shot, thread-safe "stop now, for this reason".
class ShutdownTrigger {
 public:
  // The first call decides; later ones are ignored. Never blocks for long,
  // so the engine thread may call it.
  void Request(int exit_code, std::string why);
  // Blocks until Request has been called; returns the first reason.
  ShutdownReason Wait();

 private:
  absl::Mutex mu_;
  std::optional<ShutdownReason> reason_ ABSL_GUARDED_BY(mu_);
};

// Watches the engine loop: every callback goes on to `next` (the metrics);
// a failed step that lost the device is logged as an error and requests
// shutdown with kExitDeviceLost. The loop has ended every request by then.
class DeviceLossWatcher : public batcher::ForwardingObserver {
 public:
  // `next` may be null; `trigger` must outlive the watcher.
  DeviceLossWatcher(batcher::LoopObserver* next, ShutdownTrigger* trigger)
      : ForwardingObserver(next), trigger_(trigger) {}
  void OnEngineFailure(const absl::Status& status, bool device_lost) override;

 private:
  ShutdownTrigger* const trigger_;
};

}  // namespace coalesce::service
