// The engine loop on its own thread, against the fakes of fakes.h.
#include "batcher/engine_loop.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/batcher/fakes.h"

namespace coalesce::batcher {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;

GenerationRequest Request(std::vector<int32_t> prompt, int max_new_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.arrival = absl::Now();
  return r;
}

// Every test runs with the step on the loop's thread and on a second thread
// (overlap_steps): the streams must see the same thing.
class EngineLoopTest : public ::testing::TestWithParam<bool> {
 protected:
  void StartLoop(SchedulerConfig config, int num_blocks = 64) {
    backend_ = std::make_unique<CountingBackend>(num_blocks);
    EngineLoopOptions options;
    options.scheduler = config;
    options.overlap_steps = GetParam();
    loop_ =
        std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, options, RealClock(), nullptr);
    loop_->Start();
  }
  std::shared_ptr<Collector> Submit(GenerationRequest request, uint64_t* id = nullptr) {
    return SubmitCollected(*loop_, std::move(request), id);
  }
  void ExpectAllBlocksFree() {
    // Stats are published at the end of each iteration; give it a moment.
    for (int i = 0; i < 200; ++i) {
      QueueStats s = loop_->queue_stats();
      if (s.free_kv_blocks == s.total_kv_blocks && s.running == 0) return;
      absl::SleepFor(absl::Milliseconds(5));
    }
    QueueStats s = loop_->queue_stats();
    EXPECT_EQ(s.free_kv_blocks, s.total_kv_blocks);
    EXPECT_EQ(s.running, 0);
  }

  LetterTokenizer tokenizer_;
  std::unique_ptr<CountingBackend> backend_;
  std::unique_ptr<EngineLoop> loop_;
};

TEST_P(EngineLoopTest, StreamsTokensAndFinishesOnLength) {
  StartLoop({4, absl::ZeroDuration()});
  auto sink = Submit(Request({2, 3}, 5));
  StreamUpdate last = sink->WaitFinal();
  EXPECT_TRUE(last.status.ok());
  EXPECT_EQ(last.finish_reason, FinishReason::kLength);
  EXPECT_EQ(last.prompt_tokens, 2);
  EXPECT_EQ(last.completion_tokens, 5);
  EXPECT_THAT(sink->ids(), ElementsAre(4, 5, 6, 7, 8));
  EXPECT_EQ(sink->text(), "efghi");
  EXPECT_EQ(sink->updates(), 5);  // one per step: streamed, not batched up
  ExpectAllBlocksFree();
}

TEST_P(EngineLoopTest, EndOfSequenceTokenEndsGeneration) {
  StartLoop({4, absl::ZeroDuration()});
  auto sink = Submit(Request({12}, 10));
  StreamUpdate last = sink->WaitFinal();
  EXPECT_EQ(last.finish_reason, FinishReason::kEos);
  EXPECT_THAT(sink->ids(), ElementsAre(13, 14, kEos));
  EXPECT_EQ(sink->text(), "no");
}

TEST_P(EngineLoopTest, StopSequenceEndsGenerationAndIsNotSent) {
  StartLoop({4, absl::ZeroDuration()});
  GenerationRequest r = Request({0}, 10);
  r.stop = {"def"};
  auto sink = Submit(std::move(r));
  StreamUpdate last = sink->WaitFinal();
  EXPECT_EQ(last.finish_reason, FinishReason::kStop);
  EXPECT_EQ(sink->text(), "bc");
  EXPECT_THAT(sink->ids(), ElementsAre(1, 2, 3, 4, 5));
}

TEST_P(EngineLoopTest, WindowCoalescesArrivalsIntoOnePrefill) {
  // A long window and 4 slots: four requests submitted together fill the
  // slots, so their prompts are prefilled in one step.
  StartLoop({4, absl::Seconds(10)});
  std::vector<std::shared_ptr<Collector>> sinks;
  for (int i = 0; i < 4; ++i) sinks.push_back(Submit(Request({i, i}, 3)));
  for (auto& s : sinks) EXPECT_EQ(s->WaitFinal().finish_reason, FinishReason::kLength);
  EXPECT_THAT(backend_->batch_sizes(), ElementsAre(4, 4, 4));
  EXPECT_THAT(backend_->step_tokens(), ElementsAre(8, 4, 4));
  for (int i = 0; i < 4; ++i) {
    EXPECT_THAT(sinks[i]->ids(), ElementsAre(i + 1, i + 2, i + 3));
  }
}

