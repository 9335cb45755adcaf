// The step cost model (batcher/step_cost.h) on synthetic steps whose
// durations follow known coefficients, and the step planner's time target
// (step_planner.h): prompt chunks beside decodes sized to the target, whole
// budgets without decodes, small chunks before the model is ready, and a
// prompt that still progresses when the decodes alone fill the target.
#include "batcher/step_cost.h"

#include <random>

#include "batcher/step_planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;

// A machine: 2 ms a step, 20 us a row, 2 ns a decode position, 0.5 ns a
// prompt position, 10 us a row of logits.
absl::Duration Machine(const StepShape& s) {
  return absl::Microseconds(2000 + 20.0 * s.rows + 0.002 * s.decode_positions +
                            0.0005 * s.prefill_positions + 10.0 * s.logit_rows);
}

// Steps as a server runs them: 8 decodes at contexts 100 to 2000, most with
// a prompt chunk of 16 to 512 tokens at offsets up to 4000 beside them.
StepShape RandomStep(std::mt19937& rng) {
  StepShape s;
  for (int d = 0; d < 8; ++d) {
    s += {.rows = 1,
          .decode_positions = std::uniform_int_distribution<int>(100, 2000)(rng),
          .logit_rows = 1};
  }
  if (std::uniform_int_distribution<int>(0, 3)(rng) > 0) {
    const int tokens = std::uniform_int_distribution<int>(16, 512)(rng);
    const int cached = std::uniform_int_distribution<int>(0, 4000)(rng);
    s += {.rows = tokens, .prefill_positions = ChunkPositions(cached, tokens), .logit_rows = 1};
  }
  return s;
}

// A model that has seen 40 of those steps, timed exactly.
StepCostModel Trained(unsigned seed = 4) {
  StepCostModel model;
  std::mt19937 rng(seed);
  for (int i = 0; i < 40; ++i) {
    const StepShape s = RandomStep(rng);
    model.Observe(s, Machine(s));
  }
  return model;
}

TEST(StepCostTest, ChunkPositionsCountEachTokensContext) {
  EXPECT_EQ(ChunkPositions(0, 1), 1);      // the first token attends to itself
  EXPECT_EQ(ChunkPositions(0, 4), 10);     // 1 + 2 + 3 + 4
  EXPECT_EQ(ChunkPositions(100, 2), 203);  // 101 + 102
}

TEST(StepCostTest, LearnsTheMachinesCoefficients) {
  EXPECT_FALSE(StepCostModel().ready());
  const StepCostModel model = Trained(1);
  EXPECT_TRUE(model.ready());
  std::mt19937 rng(100);  // steps it has not seen
  for (int i = 0; i < 20; ++i) {
    const StepShape s = RandomStep(rng);
    EXPECT_NEAR(absl::ToDoubleMilliseconds(model.Predict(s)),
                absl::ToDoubleMilliseconds(Machine(s)), 0.01);
  }
}

TEST(StepCostTest, NoisyStepsStillPredictWithinTheirNoise) {
  StepCostModel model;
  std::mt19937 rng(2);
  std::uniform_real_distribution<double> noise(0.9, 1.1);
  for (int i = 0; i < 64; ++i) {
    const StepShape s = RandomStep(rng);
    model.Observe(s, Machine(s) * noise(rng));
  }
  for (int i = 0; i < 20; ++i) {
    const StepShape s = RandomStep(rng);
    const double truth = absl::ToDoubleMilliseconds(Machine(s));
    EXPECT_NEAR(absl::ToDoubleMilliseconds(model.Predict(s)), truth, 0.1 * truth);
  }
}

