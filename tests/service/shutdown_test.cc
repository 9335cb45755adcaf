// The shutdown trigger (first reason wins) and the device-loss watcher: it
// passes every loop event on and stops the server only for a lost device.
#include "service/shutdown.h"

#include <thread>

#include "engine/backend.h"
#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

TEST(ShutdownTriggerTest, TheFirstReasonWinsAndWaitReturnsIt) {
  ShutdownTrigger trigger;
  ShutdownReason seen;
  std::thread waiter([&] { seen = trigger.Wait(); });
  trigger.Request(kExitDeviceLost, "device lost: gone");
  trigger.Request(0, "Terminated");
  waiter.join();
  EXPECT_EQ(seen.exit_code, kExitDeviceLost);
  EXPECT_EQ(seen.why, "device lost: gone");
  EXPECT_EQ(trigger.Wait().exit_code, kExitDeviceLost);
}

class Recorder : public batcher::LoopObserver {
 public:
  void OnPreempted() override { ++preempted; }
  void OnEngineFailure(const absl::Status& status, bool device_lost) override {
    ++failures;
    last_device_lost = device_lost;
  }
  int preempted = 0;
  int failures = 0;
  bool last_device_lost = false;
};

TEST(DeviceLossWatcherTest, ForwardsEverythingAndStopsOnlyForALostDevice) {
  Recorder next;
  ShutdownTrigger trigger;
  DeviceLossWatcher watcher(&next, &trigger);
  watcher.OnPreempted();
  watcher.OnEngineFailure(absl::InternalError("one bad step"), false);
  EXPECT_EQ(next.preempted, 1);
  EXPECT_EQ(next.failures, 1);
  EXPECT_FALSE(next.last_device_lost);

  // Not stopped yet: a later request decides.
  trigger.Request(0, "probe");
  EXPECT_EQ(trigger.Wait().exit_code, 0);

  ShutdownTrigger trigger2;
  DeviceLossWatcher watcher2(&next, &trigger2);
  watcher2.OnEngineFailure(absl::Status(engine::kDeviceLostCode, "sticky error"), true);
  EXPECT_EQ(next.failures, 2);
  EXPECT_TRUE(next.last_device_lost);
  ShutdownReason reason = trigger2.Wait();
  EXPECT_EQ(reason.exit_code, kExitDeviceLost);
  EXPECT_NE(reason.why.find("sticky error"), std::string::npos);
}

}  // namespace
}  // namespace coalesce::service
