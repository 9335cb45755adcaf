// Step-by-step tests of the scheduling decision with a fake clock. Times are
// written as milliseconds after t0.
#include "batcher/scheduler.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const absl::Time t0 = absl::FromUnixSeconds(1000);
absl::Time Ms(double ms) { return t0 + absl::Milliseconds(ms); }

// No queue timeout and no aging unless a test sets them.
SchedulerConfig Config(int max_batch_size, double window_ms,
                       BatchingMode mode = BatchingMode::kContinuous) {
  SchedulerConfig c;
  c.max_batch_size = max_batch_size;
  c.batch_window = absl::Milliseconds(window_ms);
  c.mode = mode;
  c.priority_aging = absl::InfiniteDuration();
  return c;
}

WaitingRequest Req(uint64_t id, double arrival_ms, int blocks = 1) {
  return {id, Ms(arrival_ms), blocks};
}

QueueState State(std::span<const WaitingRequest> waiting, int running, int free_blocks) {
  QueueState state;
  state.waiting = waiting;
  state.running = running;
  state.free_blocks = free_blocks;
  return state;
}

// A Decision names requests by their position in the queue; the tests read
// it with each position replaced by the id of the request there.
struct IdExpired {
  uint64_t id;
  ExpiryReason reason;
  bool operator==(const IdExpired&) const = default;
};
struct IdDecision {
  std::vector<IdExpired> expired;
  std::vector<uint64_t> admit;
  HoldReason hold;
  std::optional<absl::Time> reconsider_at;
};
IdDecision Decide(const Scheduler& s, const QueueState& state, absl::Time now) {
  const Decision d = s.Schedule(state, now);
  IdDecision out{{}, {}, d.hold, d.reconsider_at};
  for (const Expired& e : d.expired) out.expired.push_back({state.waiting[e.index].id, e.reason});
  for (const int i : d.admit) out.admit.push_back(state.waiting[i].id);
  return out;
}

TEST(SchedulerTest, NothingWaitingAdmitsNothingAndSetsNoTimer) {
  Scheduler s(Config(4, 10));
  IdDecision d = Decide(s, State({}, 0, 100), Ms(0));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kNone);
  EXPECT_FALSE(d.reconsider_at.has_value());
}

TEST(SchedulerTest, LoneRequestWaitsExactlyTheWindow) {
  Scheduler s(Config(4, 10));
  std::vector<WaitingRequest> waiting = {Req(1, 0)};
  // t=0: the window opens.
  IdDecision d = Decide(s, State(waiting, 0, 100), Ms(0));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kWindowOpen);
  EXPECT_EQ(d.reconsider_at, Ms(10));
  // t=9.999: still open.
  d = Decide(s, State(waiting, 0, 100), Ms(9.999));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.reconsider_at, Ms(10));
  // t=10: closed, admitted.
  d = Decide(s, State(waiting, 0, 100), Ms(10));
  EXPECT_THAT(d.admit, ElementsAre(1));
  EXPECT_EQ(d.hold, HoldReason::kNone);
  EXPECT_FALSE(d.reconsider_at.has_value());
}

TEST(SchedulerTest, WindowIsMeasuredFromTheOldestArrival) {
  Scheduler s(Config(4, 10));
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 6)};
  IdDecision d = Decide(s, State(waiting, 0, 100), Ms(6));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.reconsider_at, Ms(10));  // not 16
  d = Decide(s, State(waiting, 0, 100), Ms(10));
  EXPECT_THAT(d.admit, ElementsAre(1, 2));  // the later one rides along
}

TEST(SchedulerTest, FillingTheFreeSlotsClosesTheWindowEarly) {
  Scheduler s(Config(4, 50));
  // Requests 1..3 arrive at 0, 1, 2 ms: the window stays open.
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 1), Req(3, 2)};
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(2)).admit, IsEmpty());
  // Request 4 at 3 ms fills the 4 free slots: all go now, 47 ms early.
  waiting.push_back(Req(4, 3));
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(3)).admit, ElementsAre(1, 2, 3, 4));
}

TEST(SchedulerTest, JoiningARunningBatchFillsOnlyTheFreeSlots) {
  Scheduler s(Config(4, 50));
  // 3 running, 1 free slot: one arrival fills it, no window wait.
  std::vector<WaitingRequest> one = {Req(7, 0)};
  EXPECT_THAT(Decide(s, State(one, 3, 100), Ms(0)).admit, ElementsAre(7));
  // 2 running, 2 free: one arrival waits for a companion or the window.
  IdDecision d = Decide(s, State(one, 2, 100), Ms(0));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kWindowOpen);
  EXPECT_THAT(Decide(s, State(one, 2, 100), Ms(50)).admit, ElementsAre(7));
}

