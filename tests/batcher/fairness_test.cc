// Fairness between tenants in the scheduling decision (scheduler.h): shares
// of the batch by weight, order within a tenant, preemption for a tenant
// below its share, and that decisions settle instead of preempting back and
// forth. Within a tenant: preemption for a higher priority (with aging, so a
// preempted request finishes) and for a request whose samples hold more than
// their share of the batch.
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "batcher/scheduler.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/batcher/kv_loop.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const absl::Time t0 = absl::FromUnixSeconds(1000);

SchedulerConfig Config(int max_batch_size, BatchingMode mode = BatchingMode::kContinuous) {
  SchedulerConfig c;
  c.max_batch_size = max_batch_size;
  c.mode = mode;
  c.priority_aging = absl::InfiniteDuration();
  return c;
}

// Request `id` of `tenant`, arrived `id` ms after t0.
WaitingRequest Req(uint64_t id, int tenant, int priority = 0, int blocks = 1) {
  WaitingRequest r;
  r.id = id;
  r.arrival = t0 + absl::Milliseconds(id);
  r.blocks_needed = blocks;
  r.priority = priority;
  r.tenant = tenant;
  return r;
}

// A running sequence of a request of its own (ids from 1000000 on, apart
// from the waiting requests').
RunningEntry Seq(int tenant, int priority = 0, int blocks = 1) {
  static uint64_t next_id = 1000000;
  return {.tenant = tenant,
          .priority = priority,
          .slots = 1,
          .blocks_released = blocks,
          .id = next_id++,
          .arrival = t0};
}

// One of the samples of request `id` (GenerationRequest::n), after its fork.
RunningEntry Sample(uint64_t id, int tenant = 0, int priority = 0) {
  return {.tenant = tenant,
          .priority = priority,
          .slots = 1,
          .blocks_released = 1,
          .id = id,
          .arrival = t0};
}

QueueState State(std::span<const WaitingRequest> waiting, std::span<const RunningEntry> running,
                 int free_blocks, std::span<const double> weights) {
  QueueState state;
  state.waiting = waiting;
  for (const RunningEntry& e : running) state.running += e.slots;
  state.running_seqs = running;
  state.free_blocks = free_blocks;
  state.tenant_weights = weights;
  return state;
}

std::vector<uint64_t> AdmittedIds(const Decision& d, std::span<const WaitingRequest> waiting) {
  std::vector<uint64_t> ids;
  for (const int i : d.admit) ids.push_back(waiting[i].id);
  return ids;
}

TEST(FairnessTest, AnEmptyBatchIsSharedByWeight) {
  const Scheduler s(Config(8));
  const std::vector<double> weights = {1, 3};
  std::vector<WaitingRequest> waiting;
  for (uint64_t id = 1; id <= 10; ++id) waiting.push_back(Req(id, 0));
  for (uint64_t id = 11; id <= 20; ++id) waiting.push_back(Req(id, 1));
  const Decision d = s.Schedule(State(waiting, {}, 100, weights), t0 + absl::Seconds(1));
  // Tenant 1 (weight 3) gets 6 slots, tenant 0 (weight 1) 2, each in its own
  // arrival order; next is the tenant with the fewer slots per weight after
  // the admission (ties: the older request).
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(11, 12, 1, 13, 14, 15, 2, 16));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
  EXPECT_THAT(d.preempt, IsEmpty());
}

TEST(FairnessTest, PrioritiesOrderWorkOnlyWithinATenant) {
  const Scheduler s(Config(4));
  const std::vector<double> weights = {1, 1};
  // Tenant 0's requests carry a high priority; it still gets only its half.
  std::vector<WaitingRequest> waiting = {Req(1, 0, 9), Req(2, 0, 9), Req(3, 0, 9),
                                         Req(4, 1, 0), Req(5, 1, 5), Req(6, 1, 0)};
  const Decision d = s.Schedule(State(waiting, {}, 100, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1, 5, 2, 4));
}

TEST(FairnessTest, ATenantWithoutWaitingWorkLeavesItsShareToTheOthers) {
  const Scheduler s(Config(8));
  const std::vector<double> weights = {1, 1};
  // Tenant 1 wants one slot: tenant 0 takes the other seven.
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 0), Req(3, 0), Req(4, 0), Req(5, 0),
                                         Req(6, 0), Req(7, 0), Req(8, 0), Req(9, 0), Req(10, 1)};
  const Decision d = s.Schedule(State(waiting, {}, 100, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1, 10, 2, 3, 4, 5, 6, 7));
}

