// The logits controls and stopping controls in the engine loop
// (GenerationRequest::controls, sampling.min_p, min_tokens, ignore_eos,
// stop_token_ids), one Tick at a time against KvBackend, whose logits after
// a position are known (KvBackend::Row). Each output is checked against a
// direct simulation that applies the controls' definitions, written out here
// on their own, to those rows and samples with the request's own draws; and
// seeded requests keep their tokens whatever shares their batch.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
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

struct Simulated {
  std::vector<int32_t> ids;
  FinishReason reason = FinishReason::kLength;
};

// What `r` generates, computed from the definitions: the row after each
// position, then logit_bias; repetition_penalty over the prompt and output
// (divide a positive logit, multiply a negative one); frequency and
// presence penalties over the output; -inf for the end tokens before
// min_tokens; then the sampler with the request's draws.
Simulated Simulate(const KvBackend& backend, const GenerationRequest& r, uint64_t seed) {
  std::vector<int32_t> all = r.prompt;
  uint64_t number = 0;
  for (int32_t t : r.prompt) number = KvBackend::Mix(number, t);
  engine::Rng rng(seed);
  Simulated out;
  std::map<int32_t, int> counts;
  for (int i = 0; i < r.max_new_tokens; ++i) {
    std::vector<float> row = backend.Row(number);
    for (const auto& [id, bias] : r.controls.logit_bias) row[id] += bias;
    const float rep = r.controls.repetition_penalty;
    for (size_t id = 0; id < row.size(); ++id) {
      if (std::find(all.begin(), all.end(), static_cast<int32_t>(id)) == all.end()) continue;
      row[id] = row[id] < 0 ? row[id] * rep : row[id] / rep;
    }
    for (const auto& [id, c] : counts) {
      row[id] -= static_cast<float>(c) * r.controls.frequency_penalty;
      row[id] -= r.controls.presence_penalty;
    }
    if (static_cast<int>(out.ids.size()) < r.min_tokens) {
      for (int32_t id : r.stop_token_ids) row[id] = -std::numeric_limits<float>::infinity();
      if (!r.ignore_eos) row[kEos] = -std::numeric_limits<float>::infinity();
    }
    const float u = r.sampling.temperature > 0 ? rng.NextFloat() : 0.0f;
    const int32_t token = engine::SampleWithUniform(row, r.sampling, u);
    out.ids.push_back(token);
    all.push_back(token);
    ++counts[token];
    number = KvBackend::Mix(number, token);
    if (token == kEos && !r.ignore_eos) {
      out.reason = FinishReason::kEos;
      return out;
    }
    if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
        r.stop_token_ids.end()) {
      out.reason = FinishReason::kStop;
      return out;
    }
  }
  return out;
}

// The text LetterTokenizer gives `ids`, the stop token (if it ended them)
// left out.
std::string Text(const std::vector<int32_t>& ids, FinishReason reason) {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (reason == FinishReason::kStop && i + 1 == ids.size()) break;
    if (ids[i] != kEos) text += static_cast<char>('a' + ids[i]);
  }
  return text;
}

class SamplingControlsTest : public KvLoopTest {
 protected:
  // Several kinds of request, each with some of the controls.
  std::vector<GenerationRequest> Requests() {
    std::vector<GenerationRequest> out;
    auto add = [&](std::vector<int32_t> prompt, int max_new, float temperature, uint64_t seed) {
      GenerationRequest r = Request(std::move(prompt), max_new);
      r.sampling.temperature = temperature;
      r.seed = seed;
      out.push_back(r);
      return &out.back();
    };
    add({1, 2, 3}, 10, 0.5f, 1)->controls.repetition_penalty = 1.8f;
    add({4, 5, 6}, 10, 0.9f, 2)->controls.repetition_penalty = 0.6f;
    add({7, 1, 9}, 12, 0.0f, 3)->controls.presence_penalty = 1.5f;
    auto* f = add({2, 2, 2}, 12, 0.7f, 12);
    f->controls.frequency_penalty = 1.0f;
    f->controls.presence_penalty = -0.5f;
    auto* b = add({3, 1, 4, 1, 5}, 9, 0.0f, 5);
    b->controls.logit_bias = {{2, 0.5f}, {6, 3.0f}, {kEos, -100.0f}};
    auto* p = add({9, 2, 6}, 10, 1.3f, 6);
    // exp(-1.5 / 1.3) = 0.315 of the top: min_p 0.32 keeps only the top.
    p->sampling.min_p = 0.32f;
    p->sampling.top_p = 0.95f;
    auto* m = add({5, 3, 5}, 11, 0.8f, 7);
    m->min_tokens = 8;
    m->stop_token_ids = {3, 4};
    m->controls.logit_bias = {{kEos, 2.0f}, {3, 1.0f}};
    auto* s = add({8, 9, 7}, 10, 0.0f, 8);
    s->stop_token_ids = {static_cast<int32_t>(KvBackend::Expected({8, 9, 7}, 3)[2])};
    add({6, 6, 1}, 10, 1.0f, 9);  // no controls
    return out;
  }
};

