#include "tools/eval/scoring.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace coalesce::eval {

// ---------------------------------------------------------------------------
// Perplexity
// ---------------------------------------------------------------------------

absl::StatusOr<std::vector<Window>> PlanWindows(int64_t num_tokens, int64_t window,
                                                int64_t stride) {
  if (num_tokens < 2) {
    return absl::InvalidArgumentError(absl::StrCat("the text has ", num_tokens,
                                                   " token(s): at least 2 are needed (the first ",
                                                   "has no context and is never scored)"));
  }
  if (window < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("the window must be at least 2 tokens, not ", window));
  }
  if (stride < 1 || stride >= window) {
    return absl::InvalidArgumentError(
        absl::StrCat("the stride must be in [1, window - 1] = [1, ", window - 1, "], not ", stride,
                     " (each window after the first needs at least one token of context)"));
  }
  std::vector<Window> windows;
  int64_t end = std::min(num_tokens, window);
  windows.push_back({0, end, 1});
  while (end < num_tokens) {
    const int64_t next_end = std::min(num_tokens, end + stride);
    // next_end > end >= window, so the window is full length.
    windows.push_back({next_end - window, next_end, end});
    end = next_end;
  }
  return windows;
}

absl::StatusOr<std::vector<double>> ScoredLogprobs(
    const Window& window, const std::vector<int32_t>& tokens,
    const std::vector<TokenLogprob>& prompt_logprobs) {
  const int64_t expected = window.end - window.begin - 1;
  if (static_cast<int64_t>(prompt_logprobs.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("the server returned ", prompt_logprobs.size(),
                                                   " prompt log-probabilities for a prompt of ",
                                                   expected + 1, " tokens (expected ", expected,
                                                   ")"));
  }
  std::vector<double> scored;
  scored.reserve(window.end - window.score_begin);
  for (int64_t i = window.score_begin; i < window.end; ++i) {
    const TokenLogprob& lp = prompt_logprobs[i - window.begin - 1];
    if (lp.token_id != tokens[i]) {
      return absl::InvalidArgumentError(absl::StrCat("the server scored token ", lp.token_id,
                                                     " at text position ", i, " where ", tokens[i],
                                                     " is"));
    }
    // A log-probability is at most 0; float rounding of log-softmax can
    // leave a certain token a hair above it.
    if (!std::isfinite(lp.logprob) || lp.logprob > 1e-4) {
      return absl::InvalidArgumentError(absl::StrCat("the server returned log-probability ",
                                                     lp.logprob, " at text position ", i));
    }
    scored.push_back(lp.logprob);
  }
  return scored;
}

void PerplexityAccumulator::Add(double logprob) {
  nll_ -= logprob;
  ++tokens_;
}

double PerplexityAccumulator::mean_nll() const {
  return tokens_ == 0 ? 0.0 : nll_ / static_cast<double>(tokens_);
}

double PerplexityAccumulator::perplexity() const { return std::exp(mean_nll()); }

double PerplexityAccumulator::bits_per_byte(int64_t bytes) const {
  return bytes <= 0 ? 0.0 : nll_ / (std::log(2.0) * static_cast<double>(bytes));
}

// ---------------------------------------------------------------------------
// Multiple choice
// ---------------------------------------------------------------------------

std::pair<std::string, std::string> SplitContinuation(absl::string_view context,
                                                      absl::string_view choice) {
  size_t keep = context.size();
  while (keep > 0 && context[keep - 1] == ' ') --keep;
  return {std::string(context.substr(0, keep)), absl::StrCat(context.substr(keep), choice)};
}