TEST(FairnessTest, ATenantBelowItsSharePreemptsTheMostLoadedTenantsLatestSequence) {
  const Scheduler s(Config(4));
  const std::vector<double> weights = {1, 1, 1};
  // Tenant 0 runs all four slots (the last admitted with a higher priority);
  // tenant 1 arrives.
  const std::vector<RunningEntry> running = {Seq(0), Seq(0), Seq(0, 3), Seq(0)};
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 1)};
  const Decision d = s.Schedule(State(waiting, running, 0, weights), t0 + absl::Seconds(1));
  // Its lowest priority, latest admitted: position 3.
  EXPECT_THAT(d.preempt, ElementsAre(3));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(2));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);  // tenant 0's next request waits
}

TEST(FairnessTest, PreemptionMakesRoomForKvBlocksToo) {
  const Scheduler s(Config(8));
  const std::vector<double> weights = {1, 1};
  // Free slots, but tenant 1's request needs 5 blocks and 1 is free: two of
  // tenant 0's sequences (2 blocks each) go back.
  const std::vector<RunningEntry> running = {Seq(0, 0, 2), Seq(0, 0, 2), Seq(0, 0, 2),
                                             Seq(0, 0, 2)};
  std::vector<WaitingRequest> waiting = {Req(1, 1, 0, 5)};
  const Decision d = s.Schedule(State(waiting, running, 1, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, ElementsAre(3, 2));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1));
}

TEST(FairnessTest, NoPreemptionForATenantAtItsShare) {
  const Scheduler s(Config(4));
  const std::vector<double> weights = {1, 1};
  const std::vector<RunningEntry> running = {Seq(0), Seq(0), Seq(1), Seq(1)};
  std::vector<WaitingRequest> waiting = {Req(1, 1), Req(2, 0)};
  const Decision d = s.Schedule(State(waiting, running, 10, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, IsEmpty());
  EXPECT_THAT(d.admit, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
}

TEST(FairnessTest, PreemptionStopsBeforeTheClaimantWouldRunMoreThanTheVictim) {
  const Scheduler s(Config(4));
  // Tenant 0 runs 3, tenant 1 runs 1 and wants a second: tenant 0 keeps 2,
  // as many as tenant 1 then: preempted. Tenant 1's third would leave it 3
  // against 1: refused.
  const std::vector<double> weights = {1, 1};
  const std::vector<RunningEntry> running = {Seq(0), Seq(1), Seq(0), Seq(0)};
  std::vector<WaitingRequest> waiting = {Req(1, 1), Req(2, 1)};
  const Decision d = s.Schedule(State(waiting, running, 10, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, ElementsAre(3));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1));
}

TEST(FairnessTest, WithinATenantOnlyAHigherPriorityPreempts) {
  const Scheduler s(Config(2));
  // The same priority as the running requests: it waits.
  std::vector<RunningEntry> running = {Seq(0, 1), Seq(0, 1)};
  std::vector<WaitingRequest> waiting = {Req(1, 0, 1)};
  Decision d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
  // A higher one than one of them takes the room of the lowest.
  running = {Seq(0, 1), Seq(0, 0)};
  d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, ElementsAre(1));
  EXPECT_THAT(d.preempt_reasons, ElementsAre(PreemptReason::kPriority));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1));
}

TEST(FairnessTest, RunningRequestsAgeSoTheGapBetweenTwoNeverGrows) {
  SchedulerConfig config = Config(1);
  config.priority_aging = absl::Seconds(10);
  const Scheduler s(config);
  // Priority 0 running since t0 (Seq's arrival).
  const std::vector<RunningEntry> running = {Seq(0, 0)};
  // Priority 2, arrived 5 s later: 2 against 0 at t0 + 5 s; preempts.
  std::vector<WaitingRequest> waiting = {Req(5000, 0, 2)};
  Decision d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(5));
  EXPECT_THAT(d.preempt, ElementsAre(0));
  // Priority 2, arrived 25 s later: the running request has aged to 2 by
  // then, and stays ahead of any newer arrival of priority 2.
  waiting = {Req(25000, 0, 2)};
  for (const int s_after : {25, 40, 1000}) {
    d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(s_after));
    EXPECT_THAT(d.preempt, IsEmpty()) << s_after;
  }
}

