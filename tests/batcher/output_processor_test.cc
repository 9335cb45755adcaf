// The output processor alone: each finish reason, stop sequences that arrive
// over several tokens (held back, then cut or let go), a character whose
// bytes come in two tokens, stop tokens, log-probabilities of generated and
// prompt tokens.
#include "batcher/output_processor.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Token ids name byte strings; 7 is end-of-sequence (no text), and 5 and 6
// are the two bytes of "é" (U+00E9).
class BytesTokenizer : public engine::Tokenizer {
 public:
  static constexpr int32_t kEos = 7;
  int vocab_size() const override { return 8; }
  int32_t bos_id() const override { return 0; }
  std::span<const int32_t> eos_ids() const override { return eos_; }
  std::vector<int32_t> Encode(std::string_view, bool) const override { return {}; }
  std::string TokenBytes(int32_t, int32_t token) const override {
    static const char* const kBytes[] = {"", "a", "x", "y", "z", "\xC3", "\xA9", ""};
    return kBytes[token];
  }

 private:
  std::vector<int32_t> eos_ = {kEos};
};

constexpr int32_t kA = 1, kX = 2, kY = 3, kZ = 4, kE1 = 5, kE2 = 6;

class OutputProcessorTest : public ::testing::Test {
 protected:
  GenerationRequest Request(int max_new_tokens = 16) {
    GenerationRequest r;
    r.prompt = {0, kA};
    r.max_new_tokens = max_new_tokens;
    return r;
  }
  // Feeds `tokens` one at a time; returns each update's text, and the
  // finish reason of the one that ended (the feeding stops there).
  std::vector<std::string> Feed(const GenerationRequest& r, const std::vector<int32_t>& tokens,
                                std::optional<FinishReason>* finish = nullptr) {
    out_.emplace();  // a fresh stream
    processor_.Begin(r, r.prompt.back(), *out_);
    std::vector<std::string> texts;
    int length = static_cast<int>(r.prompt.size());
    for (const int32_t t : tokens) {
      OutputProcessor::Output o = processor_.Process(r, 0, t, ++length, {}, *out_);
      EXPECT_THAT(o.update.token_ids, ElementsAre(t));
      texts.push_back(o.update.text);
      if (o.finish.has_value()) {
        if (finish != nullptr) *finish = o.finish;
        break;
      }
    }
    return texts;
  }

  BytesTokenizer tokenizer_;
  OutputProcessor processor_{&tokenizer_, 8, /*max_seq_len=*/12};
  std::optional<OutputState> out_{std::in_place};
};

TEST_F(OutputProcessorTest, EndOfSequenceEndsUnlessIgnored) {
  std::optional<FinishReason> finish;
  EXPECT_THAT(Feed(Request(), {kA, BytesTokenizer::kEos, kA}, &finish), ElementsAre("a", ""));
  EXPECT_EQ(finish, FinishReason::kEos);
  GenerationRequest r = Request(3);
  r.ignore_eos = true;
  finish.reset();
  EXPECT_THAT(Feed(r, {kA, BytesTokenizer::kEos, kA}, &finish), ElementsAre("a", "", "a"));
  EXPECT_EQ(finish, FinishReason::kLength);  // the third of 3 tokens
}

TEST_F(OutputProcessorTest, LengthEndsAtMaxNewTokensOrTheContext) {
  std::optional<FinishReason> finish;
  EXPECT_THAT(Feed(Request(2), {kA, kX, kY}, &finish), ElementsAre("a", "x"));
  EXPECT_EQ(finish, FinishReason::kLength);
  EXPECT_EQ(out_->generated, 2);
  // The context holds 12 positions: a 2-token prompt and 10 more.
  finish.reset();
  const std::vector<std::string> texts = Feed(Request(100), std::vector<int32_t>(20, kA), &finish);
  EXPECT_EQ(texts.size(), 10u);
  EXPECT_EQ(finish, FinishReason::kLength);
}

TEST_F(OutputProcessorTest, AStopSequenceOverSeveralTokensIsHeldBackThenCut) {
  GenerationRequest r = Request();
  r.stop = {"xyz"};
  std::optional<FinishReason> finish;
  // "x" and "y" might start "xyz": held back until "a" shows they did not;
  // then "xyz" completes and is not sent.
  EXPECT_THAT(Feed(r, {kA, kX, kY, kA, kX, kY, kZ, kA}, &finish),
              ElementsAre("a", "", "", "xya", "", "", ""));
  EXPECT_EQ(finish, FinishReason::kStop);
}