TEST_F(SamplingControlsTest, EachRequestGeneratesWhatTheDefinitionsGive) {
  for (const LoopSetup& setup :
       {LoopSetup{}, LoopSetup{.overlap = true}, LoopSetup{.mode = BatchingMode::kStaticPadded},
        // Eight blocks of 4 for nine requests of 13 to 16 tokens:
        // preemptions, each resumed with its counts.
        LoopSetup{.num_blocks = 8, .max_batch_size = 9}}) {
    SCOPED_TRACE(setup.num_blocks);
    MakeLoop(setup, /*caching=*/setup.num_blocks == 32);
    backend_->top_logit_ = 1.5f;
    std::vector<GenerationRequest> requests = Requests();
    std::vector<std::shared_ptr<Collector>> sinks;
    for (const GenerationRequest& r : requests) sinks.push_back(Submit(r));
    RunUntilFinished(sinks);
    for (size_t i = 0; i < requests.size(); ++i) {
      SCOPED_TRACE(i);
      const Simulated want = Simulate(*backend_, requests[i], requests[i].seed);
      EXPECT_THAT(sinks[i]->ids(), ElementsAreArray(want.ids));
      const StreamUpdate final = sinks[i]->WaitFinal();
      EXPECT_EQ(final.finish_reason, want.reason);
      EXPECT_EQ(sinks[i]->text(), Text(want.ids, want.reason));
    }
    if (setup.num_blocks == 8) {
      EXPECT_GT(observer_.preemptions, 0);
    }
  }
}

// The controls change the outputs: without them, the same requests give
// other tokens (so the test above can tell them apart).
TEST_F(SamplingControlsTest, TheControlsChangeTheOutputs) {
  MakeLoop({});
  backend_->top_logit_ = 1.5f;
  std::vector<GenerationRequest> requests = Requests();
  for (size_t i = 0; i + 1 < requests.size(); ++i) {  // the last has none
    GenerationRequest& r = requests[i];
    const Simulated with = Simulate(*backend_, r, r.seed);
    r.controls = {};
    r.sampling.min_p = 0.0f;
    r.min_tokens = 0;
    r.stop_token_ids.clear();
    EXPECT_NE(Simulate(*backend_, r, r.seed).ids, with.ids) << i;
  }
}

// A seeded request gets the same tokens alone and in a batch with requests
// that use the controls (whose steps then sample on the host).
TEST_F(SamplingControlsTest, SeededRequestsKeepTheirTokensWhateverSharesTheirBatch) {
  const std::vector<GenerationRequest> requests = Requests();
  std::vector<std::vector<int32_t>> alone;
  for (const GenerationRequest& r : requests) {
    MakeLoop({});
    backend_->top_logit_ = 1.5f;
    auto sink = Submit(r);
    RunUntilFinished({sink});
    alone.push_back(sink->ids());
  }
  MakeLoop({.max_batch_size = 9});
  backend_->top_logit_ = 1.5f;
  std::vector<std::shared_ptr<Collector>> sinks;
  for (const GenerationRequest& r : requests) sinks.push_back(Submit(r));
  RunUntilFinished(sinks);
  for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(sinks[i]->ids(), alone[i]) << i;
}

TEST_F(SamplingControlsTest, SamplesEachCountTheirOwnTokens) {
  MakeLoop({});
  backend_->top_logit_ = 1.5f;
  GenerationRequest r = Request({1, 2, 3, 4, 5, 6}, 10);
  r.sampling.temperature = 1.0f;
  r.seed = 40;
  r.n = 3;
  r.controls.frequency_penalty = 1.2f;
  r.controls.repetition_penalty = 1.3f;
  r.min_tokens = 5;
  auto sink = Submit(r);
  RunUntilFinished({sink});
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(sink->ids(i), ElementsAreArray(Simulate(*backend_, r, r.seed + i).ids)) << i;
  }
}