TEST_P(EngineLoopTest, LateArrivalJoinsTheRunningBatch) {
  StartLoop({4, absl::ZeroDuration()});
  backend_->step_delay_ = absl::Milliseconds(5);
  auto first = Submit(Request({0}, 12));
  // Wait until the first request is streaming, then add a second.
  first->WaitUpdates(2);
  auto second = Submit(Request({5}, 2));
  EXPECT_EQ(second->WaitFinal().finish_reason, FinishReason::kLength);
  first->WaitFinal();
  // The second finished without waiting for the first: some steps had 2.
  std::vector<int> sizes = backend_->batch_sizes();
  EXPECT_EQ(std::count(sizes.begin(), sizes.end(), 2), 2);
  EXPECT_THAT(second->ids(), ElementsAre(6, 7));
  EXPECT_EQ(first->ids().size(), 12u);
}

TEST_P(EngineLoopTest, QueueDrainsWhenEveryAdmittedRequestEndsInItsFirstStep) {
  // More requests than slots, each done after one token (scoring traffic):
  // when the whole batch leaves in its first step, the slots it frees go to
  // the next in line at once. No aging, and a queue timeout far off: a loop
  // that slept until its next timed decision would sleep for an hour.
  SchedulerConfig config{4, absl::ZeroDuration()};
  config.priority_aging = absl::ZeroDuration();
  config.max_queue_wait = absl::Hours(1);
  backend_ = std::make_unique<CountingBackend>(64);
  EngineLoopOptions options;
  options.scheduler = config;
  options.overlap_steps = GetParam();
  loop_ = std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, options, RealClock(), nullptr);
  // Queued before the loop starts, so its first decision sees all twelve.
  std::vector<std::shared_ptr<Collector>> sinks;
  for (int i = 0; i < 12; ++i) sinks.push_back(Submit(Request({i % 8}, 1)));
  loop_->Start();
  for (int i = 0; i < 12; ++i) {
    std::optional<StreamUpdate> last = sinks[i]->WaitFinalFor(absl::Seconds(20));
    ASSERT_TRUE(last.has_value()) << "request " << i << " never finished: the loop stalled";
    EXPECT_EQ(last->finish_reason, FinishReason::kLength);
    EXPECT_THAT(sinks[i]->ids(), ElementsAre(i % 8 + 1));
  }
  EXPECT_THAT(backend_->batch_sizes(), ElementsAre(4, 4, 4));
  ExpectAllBlocksFree();
}

TEST_P(EngineLoopTest, CancelFreesTheSlotAndBlocks) {
  StartLoop({4, absl::ZeroDuration()});
  backend_->step_delay_ = absl::Milliseconds(2);
  uint64_t id = 0;
  auto sink = Submit(Request({0}, 60), &id);
  sink->WaitUpdates(3);
  loop_->Cancel(id, absl::CancelledError("client went away"));
  StreamUpdate last = sink->WaitFinal();
  EXPECT_EQ(last.status.code(), absl::StatusCode::kCancelled);
  EXPECT_LT(last.completion_tokens, 60);
  ExpectAllBlocksFree();
}

TEST_P(EngineLoopTest, CancelWhileWaitingNeverRuns) {
  StartLoop({4, absl::Seconds(10)});  // the window holds it
  uint64_t id = 0;
  auto sink = Submit(Request({0}, 5), &id);
  loop_->Cancel(id, absl::CancelledError("gone"));
  EXPECT_EQ(sink->WaitFinal().status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(sink->ids().empty());
  EXPECT_TRUE(backend_->batch_sizes().empty());
}

TEST_P(EngineLoopTest, RequestLargerThanTheCacheIsRejectedAtOnce) {
  StartLoop({4, absl::ZeroDuration()}, /*num_blocks=*/2);  // 8 positions
  auto sink = std::make_shared<Collector>();
  absl::StatusOr<uint64_t> id = loop_->Submit(Request({1, 2, 3}, 6), sink);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(id.status().message()), ::testing::HasSubstr("KV cache"));
}

TEST_P(EngineLoopTest, FullCacheMakesRequestsWaitNotFail) {
  // 4 blocks of 4 positions. Prompts of 5 tokens need 2 blocks each, so only
  // two are admitted at a time; the others wait instead of failing.
  StartLoop({8, absl::ZeroDuration()}, /*num_blocks=*/4);
  std::vector<std::shared_ptr<Collector>> sinks;
  for (int i = 0; i < 5; ++i) sinks.push_back(Submit(Request({i, i, i, i, i}, 3)));
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(sinks[i]->WaitFinal().status.ok());
    EXPECT_THAT(sinks[i]->ids(), ElementsAre(i + 1, i + 2, i + 3));
  }
  EXPECT_THAT(backend_->batch_sizes(), Each(::testing::Le(2)));
  ExpectAllBlocksFree();
}

TEST_P(EngineLoopTest, FailedStepFailsItsRequestsAndTheLoopGoesOn) {
  StartLoop({4, absl::ZeroDuration()});
  backend_->fail_next_ = true;
  auto failed = Submit(Request({0}, 3));
  EXPECT_EQ(failed->WaitFinal().status.code(), absl::StatusCode::kInternal);
  auto ok = Submit(Request({0}, 3));
  EXPECT_TRUE(ok->WaitFinal().status.ok());
  ExpectAllBlocksFree();
}