TEST(StepCostTest, MaxChunkIsTheLargestThatKeepsTheTarget) {
  const StepCostModel model = Trained(3);
  StepShape decodes;
  for (int d = 0; d < 8; ++d) decodes += {.rows = 1, .decode_positions = 1000, .logit_rows = 1};
  for (const int cached : {0, 1000, 4000}) {
    const absl::Duration target = absl::Milliseconds(8);
    const int c = model.MaxChunk(decodes, cached, false, 4096, target);
    ASSERT_GT(c, 0) << cached;
    StepShape with = decodes;
    with += {.rows = c, .prefill_positions = ChunkPositions(cached, c), .logit_rows = 1};
    StepShape more = decodes;
    more += {.rows = c + 2, .prefill_positions = ChunkPositions(cached, c + 2), .logit_rows = 1};
    EXPECT_LE(Machine(with), target + absl::Microseconds(10)) << cached;
    EXPECT_GT(Machine(more), target - absl::Microseconds(10)) << cached;
  }
  // Later chunks of a long prompt attend to more: they are smaller.
  EXPECT_GT(model.MaxChunk(decodes, 0, false, 4096, absl::Milliseconds(8)),
            model.MaxChunk(decodes, 4000, false, 4096, absl::Milliseconds(8)));
  // Scored tokens each add a row of logits.
  EXPECT_GT(model.MaxChunk(decodes, 0, false, 4096, absl::Milliseconds(8)),
            model.MaxChunk(decodes, 0, true, 4096, absl::Milliseconds(8)));
  // Nothing fits a target the decodes alone exceed; the budget caps it.
  EXPECT_EQ(model.MaxChunk(decodes, 0, false, 4096, absl::Milliseconds(1)), 0);
  EXPECT_EQ(model.MaxChunk(decodes, 0, false, 7, absl::Seconds(10)), 7);
}

TEST(StepCostTest, ACoefficientTheStepsCannotSupportStaysAtZero) {
  // Every step the same shape but the rows: the positions cannot be told
  // apart from the fixed cost; nothing comes out negative, and the
  // prediction of the steps seen is right.
  StepCostModel model;
  for (int i = 0; i < 16; ++i) {
    StepShape s{.rows = 10 + i, .prefill_positions = 50, .logit_rows = 1};
    model.Observe(s, Machine(s));
  }
  const StepShape s{.rows = 20, .prefill_positions = 50, .logit_rows = 1};
  EXPECT_NEAR(absl::ToDoubleMilliseconds(model.Predict(s)), absl::ToDoubleMilliseconds(Machine(s)),
              0.01);
  EXPECT_GE(model.Predict(StepShape{}), absl::ZeroDuration());
}

TEST(StepTimeTargetTest, ChunksBesideDecodesFitTheTargetAndAloneTakeTheBudget) {
  const StepCostModel model = Trained();
  const StepTimeTarget time{.model = &model, .target = absl::Milliseconds(6)};
  // A decode at context 1000 and a 4096-token prompt 2000 tokens in.
  const std::vector<RunningSequence> running = {{1000, 1, false, 70}, {2000, 2096, true, 256}};
  const StepPlan plan = PlanStep(running, 100, 16, 2048, time);
  ASSERT_EQ(plan.chunks.size(), 2u);
  const int chunk = plan.chunks[1].num_tokens;
  EXPECT_EQ(chunk,
            model.MaxChunk(ChunkShape(1000, 1, false, false), 2000, false, 2047, time.target));
  EXPECT_LT(chunk, 2047);
  // Alone, the prompt takes the whole budget.
  const std::vector<RunningSequence> alone = {{2000, 2096, true, 256}};
  EXPECT_THAT(PlanStep(alone, 100, 16, 2048, time).chunks, ElementsAre(StepChunk{0, 2048, false}));
  // Without a target, the budget alone.
  EXPECT_EQ(PlanStep(running, 100, 16, 2048).chunks[1].num_tokens, 2047);
}

