// How the tokens of one step are sampled. Usually the backend samples them
// itself (Backend::StepAndSample, which on a GPU keeps the logits on the
// device). When a sequence of the step needs the logits (log-probabilities,
// prompt scoring) or changes them first (logits controls, tokens banned
// before min_tokens), the step runs with Backend::Step and every token is
// sampled here, exactly as the backend would sample it
// (engine::SampleWithUniform), each changed row a copy so that the model's
// own row stays for log-probabilities. Its buffers are reused step after
// step; the engine loop fills it, runs it and reads it back.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/logits_processor.h"
#include "engine/sampler.h"

namespace coalesce::batcher {

class StepSampler {
 public:
  // How one chunk of the step is sampled: `spec` (greedy by default, as for
  // a chunk part-way through a prompt, whose token nobody reads), after
  // `processor` changes its row (null: unchanged), with `banned` tokens
  // excluded. `wants_logits`: its logits must be kept (log-probabilities).
  struct Chunk {
    engine::SampleSpec spec;
    const engine::LogitsProcessor* processor = nullptr;
    std::span<const int32_t> banned;
    bool wants_logits = false;
  };

  // Starts a step of `vocab_size` logits per row.
  void Clear(int vocab_size);
  // The next chunk of the step, in the batch's order.
  void Add(const Chunk& chunk);
  // Runs the step and samples a token for every chunk: on the host when
  // some chunk wants or changes its logits, or the batch keeps every row of
  // a chunk (all_logits).
  absl::Status Run(engine::Backend& backend, const engine::StepBatch& batch);
  // Whether the last Run sampled on the host (its logits are here).
  bool ran_on_host() const { return on_host_; }

  // The token sampled for chunk `i`.
  int32_t next(size_t i) const { return next_[i]; }
  // After a step on the host: `rows` rows of logits of chunk `i` from its
  // first (all_logits: one after each of its tokens; else one, its last's).
  std::span<const float> logits(size_t i, int rows) const;
  // After a step on the host: the row chunk `i`'s token was sampled from.
  std::span<const float> sampled_row(size_t i, const engine::SequenceStep& seq) const;

 private:
  absl::Status SampleOnTheHost(engine::Backend& backend, const engine::StepBatch& batch);

  size_t vocab_ = 0;
  bool wants_logits_ = false;  // some chunk wants or changes its logits
  bool on_host_ = false;
  std::vector<engine::SampleSpec> specs_;  // [num_chunks]
  std::vector<Chunk> chunks_;              // [num_chunks]
  std::vector<float> scratch_;             // [vocab] a changed row
  std::vector<int32_t> next_;              // [num_chunks] sampled tokens
  std::vector<float> logits_;              // [rows, vocab] when the step ran on the host
  std::vector<size_t> first_row_;          // [num_chunks] each chunk's first row of logits_
};

}  // namespace coalesce::batcher
