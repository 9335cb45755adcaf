// The arithmetic of coalesce-eval, over plain token ids and log-probabilities
// (no gRPC): how perplexity windows slide over a text, how their prompt
// log-probabilities add up, how a multiple-choice item's choices are
// tokenized and scored, and how two greedy generations agree.
//
// Perplexity windows. The text's tokens t[0..N) (t[0] is BOS when the
// tokenizer adds one) are sent as prompts of at most W tokens (W <= the
// context length - 1: a prompt plus max_new_tokens 1 must fit), each asking
// for its prompt log-probabilities. Every token but t[0] is scored exactly
// once; t[0] has no context and is never scored. The first window is
// t[0..min(N, W)) and scores t[1..]; each next one ends S tokens (the stride)
// further, or at N, begins W tokens before its end, and scores only the
// tokens after the previous window's end. So a token scored by a later window
// sees at least W - S tokens of context (S < W), and every window is W tokens
// long except a first one that already reaches N:
//
//   N = 10, W = 6, S = 3:   t0 t1 t2 t3 t4 t5 t6 t7 t8 t9
//     window 0 [0, 6)       .  s  s  s  s  s
//     window 1 [3, 9)                c  c  c  s  s  s
//     window 2 [4, 10)                  c  c  c  c  c  s
//   (s: scored; c: context only; .: t0, never scored)
//
// Multiple choice, as lm-evaluation-harness scores `loglikelihood` requests:
// trailing spaces of the context move to the front of the choice; the context
// is tokenized alone (with BOS, as a prompt is) and the context followed by
// the choice as one text; the choice's tokens are those of the whole beyond
// the context's token count; only they are scored. A prompt longer than the
// context length - 1 loses context tokens from the left. Three predictions
// per item, each the choice with the highest score (ties: the first such choice):
//   acc           the summed log-probability of the choice's tokens;
//   acc_norm      that sum divided by the choice's length in UTF-8 bytes, as
//                 written in the task file (lm-evaluation-harness's acc_norm;
//                 it counts characters, which equal bytes for ASCII text);
//   acc_per_token that sum divided by the choice's token count (the mean
//                 per-token log-probability, which the Mosaic Eval Gauntlet
//                 ranks choices by).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace coalesce::eval {

// ---------------------------------------------------------------------------
// Perplexity
// ---------------------------------------------------------------------------

// One prompt of a perplexity run: tokens [begin, end) of the text, of which
// [score_begin, end) are scored (begin < score_begin <= end).
struct Window {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t score_begin = 0;
  bool operator==(const Window& o) const {
    return begin == o.begin && end == o.end && score_begin == o.score_begin;
  }
};

// The windows over `num_tokens` tokens, as described above. InvalidArgument
// for fewer than 2 tokens (nothing to score), a window under 2 tokens, or a
// stride outside [1, window - 1].
absl::StatusOr<std::vector<Window>> PlanWindows(int64_t num_tokens, int64_t window, int64_t stride);

// A prompt token's log-probability as the server returns it (prompt
// log-probabilities: one per prompt token after the first).
struct TokenLogprob {
  int32_t token_id = 0;
  double logprob = 0;
};

// The log-probabilities of the tokens `window` scores, in order, from the
// server's prompt log-probabilities for the prompt tokens[begin, end):
// entry j scores tokens[begin + 1 + j]. InvalidArgument when their count is
// not end - begin - 1, an id is not the token it should score, or a value is
// not a finite number <= 0 (within rounding).
absl::StatusOr<std::vector<double>> ScoredLogprobs(
    const Window& window, const std::vector<int32_t>& tokens,
    const std::vector<TokenLogprob>& prompt_logprobs);

// Sums log-probabilities into a perplexity.
class PerplexityAccumulator {
 public:
  void Add(double logprob);
  void AddAll(const std::vector<double>& logprobs) {
    for (double lp : logprobs) Add(lp);
  }
  int64_t tokens() const { return tokens_; }
  // The negative log-likelihood of the scored tokens, in nats.
  double nll() const { return nll_; }
  // nll / tokens (0 with no tokens).
  double mean_nll() const;
  // exp(mean_nll): the token-level perplexity.
  double perplexity() const;
  // nll / (ln 2 * bytes): bits per byte of text, comparable across tokenizers.
  double bits_per_byte(int64_t bytes) const;

