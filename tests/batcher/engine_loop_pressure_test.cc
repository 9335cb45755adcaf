// The engine loop driven one Tick at a time with a fake clock: paged KV
// admission, preemption and resume, chunked prefill, bounded queues,
// deadlines, cancellation and priorities, step by step, plus a randomized
// run that checks the block accounting after every step.
#include <map>
#include <random>
#include <set>

#include "batcher/engine_loop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/batcher/fakes.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Counts what the loop reports.
class CountingObserver : public LoopObserver {
 public:
  void OnPreempted() override { ++preemptions; }
  void OnRejected(std::string_view reason) override { ++rejected[std::string(reason)]; }
  int preemptions = 0;
  std::map<std::string, int> rejected;
};

// Every test runs with the step on the loop's thread and on a second thread
// (overlap_steps), whose streams hear of a step's tokens one Tick later.
class PressureTest : public ::testing::TestWithParam<bool> {
 protected:
  // A loop that is never Start()ed: each Tick() is one iteration.
  void MakeLoop(EngineLoopOptions options, int num_blocks, int block_size = 4) {
    options.overlap_steps = GetParam();
    backend_ = std::make_unique<CountingBackend>(num_blocks, block_size);
    loop_ = std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, options, &clock_, &observer_);
  }
  static EngineLoopOptions Options(int max_batch_size, int max_batch_tokens = 1024) {
    EngineLoopOptions o;
    o.scheduler.max_batch_size = max_batch_size;
    o.scheduler.batch_window = absl::ZeroDuration();
    o.scheduler.priority_aging = absl::InfiniteDuration();
    o.max_batch_tokens = max_batch_tokens;
    // Preemption recomputes everything, and every block is free or held
    // (prefix_cache_test.cc runs these with caching).
    o.kv_cache.prefix_caching = false;
    return o;
  }
  GenerationRequest Request(std::vector<int32_t> prompt, int max_new_tokens, int priority = 0) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = max_new_tokens;
    r.priority = priority;
    r.arrival = clock_.Now();
    return r;
  }
  std::shared_ptr<Collector> Submit(GenerationRequest request, uint64_t* id = nullptr) {
    return SubmitCollected(*loop_, std::move(request), id);
  }
  // Ticks until every sink finished (at most `limit` ticks).
  void RunUntilFinished(const std::vector<std::shared_ptr<Collector>>& sinks, int limit = 1000) {
    for (int i = 0; i < limit; ++i) {
      if (std::all_of(sinks.begin(), sinks.end(), [](auto& s) { return s->finished(); })) return;
      loop_->Tick();
    }
    FAIL() << "not finished after " << limit << " ticks";
  }
  int UsedBlocks() {
    LoopSnapshot s = loop_->Snapshot();
    return s.total_blocks - static_cast<int>(s.free_blocks.size());
  }

  FakeClock clock_{absl::FromUnixSeconds(1000)};
  LetterTokenizer tokenizer_;
  CountingObserver observer_;
  std::unique_ptr<CountingBackend> backend_;
  std::unique_ptr<EngineLoop> loop_;
};

TEST_P(PressureTest, AdmissionTakesOnlyThePromptsBlocksAndDecodesGrow) {
  MakeLoop(Options(4), /*num_blocks=*/8, /*block_size=*/4);
  auto sink = Submit(Request({0, 1, 2}, 9));
  loop_->Tick();  // prefill 3 tokens: 1 block
  EXPECT_EQ(UsedBlocks(), 1);
  loop_->Tick();  // decode position 3: still block 0
  EXPECT_EQ(UsedBlocks(), 1);
  loop_->Tick();  // decode position 4: a second block
  EXPECT_EQ(UsedBlocks(), 2);
  RunUntilFinished({sink});
  EXPECT_THAT(sink->ids(), ElementsAre(3, 4, 5, 6, 7, 8, 9, 10, 11));
  EXPECT_EQ(UsedBlocks(), 0);
}