absl::StatusOr<ChoicePrompt> MakeChoicePrompt(const std::vector<int32_t>& context_ids,
                                              const std::vector<int32_t>& whole_ids,
                                              int max_prompt_tokens) {
  const int64_t n_context = static_cast<int64_t>(context_ids.size());
  const int64_t n_whole = static_cast<int64_t>(whole_ids.size());
  if (n_context < 1) {
    return absl::InvalidArgumentError(
        "the context encodes to no tokens, so the choice's first token has nothing to be "
        "conditioned on (this tokenizer adds no BOS: give a non-empty context)");
  }
  if (n_whole <= n_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("the choice adds no tokens to the context (context ", n_context,
                     " tokens, context + choice ", n_whole, ")"));
  }
  ChoicePrompt out;
  out.choice_tokens = static_cast<int>(n_whole - n_context);
  if (out.choice_tokens + 1 > max_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("the choice is ", out.choice_tokens, " tokens: with one token of context ",
                     "it does not fit a prompt of ", max_prompt_tokens, " tokens"));
  }
  const int64_t drop = std::max<int64_t>(0, n_whole - max_prompt_tokens);
  out.truncated = static_cast<int>(drop);
  out.prompt_ids.assign(whole_ids.begin() + drop, whole_ids.end());
  return out;
}

namespace {

// The index of the largest value, ties to the first; -1 for none.
template <typename F>
int ArgMax(const std::vector<ChoiceScore>& choices, F score) {
  int best = -1;
  double best_value = 0;
  for (int i = 0; i < static_cast<int>(choices.size()); ++i) {
    const double v = score(choices[i]);
    if (best < 0 || v > best_value) {
      best = i;
      best_value = v;
    }
  }
  return best;
}

}  // namespace

ItemPrediction Predict(const std::vector<ChoiceScore>& choices) {
  ItemPrediction p;
  p.by_sum = ArgMax(choices, [](const ChoiceScore& c) { return c.logprob; });
  p.by_byte = ArgMax(choices, [](const ChoiceScore& c) {
    return c.logprob / static_cast<double>(std::max<int64_t>(c.bytes, 1));
  });
  p.by_token = ArgMax(choices, [](const ChoiceScore& c) {
    return c.logprob / static_cast<double>(std::max(c.tokens, 1));
  });
  return p;
}

void AccuracyAccumulator::Add(const ItemPrediction& prediction, int answer) {
  ++items_;
  by_sum_ += prediction.by_sum == answer;
  by_byte_ += prediction.by_byte == answer;
  by_token_ += prediction.by_token == answer;
}

AccuracyAccumulator::Metric AccuracyAccumulator::MetricOf(int64_t correct) const {
  Metric m;
  m.correct = correct;
  if (items_ == 0) return m;
  const double n = static_cast<double>(items_);
  m.accuracy = static_cast<double>(correct) / n;
  if (items_ >= 2) m.stderr_ = std::sqrt(m.accuracy * (1.0 - m.accuracy) / (n - 1.0));
  return m;
}

// ---------------------------------------------------------------------------
// Greedy agreement
// ---------------------------------------------------------------------------

Agreement CompareGenerations(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  Agreement out;
  const int64_t common = static_cast<int64_t>(std::min(a.size(), b.size()));
  out.compared = static_cast<int64_t>(std::max(a.size(), b.size()));
  for (int64_t i = 0; i < common; ++i) {
    if (a[i] == b[i]) {
      ++out.identical;
    } else if (!out.first_parting) {
      out.first_parting = i;
    }
  }
  if (!out.first_parting && a.size() != b.size()) out.first_parting = common;
  return out;
}

void AgreementAccumulator::Add(const Agreement& agreement) {
  ++prompts_;
  compared_ += agreement.compared;
  identical_ += agreement.identical;
  if (agreement.first_parting) {
    ++parted_;
    parting_sum_ += *agreement.first_parting;
    if (!earliest_ || *agreement.first_parting < *earliest_) earliest_ = agreement.first_parting;
  }
}

double AgreementAccumulator::token_share() const {
  return compared_ == 0 ? 1.0 : static_cast<double>(identical_) / static_cast<double>(compared_);
}

std::optional<int64_t> AgreementAccumulator::earliest_parting() const { return earliest_; }

std::optional<double> AgreementAccumulator::mean_first_parting() const {
  if (parted_ == 0) return std::nullopt;
  return static_cast<double>(parting_sum_) / static_cast<double>(parted_);
}

}  // namespace coalesce::eval