TEST_P(EngineLoopTest, StopEndsQueuedWorkAndRefusesNewWork) {
  StartLoop({4, absl::Seconds(10)});
  auto queued = Submit(Request({0}, 5));
  loop_->Stop();
  StreamUpdate last = queued->WaitFinal();
  EXPECT_TRUE(last.status.ok());
  EXPECT_EQ(last.finish_reason, FinishReason::kCancelled);
  absl::StatusOr<uint64_t> late = loop_->Submit(Request({0}, 5), std::make_shared<Collector>());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
}

// With overlap_steps, a step's tokens reach their stream while the next step
// runs; without it, only between steps.
class StepWatcher : public Collector {
 public:
  // With `wait`, a delivery gives the step it should overlap up to a second
  // to start on its thread (Post returns before the thread wakes).
  StepWatcher(const CountingBackend* backend, bool wait) : backend_(backend), wait_(wait) {}
  void Deliver(StreamUpdate update) override {
    if (!update.finished) {
      const absl::Time give_up = absl::Now() + absl::Seconds(1);
      while (wait_ && !backend_->in_step() && absl::Now() < give_up) {
        absl::SleepFor(absl::Microseconds(50));
      }
      (backend_->in_step() ? during_ : between_)++;
    }
    Collector::Deliver(std::move(update));
  }
  std::atomic<int> during_{0}, between_{0};

 private:
  const CountingBackend* backend_;
  const bool wait_;
};

TEST_P(EngineLoopTest, OverlapStreamsTokensWhileTheNextStepRuns) {
  StartLoop({4, absl::ZeroDuration()});
  backend_->step_delay_ = absl::Milliseconds(20);
  auto sink = std::make_shared<StepWatcher>(backend_.get(), /*wait=*/GetParam());
  ASSERT_TRUE(loop_->Submit(Request({2, 3}, 8), sink).ok());
  EXPECT_THAT(sink->WaitFinal().completion_tokens, 8);
  EXPECT_THAT(sink->ids(), ElementsAre(4, 5, 6, 7, 8, 9, 10, 11));
  // Tokens 1 to 7 (the 8th comes with the final update).
  if (GetParam()) {
    EXPECT_EQ(sink->during_, 7);
    EXPECT_EQ(sink->between_, 0);
  } else {
    EXPECT_EQ(sink->during_, 0);
    EXPECT_EQ(sink->between_, 7);
  }
}

INSTANTIATE_TEST_SUITE_P(Overlap, EngineLoopTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "OverlapSteps" : "OneThread";
                         });

// ---------------------------------------------------------------------------
// Failed steps, one Tick at a time
// ---------------------------------------------------------------------------

// Records what the loop reports about failures.
class FailureObserver : public LoopObserver {
 public:
  void OnEngineFailure(const absl::Status& status, bool device_lost) override {
    failures.emplace_back(status, device_lost);
  }
  void OnPreempted() override { ++preemptions; }
  std::vector<std::pair<absl::Status, bool>> failures;
  int preemptions = 0;
};

class StepFailureTest : public ::testing::Test {
 protected:
  // Two slots, no window, blocks of 4 positions; never Start()ed, so each
  // Tick() is one iteration.
  void MakeLoop(int num_blocks = 16) {
    backend_ = std::make_unique<CountingBackend>(num_blocks);
    EngineLoopOptions options;
    options.scheduler.max_batch_size = 2;
    options.scheduler.batch_window = absl::ZeroDuration();
    loop_ = std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, options, &clock_, &observer_);
  }
  GenerationRequest At(std::vector<int32_t> prompt, int max_new_tokens) {
    GenerationRequest r = Request(std::move(prompt), max_new_tokens);
    r.arrival = clock_.Now();
    return r;
  }
  std::shared_ptr<Collector> Submit(std::vector<int32_t> prompt, int max_new_tokens) {
    auto sink = std::make_shared<Collector>();
    absl::StatusOr<uint64_t> id = loop_->Submit(At(std::move(prompt), max_new_tokens), sink);
    EXPECT_TRUE(id.ok()) << id.status();
    return sink;
  }
  void RunUntilFinished(const std::vector<std::shared_ptr<Collector>>& sinks) {
    for (int i = 0; i < 100; ++i) {
      if (std::all_of(sinks.begin(), sinks.end(), [](auto& s) { return s->finished(); })) return;
      loop_->Tick();
    }
    FAIL() << "not finished after 100 ticks";
  }
  int UsedBlocks() {
    LoopSnapshot s = loop_->Snapshot();
    return s.total_blocks - static_cast<int>(s.free_blocks.size());
  }

  FakeClock clock_{absl::FromUnixSeconds(1000)};
  LetterTokenizer tokenizer_;
  FailureObserver observer_;
  std::unique_ptr<CountingBackend> backend_;
  std::unique_ptr<EngineLoop> loop_;
};