TEST(FairnessTest, APreemptedLowPriorityRequestOutranksNewHighPriorityOnesAfterAging) {
  SchedulerConfig config = Config(1);
  config.priority_aging = absl::Seconds(10);
  const Scheduler s(config);
  // Request 1 (priority 0, arrived at t0 + 1 ms) was preempted and waits;
  // request 2 (priority 3) arrives at t0 + 31 s and so does the free slot.
  WaitingRequest low = Req(1, 0, 0);
  low.preempted = true;
  WaitingRequest high = Req(31000, 0, 3);
  std::vector<WaitingRequest> waiting = {high, low};
  const Decision d = s.Schedule(State(waiting, {}, 10, {}), t0 + absl::Seconds(31));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1));  // 3 by aging, and older
}

TEST(FairnessTest, ARequestsSamplesGiveUpSlotsToWaitingRequests) {
  const Scheduler s(Config(4));
  // Request 77's four samples hold the batch; five requests wait.
  const std::vector<RunningEntry> running = {Sample(77), Sample(77), Sample(77), Sample(77)};
  std::vector<WaitingRequest> waiting = {Req(1, 0), Req(2, 0), Req(3, 0), Req(4, 0), Req(5, 0)};
  const Decision d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(1));
  // Each newcomer takes the latest sample's slot while request 77 keeps at
  // least as many as the newcomer's: three go, one sample stays.
  EXPECT_THAT(d.preempt, ElementsAre(3, 2, 1));
  EXPECT_THAT(d.preempt_reasons, ElementsAre(PreemptReason::kSamples, PreemptReason::kSamples,
                                             PreemptReason::kSamples));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1, 2, 3));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
}

TEST(FairnessTest, APreemptedSampleWaitsBehindRequestsWithNothingRunning) {
  const Scheduler s(Config(4));
  // Request 77 runs three samples and waits with its fourth (preempted,
  // older than everyone); request 6 arrives.
  const std::vector<RunningEntry> running = {Sample(77), Sample(77), Sample(77), Seq(0)};
  WaitingRequest sample = Req(77, 0);
  sample.arrival = t0 - absl::Seconds(5);
  sample.preempted = true;
  std::vector<WaitingRequest> waiting = {sample, Req(6, 0)};
  const Decision d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(1));
  // Request 6 first, in place of one of 77's samples; 77's waiting sample
  // may not take the single request's slot back.
  EXPECT_THAT(d.preempt, ElementsAre(2));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(6));
  EXPECT_EQ(d.hold, HoldReason::kNoFreeSlot);
}

TEST(FairnessTest, SamplesOfAHigherPriorityAreNotPreemptedForALowerOne) {
  const Scheduler s(Config(2));
  const std::vector<RunningEntry> running = {Sample(77, 0, 5), Sample(77, 0, 5)};
  std::vector<WaitingRequest> waiting = {Req(1, 0, 0)};
  const Decision d = s.Schedule(State(waiting, running, 10, {}), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, IsEmpty());
}

