// The one interface between the scheduler and the arithmetic: a Backend runs
// one batched model step over plain buffers. It owns the weights and the KV
// cache memory; the caller owns the accounting of which KV block belongs to
// which sequence and passes each sequence's block table with every step. The
// CPU backend (cpu/) implements it today; a CUDA backend implements the same.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "absl/status/status.h"
#include "engine/model.h"

namespace coalesce::engine {

// The paged KV cache: `num_blocks` blocks of `block_size` token positions,
// each holding K and V for every layer.
struct KvCacheConfig {
  int block_size = 16;  // token positions per block
  int num_blocks = 0;   // blocks in the pool
};

// Bytes one KV block takes for `config` (K and V, all layers, float32).
int64_t KvBlockBytes(const ModelConfig& config, int block_size);

// One sequence's share of a step.
struct SequenceStep {
  int32_t num_tokens = 0;  // tokens of this sequence in the step (>= 1)
  int32_t start_pos = 0;   // position of its first token = tokens already cached
  // KV blocks of this sequence, in position order: position p lives in block
  // block_table[p / block_size] at offset p % block_size. Covers at least
  // positions [0, start_pos + num_tokens).
  std::span<const int32_t> block_table;
};

struct StepBatch {
  std::span<const int32_t> tokens;     // [total_tokens]: sequence after sequence
  std::span<const SequenceStep> seqs;  // [num_seqs]; sum of num_tokens == total_tokens
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Runs every token of `batch` through the model at its position, writes each
  // token's K and V into its sequence's blocks, and writes the logits that
  // follow the last token of each sequence into `logits` [num_seqs, vocab_size].
  // Sequences attend only to their own cache. On error nothing is promised
  // about the KV contents of the sequences in the batch.
  virtual absl::Status Step(const StepBatch& batch, std::span<float> logits) = 0;

  virtual const ModelConfig& config() const = 0;
  virtual const KvCacheConfig& kv_cache() const = 0;
  virtual std::string_view name() const = 0;  // "cpu", "cuda"
};

}  // namespace coalesce::engine
