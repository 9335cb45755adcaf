// The one interface between the scheduler and the arithmetic: a Backend runs
// one batched model step over plain buffers. It owns the weights and the KV
// cache memory; the caller owns the accounting of which KV block belongs to
// which sequence and passes each sequence's block table with every step. The
// CPU backend (cpu/) and the CUDA backend (cuda/) implement it; so does the
// null backend (null_backend.h), which does no arithmetic at all, for
// measuring the server's own cost.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/model.h"
#include "engine/precision.h"
#include "engine/sampler.h"

namespace coalesce::engine {

// The paged KV cache: `num_blocks` blocks of `block_size` token positions,
// each holding K and V for every layer, as `dtype`.
struct KvCacheConfig {
  int block_size = 16;             // token positions per block
  int num_blocks = 0;              // blocks in the pool
  KvDtype dtype = KvDtype::kFp32;  // what K and V are stored as
};

// Bytes one KV block takes for `config` (K and V, all layers) when the cache
// holds `precision` (the CPU backend's default is float32).
int64_t KvBlockBytes(const ModelConfig& config, int block_size,
                     Precision precision = Precision::kFp32);
// The same for a cache of `dtype`, its scales included: 2 x layers x
// block_size x (kv_dim x KvDtypeBytes + n_kv_heads x KvDtypeScaleBytes).
int64_t KvBlockBytes(const ModelConfig& config, int block_size, KvDtype dtype);

// Checks a model's shape (positive sizes, heads dividing the width, an even
// head size, a context of at most 2^20) and, when check_weights, that every
// weight span has the size the shape implies (or, for a matrix held
// quantized, that its rows and columns do), so that a mismatched loader fails
// at start-up instead of reading out of bounds in a step.
absl::Status ValidateModel(const Model& model, bool check_weights);

// One sequence's share of a step.
struct SequenceStep {
  int32_t num_tokens = 0;  // tokens of this sequence in the step (>= 1)
  int32_t start_pos = 0;   // position of its first token = tokens already cached
  // KV blocks of this sequence, in position order: position p lives in block
  // block_table[p / block_size] at offset p % block_size. Covers at least
  // positions [0, start_pos + num_tokens).
  std::span<const int32_t> block_table;
  // Step writes the logits after every token of this sequence, in order,
  // not only after its last (prompt log-probabilities). Only for a backend
  // whose capabilities say all_logits.
  bool all_logits = false;
};

struct StepBatch {
  std::span<const int32_t> tokens;     // [total_tokens]: sequence after sequence
  std::span<const SequenceStep> seqs;  // [num_seqs]; sum of num_tokens == total_tokens
};

// The rows of logits Step writes for `batch`: one per sequence, or one per
// token of a sequence with all_logits.
size_t LogitRows(const StepBatch& batch);

// How one sequence of a step picks its next token (Backend::StepAndSample).
struct SampleSpec {
  SamplingParams params;
  // The draw in [0, 1) from the request's own Rng (engine/sampler.h); unused
  // when params is greedy. Drawn on the host, so a seeded request gets the
  // same stream of draws on every backend and in every batch.
  float uniform = 0.0f;
};

// A Step error with this code means the device can no longer be used (a
// sticky CUDA error, say): every later step would fail too, so the server
// should report itself unhealthy and exit. Any other code fails only the
// requests of that step.
inline constexpr absl::StatusCode kDeviceLostCode = absl::StatusCode::kUnavailable;

// Checks a step before a backend runs it: token ids within the vocabulary,
// positions within the context, block tables that cover every position with
// block ids in range, and no block written by two sequences (a shared block
// that only one writes, a shared prefix, is fine). `block_owner` is scratch
// that the call sizes to num_blocks and leaves all -1.
absl::Status ValidateStep(const ModelConfig& config, const KvCacheConfig& kv,
                          const StepBatch& batch, std::vector<int32_t>& block_owner);

// StepAndSample's sizes: one sampling spec and one output per sequence.
absl::Status CheckSampleSizes(const StepBatch& batch, size_t num_specs, size_t num_tokens);

// What a backend is, for its users to ask instead of telling backends apart
// by name.
struct BackendCapabilities {
  // Runs the model. False for the null backend: no arithmetic, and output
  // that means nothing.
  bool runs_model = true;
  // Reads its weights from host memory, so that the host's memory bandwidth
  // bounds how fast a decode step can be.
  bool weights_in_host_memory = false;
  // A step takes long enough that running it on a thread of its own, while
  // the previous step's tokens are streamed, pays for the handoff.
  bool overlap_pays = true;
  // CopyBlocks copies KV blocks (else it is UNIMPLEMENTED).
  bool copies_blocks = false;
  // Step honours SequenceStep::all_logits.
  bool all_logits = false;
  // StepAndSample picks exactly what SampleWithUniform picks from Step's
  // logits: a caller that needs the logits too (log-probabilities) may call
  // Step and sample on the host without changing any token.
  bool samples_on_host = false;
};

// One KV block to copy (Backend::CopyBlocks).
struct BlockCopy {
  int32_t from = 0;
  int32_t to = 0;
};

// Checks copies before a backend runs them: ids within the pool, and no block
// both copied from and written to (so the copies' order cannot matter).
absl::Status ValidateBlockCopies(const KvCacheConfig& kv, std::span<const BlockCopy> copies);

class Backend {
 public:
  virtual ~Backend() = default;

  // Runs every token of `batch` through the model at its position, writes each
  // token's K and V into its sequence's blocks, and writes the logits that
  // follow the last token of each sequence (each token of one with
  // all_logits) into `logits` [LogitRows(batch), vocab_size], in order.
  // Sequences attend only to their own cache. On error nothing is promised
  // about the KV contents of the sequences in the batch.
  virtual absl::Status Step(const StepBatch& batch, std::span<float> logits) = 0;

  // Runs Step and picks each sequence's next token: tokens[i] follows the
  // last token of batch.seqs[i], sampled as sampling[i] says. The default samples the
  // logits on the host (SampleWithUniform); the CUDA backend samples on the
  // device, so that only token ids cross to the host.
  virtual absl::Status StepAndSample(const StepBatch& batch, std::span<const SampleSpec> sampling,
                                     std::span<int32_t> tokens);

  // Copies K and V of every layer, every position, from block `from` to
  // block `to` of each copy: after every earlier step and before every later
  // one. Sequences that share a prompt share its full blocks and each copy
  // the partly filled last one before writing to it. The default, for a
  // backend whose capabilities do not say copies_blocks, is UNIMPLEMENTED,
  // and the caller recomputes those positions instead. INVALID_ARGUMENT
  // (ValidateBlockCopies) and nothing copied for bad ids.
  virtual absl::Status CopyBlocks(std::span<const BlockCopy> copies);

  // Bytes of weights one step reads (the model's parameters at the precision
  // the backend holds them in) and bytes one token position takes in the KV
  // cache (all layers, K and V, scales included): the floor of what a step
  // must move. The default kv_bytes_per_token is KvBlockBytes of kv_cache()'s
  // dtype.
  virtual int64_t weight_bytes() const;
  virtual int64_t kv_bytes_per_token() const;

  virtual const ModelConfig& config() const = 0;
  virtual const KvCacheConfig& kv_cache() const = 0;
  virtual std::string_view name() const = 0;  // "cpu", "cuda", "null"
  virtual BackendCapabilities capabilities() const { return {}; }
  // One line for the start-up log: the device, the precision, the KV cache.
  virtual std::string Describe() const { return std::string(name()); }

 private:
  std::vector<float> logits_;  // the default StepAndSample's [num_seqs, vocab]
};

}  // namespace coalesce::engine