TEST_F(OutputProcessorTest, HeldBackTextGoesOutWhenTheSequenceEndsOtherwise) {
  GenerationRequest r = Request(3);
  r.stop = {"xyz"};
  std::optional<FinishReason> finish;
  EXPECT_THAT(Feed(r, {kA, kX, kY}, &finish), ElementsAre("a", "", "xy"));
  EXPECT_EQ(finish, FinishReason::kLength);
}

TEST_F(OutputProcessorTest, ACharacterSplitAcrossTokensGoesOutWhole) {
  std::optional<FinishReason> finish;
  EXPECT_THAT(Feed(Request(3), {kE1, kE2, kA}, &finish), ElementsAre("", "\xC3\xA9", "a"));
  EXPECT_EQ(finish, FinishReason::kLength);
}

TEST_F(OutputProcessorTest, AStopTokenEndsWithoutItsText) {
  GenerationRequest r = Request();
  r.stop_token_ids = {kZ};
  std::optional<FinishReason> finish;
  EXPECT_THAT(Feed(r, {kA, kZ, kA}, &finish), ElementsAre("a", ""));
  EXPECT_EQ(finish, FinishReason::kStop);
}

TEST_F(OutputProcessorTest, LogProbabilitiesOfEachTokenAndOfThePromptOnce) {
  GenerationRequest r = Request();
  r.prompt = {0, kA, kX, kY};
  r.logprobs = true;
  r.prompt_logprobs = true;
  r.top_logprobs = 1;
  processor_.Begin(r, r.prompt.back(), *out_);
  // Rows after positions 0..2 predict prompt tokens 1..3; position 1's row
  // comes twice (after a preemption) and is scored once.
  std::vector<float> rows(3 * 8, 0.0f);
  rows[0 * 8 + kA] = 2.0f;
  rows[1 * 8 + kX] = 3.0f;
  rows[2 * 8 + kY] = 4.0f;
  EXPECT_TRUE(OutputProcessor::ScoringPrompt(r, *out_));
  processor_.ScorePrompt(r, 0, std::span<const float>(rows).first(16), *out_);
  processor_.ScorePrompt(r, 1, std::span<const float>(rows).subspan(8), *out_);
  EXPECT_FALSE(OutputProcessor::ScoringPrompt(r, *out_));
  ASSERT_EQ(out_->prompt_logprobs.size(), 3u);
  const double z = std::log(7.0 + std::exp(2.0));  // row 0: one logit of 2, seven of 0
  EXPECT_EQ(out_->prompt_logprobs[0].token, kA);
  EXPECT_NEAR(out_->prompt_logprobs[0].logprob, 2.0 - z, 1e-5);
  EXPECT_EQ(out_->prompt_logprobs[2].token, kY);

  std::vector<float> logits(8, 0.0f);
  logits[kZ] = 1.0f;
  OutputProcessor::Output first = processor_.Process(r, 0, kZ, 5, logits, *out_);
  ASSERT_EQ(first.update.logprobs.size(), 1u);
  EXPECT_NEAR(first.update.logprobs[0].logprob, 1.0 - std::log(7.0 + std::exp(1.0)), 1e-5);
  ASSERT_EQ(first.update.logprobs[0].top.size(), 1u);
  EXPECT_EQ(first.update.logprobs[0].top[0].first, kZ);
  EXPECT_EQ(first.update.prompt_logprobs.size(), 3u);
  OutputProcessor::Output second = processor_.Process(r, 0, kZ, 6, logits, *out_);
  EXPECT_THAT(second.update.prompt_logprobs, IsEmpty());
  EXPECT_EQ(second.update.logprobs.size(), 1u);
}

TEST_F(OutputProcessorTest, UpdatesNameTheirSample) {
  GenerationRequest r = Request();
  processor_.Begin(r, r.prompt.back(), *out_);
  EXPECT_EQ(processor_.Process(r, 3, kA, 3, {}, *out_).update.index, 3);
}

}  // namespace
}  // namespace coalesce::batcher
