// Log-probabilities in the engine loop (GenerationRequest::logprobs,
// ::prompt_logprobs), one Tick at a time against KvBackend, whose logits
// after a position are known (KvBackend::Row): each generated token's and
// each prompt token's log-probability is engine::Logprob of the row that
// predicted it; sampling on the host picks the tokens the backend picks; a
// scored prompt is prefilled in chunks of max_scored_chunk, never taken from
// the prefix cache, and sent once, also with several samples and across a
// preemption.
#include <algorithm>
#include <vector>

#include "batcher/engine_loop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/batcher/fakes.h"
#include "tests/batcher/kv_loop.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAreArray;

class LogprobsTest : public KvLoopTest {
 protected:
  // What the request's tokens from position `from` on should score: the
  // log-probability of tokens[p + 1] after the row of position p.
  std::vector<engine::TokenLogprob> Expected(const std::vector<int32_t>& tokens, int from,
                                             int top) {
    const std::vector<uint64_t> numbers = KvBackend::Numbers(tokens);
    std::vector<engine::TokenLogprob> out;
    for (size_t p = from; p + 1 < tokens.size(); ++p) {
      out.push_back(engine::Logprob(backend_->Row(numbers[p]), tokens[p + 1], top));
    }
    return out;
  }
};

void ExpectEqual(const std::vector<engine::TokenLogprob>& got,
                 const std::vector<engine::TokenLogprob>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].token, want[i].token) << i;
    EXPECT_EQ(got[i].logprob, want[i].logprob) << i;
    EXPECT_EQ(got[i].top, want[i].top) << i;
  }
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_F(LogprobsTest, EachGeneratedTokenComesWithItsLogprob) {
  MakeLoop({});
  backend_->top_logit_ = 1.0f;
  const std::vector<int32_t> prompt = {3, 4, 5, 6, 7};
  GenerationRequest r = Request(prompt, 9);
  r.sampling.temperature = 1.0f;
  r.seed = 11;
  r.logprobs = true;
  r.top_logprobs = 3;
  auto sink = Submit(std::move(r));
  RunUntilFinished({sink});
  const std::vector<int32_t> ids = sink->ids();
  ASSERT_FALSE(ids.empty());
  // The rows after the last prompt position and after each generated token.
  ExpectEqual(sink->logprobs(), Expected(Concat(prompt, ids), prompt.size() - 1, 3));
  ASSERT_EQ(sink->logprobs()[0].top.size(), 3u);
  EXPECT_TRUE(sink->prompt_logprobs().empty());
}

// Seeded requests get the same tokens whether or not a request beside them
// asks for log-probabilities (which makes their steps sample on the host).
TEST_F(LogprobsTest, SamplingOnTheHostPicksWhatTheBackendPicks) {
  auto run = [&](bool logprobs) {
    MakeLoop({});
    backend_->top_logit_ = 1.0f;
    std::vector<std::shared_ptr<Collector>> sinks;
    for (int i = 0; i < 4; ++i) {
      GenerationRequest r = Request({1, 2, static_cast<int32_t>(3 + i)}, 12);
      r.sampling.temperature = 0.8f;
      r.seed = 100 + i;
      r.logprobs = logprobs && i % 2 == 0;
      sinks.push_back(Submit(std::move(r)));
    }
    RunUntilFinished(sinks);
    std::vector<std::vector<int32_t>> outputs;
    for (auto& s : sinks) outputs.push_back(s->ids());
    return outputs;
  };
  const auto without = run(false);
  EXPECT_EQ(run(true), without);
  EXPECT_NE(without[0], without[1]);
}

