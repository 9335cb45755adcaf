// The changes a request asks of its logits before sampling: a bias per
// token, and penalties for tokens it has already seen. Each request owns a
// LogitsProcessor that counts its tokens, so what it does to a row depends
// on that request alone, never on what shares its batch.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace coalesce::engine {

struct LogitsControls {
  // transformers' RepetitionPenaltyLogitsProcessor (from CTRL): the logit of
  // every token in the prompt or the output so far is divided by the penalty
  // when positive and multiplied by it when negative. 1: off.
  float repetition_penalty = 1.0f;
  // OpenAI's definition, over the output so far (not the prompt): the logit
  // of a token that appeared c times loses c * frequency_penalty, and
  // presence_penalty once if c > 0. 0: off.
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // (token id, bias) added to the logit: transformers' SequenceBiasLogitsProcessor
  // with one-token sequences, OpenAI's logit_bias. Ids within the vocabulary.
  std::vector<std::pair<int32_t, float>> logit_bias;

  // Whether any of the above changes anything.
  bool active() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f ||
           !logit_bias.empty();
  }
};

class LogitsProcessor {
 public:
  // `prompt`: the tokens before the output (repetition_penalty counts them).
  LogitsProcessor(LogitsControls controls, std::span<const int32_t> prompt);

  // A token of the output, in order.
  void Accept(int32_t token);

  // Changes `logits` (one row, the vocabulary) in transformers' order:
  // logit_bias, then repetition_penalty, then frequency and presence
  // penalties (float32 arithmetic throughout); then every id in `banned`
  // gets -infinity (min_tokens). Ids outside the row are ignored.
  void Apply(std::span<float> logits, std::span<const int32_t> banned) const;

  const LogitsControls& controls() const { return controls_; }

 private:
  LogitsControls controls_;
  absl::flat_hash_set<int32_t> seen_;             // prompt and output
  absl::flat_hash_map<int32_t, int32_t> counts_;  // output only
};

}  // namespace coalesce::engine
