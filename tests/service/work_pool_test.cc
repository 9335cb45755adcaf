#include "service/work_pool.h"

#include <atomic>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

TEST(WorkPoolTest, RunsEveryJobPostedBeforeItStops) {
  std::atomic<int> ran{0};
  {
    WorkPool pool(2, 100);
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(pool.TryPost([&] { ++ran; }, i % 3 == 0));
  }
  EXPECT_EQ(ran, 50);
}

// In each test, what the jobs use is declared before the pool, so that it
// outlives the pool's destructor, which runs what is queued and joins.

TEST(WorkPoolTest, SmallJobsRunWhileLargeOnesHoldEveryOtherThread) {
  absl::Notification release, large_started, small_ran;
  std::atomic<int> large_ran{0};
  WorkPool pool(2, 100);
  // Two large jobs: one runs (and blocks), the other must wait, because the
  // last thread is kept for small jobs.
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(pool.TryPost(
        [&] {
          ++large_ran;
          if (!large_started.HasBeenNotified()) large_started.Notify();
          release.WaitForNotification();
        },
        /*large=*/true));
  }
  large_started.WaitForNotification();
  ASSERT_TRUE(pool.TryPost([&] { small_ran.Notify(); }));
  EXPECT_TRUE(small_ran.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(large_ran, 1);
  release.Notify();
}

TEST(WorkPoolTest, RefusesJobsBeyondItsQueue) {
  absl::Notification release;
  absl::BlockingCounter started(2);
  WorkPool pool(2, 3);
  // Two running jobs hold both threads; three more fill the queue.
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(pool.TryPost([&] {
      started.DecrementCount();
      release.WaitForNotification();
    }));
  }
  started.Wait();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.TryPost([] {}));
  EXPECT_FALSE(pool.TryPost([] {}));
  release.Notify();
}

}  // namespace
}  // namespace coalesce::service
