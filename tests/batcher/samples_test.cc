// Several samples per request (GenerationRequest::n) in the engine loop,
// driven one Tick at a time against KvBackend, whose KV cache carries each
// sequence's history: the prompt is computed once and its blocks shared;
// sample i produces exactly what a request with seed + i produces alone
// (tokens, text, finish), whether the backend copies the partly filled block
// or the loop recomputes it, with caching on or off, under preemption and in
// every batching mode; a waiting request takes a sample's slot once they
// part; cancellation, deadlines and refusals end or refuse all samples at
// once and leak no block.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "batcher/engine_loop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/batcher/fakes.h"
#include "tests/batcher/kv_loop.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAreArray;

class SamplesTest : public KvLoopTest {
 protected:
  // A request that samples (temperature 1 over KvBackend's logits, whose
  // favourite gets a logit of only 1 here), with stop sequence "c".
  GenerationRequest Sampled(std::vector<int32_t> prompt, int max_new_tokens, uint64_t seed,
                            int n = 1) {
    GenerationRequest r = Request(std::move(prompt), max_new_tokens);
    r.sampling.temperature = 1.0f;
    r.seed = seed;
    r.stop = {"c"};
    r.n = n;
    return r;
  }
  void MakeSamplingLoop(LoopSetup setup, bool caching = true) {
    MakeLoop(setup, caching);
    backend_->top_logit_ = 1.0f;
  }
  int StepTokens() { return StepTokensSince(0); }
};

struct Sample {
  std::vector<int32_t> ids;
  std::string text;
  FinishReason reason;
  bool operator==(const Sample&) const = default;
};

void PrintTo(const Sample& s, std::ostream* os) {
  *os << "{" << ::testing::PrintToString(s.ids) << " \"" << s.text << "\" reason "
      << static_cast<int>(s.reason) << "}";
}

TEST_F(SamplesTest, NSamplesEqualNSeparateRequestsWithSeedsPlusI) {
  constexpr int kN = 4, kMaxNew = 10;
  constexpr uint64_t kSeed = 0xfffffffffffffffeULL;  // seed + i wraps around
  std::set<std::vector<int32_t>> distinct;
  std::set<FinishReason> reasons;
  // Prompts of 1 token, ending inside a block, one past a block boundary
  // (its shared part ends on the boundary), and of several blocks.
  for (const int length : {1, 3, 5, 13}) {
    std::vector<int32_t> prompt;
    for (int t = 0; t < length; ++t) prompt.push_back((3 * t + 1) % 14);
    for (const bool copies : {true, false}) {
      for (const bool caching : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "prompt " << length << (copies ? " copies" : "")
                                          << (caching ? " caching" : ""));
        // Alone, seed by seed.
        std::vector<Sample> alone;
        int alone_tokens = 0;
        for (int i = 0; i < kN; ++i) {
          MakeSamplingLoop({.copies = copies}, caching);
          auto sink = Submit(Sampled(prompt, kMaxNew, kSeed + i));
          RunUntilFinished({sink});
          const StreamUpdate last = sink->WaitFinal();
          ASSERT_TRUE(last.status.ok()) << last.status;
          alone.push_back({sink->ids(), sink->text(), last.finish_reason});
          alone_tokens += StepTokens();
        }
        // Together.
        MakeSamplingLoop({.copies = copies}, caching);
        auto sink = Submit(Sampled(prompt, kMaxNew, kSeed, kN));
        RunUntilFinished({sink});
        int decoded = 0;
        for (int i = 0; i < kN; ++i) {
          const StreamUpdate last = sink->WaitFinal(i);
          ASSERT_TRUE(last.status.ok()) << last.status;
          EXPECT_EQ(last.index, i);
          EXPECT_EQ(last.prompt_tokens, length);
          EXPECT_EQ(last.completion_tokens, static_cast<int>(sink->ids(i).size()));
          EXPECT_EQ((Sample{sink->ids(i), sink->text(i), last.finish_reason}), alone[i])
              << "sample " << i;
          decoded += last.completion_tokens - 1;
          distinct.insert(sink->ids(i));
          reasons.insert(last.finish_reason);
        }
        // The prompt but its last token once; then each sample its last
        // token (and, without copies, the partly filled block's positions
        // again) and its decodes.
        const int shared = length - 1;
        const int partial = copies ? 0 : shared % 4;
        EXPECT_EQ(StepTokens(), shared + kN * (1 + partial) - partial + decoded);
        EXPECT_EQ(backend_->copied_, copies && shared % 4 != 0 ? kN - 1 : 0);
        // Less than alone whenever something is shared and not recomputed.
        if (shared - partial > 0) {
          EXPECT_LT(StepTokens(), alone_tokens);
        }
        // One request for the observer: one first token, one end.
        EXPECT_EQ(observer_.first_tokens, 1);
        EXPECT_EQ(observer_.finished, 1);
        EXPECT_EQ(observer_.completion_tokens, decoded + kN);
        EXPECT_EQ(Available(), 32);
      }
    }
  }
  // The seeds matter, and samples end for their own reasons.
  EXPECT_GE(distinct.size(), 3u);
  EXPECT_GE(reasons.size(), 2u);
}