TEST_F(StepFailureTest, FailedStepFailsOnlyItsRequestsAndFreesTheirBlocks) {
  MakeLoop();
  auto a = Submit({0, 1, 2}, 6);
  auto b = Submit({5}, 6);
  auto c = Submit({9}, 3);  // no free slot: waits, so it is in no step
  loop_->Tick();            // A and B prefill and sample their first token
  ASSERT_THAT(a->ids(), ElementsAre(3));
  ASSERT_THAT(b->ids(), ElementsAre(6));
  backend_->fail_next_ = true;
  loop_->Tick();  // the decode step of A and B fails
  for (auto* sink : {&a, &b}) {
    ASSERT_TRUE((*sink)->finished());
    StreamUpdate last = (*sink)->WaitFinal();
    EXPECT_EQ(last.status.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(last.status.message()), ::testing::HasSubstr("injected failure"));
    EXPECT_EQ(last.completion_tokens, 1);
  }
  EXPECT_FALSE(c->finished());
  EXPECT_EQ(UsedBlocks(), 0);  // A's and B's blocks are back; C is not admitted yet
  ASSERT_EQ(observer_.failures.size(), 1u);
  EXPECT_EQ(observer_.failures[0].first.code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(observer_.failures[0].second);

  // The loop goes on: C, and a request submitted after the failure, run as
  // if nothing had happened.
  auto d = Submit({1}, 2);
  RunUntilFinished({c, d});
  EXPECT_TRUE(c->WaitFinal().status.ok());
  EXPECT_THAT(c->ids(), ElementsAre(10, 11, 12));
  EXPECT_TRUE(d->WaitFinal().status.ok());
  EXPECT_THAT(d->ids(), ElementsAre(2, 3));
  EXPECT_EQ(UsedBlocks(), 0);
  EXPECT_EQ(observer_.failures.size(), 1u);
}

TEST_F(StepFailureTest, DeviceLossEndsEveryRequestAndRefusesNewOnes) {
  MakeLoop();
  auto a = Submit({0, 1, 2}, 6);
  auto b = Submit({5}, 6);
  auto c = Submit({9}, 3);  // waits: never runs
  loop_->Tick();
  backend_->fail_code_ = engine::kDeviceLostCode;
  backend_->fail_next_ = true;
  loop_->Tick();
  // A and B were running: INTERNAL. C never ran: UNAVAILABLE, retryable
  // elsewhere.
  EXPECT_EQ(a->WaitFinal().status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(b->WaitFinal().status.code(), absl::StatusCode::kInternal);
  StreamUpdate never_ran = c->WaitFinal();
  EXPECT_EQ(never_ran.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(c->ids().empty());
  EXPECT_EQ(UsedBlocks(), 0);
  EXPECT_TRUE(loop_->Snapshot().running.empty());
  EXPECT_TRUE(loop_->Snapshot().waiting.empty());
  ASSERT_EQ(observer_.failures.size(), 1u);
  EXPECT_EQ(observer_.failures[0].first.code(), engine::kDeviceLostCode);
  EXPECT_TRUE(observer_.failures[0].second);

  // New work is refused, and no step ever runs again.
  absl::StatusOr<uint64_t> late = loop_->Submit(At({1}, 2), std::make_shared<Collector>());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
  const size_t steps = backend_->batch_sizes().size();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(loop_->Tick());
  EXPECT_EQ(backend_->batch_sizes().size(), steps);
  EXPECT_EQ(observer_.failures.size(), 1u);
}

TEST_F(StepFailureTest, DeviceLossFailsAPreemptedRequestWithInternal) {
  // 3 blocks of 4 positions: as A and B grow, B (admitted last) is preempted
  // after it has streamed tokens. When the device is lost while B waits, B
  // ends with INTERNAL like a running request: its stream already began.
  MakeLoop(/*num_blocks=*/3);
  auto a = Submit({0}, 8);
  auto b = Submit({3}, 8);
  for (int i = 0; i < 20 && observer_.preemptions == 0; ++i) loop_->Tick();
  ASSERT_EQ(observer_.preemptions, 1);
  ASSERT_EQ(loop_->Snapshot().waiting.size(), 1u);
  ASSERT_FALSE(b->ids().empty());
  backend_->fail_code_ = engine::kDeviceLostCode;
  backend_->fail_next_ = true;
  loop_->Tick();
  EXPECT_EQ(a->WaitFinal().status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(b->WaitFinal().status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(UsedBlocks(), 0);
}

}  // namespace
}  // namespace coalesce::batcher
