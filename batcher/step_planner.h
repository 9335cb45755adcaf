// What one engine step runs: given the running sequences, the free KV blocks
// and the token budget, which sequences to preempt and how many tokens each
// remaining sequence processes. A pure function, tested with step tables
// (tests/batcher/step_planner_test.cc).
//
// The rule:
//   1. Decodes first. Every decoding sequence processes its one new token.
//      One whose next position starts a new block needs a free block; when
//      there are not enough, running sequences are preempted until the
//      remaining decodes fit: first those of tenants that run more than
//      their share of the batch (scheduler.h), then the lowest priority and,
//      among equals, the most recently admitted. A preempted sequence gives
//      back all its blocks (those it shares with others stay held by them),
//      returns to the waiting queue, and is later resumed by recomputing its
//      prompt and what it had generated (less what it finds in the prefix
//      cache).
//   2. Prefill fills the rest of `max_batch_tokens`, in admission order. A
//      prompt longer than what is left is split: its first part runs now, the
//      rest in later steps, so one huge prompt cannot stall everyone's next
//      token (and a sequence's own max_chunk can split it further).
//      Prefilling sequences hold the blocks for their whole prompt from
//      admission, so prefill never needs new blocks.
//   3. With a time target (StepTimeTarget) and decodes in the step, the
//      prompt chunks are also sized so that the step's predicted duration
//      (step_cost.h) stays within the target: the decoders' next token is
//      not held up by more than that, however long the prompt and its
//      context. A step without decodes is not limited by time. Before the
//      model has seen enough steps (for a prompt_logprobs chunk, enough
//      steps with such chunks), chunks beside decodes are at most
//      `cold_chunk` tokens. And the first chunk of a step gets at least the
//      tokens that fit in a quarter of the target beyond the decodes'
//      predicted time (one at least), so that prompts progress however many
//      sequences decode: then the step may take up to a quarter more than
//      the target, or the decodes' time and a quarter of it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/time/time.h"
#include "batcher/step_cost.h"

namespace coalesce::batcher {

struct RunningSequence {
  int cached_tokens = 0;    // positions already in the KV cache
  int pending_tokens = 0;   // tokens not yet in the cache (>= 1)
  bool prefilling = false;  // pending tokens are prompt/recomputation, not one decode
  int blocks_held = 0;
  int priority = 0;  // higher is more important
  // Blocks that preempting it makes available: those no other sequence
  // holds (a shared cached prefix stays held). -1: all of blocks_held.
  int blocks_released = -1;
  // Most prefill tokens in one step; 0: no limit but the budget.
  int max_chunk = 0;
  // Its tenant runs more slots than its share (scheduler.h): preempted first.
  bool over_share = false;
  // Every prompt token of its chunk makes a row of logits (prompt_logprobs).
  bool scored = false;
};

// A step's time target (see the top of this file).
struct StepTimeTarget {
  const StepCostModel* model = nullptr;
  absl::Duration target = absl::ZeroDuration();  // zero: no target
  int cold_chunk = 64;
};

struct StepChunk {
  int index = 0;           // position in `running`
  int num_tokens = 0;      // tokens of this sequence in the step
  bool new_block = false;  // needs one more KV block before the step
  bool operator==(const StepChunk&) const = default;
};

// Sequences are named by their position in PlanStep's `running`, so the
// caller finds each one without a search.
struct StepPlan {
  std::vector<int> preempt;       // in the order chosen
  std::vector<StepChunk> chunks;  // in admission order; sequences left out wait
  int decode_tokens = 0;
  int prefill_tokens = 0;
};

// `running` is in admission order. `max_batch_tokens` must be at least the
// number of running sequences (every decode fits).
StepPlan PlanStep(std::span<const RunningSequence> running, int free_blocks, int block_size,
                  int max_batch_tokens, const StepTimeTarget& time = {});

// The shape of a step's chunk (step_cost.h): `tokens` of a sequence with
// `cached` positions in the cache.
StepShape ChunkShape(int cached, int tokens, bool prefilling, bool scored);

}  // namespace coalesce::batcher