TEST_F(SamplingControlsTest, StopTokensEndWithStopAndTheirTextIsNotSent) {
  MakeLoop({});
  const std::vector<int32_t> prompt = {8, 9, 7};
  const std::vector<int32_t> plain = KvBackend::Expected(prompt, 6);
  GenerationRequest r = Request(prompt, 6);
  r.stop_token_ids = {plain[2]};
  auto sink = Submit(r);
  RunUntilFinished({sink});
  ASSERT_EQ(std::find(plain.begin(), plain.begin() + 2, plain[2]), plain.begin() + 2);
  EXPECT_THAT(sink->ids(),
              ElementsAreArray(std::vector<int32_t>(plain.begin(), plain.begin() + 3)));
  EXPECT_EQ(sink->WaitFinal().finish_reason, FinishReason::kStop);
  EXPECT_EQ(sink->WaitFinal().completion_tokens, 3);
  EXPECT_EQ(sink->text(), Text({plain[0], plain[1]}, FinishReason::kLength));
}

TEST_F(SamplingControlsTest, IgnoreEosGoesOnPastTheEndToken) {
  MakeLoop({});
  backend_->top_logit_ = 1.5f;
  // A seed whose sampled continuation reaches EOS early.
  GenerationRequest r = Request({2, 7}, 10);
  r.sampling.temperature = 1.0f;
  size_t eos_at = 0;
  for (r.seed = 0; r.seed < 1000; ++r.seed) {
    const Simulated plain = Simulate(*backend_, r, r.seed);
    if (plain.reason == FinishReason::kEos && plain.ids.size() >= 3) {
      eos_at = plain.ids.size() - 1;
      break;
    }
  }
  ASSERT_GT(eos_at, 0u);
  const StreamUpdate ended = Run(r);
  EXPECT_EQ(ended.finish_reason, FinishReason::kEos);
  EXPECT_EQ(ended.completion_tokens, static_cast<int>(eos_at) + 1);

  r.ignore_eos = true;
  const Simulated on = Simulate(*backend_, r, r.seed);
  ASSERT_EQ(on.ids.size(), 10u);
  EXPECT_EQ(on.ids[eos_at], kEos);
  auto sink = Submit(r);
  RunUntilFinished({sink});
  EXPECT_THAT(sink->ids(), ElementsAreArray(on.ids));
  EXPECT_EQ(sink->WaitFinal().finish_reason, FinishReason::kLength);

  // min_tokens keeps the end token away until then.
  r.ignore_eos = false;
  r.min_tokens = static_cast<int>(eos_at) + 1;
  const Simulated later = Simulate(*backend_, r, r.seed);
  EXPECT_NE(later.ids[eos_at], kEos);
  sink = Submit(r);
  RunUntilFinished({sink});
  EXPECT_THAT(sink->ids(), ElementsAreArray(later.ids));
  EXPECT_GE(sink->ids().size(), eos_at + 1);
}

TEST_F(SamplingControlsTest, BackendsThatSampleOnTheirOwnRefuseThem) {
  CountingBackend counting(8);
  EngineLoop loop(&counting, &tokenizer_, EngineLoopOptions{}, &clock_, nullptr);
  auto refused = [&](auto set) {
    GenerationRequest r = Request({1, 2}, 4);
    set(r);
    absl::StatusOr<uint64_t> id = loop.Submit(r, std::make_shared<Collector>());
    return id.status().code() == absl::StatusCode::kUnimplemented &&
           std::string(id.status().message()).find("counting backend") != std::string::npos;
  };
  EXPECT_TRUE(refused([](GenerationRequest& r) { r.controls.repetition_penalty = 1.1f; }));
  EXPECT_TRUE(refused([](GenerationRequest& r) { r.controls.frequency_penalty = 0.1f; }));
  EXPECT_TRUE(refused([](GenerationRequest& r) { r.controls.presence_penalty = 0.1f; }));
  EXPECT_TRUE(refused([](GenerationRequest& r) { r.controls.logit_bias = {{1, 1.0f}}; }));
  EXPECT_TRUE(refused([](GenerationRequest& r) { r.sampling.min_p = 0.1f; }));
  EXPECT_TRUE(refused([](GenerationRequest& r) { r.min_tokens = 2; }));
  // Stopping controls need no logits.
  EXPECT_FALSE(refused([](GenerationRequest& r) {
    r.ignore_eos = true;
    r.stop_token_ids = {3};
  }));
}

}  // namespace
}  // namespace coalesce::batcher
