// engine::LogitsProcessor against values worked out by hand from the
// definitions (transformers' repetition penalty, OpenAI's frequency and
// presence penalties, an additive bias, banned tokens).
#include "engine/logits_processor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace coalesce::engine {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(LogitsProcessorTest, NothingSetChangesNothing) {
  LogitsProcessor p(LogitsControls{}, std::vector<int32_t>{1, 2, 3});
  EXPECT_FALSE(p.controls().active());
  p.Accept(2);
  std::vector<float> row = {1.0f, -2.0f, 3.0f, 0.5f};
  p.Apply(row, {});
  EXPECT_EQ(row, (std::vector<float>{1.0f, -2.0f, 3.0f, 0.5f}));
}

TEST(LogitsProcessorTest, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOfSeenTokens) {
  // Seen: 1 and 3 in the prompt (3 twice), 4 generated; 0, 2 and 5 unseen.
  LogitsProcessor p({.repetition_penalty = 2.0f}, std::vector<int32_t>{3, 1, 3});
  p.Accept(4);
  std::vector<float> row = {1.0f, 4.0f, 3.0f, -1.5f, 0.0f, -7.0f};
  p.Apply(row, {});
  EXPECT_EQ(row, (std::vector<float>{1.0f, 2.0f, 3.0f, -3.0f, 0.0f, -7.0f}));
  // Below 1 it encourages them instead.
  LogitsProcessor q({.repetition_penalty = 0.5f}, std::vector<int32_t>{1});
  row = {1.0f, 4.0f};
  q.Apply(row, {});
  EXPECT_EQ(row, (std::vector<float>{1.0f, 8.0f}));
}

TEST(LogitsProcessorTest, FrequencyAndPresencePenaltiesCountTheOutputOnly) {
  // Token 1 is in the prompt only; 2 generated three times, 3 once.
  LogitsProcessor p({.frequency_penalty = 0.5f, .presence_penalty = 0.25f},
                    std::vector<int32_t>{1, 1});
  for (int32_t t : {2, 3, 2, 2}) p.Accept(t);
  std::vector<float> row = {0.0f, 1.0f, 2.0f, 3.0f};
  p.Apply(row, {});
  EXPECT_FLOAT_EQ(row[0], 0.0f);
  EXPECT_FLOAT_EQ(row[1], 1.0f);
  EXPECT_FLOAT_EQ(row[2], 2.0f - 3 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(row[3], 3.0f - 0.5f - 0.25f);
  // Negative penalties encourage repetition.
  LogitsProcessor q({.frequency_penalty = -1.0f, .presence_penalty = -2.0f}, {});
  q.Accept(0);
  row = {0.0f, 0.0f};
  q.Apply(row, {});
  EXPECT_FLOAT_EQ(row[0], 3.0f);
  EXPECT_FLOAT_EQ(row[1], 0.0f);
}

TEST(LogitsProcessorTest, BiasComesBeforeTheRepetitionPenalty) {
  // Token 0 is seen. Biased first, its logit turns negative and is
  // multiplied: (0.5 - 2) * 2 = -3 (the other order would give
  // 0.5 / 2 - 2 = -1.75).
  LogitsProcessor p({.repetition_penalty = 2.0f, .logit_bias = {{0, -2.0f}, {2, 100.0f}}},
                    std::vector<int32_t>{0});
  std::vector<float> row = {0.5f, 1.0f, -100.0f};
  p.Apply(row, {});
  EXPECT_EQ(row, (std::vector<float>{-3.0f, 1.0f, 0.0f}));
}

TEST(LogitsProcessorTest, BannedTokensGetMinusInfinityAndIdsOutsideTheRowAreIgnored) {
  LogitsProcessor p({.presence_penalty = 1.0f, .logit_bias = {{9, 1.0f}, {-1, 1.0f}}},
                    std::vector<int32_t>{});
  p.Accept(7);
  std::vector<float> row = {1.0f, 2.0f, 3.0f};
  const std::vector<int32_t> banned = {2, 5};
  p.Apply(row, banned);
  EXPECT_EQ(row[0], 1.0f);
  EXPECT_EQ(row[1], 2.0f);
  EXPECT_EQ(row[2], -kInf);
}

}  // namespace
}  // namespace coalesce::engine
