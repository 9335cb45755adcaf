// The null backend: no arithmetic. Every step returns at once with token ids
// that are a fixed function of each sequence's last token and position, so
// the rest of the server (gRPC, the streaming reactors, the engine loop, the
// scheduler, detokenisation, metrics) can be measured on its own: what the
// service costs, and how many tokens per second it can stream when the model
// takes no time. Its output is meaningless.
//
// It checks every step as a real backend does (engine::ValidateStep), keeps
// the KV-block accounting of the configuration it is given (the batcher
// admits, grows and preempts exactly as it would on the CPU), but holds no
// KV memory and reads no weights. It never emits the ids it is told to avoid
// (the tokenizer's end-of-sequence ids), so a generation always runs to its
// max_new_tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace coalesce::engine {

struct NullBackendOptions {
  KvCacheConfig kv_cache;  // accounting only: no memory is held
  // Ids never emitted (the tokenizer's end-of-sequence ids). At least one id
  // of the vocabulary must remain.
  std::vector<int32_t> never_emit = {};  // (`= {}`: designated initialisers may leave it out)
};

// The token the null backend emits after `last_token` for the position
// `position` (the position the new token takes: start_pos + num_tokens of the
// step), in [0, vocab_size) and never one of `never_emit`. The same inputs
// give the same token, whatever the batch and the sampling parameters.
int32_t NullBackendToken(int32_t last_token, int32_t position, int32_t vocab_size,
                         const std::vector<int32_t>& never_emit);

// INVALID_ARGUMENT for a bad KV configuration or a `never_emit` that covers
// the whole vocabulary. Only `config` is used: weights may be empty.
absl::StatusOr<std::unique_ptr<Backend>> CreateNullBackend(const ModelConfig& config,
                                                           const NullBackendOptions& options);

}  // namespace coalesce::engine
