// Step tables for the step planner: decodes first, prompt chunks in the rest
// of the token budget, preemption when decodes need blocks that are not free.
#include "batcher/step_planner.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Plans name sequences by their position in `running`: 0 is the oldest.
RunningSequence Decoding(int cached, int blocks, int priority = 0) {
  return {cached, 1, false, blocks, priority};
}
RunningSequence Prefilling(int cached, int pending, int blocks) {
  return {cached, pending, true, blocks, 0};
}

TEST(StepPlannerTest, DecodesFirstThenPromptChunksFillTheBudget) {
  // Budget 8: two decodes (2 tokens), then 6 prompt tokens: A's 4 whole and
  // the first 2 of B's 10; C waits for the next step.
  const std::vector<RunningSequence> running = {Decoding(5, 2), Prefilling(0, 4, 1), Decoding(9, 3),
                                                Prefilling(0, 10, 3), Prefilling(0, 3, 1)};
  StepPlan plan = PlanStep(running, /*free_blocks=*/10, /*block_size=*/4, /*max_batch_tokens=*/8);
  EXPECT_THAT(plan.preempt, IsEmpty());
  EXPECT_THAT(plan.chunks, ElementsAre(StepChunk{0, 1, false}, StepChunk{1, 4, false},
                                       StepChunk{2, 1, false}, StepChunk{3, 2, false}));
  EXPECT_EQ(plan.decode_tokens, 2);
  EXPECT_EQ(plan.prefill_tokens, 6);
}

TEST(StepPlannerTest, APromptResumesWhereItsLastChunkEnded) {
  const std::vector<RunningSequence> running = {Prefilling(2, 8, 3)};
  StepPlan plan = PlanStep(running, 0, 4, 5);
  EXPECT_THAT(plan.chunks, ElementsAre(StepChunk{0, 5, false}));
}

TEST(StepPlannerTest, DecodeCrossingABlockBoundaryGetsANewBlock) {
  // The first has 8 cached positions in 2 blocks of 4: position 8 starts block 3.
  const std::vector<RunningSequence> running = {Decoding(8, 2), Decoding(6, 2)};
  StepPlan plan = PlanStep(running, 1, 4, 16);
  EXPECT_THAT(plan.chunks, ElementsAre(StepChunk{0, 1, true}, StepChunk{1, 1, false}));
}

TEST(StepPlannerTest, PreemptsTheMostRecentlyAdmittedWhenBlocksRunOut) {
  // Three decodes each need a new block; one is free. Preempting the third
  // (the newest) frees its 2 blocks: 3 free for the 2 remaining needs.
  const std::vector<RunningSequence> running = {Decoding(8, 2), Decoding(8, 2), Decoding(8, 2)};
  StepPlan plan = PlanStep(running, 1, 4, 16);
  EXPECT_THAT(plan.preempt, ElementsAre(2));
  EXPECT_THAT(plan.chunks, ElementsAre(StepChunk{0, 1, true}, StepChunk{1, 1, true}));
}

TEST(StepPlannerTest, PreemptsLowerPriorityBeforeNewer) {
  const std::vector<RunningSequence> running = {Decoding(8, 2, /*priority=*/0),
                                                Decoding(8, 2, /*priority=*/1),
                                                Decoding(8, 2, /*priority=*/1)};
  StepPlan plan = PlanStep(running, 0, 4, 16);
  // The first goes despite being the oldest; its 2 blocks serve both others.
  EXPECT_THAT(plan.preempt, ElementsAre(0));
  EXPECT_THAT(plan.chunks, ElementsAre(StepChunk{1, 1, true}, StepChunk{2, 1, true}));
}

TEST(StepPlannerTest, PreemptsATenantOverItsShareFirst) {
  // All three need a block, none is free: one goes. Sequence 0 belongs to a
  // tenant over its share, so it goes despite its higher priority and age.
  std::vector<RunningSequence> running = {Decoding(8, 2, /*priority=*/5),
                                          Decoding(8, 2, /*priority=*/0),
                                          Decoding(8, 2, /*priority=*/1)};
  running[0].over_share = true;
  EXPECT_THAT(PlanStep(running, 0, 4, 100).preempt, ElementsAre(0));
  running[0].over_share = false;  // otherwise: the lowest priority
  EXPECT_THAT(PlanStep(running, 0, 4, 100).preempt, ElementsAre(1));
}

TEST(StepPlannerTest, APrefillingSequenceCanBeTheVictim) {
  // The newest is still prefilling and holds 3 blocks: preempting it is
  // enough for the decode's new block.
  const std::vector<RunningSequence> running = {Decoding(4, 1), Prefilling(0, 12, 3)};
  StepPlan plan = PlanStep(running, 0, 4, 16);
  EXPECT_THAT(plan.preempt, ElementsAre(1));
  EXPECT_THAT(plan.chunks, ElementsAre(StepChunk{0, 1, true}));
}

TEST(StepPlannerTest, ALoneSequenceWithNoBlockLeftPreemptsItself) {
  const std::vector<RunningSequence> running = {Decoding(4, 1)};
  StepPlan plan = PlanStep(running, 0, 4, 16);
  EXPECT_THAT(plan.preempt, ElementsAre(0));
  EXPECT_THAT(plan.chunks, IsEmpty());
}

}  // namespace
}  // namespace coalesce::batcher
