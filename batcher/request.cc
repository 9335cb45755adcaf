#include "batcher/request.h"

#include "absl/strings/str_cat.h"
#include "batcher/block_pool.h"

namespace coalesce::batcher {

absl::Status CheckRequest(const GenerationRequest& request, const RequestLimits& limits) {
  if (request.prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  const engine::BackendCapabilities& can = limits.capabilities;
  if ((request.logprobs || request.prompt_logprobs) &&
      (!can.samples_on_host || (request.prompt_logprobs && !can.all_logits))) {
    return absl::UnimplementedError(absl::StrCat("log-probabilities are not available on the ",
                                                 limits.backend, " backend yet"));
  }
  if ((request.controls.active() || request.sampling.min_p > 0.0f || request.min_tokens > 0) &&
      !can.samples_on_host) {
    return absl::UnimplementedError(absl::StrCat(
        "repetition_penalty, frequency_penalty, presence_penalty, logit_bias, min_p and "
        "min_tokens are not available on the ",
        limits.backend, " backend yet"));
  }
  if (request.top_logprobs < 0 || request.top_logprobs > limits.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs = ", request.top_logprobs, ": 0 to the vocabulary's size"));
  }
  if (request.n < 1 || request.n > limits.max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n = ", request.n, " samples: at least 1, and the samples run together, so at most the ",
        limits.max_batch_size, " sequences the server batches (max_batch_size)"));
  }
  // Each sample must fit the cache on its own, or it could never finish:
  // preemption makes room only by sending others away. And the prompt must
  // fit with a block for each other sample, to fork.
  const int tokens = static_cast<int>(request.prompt.size()) + request.max_new_tokens;
  const int prompt = static_cast<int>(request.prompt.size());
  if (BlocksForTokens(tokens, limits.block_size) > limits.total_blocks ||
      BlocksForTokens(prompt, limits.block_size) + request.n - 1 > limits.total_blocks) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request needs ", tokens, " tokens of KV cache (prompt ",
                     request.prompt.size(), " + max_new_tokens ", request.max_new_tokens,
                     ") but the server's cache holds ", limits.total_blocks * limits.block_size,
                     " tokens; lower max_new_tokens or shorten the prompt"));
  }
  return absl::OkStatus();
}

}  // namespace coalesce::batcher