TEST(StepTimeTargetTest, SeveralPromptsShareTheTime) {
  const StepCostModel model = Trained();
  // The first prompt's 2000 tokens fit whole (about 43 ms), the second's
  // only in part.
  const StepTimeTarget time{.model = &model, .target = absl::Milliseconds(60)};
  const std::vector<RunningSequence> running = {
      {1000, 1, false, 70}, {0, 2000, true, 125}, {0, 2000, true, 125}};
  const StepPlan plan = PlanStep(running, 100, 16, 4096, time);
  ASSERT_EQ(plan.chunks.size(), 3u);
  StepShape shape = ChunkShape(1000, 1, false, false);
  shape += ChunkShape(0, plan.chunks[1].num_tokens, true, false);
  shape += ChunkShape(0, plan.chunks[2].num_tokens, true, false);
  EXPECT_LE(model.Predict(shape), time.target);
  EXPECT_EQ(plan.chunks[1].num_tokens, 2000);  // the older first
  EXPECT_GT(plan.chunks[2].num_tokens, 0);
  EXPECT_LT(plan.chunks[2].num_tokens, 2000);
}

TEST(StepTimeTargetTest, BeforeTheModelIsReadyChunksBesideDecodesAreSmall) {
  const StepCostModel cold;
  const StepTimeTarget time{.model = &cold, .target = absl::Milliseconds(6), .cold_chunk = 64};
  const std::vector<RunningSequence> running = {{1000, 1, false, 70}, {0, 4096, true, 256}};
  EXPECT_EQ(PlanStep(running, 100, 16, 2048, time).chunks[1].num_tokens, 64);
}

TEST(StepTimeTargetTest, ScoredChunksStaySmallUntilTheModelHasTimedSome) {
  // A row of logits per scored token: no step so far had more than one per
  // sequence, so the model cannot know their cost yet.
  StepCostModel model = Trained();
  EXPECT_FALSE(model.knows_scored());
  const StepTimeTarget time{.model = &model, .target = absl::Milliseconds(60), .cold_chunk = 64};
  const std::vector<RunningSequence> running = {
      {.cached_tokens = 1000, .pending_tokens = 1, .blocks_held = 70},
      {.cached_tokens = 0,
       .pending_tokens = 2000,
       .prefilling = true,
       .blocks_held = 125,
       .max_chunk = 256,
       .scored = true}};
  EXPECT_EQ(PlanStep(running, 100, 16, 2048, time).chunks[1].num_tokens, 64);
  for (int i = 0; i < StepCostModel::kMinPrefillSteps; ++i) {
    StepShape s = ChunkShape(1000, 1, false, false);
    s += ChunkShape(i * 64, 64, true, true);
    model.Observe(s, Machine(s));
  }
  EXPECT_TRUE(model.knows_scored());
  const int chunk = PlanStep(running, 100, 16, 2048, time).chunks[1].num_tokens;
  EXPECT_EQ(chunk, std::max(1, model.MaxChunk(ChunkShape(1000, 1, false, false), 0, true, 256,
                                              time.target)));
  EXPECT_NE(chunk, 64);
}

TEST(StepTimeTargetTest, APromptProgressesWhenTheDecodesAloneFillTheTarget) {
  const StepCostModel model = Trained();
  // 32 decodes at context 3000 take about 2.5 ms: more than the target.
  std::vector<RunningSequence> running(32, {3000, 1, false, 200});
  running.push_back({0, 4096, true, 256});
  running.push_back({0, 4096, true, 256});
  StepShape decodes;
  for (int d = 0; d < 32; ++d) decodes += ChunkShape(3000, 1, false, false);
  for (const absl::Duration target : {absl::Milliseconds(2), absl::Milliseconds(4)}) {
    const StepTimeTarget time{.model = &model, .target = target};
    ASSERT_GT(model.Predict(decodes), target / 2);
    const StepPlan plan = PlanStep(running, 100, 16, 2048, time);
    // The first prompt gets what fits in a quarter of the target beyond the
    // decodes (one token at least); the second nothing this step.
    const int floor =
        std::max(1, model.MaxChunk(decodes, 0, false, 4096, model.Predict(decodes) + target / 4));
    ASSERT_EQ(plan.chunks.size(), 33u);
    EXPECT_EQ(
        plan.chunks.back(),
        (StepChunk{32, std::max(floor, model.MaxChunk(decodes, 0, false, 4096, target)), false}));
    EXPECT_GT(plan.chunks.back().num_tokens, 1);
  }
}

}  // namespace
}  // namespace coalesce::batcher
