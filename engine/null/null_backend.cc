#include "engine/null/null_backend.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace coalesce::engine {

// Declared in null_backend.h. A small integer hash (the finaliser of
// MurmurHash3) of the two inputs, so that consecutive tokens look unrelated
// and the detokeniser sees a spread of ids, as it would with a real model;
// then the next id up that is not to be avoided.
int32_t NullBackendToken(int32_t last_token, int32_t position, int32_t vocab_size,
                         const std::vector<int32_t>& never_emit) {
  uint32_t h = static_cast<uint32_t>(last_token) * 0x9E3779B1u ^
               (static_cast<uint32_t>(position) * 0x85EBCA77u + 0x165667B1u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  int32_t token = static_cast<int32_t>(h % static_cast<uint32_t>(vocab_size));
  // CreateNullBackend checked that some id remains, so this ends.
  while (std::find(never_emit.begin(), never_emit.end(), token) != never_emit.end()) {
    token = (token + 1) % vocab_size;
  }
  return token;
}

namespace {

class NullBackend final : public Backend {
 public:
  NullBackend(const ModelConfig& config, NullBackendOptions options)
      : config_(config),
        kv_(options.kv_cache),
        never_emit_(std::move(options.never_emit)),
        block_owner_(kv_.num_blocks, -1) {}

  // Logits that make the null token the choice: 0 for it, a large negative
  // for every other id. Greedy sampling picks it, and so does sampling at a
  // temperature for any draw in (0, 1) (a draw of exactly 0 may take the
  // first id: the sampler's exp gives about e^-87, not 0, to the others).
  // Only callers of Step pay for writing them; the engine loop calls
  // StepAndSample.
  absl::Status Step(const StepBatch& batch, std::span<float> logits) override {
    const size_t vocab = static_cast<size_t>(config_.vocab_size);
    const size_t rows = LogitRows(batch);
    if (logits.size() < rows * vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logits has ", logits.size(), " floats, need LogitRows * vocab_size = ", rows * vocab));
    }
    if (absl::Status s = ValidateStep(config_, kv_, batch, block_owner_); !s.ok()) return s;
    std::fill(logits.begin(), logits.begin() + rows * vocab, kLow);
    size_t token = 0, row = 0;  // the first token and logit row of sequence i
    for (const SequenceStep& seq : batch.seqs) {
      // Each row's null token follows the row's token at its position.
      for (int t = seq.all_logits ? 0 : seq.num_tokens - 1; t < seq.num_tokens; ++t, ++row) {
        logits[row * vocab + NullBackendToken(batch.tokens[token + t], seq.start_pos + t + 1,
                                              config_.vocab_size, never_emit_)] = 0.0f;
      }
      token += seq.num_tokens;
    }
    return absl::OkStatus();
  }

  // The null token of every sequence, whatever `sampling` says: no logits
  // are written and no draw is used.
  absl::Status StepAndSample(const StepBatch& batch, std::span<const SampleSpec> sampling,
                             std::span<int32_t> tokens) override {
    RETURN_IF_ERROR(CheckSampleSizes(batch, sampling.size(), tokens.size()));
    if (absl::Status s = ValidateStep(config_, kv_, batch, block_owner_); !s.ok()) return s;
    size_t end = 0;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      end += batch.seqs[i].num_tokens;
      tokens[i] = NextToken(batch, i, end);
    }
    return absl::OkStatus();
  }

  // Nothing is read and nothing is held.
  int64_t weight_bytes() const override { return 0; }
  int64_t kv_bytes_per_token() const override { return 0; }

  const ModelConfig& config() const override { return config_; }
  const KvCacheConfig& kv_cache() const override { return kv_; }
  std::string_view name() const override { return "null"; }
  // Its steps take no time: a handoff to a step thread would only cost.
  BackendCapabilities capabilities() const override {
    return {.runs_model = false,
            .weights_in_host_memory = false,
            .overlap_pays = false,
            .copies_blocks = true,
            .all_logits = true,
            .samples_on_host = true};
  }
  // It holds no KV memory: there is nothing to copy.
  absl::Status CopyBlocks(std::span<const BlockCopy> copies) override {
    return ValidateBlockCopies(kv_, copies);
  }
  std::string Describe() const override {
    return "null (NO ARITHMETIC: for measuring the server's own cost; output is meaningless; "
           "KV cache accounted, not allocated)";
  }

 private:
  static constexpr float kLow = -1e9f;

  // Sequence i's token, given `end`, the index just past its last token.
  int32_t NextToken(const StepBatch& batch, size_t i, size_t end) const {
    const SequenceStep& seq = batch.seqs[i];
    return NullBackendToken(batch.tokens[end - 1], seq.start_pos + seq.num_tokens,
                            config_.vocab_size, never_emit_);
  }

  const ModelConfig config_;
  const KvCacheConfig kv_;
  const std::vector<int32_t> never_emit_;
  std::vector<int32_t> block_owner_;  // [num_blocks] ValidateStep's scratch
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateNullBackend(const ModelConfig& config,
                                                           const NullBackendOptions& options) {
  if (config.vocab_size <= 0 || config.max_seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("model ", config.name, ": vocab_size ",
                                                   config.vocab_size, ", context ",
                                                   config.max_seq_len, " must be positive"));
  }
  const KvCacheConfig& kv = options.kv_cache;
  if (kv.block_size <= 0 || kv.num_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("invalid KV cache: block_size ", kv.block_size,
                                                   ", num_blocks ", kv.num_blocks));
  }
  const std::vector<int32_t>& avoid = options.never_emit;
  bool some_id_left = false;
  for (int32_t id = 0; id < config.vocab_size && !some_id_left; ++id) {
    some_id_left = std::find(avoid.begin(), avoid.end(), id) == avoid.end();
  }
  if (!some_id_left) {
    return absl::InvalidArgumentError(
        absl::StrCat("the null backend must avoid every id of the vocabulary of ",
                     config.vocab_size, ": it would have no token to emit"));
  }
  return std::unique_ptr<Backend>(new NullBackend(config, options));
}

}  // namespace coalesce::engine