TEST_F(SamplesTest, SamplesThatArePreemptedStillEqualSeparateRequests) {
  // Eight blocks of 4: three samples of 6 + 14 tokens need up to 1 + 3 x 4.
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10};
  for (const bool overlap : {false, true}) {
    for (const BatchingMode mode : kBatchingModes) {
      SCOPED_TRACE(::testing::Message() << BatchingModeName(mode) << (overlap ? " overlap" : ""));
      const LoopSetup setup{.num_blocks = 8, .overlap = overlap, .mode = mode};
      std::vector<std::vector<int32_t>> alone;
      for (int i = 0; i < 3; ++i) {
        MakeSamplingLoop(setup);
        backend_->never_eos_ = true;
        GenerationRequest r = Sampled(prompt, 14, 77 + i);
        r.stop.clear();
        auto sink = Submit(std::move(r));
        RunUntilFinished({sink});
        alone.push_back(sink->ids());
      }
      MakeSamplingLoop(setup);
      backend_->never_eos_ = true;
      GenerationRequest r = Sampled(prompt, 14, 77, 3);
      r.stop.clear();
      auto sink = Submit(std::move(r));
      RunUntilFinished({sink});
      if (mode == BatchingMode::kContinuous) {
        EXPECT_GE(observer_.preemptions, 1);
      }
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(sink->WaitFinal(i).finish_reason, FinishReason::kLength);
        EXPECT_THAT(sink->ids(i), ElementsAreArray(alone[i])) << "sample " << i;
      }
      EXPECT_EQ(Available(), 8);
    }
  }
}

TEST_F(SamplesTest, CancellingEndsEverySampleBeforeAndAfterTheFork) {
  const std::vector<int32_t> prompt(23, 9);
  for (const int ticks : {1, 6}) {  // mid-prefill; after the fork, decoding
    SCOPED_TRACE(ticks);
    MakeSamplingLoop({.max_batch_tokens = 6});
    uint64_t id = 0;
    auto sink = Submit(Sampled(prompt, 20, 1, 3), &id);
    auto other = Submit(Sampled({1, 2}, 20, 1));
    for (int i = 0; i < ticks; ++i) Tick();
    ASSERT_FALSE(sink->finished());
    loop_->Cancel(id, absl::CancelledError("bye"));
    Tick();
    ASSERT_TRUE(sink->finished());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(sink->WaitFinal(i).status.code(), absl::StatusCode::kCancelled);
      EXPECT_EQ(sink->WaitFinal(i).finish_reason, FinishReason::kCancelled);
    }
    EXPECT_EQ(observer_.finished, 1);
    EXPECT_EQ(observer_.statuses, std::vector<std::string>{"cancelled"});
    // The other request goes on, and every block comes back.
    EXPECT_FALSE(other->finished());
    RunUntilFinished({other});
    EXPECT_TRUE(other->WaitFinal().status.ok());
    EXPECT_EQ(Available(), 32);
  }
}