TEST(SchedulerTest, ZeroWindowAdmitsAtOnce) {
  Scheduler s(Config(4, 0));
  std::vector<WaitingRequest> waiting = {Req(1, 0)};
  EXPECT_THAT(Decide(s, State(waiting, 1, 100), Ms(0)).admit, ElementsAre(1));
}

TEST(SchedulerTest, FullBatchHoldsEveryoneWithoutATimer) {
  Scheduler s(Config(2, 0));
  std::vector<WaitingRequest> waiting = {Req(1, 0)};
  IdDecision d = Decide(s, State(waiting, 2, 100), Ms(100));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
  // A slot frees only when a sequence leaves, which wakes the loop anyway.
  EXPECT_FALSE(d.reconsider_at.has_value());
}

TEST(SchedulerTest, MoreArrivalsThanSlotsAdmitsTheOldestInOrder) {
  Scheduler s(Config(3, 10));
  std::vector<WaitingRequest> waiting = {Req(5, 0), Req(6, 1), Req(7, 2), Req(8, 3)};
  IdDecision d = Decide(s, State(waiting, 0, 100), Ms(3));
  EXPECT_THAT(d.admit, ElementsAre(5, 6, 7));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
}

TEST(SchedulerTest, KvBlocksLimitAdmissionWithoutOvertaking) {
  Scheduler s(Config(8, 0));
  // 10 free blocks: request 1 (4) fits, request 2 (8) does not; request 3
  // (1) would fit but must not overtake request 2.
  std::vector<WaitingRequest> waiting = {Req(1, 0, 4), Req(2, 1, 8), Req(3, 2, 1)};
  IdDecision d = Decide(s, State(waiting, 0, 10), Ms(5));
  EXPECT_THAT(d.admit, ElementsAre(1));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeBlocks);
}

// A request for several samples takes a slot for each, all at once.
TEST(SchedulerTest, SamplesTakeASlotEachAndCloseTheWindowByTheirSlots) {
  Scheduler s(Config(4, 50));
  WaitingRequest three = Req(1, 0);
  three.slots = 3;
  // Three slots of four wanted: the window stays open; a fourth closes it.
  std::vector<WaitingRequest> waiting = {three};
  IdDecision d = Decide(s, State(waiting, 0, 100), Ms(1));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kWindowOpen);
  waiting.push_back(Req(2, 1));
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(1)).admit, ElementsAre(1, 2));
  // With two running only two slots are free: the three samples wait, and
  // the single request behind them does not overtake.
  d = Decide(s, State(waiting, 2, 100), Ms(60));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
  d = Decide(s, State(waiting, 1, 100), Ms(60));
  EXPECT_THAT(d.admit, ElementsAre(1));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
}

TEST(SchedulerTest, StaticBatchingWaitsForTheWholeBatchToFinish) {
  Scheduler s(Config(4, 10, BatchingMode::kStatic));
  std::vector<WaitingRequest> waiting = {Req(1, 0)};
  // One sequence still runs: a static batch admits nobody, even with room.
  IdDecision d = Decide(s, State(waiting, 1, 100), Ms(500));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kStaticBatchRunning);
  // Empty engine: the window rule applies to the new batch.
  d = Decide(s, State(waiting, 0, 100), Ms(5));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.reconsider_at, Ms(10));
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(10)).admit, ElementsAre(1));
}

TEST(SchedulerTest, HigherPriorityGoesFirstThenArrival) {
  Scheduler s(Config(2, 0));
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 1), Req(3, 2), Req(4, 3)};
  waiting[2].priority = 5;
  waiting[3].priority = 5;
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(3)).admit, ElementsAre(3, 4));
  EXPECT_THAT(Decide(s, State(waiting, 1, 100), Ms(3)).admit, ElementsAre(3));
}

