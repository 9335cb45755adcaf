// What an engine step costs, learned from the steps the loop has timed, so
// that a step with decoding sequences in it can be kept under a time target
// (EngineLoopOptions::max_step_time): the prompt chunks that share the step
// with the decodes are sized to fit, while a step without decodes may take
// the whole token budget. Pure arithmetic on a fed clock, tested in
// tests/batcher/step_cost_test.cc.
//
// The model. A step's duration is close to linear in its shape:
//   duration = fixed                       (weights read, launch, host work)
//            + per_row x rows              (every token goes through the
//                                           matrices)
//            + per_decode_position x positions the decodes attend to
//            + per_prefill_position x positions the prompt tokens attend to
//            + per_logit_row x rows of logits
// (attention reads each token's whole context: a chunk of c prompt tokens at
// offset o attends to c x o + c (c + 1) / 2 positions, which is why a long
// prompt's late chunks cost more than its early ones; decodes and prompt
// chunks attend at different costs per position, as a chunk's tokens share
// the reads of their context). The coefficients are fit by least squares
// over the last kWindow steps that ran prompt tokens and the last kWindow
// that did not (kept apart, so that a long run of decodes does not forget
// what prompt tokens cost), each kept at zero or above (a coefficient the
// steps cannot support is left out and the rest fit again). Until it has
// seen kMinSteps steps of which kMinPrefillSteps ran prompt tokens, the
// model is not ready and callers keep chunks small.
#pragma once

#include <array>
#include <cstdint>
#include <deque>

#include "absl/time/time.h"

namespace coalesce::batcher {

struct StepShape {
  int rows = 0;                   // tokens in the step
  int64_t decode_positions = 0;   // positions the decodes attend to
  int64_t prefill_positions = 0;  // positions the prompt tokens attend to
  int logit_rows = 0;             // rows of logits computed
  int scored_rows = 0;            // of those, of prompt tokens (prompt_logprobs): not a feature
  StepShape& operator+=(const StepShape& other);
};

// Positions a chunk of `tokens` prompt tokens after `cached` ones attends to.
int64_t ChunkPositions(int cached, int tokens);

class StepCostModel {
 public:
  static constexpr int kWindow = 32;
  static constexpr int kMinSteps = 8;
  static constexpr int kMinPrefillSteps = 3;

  void Observe(const StepShape& shape, absl::Duration duration);
  bool ready() const;
  // Whether it has seen steps with scored prompt tokens (each a row of
  // logits), so that it knows what a row of logits costs; until then
  // callers keep scored chunks small.
  bool knows_scored() const { return scored_steps_ >= kMinPrefillSteps; }
  // The predicted duration of a step of `shape` (zero before any fit).
  absl::Duration Predict(const StepShape& shape) const;

  // The most prompt tokens, at most `at_most`, that a chunk after `cached`
  // tokens may add to a step of shape `so_far` (with `scored`, each of them
  // a row of logits, else one) and keep the step's predicted duration within
  // `target`; 0 when even one does not fit.
  int MaxChunk(const StepShape& so_far, int cached, bool scored, int at_most,
               absl::Duration target) const;

 private:
  static constexpr int kFeatures = 5;
  using Features = std::array<double, kFeatures>;
  static Features FeaturesOf(const StepShape& shape);
  void Fit();

  struct Sample {
    Features x;
    double seconds;
  };
  std::deque<Sample> prefill_;  // steps that ran prompt tokens
  std::deque<Sample> decode_;   // the others
  int scored_steps_ = 0;        // ever
  Features coefficients_{};     // seconds per unit of each feature
};

}  // namespace coalesce::batcher