TEST(FairnessTest, APriorityPreemptsOnlyWithinItsTenant) {
  const Scheduler s(Config(4));
  const std::vector<double> weights = {1, 1};
  // Tenant 1, at its share, asks priority 9: it takes the room of its own
  // priority-0 sequence, not tenant 0's.
  const std::vector<RunningEntry> running = {Seq(0), Seq(0), Seq(1), Seq(1)};
  std::vector<WaitingRequest> waiting = {Req(1, 1, 9)};
  const Decision d = s.Schedule(State(waiting, running, 10, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, ElementsAre(3));
  EXPECT_THAT(d.preempt_reasons, ElementsAre(PreemptReason::kPriority));
  EXPECT_THAT(AdmittedIds(d, waiting), ElementsAre(1));
}

TEST(FairnessTest, StaticBatchingNeverPreempts) {
  const Scheduler s(Config(2, BatchingMode::kStatic));
  const std::vector<double> weights = {1, 1};
  const std::vector<RunningEntry> running = {Seq(0), Seq(0)};
  std::vector<WaitingRequest> waiting = {Req(1, 1)};
  const Decision d = s.Schedule(State(waiting, running, 10, weights), t0 + absl::Seconds(1));
  EXPECT_THAT(d.preempt, IsEmpty());
  EXPECT_EQ(d.hold, HoldReason::kStaticBatchRunning);
}

TEST(FairnessTest, SharesCountOnlyTenantsWithWork) {
  const Scheduler s(Config(12));
  const std::vector<double> weights = {1, 2, 3};
  const std::vector<RunningEntry> running = {Seq(0), Seq(0)};
  std::vector<WaitingRequest> waiting = {Req(1, 2)};
  const TenantShares shares = s.Shares(State(waiting, running, 0, weights));
  EXPECT_THAT(shares.running, ElementsAre(2, 0, 0));
  ASSERT_EQ(shares.share.size(), 3u);
  EXPECT_DOUBLE_EQ(shares.share[0], 3.0);  // 12 x 1 / (1 + 3)
  EXPECT_DOUBLE_EQ(shares.share[1], 0.0);  // no work
  EXPECT_DOUBLE_EQ(shares.share[2], 9.0);
}

// Random tenants, weights and batch sizes, every tenant with more work than
// the batch holds: decisions applied one after another (preemptions back to
// the queue, admissions into the batch) settle within a few rounds with a
// full batch, and then each tenant runs about its share.
TEST(FairnessTest, BackloggedTenantsSettleAtTheirShares) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int tenants = std::uniform_int_distribution<int>(2, 5)(rng);
    const int batch = std::uniform_int_distribution<int>(tenants, 24)(rng);
    std::vector<double> weights;
    for (int t = 0; t < tenants; ++t) {
      weights.push_back(std::uniform_int_distribution<int>(1, 4)(rng));
    }
    const Scheduler s(Config(batch));
    // Start from a batch full of tenant 0's sequences, the worst case.
    std::vector<RunningEntry> running(batch, Seq(0));
    std::vector<WaitingRequest> waiting;
    uint64_t next_id = 1;
    for (int t = 0; t < tenants; ++t) {
      for (int i = 0; i < batch; ++i) waiting.push_back(Req(next_id++, t));
    }
    int rounds = 0;
    for (;; ++rounds) {
      ASSERT_LT(rounds, batch + 2) << "trial " << trial << ": decisions do not settle";
      const Decision d = s.Schedule(State(waiting, running, 1000, weights), t0 + absl::Seconds(1));
      if (d.admit.empty() && d.preempt.empty()) break;
      std::vector<bool> gone(running.size(), false);
      for (const int i : d.preempt) {
        gone[i] = true;
        waiting.push_back(Req(next_id++, running[i].tenant));
      }
      std::vector<RunningEntry> kept;
      for (size_t i = 0; i < running.size(); ++i) {
        if (!gone[i]) kept.push_back(running[i]);
      }
      for (const int i : d.admit) kept.push_back(Seq(waiting[i].tenant));
      std::vector<bool> admitted(waiting.size(), false);
      for (const int i : d.admit) admitted[i] = true;
      std::vector<WaitingRequest> still;
      for (size_t i = 0; i < waiting.size(); ++i) {
        if (!admitted[i]) still.push_back(waiting[i]);
      }
      running = std::move(kept);
      waiting = std::move(still);
    }
    ASSERT_EQ(static_cast<int>(running.size()), batch) << "trial " << trial;
    const TenantShares shares = s.Shares(State(waiting, running, 1000, weights));
    for (int t = 0; t < tenants; ++t) {
      // Whole slots: each tenant runs its share within one slot per weight
      // ratio, and no exchange of one slot would even the loads further.
      const double load_t = shares.running[t] / weights[t];
      for (int v = 0; v < tenants; ++v) {
        if (v == t) continue;
        EXPECT_GT((shares.running[t] + 1) / weights[t], (shares.running[v] - 1) / weights[v])
            << "trial " << trial << ": tenant " << t << " could take a slot of tenant " << v;
      }
      EXPECT_LT(std::abs(shares.running[t] - shares.share[t]), 1.0 + weights[t])
          << "trial " << trial << " tenant " << t << " load " << load_t;
    }
  }
}

// The engine loop with tenants (GenerationRequest::tenant): a tenant that
// arrives at a batch full of another's sequences runs at the next step, the
// preempted sequences still produce exactly their output, and no KV block
// leaks (KvLoopTest checks the blocks after every tick).
class TenantLoopTest : public KvLoopTest {
 protected:
  // Request `i`'s prompt: three tokens of the fake backend's vocabulary.
  static std::vector<int32_t> Prompt(int i) {
    return {1 + i % 13, 1 + (i * 7) % 13, 1 + (i * 11 + 3) % 13};
  }
  GenerationRequest Of(std::string tenant, double weight, int i, int max_new_tokens) {
    GenerationRequest r = Request(Prompt(i), max_new_tokens);
    r.tenant = std::move(tenant);
    r.tenant_weight = weight;
    return r;
  }
  // Running sequences by tenant.
  std::map<std::string, int> RunningByTenant(const std::map<uint64_t, std::string>& tenant_of) {
    std::map<std::string, int> count;
    for (const auto& seq : loop_->Snapshot().running) ++count[tenant_of.at(seq.id)];
    return count;
  }
};