TEST(SchedulerTest, AgingRaisesAWaitingRequestOneLevelPerInterval) {
  SchedulerConfig config = Config(1, 0);
  config.priority_aging = absl::Milliseconds(100);
  Scheduler s(config);
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 250)};
  waiting[1].priority = 2;
  // At 250 ms request 1 has aged 2 levels: a tie at 2, and it is older.
  EXPECT_EQ(s.EffectivePriority(waiting[0], Ms(250)), 2);
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(250)).admit, ElementsAre(1));
  // At 199 ms it had aged only once: request 2 (arriving at 150 ms here)
  // would still win.
  waiting[1].arrival = Ms(150);
  EXPECT_THAT(Decide(s, State(waiting, 0, 100), Ms(199)).admit, ElementsAre(2));
  // The next aging step is a reason to decide again.
  EXPECT_EQ(Decide(s, State(waiting, 1, 100), Ms(199)).reconsider_at, Ms(200));
}

TEST(SchedulerTest, QueueTimeoutExpiresRequestsNeverAdmitted) {
  SchedulerConfig config = Config(1, 0);
  config.max_queue_wait = absl::Milliseconds(100);
  Scheduler s(config);
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 50), Req(3, 0)};
  waiting[2].preempted = true;  // admitted before: exempt
  IdDecision d = Decide(s, State(waiting, 1, 100), Ms(99));
  EXPECT_THAT(d.expired, IsEmpty());
  EXPECT_EQ(d.reconsider_at, Ms(100));
  d = Decide(s, State(waiting, 1, 100), Ms(100));
  EXPECT_THAT(d.expired, ElementsAre(IdExpired{1, ExpiryReason::kQueueTimeout}));
  EXPECT_EQ(d.reconsider_at, Ms(150));
}

TEST(SchedulerTest, DeadlinesExpireWaitingRequestsAndWakeTheLoop) {
  Scheduler s(Config(4, 20));
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 0)};
  waiting[0].deadline = Ms(5);
  IdDecision d = Decide(s, State(waiting, 0, 100), Ms(0));
  EXPECT_EQ(d.reconsider_at, Ms(5));  // before the window's end at 20
  d = Decide(s, State(waiting, 0, 100), Ms(5));
  EXPECT_THAT(d.expired, ElementsAre(IdExpired{1, ExpiryReason::kDeadline}));
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.reconsider_at, Ms(20));
}

TEST(SchedulerTest, DecisionsNamePositionsInTheQueueAsGiven) {
  // The queue in no particular order: the decision's positions index it as
  // given. Id 5's deadline passed; 3 then 7 are admitted by arrival.
  SchedulerConfig config = Config(2, 0);
  Scheduler s(config);
  std::vector<WaitingRequest> waiting = {Req(9, 5), Req(3, 0), Req(5, 1), Req(7, 2)};
  waiting[2].deadline = Ms(4);
  const Decision d = s.Schedule(State(waiting, 0, 100), Ms(6));
  EXPECT_THAT(d.expired, ElementsAre(Expired{2, ExpiryReason::kDeadline}));
  EXPECT_THAT(d.admit, ElementsAre(1, 3));
}

// ---------------------------------------------------------------------------
// Whole timelines: a tiny world in which each running sequence needs a
// number of steps, every step takes 4 ms, and the scheduler decides at each
// step boundary, as the engine loop does.
// ---------------------------------------------------------------------------

struct Arrival {
  uint64_t id;
  double at_ms;
  int steps;  // decode steps until it finishes
};

struct StepRecord {
  double at_ms;
  std::vector<uint64_t> admitted;
  std::vector<uint64_t> running;  // after admission, in admission order
  bool operator==(const StepRecord&) const = default;
};

std::ostream& operator<<(std::ostream& os, const StepRecord& r) {
  os << "{t=" << r.at_ms << " admitted=[";
  for (auto id : r.admitted) os << id << " ";
  os << "] running=[";
  for (auto id : r.running) os << id << " ";
  return os << "]}";
}

class World {
 public:
  World(SchedulerConfig config, std::vector<Arrival> arrivals)
      : scheduler_(config), arrivals_(std::move(arrivals)) {}

  void Cancel(uint64_t id, double at_ms) { cancels_[id] = at_ms; }