TEST_P(PressureTest, PreemptsTheNewestAndResumesWithTheSameOutput) {
  // 3 blocks of 4 positions. A and B each start with 1 block; as they grow,
  // the decodes need more than the pool has, and B (admitted last) is sent
  // back, recomputed when A has finished, and completes the same tokens.
  MakeLoop(Options(4), /*num_blocks=*/3, /*block_size=*/4);
  auto a = Submit(Request({0}, 8));
  auto b = Submit(Request({3}, 8));
  // Req A: (0) 1 2 3 4 5 6 7 8
  // Req B: (3) 4 5 6 7 8 9 10 11
  RunUntilFinished({a, b});
  EXPECT_THAT(a->ids(), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8));
  EXPECT_THAT(b->ids(), ElementsAre(4, 5, 6, 7, 8, 9, 10, 11));
  EXPECT_GE(observer_.preemptions, 1);
  EXPECT_TRUE(a->WaitFinal().status.ok());
  EXPECT_TRUE(b->WaitFinal().status.ok());
  EXPECT_EQ(UsedBlocks(), 0);
  // The resumed step recomputed B's prompt and its tokens so far in one go.
  std::vector<int> tokens = backend_->step_tokens();
  EXPECT_GT(*std::max_element(tokens.begin(), tokens.end()), 2);
}

TEST_P(PressureTest, LowerPriorityIsPreemptedFirst) {
  MakeLoop(Options(4), /*num_blocks=*/3, /*block_size=*/4);
  auto low = Submit(Request({3}, 8, /*priority=*/0));
  auto high = Submit(Request({0}, 8, /*priority=*/5));  // admitted last, but more important
  // The newer, higher-priority one keeps its blocks and finishes first; the
  // older, lower one pauses and resumes with the same tokens.
  RunUntilFinished({high});
  EXPECT_FALSE(low->finished());
  RunUntilFinished({low});
  EXPECT_EQ(observer_.preemptions, 1);
  EXPECT_THAT(high->ids(), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8));
  EXPECT_THAT(low->ids(), ElementsAre(4, 5, 6, 7, 8, 9, 10, 11));
}

// Static batches: A (2 tokens) and B (6 tokens) run together; C waits for
// the batch to end. Without padding A's row leaves when A finishes; with it
// (the classic fixed-shape batch) A's row and KV blocks stay until B ends.
TEST_P(PressureTest, StaticBatchesWithAndWithoutPadding) {
  for (BatchingMode mode : {BatchingMode::kStatic, BatchingMode::kStaticPadded}) {
    SCOPED_TRACE(mode == BatchingMode::kStatic ? "static" : "static_padded");
    EngineLoopOptions options = Options(4);
    options.scheduler.mode = mode;
    MakeLoop(options, /*num_blocks=*/16);
    auto a = Submit(Request({0, 1}, 2));
    auto b = Submit(Request({5, 6, 7}, 6));
    loop_->Tick();  // A and B prefill together, each samples its first token
    auto c = Submit(Request({9}, 1));
    loop_->Tick();                             // A's second and last token
    ASSERT_TRUE(a->finished() || GetParam());  // with overlap, delivered next Tick
    const int used_after_a = UsedBlocks();
    RunUntilFinished({a, b, c});
    EXPECT_THAT(a->ids(), ElementsAre(2, 3));
    EXPECT_THAT(b->ids(), ElementsAre(8, 9, 10, 11, 12, 13));
    EXPECT_THAT(c->ids(), ElementsAre(10));
    if (mode == BatchingMode::kStatic) {
      // A's block (4 positions) is free as soon as it finishes; B holds 1.
      EXPECT_EQ(used_after_a, 1);
      EXPECT_THAT(backend_->batch_sizes(), ElementsAre(2, 2, 1, 1, 1, 1, 1));
    } else {
      EXPECT_EQ(used_after_a, 2);  // A's block is held for its padding row
      EXPECT_THAT(backend_->batch_sizes(), ElementsAre(2, 2, 2, 2, 2, 2, 1));
    }
    EXPECT_EQ(UsedBlocks(), 0);
  }
}

TEST_P(PressureTest, ChunkedPrefillInterleavesWithDecodes) {
  // Budget of 4 tokens per step. A decodes; B's 10-token prompt arrives and
  // is split 3 + 3 + 3 + 1 around A's one decode token per step.
  MakeLoop(Options(4, /*max_batch_tokens=*/4), /*num_blocks=*/16);
  auto a = Submit(Request({0}, 8));
  loop_->Tick();  // A prefill (1 token)
  auto b = Submit(Request({5, 5, 5, 5, 5, 5, 5, 5, 5, 5}, 2));
  RunUntilFinished({a, b});
  //  step:   1  2  3  4  5  6 ...
  //  A:      1  1  1  1  1  1
  //  B:         3  3  3  1  1 (decode)
  EXPECT_THAT(backend_->step_tokens(), ElementsAre(1, 4, 4, 4, 2, 2, 1, 1));
  EXPECT_THAT(b->ids(), ElementsAre(6, 7));
  EXPECT_THAT(a->ids(), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8));
}

