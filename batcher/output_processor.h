// What a sequence's stream says about each token it makes: the token in
// (with the logits it was sampled from), the StreamUpdate for its client
// and, when the token ends the sequence, the finish reason out. Text (valid
// UTF-8 only, a character split across tokens sent once whole), stop
// sequences and stop tokens (neither's text is sent), end of sequence,
// length, log-probabilities of generated and prompt tokens. It returns; the
// engine loop delivers the update and lets the sequence go.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "batcher/request.h"
#include "engine/sampler.h"
#include "engine/tokenizer/text_stream.h"
#include "engine/tokenizer/tokenizer.h"

namespace coalesce::batcher {

// One sequence's output so far, kept inside the sequence.
struct OutputState {
  std::optional<engine::TextStream> text;  // once the prompt's last token is known
  int generated = 0;                       // tokens made
  // With prompt_logprobs: the log-probabilities of prompt tokens 1 to
  // prompt_scored, until sent with the first update (sample 0's).
  std::vector<engine::TokenLogprob> prompt_logprobs;
  int prompt_scored = 0;
  bool prompt_logprobs_sent = false;
};

class OutputProcessor {
 public:
  // `tokenizer` must outlive it; `max_seq_len` is the model's context.
  OutputProcessor(const engine::Tokenizer* tokenizer, int vocab_size, int max_seq_len)
      : tokenizer_(tokenizer), vocab_size_(vocab_size), max_seq_len_(max_seq_len) {}

  // The stream of a sequence whose text follows `last_prompt_token`.
  void Begin(const GenerationRequest& request, int32_t last_prompt_token, OutputState& out) const;

  // Whether prompt tokens remain to be scored (prompt_logprobs).
  static bool ScoringPrompt(const GenerationRequest& request, const OutputState& out) {
    return request.prompt_logprobs &&
           out.prompt_scored < static_cast<int>(request.prompt.size()) - 1;
  }
  // `rows` are the logits after each of the positions from `first` on:
  // scores the prompt tokens they predict that are not scored yet.
  void ScorePrompt(const GenerationRequest& request, int first, std::span<const float> rows,
                   OutputState& out) const;

  struct Output {
    StreamUpdate update;  // for sample `sample`; not yet marked finished
    std::optional<FinishReason> finish;
  };
  // The sequence made `token`, sampled from `logits` (needed with
  // request.logprobs only), and now holds `length` tokens, prompt included.
  // With a finish reason the update holds the rest of the text too.
  Output Process(const GenerationRequest& request, int sample, int32_t token, int length,
                 std::span<const float> logits, OutputState& out) const;

 private:
  const engine::Tokenizer* const tokenizer_;
  const int vocab_size_;
  const int max_seq_len_;
};

}  // namespace coalesce::batcher