TEST_F(LogprobsTest, PromptLogprobsScoreEveryPromptTokenOnceInChunksWithoutTheCache) {
  const std::vector<int32_t> prompt = {1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7};  // 13
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    MakeLoop({.max_batch_tokens = 20, .overlap = overlap});
    backend_->top_logit_ = 2.0f;
    // The same prompt, cached first.
    Run(Request(prompt, 2));
    GenerationRequest r = Request(prompt, 3);
    r.prompt_logprobs = true;
    r.top_logprobs = 2;
    const size_t steps_before = backend_->step_tokens().size();
    auto sink = Submit(std::move(r));
    RunUntilFinished({sink});
    EXPECT_EQ(sink->WaitFinal().cached_prompt_tokens, 0);
    ExpectEqual(sink->prompt_logprobs(), Expected(prompt, 0, 2));
    EXPECT_EQ(sink->prompt_logprob_updates(), 1);
    EXPECT_TRUE(sink->logprobs().empty());
    // With the default max_scored_chunk (256), the 13 tokens in one step.
    const std::vector<int> steps = backend_->step_tokens();
    EXPECT_EQ(steps[steps_before], 13);
  }
  // A small max_scored_chunk splits the prompt.
  EngineLoopOptions o;
  o.scheduler.batch_window = absl::ZeroDuration();
  o.max_scored_chunk = 4;
  backend_ = std::make_unique<KvBackend>(32, 4);
  loop_ = std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, o, &clock_, &observer_);
  GenerationRequest r = Request(prompt, 1);
  r.prompt_logprobs = true;
  auto sink = Submit(std::move(r));
  RunUntilFinished({sink});
  EXPECT_THAT(backend_->step_tokens(), ElementsAreArray({4, 4, 4, 1}));
  ExpectEqual(sink->prompt_logprobs(), Expected(prompt, 0, 0));
}

TEST_F(LogprobsTest, SeveralSamplesSendThePromptLogprobsOnce) {
  MakeLoop({});
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7};
  GenerationRequest r = Request(prompt, 4);
  r.n = 3;
  r.prompt_logprobs = true;
  r.logprobs = true;
  auto sink = Submit(std::move(r));
  RunUntilFinished({sink});
  EXPECT_EQ(sink->prompt_logprob_updates(), 1);
  ExpectEqual(sink->prompt_logprobs(0), Expected(prompt, 0, 0));
  for (int i = 0; i < 3; ++i) {
    ExpectEqual(sink->logprobs(i), Expected(Concat(prompt, sink->ids(i)), prompt.size() - 1, 0));
  }
}

TEST_F(LogprobsTest, APromptScoredAcrossAPreemptionIsScoredOnce) {
  // Four blocks of 4. The scored request's 7-token prompt takes two and is
  // prefilled a token a step; the higher-priority request decoding beside
  // it needs a fourth block at its position 8 and preempts it part-way;
  // it resumes from the start of its prompt once the other has finished.
  EngineLoopOptions o;
  o.scheduler.batch_window = absl::ZeroDuration();
  o.scheduler.priority_aging = absl::InfiniteDuration();
  o.max_scored_chunk = 1;
  backend_ = std::make_unique<KvBackend>(4, 4);
  observer_ = LookupObserver();
  loop_ = std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, o, &clock_, &observer_);
  GenerationRequest a = Request({1, 2, 3}, 12, "", 1);
  auto a_sink = Submit(std::move(a));
  Tick();  // a prefills; its 3 tokens and the next 9 need 3 blocks in all
  const std::vector<int32_t> prompt = {9, 8, 7, 6, 5, 4, 3};
  GenerationRequest b = Request(prompt, 2);
  b.prompt_logprobs = true;
  auto b_sink = Submit(std::move(b));
  RunUntilFinished({a_sink, b_sink});
  EXPECT_GE(observer_.preemptions, 1);
  ExpectEqual(b_sink->prompt_logprobs(), Expected(prompt, 0, 0));
  EXPECT_EQ(b_sink->prompt_logprob_updates(), 1);
  EXPECT_THAT(b_sink->ids(), ElementsAreArray(KvBackend::Expected(prompt, 2)));
}

TEST_F(LogprobsTest, BackendsThatSampleOnTheirOwnRefuseThem) {
  CountingBackend counting(8);
  EngineLoop loop(&counting, &tokenizer_, EngineLoopOptions{}, &clock_, nullptr);
  GenerationRequest r = Request({1, 2}, 2);
  r.logprobs = true;
  absl::StatusOr<uint64_t> id = loop.Submit(r, std::make_shared<Collector>());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(id.status().message()), ::testing::HasSubstr("counting backend"));
  r.logprobs = false;
  r.top_logprobs = 17;  // more than the vocabulary
  EXPECT_EQ(loop.Submit(r, std::make_shared<Collector>()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace coalesce::batcher