TEST_P(PressureTest, FullQueueRefusesAtOnce) {
  EngineLoopOptions options = Options(1);
  options.max_queue = 2;
  MakeLoop(options, 16);
  Submit(Request({0}, 4));
  Submit(Request({0}, 4));
  auto sink = std::make_shared<Collector>();
  absl::StatusOr<uint64_t> third = loop_->Submit(Request({0}, 4), sink);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("retry"));
  EXPECT_EQ(observer_.rejected["queue_full"], 1);
  // Once one is admitted the queue has room again.
  loop_->Tick();
  EXPECT_TRUE(loop_->Submit(Request({0}, 4), sink).ok());
}

TEST_P(PressureTest, QueueTimeoutFailsARequestNeverAdmitted) {
  EngineLoopOptions options = Options(1);
  options.scheduler.max_queue_wait = absl::Milliseconds(100);
  MakeLoop(options, 16);
  auto running = Submit(Request({0}, 50));
  auto waiting = Submit(Request({0}, 4));
  loop_->Tick();
  clock_.Advance(absl::Milliseconds(99));
  loop_->Tick();
  EXPECT_FALSE(waiting->finished());
  clock_.Advance(absl::Milliseconds(1));
  loop_->Tick();
  ASSERT_TRUE(waiting->finished());
  StreamUpdate last = waiting->WaitFinal();
  EXPECT_EQ(last.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(last.status.message()), HasSubstr("queue wait limit"));
  EXPECT_EQ(observer_.rejected["queue_timeout"], 1);
  EXPECT_FALSE(running->finished());
}