  // Runs until everything finished; one record per engine step.
  std::vector<StepRecord> Run(double step_ms = 4) {
    std::vector<StepRecord> records;
    double now = 0;
    while (now < 1000) {
      // Arrivals and cancellations up to now enter/leave the queue.
      for (const Arrival& a : arrivals_) {
        if (a.at_ms <= now && !seen_.contains(a.id)) {
          seen_.insert(a.id);
          waiting_.push_back(Req(a.id, a.at_ms));
          steps_left_[a.id] = a.steps;
        }
      }
      for (auto& [id, at] : cancels_) {
        if (at > now) continue;
        std::erase_if(waiting_, [id = id](const WaitingRequest& w) { return w.id == id; });
        std::erase(running_, id);
      }
      IdDecision d =
          Decide(scheduler_, State(waiting_, static_cast<int>(running_.size()), 1000), Ms(now));
      for (uint64_t id : d.admit) {
        running_.push_back(id);
        std::erase_if(waiting_, [id](const WaitingRequest& w) { return w.id == id; });
      }
      if (running_.empty()) {
        if (waiting_.empty() && seen_.size() == arrivals_.size()) break;
        // Idle: sleep until the window ends or the next arrival.
        double next = 1000;
        if (d.reconsider_at) next = absl::ToDoubleMilliseconds(*d.reconsider_at - t0);
        for (const Arrival& a : arrivals_) {
          if (!seen_.contains(a.id)) next = std::min(next, a.at_ms);
        }
        now = next;
        continue;
      }
      records.push_back({now, d.admit, running_});
      // The step: every running sequence advances; finished ones leave.
      for (uint64_t id : running_) --steps_left_[id];
      std::erase_if(running_, [&](uint64_t id) { return steps_left_[id] == 0; });
      now += step_ms;
    }
    return records;
  }

 private:
  Scheduler scheduler_;
  std::vector<Arrival> arrivals_;
  std::map<uint64_t, double> cancels_;
  std::set<uint64_t> seen_;
  std::vector<WaitingRequest> waiting_;
  std::vector<uint64_t> running_;
  std::map<uint64_t, int> steps_left_;
};

TEST(SchedulerTimelineTest, ContinuousBatchingJoinsAndLeavesAtStepBoundaries) {
  // Window 6 ms, 3 slots. Req 1: 0 ms, 2 steps; req 2: 2 ms, 5 steps;
  // req 3: 9 ms, 2 steps; req 4: 10 ms, 1 step.
  World world(Config(3, 6), {{1, 0, 2}, {2, 2, 5}, {3, 9, 2}, {4, 10, 1}});
  //          Req 1   Req 2   Req 3   Req 4
  // t=0      arrives                          window open until 6 (idle)
  // t=2              arrives                  still open
  // t=6      joins   joins                    window closed
  // t=10     runs    runs    joins   waits    one free slot, two waiting:
  //                                           filled at once, oldest first
  // t=14     (left)  runs    runs    joins    1 left after t=10
  // t=18             runs    (left)  (left)
  // t=22             runs
  const std::vector<StepRecord> expected = {
      {6, {1, 2}, {1, 2}}, {10, {3}, {1, 2, 3}}, {14, {4}, {2, 3, 4}}, {18, {}, {2}}, {22, {}, {2}},
  };
  EXPECT_EQ(world.Run(), expected);
}

TEST(SchedulerTimelineTest, StaticBatchingRunsEachBatchToTheEnd) {
  World world(Config(2, 0, BatchingMode::kStatic), {{1, 0, 3}, {2, 0, 1}, {3, 1, 1}});
  const std::vector<StepRecord> expected = {
      {0, {1, 2}, {1, 2}},
      {4, {}, {1}},  // 2 finished, but 3 may not join the running batch
      {8, {}, {1}},
      {12, {3}, {3}},  // the batch is over: the next one starts
  };
  EXPECT_EQ(world.Run(), expected);
}

TEST(SchedulerTimelineTest, CancelledRequestsLeaveAndFreeTheirSlot) {
  World world(Config(1, 0), {{1, 0, 50}, {2, 1, 1}});
  world.Cancel(1, 7);  // cancelled while running
  const std::vector<StepRecord> expected = {
      {0, {1}, {1}},
      {4, {}, {1}},
      {8, {2}, {2}},  // 1 left at the boundary at 8 ms; 2 took the slot
  };
  EXPECT_EQ(world.Run(), expected);
}

TEST(SchedulerTimelineTest, CancelledWhileWaitingNeverRuns) {
  World world(Config(4, 20), {{1, 0, 1}, {2, 5, 1}});
  world.Cancel(1, 10);
  // 1 leaves the queue before the window ends; 2's window starts at 5 ms.
  const std::vector<StepRecord> expected = {{25, {2}, {2}}};
  EXPECT_EQ(world.Run(), expected);
}

}  // namespace
}  // namespace coalesce::batcher