TEST_F(SamplesTest, ADeadlineEndsEverySample) {
  MakeSamplingLoop({});
  GenerationRequest r = Sampled({1, 2, 3}, 30, 5, 2);
  r.stop.clear();
  r.deadline = clock_.Now() + absl::Milliseconds(10);
  auto sink = Submit(std::move(r));
  Tick();
  Tick();
  clock_.Advance(absl::Milliseconds(20));
  Tick();
  ASSERT_TRUE(sink->finished());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(sink->WaitFinal(i).status.code(), absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_EQ(Available(), 32);
}

TEST_F(SamplesTest, TheSamplesAreAdmittedTogetherWithoutOvertaking) {
  MakeSamplingLoop({.max_batch_size = 4});
  uint64_t a_id = 0, b_id = 0, c_id = 0;
  GenerationRequest a = Sampled({1}, 5, 1);
  a.stop.clear();
  auto first = Submit(std::move(a), &a_id);
  Tick();  // a runs: three slots left
  auto group = Submit(Sampled({2, 3}, 5, 1, 4), &b_id);
  auto single = Submit(Sampled({4}, 5, 1), &c_id);
  Tick();
  // The four samples wait for four slots, and the later single request
  // does not pass them.
  LoopSnapshot s = loop_->Snapshot();
  ASSERT_EQ(s.running.size(), 1u);
  EXPECT_EQ(s.running[0].id, a_id);
  EXPECT_EQ(s.waiting.size(), 2u);
  RunUntilFinished({first});
  Tick();
  s = loop_->Snapshot();
  std::multiset<uint64_t> running;
  for (const auto& seq : s.running) running.insert(seq.id);
  EXPECT_EQ(running.count(b_id), 4u);
  EXPECT_EQ(running.count(c_id), 0u);
  RunUntilFinished({group, single});
  EXPECT_EQ(Available(), 32);
}

TEST_F(SamplesTest, TheSamplesHoldTheirSlotsBeforeTheyPart) {
  // Four samples of a 13-token prompt, 4 prompt tokens a step: they run as
  // one sequence for three steps, but hold all four slots meanwhile, so a
  // later request waits until they part; then it takes one sample's slot.
  MakeSamplingLoop({.max_batch_size = 4, .max_batch_tokens = 4});
  backend_->never_eos_ = true;
  uint64_t group_id = 0, single_id = 0;
  GenerationRequest r = Sampled({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 8, 1, 4);
  r.stop.clear();
  auto group = Submit(std::move(r), &group_id);
  Tick();
  auto single = Submit(Sampled({4}, 3, 1), &single_id);
  Tick();
  LoopSnapshot s = loop_->Snapshot();
  ASSERT_EQ(s.running.size(), 1u);  // before the fork
  EXPECT_EQ(s.running[0].id, group_id);
  EXPECT_THAT(s.waiting, ::testing::ElementsAre(single_id));
  while (loop_->Snapshot().running.size() == 1) Tick();  // until the fork
  Tick();
  s = loop_->Snapshot();
  EXPECT_THAT(s.waiting, ::testing::ElementsAre(group_id));
  EXPECT_EQ(observer_.admission_preemptions["samples"], 1);
  RunUntilFinished({group, single});
  EXPECT_EQ(Available(), 32);
}

TEST_F(SamplesTest, AWaitingRequestTakesASamplesSlotAndEverySampleStillEqualsItsRequest) {
  // Four samples fill the batch; a single request arrives: it runs at the
  // next step in place of the latest sample, which resumes when the single
  // one ends, and every output is what it is alone.
  constexpr int kN = 4, kMaxNew = 12;
  const std::vector<int32_t> prompt = {5, 6, 7};
  auto sampled = [&](uint64_t seed, int n) {
    GenerationRequest r = Sampled(prompt, kMaxNew, seed, n);
    r.stop.clear();
    return r;
  };
  const GenerationRequest single_request = Request({4, 1}, 3);
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < kN; ++i) {
    MakeSamplingLoop({.max_batch_size = kN});
    backend_->never_eos_ = true;
    auto sink = Submit(sampled(40 + i, 1));
    RunUntilFinished({sink});
    alone.push_back(sink->ids());
  }
  MakeSamplingLoop({.max_batch_size = kN});
  backend_->never_eos_ = true;
  auto single_alone = Submit(single_request);
  RunUntilFinished({single_alone});
  MakeSamplingLoop({.max_batch_size = kN});
  backend_->never_eos_ = true;
  auto group = Submit(sampled(40, kN));
  Tick();
  Tick();
  ASSERT_EQ(loop_->Snapshot().running.size(), static_cast<size_t>(kN));
  auto single = Submit(single_request);
  Tick();
  EXPECT_EQ(single->ids().size(), 1u);
  EXPECT_EQ(observer_.admission_preemptions["samples"], 1);
  RunUntilFinished({group, single});
  EXPECT_EQ(single->ids(), single_alone->ids());
  EXPECT_EQ(single->WaitFinal().finish_reason, single_alone->WaitFinal().finish_reason);
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(group->WaitFinal(i).finish_reason, FinishReason::kLength);
    EXPECT_THAT(group->ids(i), ElementsAreArray(alone[i])) << "sample " << i;
  }
  EXPECT_EQ(Available(), 32);
}

TEST_F(SamplesTest, RefusesSamplesThatCouldNeverRunTogether) {
  MakeSamplingLoop({.num_blocks = 6, .max_batch_size = 4});
  auto code = [&](GenerationRequest r) {
    return loop_->Submit(std::move(r), std::make_shared<Collector>(std::max(r.n, 1)))
        .status()
        .code();
  };
  EXPECT_EQ(code(Sampled({1, 2}, 4, 1, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Sampled({1, 2}, 4, 1, 5)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Sampled({}, 4, 1, 2)), absl::StatusCode::kInvalidArgument);
  // 17 tokens take 5 blocks; with 3 more samples, 8 of the 6.
  EXPECT_EQ(code(Sampled(std::vector<int32_t>(17, 1), 1, 1, 4)),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(code(Sampled(std::vector<int32_t>(17, 1), 1, 1, 2)), absl::StatusCode::kOk);
}

TEST_F(SamplesTest, AFailedStepEndsTheSamplesAndLeaksNothing) {
  MakeLoop({});
  GenerationRequest r = Request({1, 2, 3, 4, 5, 6}, 8);  // greedy: no early end
  r.n = 3;
  auto sink = Submit(std::move(r));
  Tick();
  Tick();  // forked, decoding
  backend_->fail_next_ = true;
  Tick();
  ASSERT_TRUE(sink->finished());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(sink->WaitFinal(i).status.code(), absl::StatusCode::kInternal);
  }
  EXPECT_EQ(observer_.finished, 1);
  EXPECT_EQ(Available(), 32);
}

}  // namespace
}  // namespace coalesce::batcher