 private:
  int64_t tokens_ = 0;
  double nll_ = 0;
};

// ---------------------------------------------------------------------------
// Multiple choice
// ---------------------------------------------------------------------------

// lm-evaluation-harness's split: trailing spaces of `context` move to the
// front of `choice`. Returns (context, continuation).
std::pair<std::string, std::string> SplitContinuation(absl::string_view context,
                                                      absl::string_view choice);

// The prompt that scores one choice and how many of its last tokens are the
// choice's.
struct ChoicePrompt {
  std::vector<int32_t> prompt_ids;  // [<= max_prompt_tokens]
  int choice_tokens = 0;            // the last choice_tokens of prompt_ids are scored
  int truncated = 0;                // context tokens dropped from the left to fit
};

// From the context's tokens alone and the whole text's (context followed by
// the choice), as described above. InvalidArgument when the context has no
// tokens (nothing to condition the first choice token on), the whole has no
// more tokens than the context, or the choice alone does not fit
// max_prompt_tokens with one token of context.
absl::StatusOr<ChoicePrompt> MakeChoicePrompt(const std::vector<int32_t>& context_ids,
                                              const std::vector<int32_t>& whole_ids,
                                              int max_prompt_tokens);

// One scored choice.
struct ChoiceScore {
  double logprob = 0;  // summed over its tokens
  int tokens = 0;      // >= 1
  int64_t bytes = 0;   // of the choice as written in the task file, >= 1
};

// The three predictions of one item (indices into its choices).
struct ItemPrediction {
  int by_sum = -1;
  int by_byte = -1;
  int by_token = -1;
};

// Argmax of each score over the choices, ties to the lowest index. All -1 for
// no choices.
ItemPrediction Predict(const std::vector<ChoiceScore>& choices);

// Counts correct predictions over items.
class AccuracyAccumulator {
 public:
  void Add(const ItemPrediction& prediction, int answer);
  int64_t items() const { return items_; }
  struct Metric {
    int64_t correct = 0;
    double accuracy = 0;
    // The standard error of the mean of the 0/1 outcomes, sqrt(p (1 - p) /
    // (n - 1)), as lm-evaluation-harness reports it; 0 for n < 2.
    double stderr_ = 0;
  };
  Metric acc() const { return MetricOf(by_sum_); }
  Metric acc_norm() const { return MetricOf(by_byte_); }
  Metric acc_per_token() const { return MetricOf(by_token_); }

 private:
  Metric MetricOf(int64_t correct) const;
  int64_t items_ = 0;
  int64_t by_sum_ = 0;
  int64_t by_byte_ = 0;
  int64_t by_token_ = 0;
};

// ---------------------------------------------------------------------------
// Greedy agreement
// ---------------------------------------------------------------------------

// Two generations of the same prompt, position by position: positions
// 0..max(|a|, |b|) are compared, and a position only one of them reached
// differs.
struct Agreement {
  int64_t compared = 0;   // max(|a|, |b|)
  int64_t identical = 0;  // positions where a[i] == b[i]
  // The first position that differs, or none when a == b. A generation that
  // stops (EOS) while the other goes on parts where it stopped.
  std::optional<int64_t> first_parting;
};
Agreement CompareGenerations(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// Agreement over many prompts.
class AgreementAccumulator {
 public:
  void Add(const Agreement& agreement);
  int64_t prompts() const { return prompts_; }
  int64_t compared() const { return compared_; }
  int64_t identical() const { return identical_; }
  // identical / compared: the share of identical tokens (1 when nothing was
  // compared: two empty generations agree).
  double token_share() const;
  // Prompts whose generations are identical.
  int64_t identical_prompts() const { return prompts_ - parted_; }
  int64_t parted_prompts() const { return parted_; }
  // Over the prompts that part: the earliest first parting position, and the
  // mean of their first parting positions. None when no prompt parts.
  std::optional<int64_t> earliest_parting() const;
  std::optional<double> mean_first_parting() const;

 private:
  int64_t prompts_ = 0;
  int64_t compared_ = 0;
  int64_t identical_ = 0;
  int64_t parted_ = 0;
  int64_t parting_sum_ = 0;
  std::optional<int64_t> earliest_;
};

}  // namespace coalesce::eval
