// What the batcher is asked to do and what it reports back, in plain structs:
// the service turns protobuf into these and these into protobuf.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/backend.h"
#include "engine/logits_processor.h"
#include "engine/sampler.h"

namespace coalesce::batcher {

struct GenerationRequest {
  std::string request_id;  // the caller's, for logs
  std::string tenant;      // who sent it (--api_keys_file); empty: nobody named
  // The tenant's share of the batch relative to the others' (scheduler.h,
  // fairness); the latest request of a tenant sets it.
  double tenant_weight = 1.0;
  std::vector<int32_t> prompt;  // token ids, BOS included if wanted
  int max_new_tokens = 16;
  engine::SamplingParams sampling;
  uint64_t seed = 0;                             // the request's own random generator
  std::vector<std::string> stop;                 // stop sequences
  int priority = 0;                              // higher is admitted first
  absl::Time arrival;                            // when the server received it
  absl::Time deadline = absl::InfiniteFuture();  // DEADLINE_EXCEEDED after this
  // Requests share cached prompt blocks only with requests of the same
  // partition and salt. The partition says who may share: the tenant, or
  // the group of tenants it shares with (--api_keys_file); empty without
  // tenants. The salt is the client's own.
  std::string cache_partition;
  std::string cache_salt;
  // Samples of the prompt: the prompt is computed once and its KV blocks
  // shared; sample i then draws from its own generator, seeded seed + i
  // (so it produces what a request with that seed would), and has its own
  // stop, finish and updates (StreamUpdate::index). At least 1, at most the
  // loop's max_batch_size: the samples are admitted together.
  int n = 1;
  // Log-probabilities (StreamUpdate::logprobs, ::prompt_logprobs): of each
  // generated token, of each prompt token after the first, and at each of
  // those positions the top_logprobs most likely tokens. Only on a backend
  // that samples on the host (engine::BackendCapabilities).
  bool logprobs = false;
  int top_logprobs = 0;
  bool prompt_logprobs = false;
  // Changes to the logits before sampling (engine/logits_processor.h); only
  // on a backend that samples on the host, as are sampling.min_p and
  // min_tokens.
  engine::LogitsControls controls;
  // The tokenizer's end-of-sequence tokens and stop_token_ids cannot be
  // sampled before this many tokens have been generated.
  int min_tokens = 0;
  // An end-of-sequence token does not end the generation.
  bool ignore_eos = false;
  // Generating one of these ends the generation (FinishReason::kStop); its
  // id is sent, its text is not.
  std::vector<int32_t> stop_token_ids;
};

// What an engine loop can run: its backend's and its own limits.
struct RequestLimits {
  std::string backend;  // the backend's name, for messages
  engine::BackendCapabilities capabilities;
  int vocab_size = 0;
  int max_batch_size = 1;
  int block_size = 1;
  int total_blocks = 0;  // of the KV cache
};

// OK, or why a loop with `limits` cannot run `request`: INVALID_ARGUMENT
// for an empty prompt, top_logprobs outside the vocabulary or n outside
// [1, max_batch_size]; UNIMPLEMENTED for what the backend cannot do;
// RESOURCE_EXHAUSTED for a request that could never fit the KV cache.
absl::Status CheckRequest(const GenerationRequest& request, const RequestLimits& limits);

enum class FinishReason { kLength, kStop, kEos, kCancelled };

// One batch of output for one sample of a request. Every update of a sample
// but its last has finished == false.
struct StreamUpdate {
  int index = 0;                   // the sample (GenerationRequest::n)
  std::vector<int32_t> token_ids;  // new since the previous update
  std::string text;                // new valid UTF-8 text
  bool finished = false;
  // When finished: OK with a finish_reason, or the error that ended it.
  absl::Status status;
  FinishReason finish_reason = FinishReason::kLength;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  // Prompt tokens whose KV came from the prefix cache at admission.
  int cached_prompt_tokens = 0;
  // With GenerationRequest::logprobs, one per token_ids entry.
  std::vector<engine::TokenLogprob> logprobs;
  // With GenerationRequest::prompt_logprobs, once, with sample 0's first
  // update: one per prompt token after the first.
  std::vector<engine::TokenLogprob> prompt_logprobs;
};

// Where a request's output goes. Called on the engine thread: it must not
// block (append to an outbox and return). Each of a request's n samples gets
// exactly one update with finished == true, its last; Deliver is never
// called again after the n-th.
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual void Deliver(StreamUpdate update) = 0;
};

}  // namespace coalesce::batcher
