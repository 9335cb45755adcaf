// A request inside the engine loop, from arrival to its last token: a
// Sequence, or one for each of its samples. Owned by the loop thread once it
// leaves the inbox.
//
// States. Every sequence goes
//   kQueued -> kRunning -> (kPreempted -> kRunning)* -> kFinished
// and may finish from any of them (cancelled, expired, failed, shut down).
// Queued and preempted ones wait (EngineLoop's waiting list) and hold no KV
// block; running ones are in the batch and hold blocks; a finished one has
// sent its final update and holds nothing.
//
// Samples (GenerationRequest::n > 1). The request first runs as one
// sequence in the role kUnforked: it computes all of its prompt but the last
// token, holding a block reserved for each other sample. Then it forks: it
// becomes sample 0 (kSample), and each other sample is a new kSample
// sequence with the same id that shares the prompt's full blocks and holds
// one block of its own, the reserved one, for the rest: a copy of the partly
// filled last block (Backend::CopyBlocks), or, on a backend that cannot
// copy, the same positions computed again. Every sample then computes the
// prompt's last token itself and samples from its own generator. The
// samples share a SampleGroup, through which the request ends, for the
// observer, with its last sample.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "batcher/block_pool.h"
#include "batcher/kv_cache_manager.h"
#include "batcher/output_processor.h"
#include "batcher/request.h"
#include "engine/logits_processor.h"
#include "engine/sampler.h"

namespace coalesce::batcher {

enum class SequenceState {
  kQueued,     // waiting for its first admission
  kRunning,    // in the batch, holding KV blocks
  kPreempted,  // was running; gave back its blocks and waits to recompute them
  kFinished,   // its final update is out
};
enum class SampleRole {
  kSingle,    // a request for one sample
  kUnforked,  // a request for n > 1 samples, computing the prompt they share
  kSample,    // one of those samples, after the fork
};

// What the samples of one request share once they run apart.
struct SampleGroup {
  explicit SampleGroup(int samples) : unfinished(samples) {}
  int unfinished;             // samples without their final update
  int completion_tokens = 0;  // of the finished ones
  std::string status = "ok";  // the first error's, if any
  bool first_token = false;   // reported
};

struct Sequence {
  Sequence(uint64_t id, GenerationRequest req, std::shared_ptr<OutputSink> out, int index = 0)
      : id(id),
        request(std::move(req)),
        sink(std::move(out)),
        index(index),
        rng(request.seed + static_cast<uint64_t>(index)),
        tokens(request.prompt),
        prefill_end(static_cast<int>(tokens.size())) {
    if (request.controls.active() || request.min_tokens > 0) {
      processor.emplace(request.controls, request.prompt);
    }
  }

  // The samples it runs for: the request's n while unforked, else 1.
  int samples() const { return role == SampleRole::kUnforked ? request.n : 1; }
  // Positions not yet in the KV cache: the prompt (or everything, after a
  // preemption), or the one token sampled last.
  int pending() const { return static_cast<int>(tokens.size()) - num_cached; }
  bool prefilling() const { return num_cached < prefill_end; }
  // The blocks it must take to run: its tokens', and while unforked also
  // the prompt's last position and one for each other sample.
  int BlocksToAdmit(int block_size) const {
    const int len = static_cast<int>(tokens.size());
    return role != SampleRole::kUnforked ? BlocksForTokens(len, block_size)
                                         : BlocksForTokens(len + 1, block_size) + request.n - 1;
  }
  // How many leading full blocks it may take from the prefix cache: all but
  // the one holding its last token, which it must compute for its logits;
  // while unforked, all (each sample computes the prompt's last token).
  int MatchLimit(int block_size) const {
    if (scoring_prompt()) return 0;  // every prompt position needs its logits
    const int len = static_cast<int>(tokens.size());
    return role != SampleRole::kUnforked ? (len - 1) / block_size : len / block_size;
  }
  // With prompt_logprobs: prompt tokens after the first not yet scored.
  bool scoring_prompt() const { return OutputProcessor::ScoringPrompt(request, output); }
  // The tokens it may not sample now: before min_tokens, those that would
  // end it.
  std::span<const int32_t> banned() const {
    return output.generated < request.min_tokens ? std::span<const int32_t>(end_tokens)
                                                 : std::span<const int32_t>();
  }
  // Whether its logits must be changed before it samples.
  bool processes_logits() const {
    return processor.has_value() && (processor->controls().active() || !banned().empty());
  }
  const uint64_t id;
  const GenerationRequest request;
  const std::shared_ptr<OutputSink> sink;
  const int index;  // the sample
  SequenceState state = SequenceState::kQueued;
  SampleRole role = SampleRole::kSingle;
  std::shared_ptr<SampleGroup> group;  // kSample only
  int tenant = 0;                      // EngineLoop's index of request.tenant
  engine::Rng rng;
  std::vector<int32_t> tokens;   // [prompt + generated]
  int num_cached = 0;            // leading tokens whose K/V are in the cache
  int prefill_end;               // tokens before this are prefill work
  SequenceBlocks kv;             // its KV blocks (KvCacheManager)
  int cached_prompt_tokens = 0;  // what the prefix cache gave it at its first admission
  OutputState output;            // what its stream has said (OutputProcessor)
  // With logits controls or min_tokens: counts its tokens and changes its
  // logits (engine/logits_processor.h).
  std::optional<engine::LogitsProcessor> processor;
  // With min_tokens: the tokens that would end it (end-of-sequence, unless
  // ignored, and stop_token_ids).
  std::vector<int32_t> end_tokens;
  absl::Time last_token_at;
  absl::Duration window_wait;  // time held by the coalescing window
};

// Sample `index` (1 to n - 1) of `parent`'s request at its fork, `parent`
// being sample 0 now: running, with `kv` (KvCacheManager::Fork) and its
// first `computed` positions cached, the prompt scored (sample 0 sends the
// scores). Its output stream is not begun.
std::unique_ptr<Sequence> ForkSample(const Sequence& parent, int index, SequenceBlocks kv,
                                     int computed);

}  // namespace coalesce::batcher
