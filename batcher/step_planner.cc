#include "batcher/step_planner.h"

#include <algorithm>

namespace coalesce::batcher {
namespace {

bool NeedsNewBlock(const RunningSequence& s, int block_size) {
  return !s.prefilling && s.cached_tokens + s.pending_tokens > s.blocks_held * block_size;
}

}  // namespace

StepShape ChunkShape(int cached, int tokens, bool prefilling, bool scored) {
  StepShape shape{
      .rows = tokens, .logit_rows = scored ? tokens : 1, .scored_rows = scored ? tokens : 0};
  if (prefilling) {
    shape.prefill_positions = ChunkPositions(cached, tokens);
  } else {
    shape.decode_positions = ChunkPositions(cached, tokens);
  }
  return shape;
}

StepPlan PlanStep(std::span<const RunningSequence> running, int free_blocks, int block_size,
                  int max_batch_tokens, const StepTimeTarget& time) {
  StepPlan plan;
  std::vector<bool> preempted(running.size(), false);

  // 1. Decodes first: preempt until every remaining decode's new block fits.
  auto blocks_wanted = [&] {
    int n = 0;
    for (size_t i = 0; i < running.size(); ++i) {
      if (!preempted[i] && NeedsNewBlock(running[i], block_size)) ++n;
    }
    return n;
  };
  while (blocks_wanted() > free_blocks) {
    // Victim: one of a tenant over its share first, then the lowest
    // priority, then the most recently admitted (latest in order).
    int victim = -1;
    for (int i = static_cast<int>(running.size()) - 1; i >= 0; --i) {
      if (preempted[i]) continue;
      const RunningSequence& s = running[i];
      if (victim < 0) {
        victim = i;
        continue;
      }
      const RunningSequence& best = running[victim];
      if (s.over_share != best.over_share ? s.over_share : s.priority < best.priority) victim = i;
    }
    preempted[victim] = true;
    const RunningSequence& v = running[victim];
    free_blocks += v.blocks_released >= 0 ? v.blocks_released : v.blocks_held;
    plan.preempt.push_back(victim);
  }

  int budget = max_batch_tokens;
  for (size_t i = 0; i < running.size(); ++i) {
    if (!preempted[i] && !running[i].prefilling) budget -= running[i].pending_tokens;
  }

  // 2. In admission order: every decode, and prefill chunks while the budget
  //    (and, with decodes in the step and a time target, the time: 3.)
  //    lasts. The step's shape starts with the decodes'; the chunks add
  //    theirs as they are planned.
  StepShape shape;
  bool timed = false;
  if (time.model != nullptr && time.target > absl::ZeroDuration()) {
    for (size_t i = 0; i < running.size(); ++i) {
      const RunningSequence& s = running[i];
      if (preempted[i] || s.prefilling) continue;
      shape += ChunkShape(s.cached_tokens, s.pending_tokens, false, false);
      timed = true;
    }
  }

  for (size_t i = 0; i < running.size(); ++i) {
    const RunningSequence& s = running[i];
    if (preempted[i]) continue;
    if (!s.prefilling) {
      plan.chunks.push_back({static_cast<int>(i), s.pending_tokens, NeedsNewBlock(s, block_size)});
      plan.decode_tokens += s.pending_tokens;
      continue;
    }
    int chunk = std::min(s.pending_tokens, budget);
    if (s.max_chunk > 0) chunk = std::min(chunk, s.max_chunk);
    if (chunk <= 0) continue;
    if (timed) {
      const StepCostModel& model = *time.model;
      const bool known = model.ready() && (!s.scored || model.knows_scored());
      int fits = known ? model.MaxChunk(shape, s.cached_tokens, s.scored, chunk, time.target)
                       : std::min(chunk, time.cold_chunk);
      if (plan.prefill_tokens == 0 && known) {
        // The progress every step owes the prompts.
        const int floor = model.MaxChunk(shape, s.cached_tokens, s.scored, chunk,
                                         model.Predict(shape) + time.target / 4);
        fits = std::max({fits, floor, 1});
      }
      chunk = fits;
      if (chunk <= 0) continue;  // the step is full for this one
      shape += ChunkShape(s.cached_tokens, chunk, true, s.scored);
    }
    budget -= chunk;
    plan.chunks.push_back({static_cast<int>(i), chunk, false});
    plan.prefill_tokens += chunk;
  }
  return plan;
}

}  // namespace coalesce::batcher