TEST_F(TenantLoopTest, AnArrivingTenantRunsAtTheNextStepAndNothingIsLost) {
  for (const bool with_tenants : {true, false}) {
    SCOPED_TRACE(with_tenants ? "two tenants" : "no tenants");
    MakeLoop({.num_blocks = 64, .block_size = 4, .max_batch_size = 4});
    std::vector<std::shared_ptr<Collector>> flood;
    for (int i = 0; i < 6; ++i) flood.push_back(Submit(Of(with_tenants ? "a" : "", 1, i, 20)));
    for (int i = 0; i < 3; ++i) Tick();
    auto b = Submit(Of(with_tenants ? "b" : "", 1, 6, 5));
    Tick();
    if (with_tenants) {
      // Admitted at once, in place of tenant a's latest sequence: its first
      // token is out after one step.
      EXPECT_EQ(b->ids().size(), 1u);
      EXPECT_EQ(observer_.fairness_preemptions["a"], 1);
    } else {
      // One tenant: it waits behind the earlier requests.
      EXPECT_TRUE(b->ids().empty());
      EXPECT_TRUE(observer_.fairness_preemptions.empty());
    }
    flood.push_back(b);
    RunUntilFinished(flood);
    for (size_t i = 0; i < flood.size(); ++i) {
      const int n = i + 1 == flood.size() ? 5 : 20;
      EXPECT_EQ(flood[i]->ids(), KvBackend::Expected(Prompt(static_cast<int>(i)), n))
          << "request " << i;
    }
    EXPECT_EQ(Available(), 64);
  }
}

TEST_F(TenantLoopTest, AHigherPriorityRunsAtTheNextStepAndThePreemptedOneLosesNothing) {
  MakeLoop({.num_blocks = 64, .block_size = 4, .max_batch_size = 2});
  std::vector<std::shared_ptr<Collector>> sinks;
  for (int i = 0; i < 2; ++i) sinks.push_back(Submit(Request(Prompt(i), 20, "", i)));
  for (int i = 0; i < 3; ++i) Tick();
  auto high = Submit(Request(Prompt(2), 5, "", 7));
  Tick();
  // In place of the lowest priority (request 0).
  EXPECT_EQ(high->ids().size(), 1u);
  EXPECT_EQ(observer_.admission_preemptions["priority"], 1);
  EXPECT_EQ(sinks[0]->ids().size(), 3u);
  EXPECT_EQ(sinks[1]->ids().size(), 4u);
  sinks.push_back(high);
  RunUntilFinished(sinks);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(sinks[i]->ids(), KvBackend::Expected(Prompt(i), i == 2 ? 5 : 20)) << "request " << i;
  }
  EXPECT_EQ(observer_.preemptions, 0);  // none for KV blocks
  EXPECT_EQ(Available(), 64);
}

TEST_F(TenantLoopTest, WeightsSplitTheBatch) {
  MakeLoop({.num_blocks = 128, .block_size = 4, .max_batch_size = 8});
  std::map<uint64_t, std::string> tenant_of;
  std::vector<std::shared_ptr<Collector>> sinks;
  auto submit = [&](const std::string& tenant, double weight, int i) {
    uint64_t id = 0;
    sinks.push_back(Submit(Of(tenant, weight, i, 30), &id));
    tenant_of[id] = tenant;
  };
  for (int i = 0; i < 10; ++i) submit("a", 1, i);
  for (int i = 0; i < 3; ++i) Tick();
  EXPECT_EQ(RunningByTenant(tenant_of), (std::map<std::string, int>{{"a", 8}}));
  // Tenant b, weight 3, with more work than its share: 6 of the 8 slots.
  for (int i = 10; i < 20; ++i) submit("b", 3, i);
  Tick();
  EXPECT_EQ(RunningByTenant(tenant_of), (std::map<std::string, int>{{"a", 2}, {"b", 6}}));
  EXPECT_EQ(observer_.fairness_preemptions["a"], 6);
  EXPECT_EQ(observer_.fairness_preemptions.count("b"), 0u);
  RunUntilFinished(sinks);
  EXPECT_EQ(Available(), 128);
}

}  // namespace
}  // namespace coalesce::batcher
