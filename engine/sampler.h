// Picks the next token from a row of logits. Each request owns its Rng, so a
// request with a seed gets the same tokens whatever else is in its batch.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace coalesce::engine {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties to the lowest id)
  int top_k = 0;             // 0: no limit
  float top_p = 1.0f;        // nucleus mass in (0, 1]; 1: no limit
  // After top_k and top_p, drop tokens less likely than min_p times the
  // most likely one (transformers' MinPLogitsWarper). In [0, 1]; 0: off.
  float min_p = 0.0f;
};

// xoshiro256** seeded through splitmix64: small, fast, and the same sequence
// on every platform (std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t NextU64();
  // Uniform in [0, 1).
  float NextFloat();

 private:
  uint64_t s_[4];
};

// Samples one token id. Order: temperature scales the logits, softmax, keep
// the top_k most likely, keep the smallest prefix (by descending probability)
// whose mass reaches top_p, keep those at least min_p times as likely as the
// most likely, renormalise, draw. Greedy ignores top_k/top_p and
// draws nothing from `rng`.
int32_t Sample(std::span<const float> logits, const SamplingParams& params, Rng& rng);

// Sample with the draw made beforehand: `uniform` in [0, 1) stands for
// rng.NextFloat(). Sample(logits, p, rng) equals SampleWithUniform(logits, p,
// rng.NextFloat()) whenever p.temperature > 0 and the logits are finite.
int32_t SampleWithUniform(std::span<const float> logits, const SamplingParams& params,
                          float uniform);

// A token's log-probability at a position, and the most likely tokens there.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  // (token, logprob), most likely first; among equals, the lower id first.
  std::vector<std::pair<int32_t, float>> top;
};

// The log-softmax of `logits` at `token` and at the `top` most likely ids:
// logit - (max + log(sum of exp(logit - max))), the sum taken in double and
// the result rounded to float. The model's own distribution: no temperature
// or truncation. `token` must be within the logits; `top` at most their size.
TokenLogprob Logprob(std::span<const float> logits, int32_t token, int top);

}  // namespace coalesce::engine