TEST_P(PressureTest, DeadlinesEndWaitingAndRunningRequests) {
  MakeLoop(Options(1), 16);
  GenerationRequest run = Request({0}, 50);
  run.deadline = clock_.Now() + absl::Milliseconds(30);
  GenerationRequest wait = Request({0}, 5);
  wait.deadline = clock_.Now() + absl::Milliseconds(10);
  auto running = Submit(std::move(run));
  auto waiting = Submit(std::move(wait));
  loop_->Tick();
  EXPECT_EQ(UsedBlocks(), 1);
  clock_.Advance(absl::Milliseconds(10));
  loop_->Tick();
  EXPECT_EQ(waiting->WaitFinal().status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(running->finished());
  clock_.Advance(absl::Milliseconds(20));
  loop_->Tick();  // freed within one step
  EXPECT_EQ(running->WaitFinal().status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(UsedBlocks(), 0);
}

TEST_P(PressureTest, CancelMidPrefillFreesEverythingWithinOneStep) {
  MakeLoop(Options(4, /*max_batch_tokens=*/4), 16);
  uint64_t id = 0;
  auto sink = Submit(Request(std::vector<int32_t>(12, 1), 4), &id);
  loop_->Tick();  // first 4 of 12 prompt tokens
  EXPECT_EQ(UsedBlocks(), 3);
  EXPECT_FALSE(sink->finished());
  loop_->Cancel(id, absl::CancelledError("gone"));
  loop_->Tick();
  EXPECT_EQ(sink->WaitFinal().status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(UsedBlocks(), 0);
  EXPECT_THAT(backend_->step_tokens(), ElementsAre(4));  // nothing more ran
}

TEST_P(PressureTest, HigherPriorityFirstAndAgingPreventsStarvation) {
  EngineLoopOptions options = Options(1);
  options.scheduler.priority_aging = absl::Seconds(1);
  MakeLoop(options, 16);
  auto first = Submit(Request({0}, 1));
  loop_->Tick();  // runs and finishes `first`
  auto low = Submit(Request({1}, 1, /*priority=*/0));
  clock_.Advance(absl::Milliseconds(10));
  auto high = Submit(Request({2}, 1, /*priority=*/1));
  loop_->Tick();
  EXPECT_TRUE(high->finished());  // higher priority overtook the older one
  EXPECT_FALSE(low->finished());
  loop_->Tick();
  EXPECT_TRUE(low->finished());

  // Aging: a priority-0 request that has waited 3 s ranks as priority 3, so
  // it goes before a fresh priority-2 arrival.
  auto blocker = Submit(Request({0}, 30));
  loop_->Tick();
  auto old = Submit(Request({1}, 1, 0));
  clock_.Advance(absl::Seconds(3));
  auto fresh = Submit(Request({2}, 1, 2));
  RunUntilFinished({blocker});
  loop_->Tick();
  EXPECT_TRUE(old->finished());
  EXPECT_FALSE(fresh->finished());
  RunUntilFinished({fresh});
}

// Seeded random arrivals, cancellations, deadlines and clock jumps against a
// small cache; after every step the block accounting must be exact.
TEST_P(PressureTest, RandomizedRunKeepsTheBlockAccountingExact) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    EngineLoopOptions options = Options(1 + rng() % 6, /*max_batch_tokens=*/6 + rng() % 20);
    options.max_queue = 8;
    options.scheduler.max_queue_wait = absl::Milliseconds(50 + rng() % 200);
    options.scheduler.priority_aging = absl::Milliseconds(20);
    MakeLoop(options, /*num_blocks=*/6 + rng() % 10, /*block_size=*/1 + rng() % 4);
    const int capacity = backend_->kv_cache().num_blocks * backend_->kv_cache().block_size;

    std::vector<std::shared_ptr<Collector>> sinks;
    std::vector<uint64_t> ids;
    for (int round = 0; round < 300; ++round) {
      if (rng() % 3 == 0) {
        const int prompt_len = 1 + rng() % std::min(capacity - 1, 12);
        GenerationRequest r =
            Request(std::vector<int32_t>(prompt_len, rng() % 14),
                    1 + rng() % std::max(1, capacity - prompt_len), static_cast<int>(rng() % 3));
        if (rng() % 4 == 0) r.deadline = clock_.Now() + absl::Milliseconds(rng() % 100);
        auto sink = std::make_shared<Collector>();
        absl::StatusOr<uint64_t> id = loop_->Submit(std::move(r), sink);
        if (id.ok()) {
          sinks.push_back(sink);
          ids.push_back(*id);
        } else {
          EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
        }
      }
      if (!ids.empty() && rng() % 10 == 0) {
        loop_->Cancel(ids[rng() % ids.size()], absl::CancelledError("random"));
      }
      clock_.Advance(absl::Milliseconds(rng() % 5));
      loop_->Tick();

      // Invariants: every block is either free or held by exactly one
      // running sequence, and waiting sequences hold none.
      LoopSnapshot s = loop_->Snapshot();
      std::multiset<int32_t> owned(s.free_blocks.begin(), s.free_blocks.end());
      for (const auto& seq : s.running) owned.insert(seq.blocks.begin(), seq.blocks.end());
      ASSERT_EQ(static_cast<int>(owned.size()), s.total_blocks);
      ASSERT_EQ(std::set<int32_t>(owned.begin(), owned.end()).size(), owned.size())
          << "a block is owned twice";
    }
    // Drain: everything ends, each with a reason, and the pool is full again.
    for (int i = 0; i < 5000 &&
                    !std::all_of(sinks.begin(), sinks.end(), [](auto& s) { return s->finished(); });
         ++i) {
      clock_.Advance(absl::Milliseconds(1));
      loop_->Tick();
    }
    for (auto& sink : sinks) {
      ASSERT_TRUE(sink->finished());
      StreamUpdate last = sink->WaitFinal();
      if (last.status.ok()) {
        EXPECT_NE(last.finish_reason, FinishReason::kCancelled);
        EXPECT_EQ(last.completion_tokens, static_cast<int>(sink->ids().size()));
      } else {
        EXPECT_THAT(last.status.code(), ::testing::AnyOf(absl::StatusCode::kCancelled,
                                                         absl::StatusCode::kDeadlineExceeded,
                                                         absl::StatusCode::kResourceExhausted));
      }
    }
    EXPECT_EQ(UsedBlocks(), 0);
    EXPECT_TRUE(loop_->Snapshot().running.empty());
    EXPECT_TRUE(loop_->Snapshot().waiting.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(Overlap, PressureTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "OverlapSteps" : "OneThread";
                         });

}  // namespace
}  // namespace coalesce::batcher
