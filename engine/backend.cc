#include "engine/backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace coalesce::engine {

// Declared in backend.h.
// Every backend (CPU, CUDA) holds the same per block, however it lays it out:
// K and V for every layer, block_size positions of kv_dim elements each (and,
// for int8, one scale per position and KV head).
int64_t KvBlockBytes(const ModelConfig& config, int block_size, Precision precision) {
  return int64_t{2} * config.n_layers * block_size * config.kv_dim() * PrecisionBytes(precision);
}

int64_t KvBlockBytes(const ModelConfig& config, int block_size, KvDtype dtype) {
  return int64_t{2} * config.n_layers * block_size *
         (int64_t{config.kv_dim()} * KvDtypeBytes(dtype) +
          int64_t{config.n_kv_heads} * KvDtypeScaleBytes(dtype));
}

absl::Status ValidateModel(const Model& model, bool check_weights) {
  const ModelConfig& c = model.config;
  if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.vocab_size <= 0 || c.max_seq_len <= 0 || c.dim % c.n_heads != 0 ||
      c.n_heads % c.n_kv_heads != 0 || c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model ", c.name, " has an invalid shape"));
  }
  // RoPE tables and attention scratch grow with the context.
  constexpr int kMaxContext = 1 << 20;
  if (c.max_seq_len > kMaxContext) {
    return absl::InvalidArgumentError(absl::StrCat("model ", c.name, ": context ", c.max_seq_len,
                                                   " exceeds the engine's ", kMaxContext));
  }
  if (!check_weights) return absl::OkStatus();
  const size_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  const ModelWeights& w = model.weights;
  // A matrix is [rows][cols] in float32, or quantized (not both).
  auto matrix = [](std::span<const float> f, const QuantizedMatrix& q, size_t rows, size_t cols) {
    if (q.empty()) return f.size() == rows * cols;
    return f.empty() && q.rows == static_cast<int64_t>(rows) &&
           q.cols == static_cast<int64_t>(cols) && q.cols % QuantBlockSize(q.type) == 0;
  };
  bool ok = matrix(w.token_embedding, w.quantized_token_embedding, v, d) &&
            matrix(w.classifier, w.quantized_classifier, v, d) && w.final_norm.size() == d &&
            w.layers.size() == static_cast<size_t>(c.n_layers);
  const size_t qkv_bias = c.qkv_bias ? 1 : 0, o_bias = c.o_bias ? 1 : 0;
  for (const LayerWeights& l : w.layers) {
    const LayerWeights::Quantized& q = l.quantized;
    ok = ok && l.attn_norm.size() == d && matrix(l.wq, q.wq, d, d) && matrix(l.wk, q.wk, kv, d) &&
         matrix(l.wv, q.wv, kv, d) && matrix(l.wo, q.wo, d, d) && l.ffn_norm.size() == d &&
         matrix(l.w1, q.w1, h, d) && matrix(l.w2, q.w2, d, h) && matrix(l.w3, q.w3, h, d) &&
         l.bq.size() == qkv_bias * d && l.bk.size() == qkv_bias * kv &&
         l.bv.size() == qkv_bias * kv && l.bo.size() == o_bias * d;
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", c.name, ": weight sizes do not match its config"));
  }
  return absl::OkStatus();
}

absl::Status ValidateStep(const ModelConfig& config, const KvCacheConfig& kv,
                          const StepBatch& batch, std::vector<int32_t>& block_owner) {
  const size_t num_seqs = batch.seqs.size();
  block_owner.resize(kv.num_blocks, -1);
  int64_t total = 0;
  for (size_t s = 0; s < num_seqs; ++s) {
    const SequenceStep& seq = batch.seqs[s];
    if (seq.num_tokens < 1 || seq.start_pos < 0) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": num_tokens ",
                                                     seq.num_tokens, " must be >= 1 and start_pos ",
                                                     seq.start_pos, " >= 0"));
    }
    const int64_t end = int64_t{seq.start_pos} + seq.num_tokens;
    if (end > config.max_seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": positions up to ", end,
                                                     " exceed the context of ",
                                                     config.max_seq_len));
    }
    const int64_t blocks_needed = (end + kv.block_size - 1) / kv.block_size;
    if (static_cast<int64_t>(seq.block_table.size()) < blocks_needed) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", s, ": block table has ", seq.block_table.size(),
                       " blocks, positions up to ", end, " need ", blocks_needed));
    }
    for (int64_t b = 0; b < blocks_needed; ++b) {
      if (seq.block_table[b] < 0 || seq.block_table[b] >= kv.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": block id ",
                                                       seq.block_table[b], " out of range [0, ",
                                                       kv.num_blocks, ")"));
      }
    }
    total += seq.num_tokens;
  }
  if (total != static_cast<int64_t>(batch.tokens.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequences hold ", total, " tokens, batch has ", batch.tokens.size()));
  }
  for (size_t t = 0; t < batch.tokens.size(); ++t) {
    if (batch.tokens[t] < 0 || batch.tokens[t] >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token ", t, " id ", batch.tokens[t],
                                                     " out of range [0, ", config.vocab_size, ")"));
    }
  }
  // Two sequences writing one block would race and corrupt each other; a
  // shared block that only one writes (a shared prefix) is fine.
  absl::Status status = absl::OkStatus();
  std::vector<int32_t> written;
  for (size_t s = 0; s < num_seqs && status.ok(); ++s) {
    const SequenceStep& seq = batch.seqs[s];
    const int first = seq.start_pos / kv.block_size;
    const int last = (seq.start_pos + seq.num_tokens - 1) / kv.block_size;
    for (int b = first; b <= last; ++b) {
      const int32_t block = seq.block_table[b];
      if (block_owner[block] == -1) {
        block_owner[block] = static_cast<int32_t>(s);
        written.push_back(block);
      } else if (block_owner[block] != static_cast<int32_t>(s)) {
        status = absl::InvalidArgumentError(absl::StrCat("sequences ", block_owner[block], " and ",
                                                         s, " both write block ", block));
        break;
      }
    }
  }
  for (const int32_t block : written) block_owner[block] = -1;
  return status;
}

size_t LogitRows(const StepBatch& batch) {
  size_t rows = 0;
  for (const SequenceStep& seq : batch.seqs) rows += seq.all_logits ? seq.num_tokens : 1;
  return rows;
}

absl::Status ValidateBlockCopies(const KvCacheConfig& kv, std::span<const BlockCopy> copies) {
  auto in_range = [&kv](int32_t id) { return id >= 0 && id < kv.num_blocks; };
  for (const BlockCopy& c : copies) {
    if (!in_range(c.from) || !in_range(c.to)) {
      return absl::InvalidArgumentError(absl::StrCat("block copy ", c.from, " -> ", c.to,
                                                     ": the pool has ", kv.num_blocks, " blocks"));
    }
  }
  for (const BlockCopy& c : copies) {
    for (const BlockCopy& d : copies) {
      if (c.to == d.from || (&c != &d && c.to == d.to)) {
        return absl::InvalidArgumentError(
            absl::StrCat("block ", c.to, " is written by one copy and read or written by another"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Backend::CopyBlocks(std::span<const BlockCopy> copies) {
  return absl::UnimplementedError(
      absl::StrCat("the ", std::string(name()), " backend does not copy KV blocks"));
}

absl::Status CheckSampleSizes(const StepBatch& batch, size_t num_specs, size_t num_tokens) {
  if (num_specs != batch.seqs.size() || num_tokens != batch.seqs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("StepAndSample: ", batch.seqs.size(),
                                                   " sequences, ", num_specs, " sampling specs, ",
                                                   num_tokens, " outputs"));
  }
  return absl::OkStatus();
}

absl::Status Backend::StepAndSample(const StepBatch& batch, std::span<const SampleSpec> sampling,
                                    std::span<int32_t> tokens) {
  RETURN_IF_ERROR(CheckSampleSizes(batch, sampling.size(), tokens.size()));
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  logits_.resize(LogitRows(batch) * vocab);
  if (absl::Status status = Step(batch, std::span<float>(logits_)); !status.ok()) return status;
  size_t row = 0;  // past the rows of the sequences before
  for (size_t i = 0; i < tokens.size(); ++i) {
    row += batch.seqs[i].all_logits ? batch.seqs[i].num_tokens : 1;
    tokens[i] = SampleWithUniform(std::span<const float>(logits_).subspan((row - 1) * vocab, vocab),
                                  sampling[i].params, sampling[i].uniform);
  }
  return absl::OkStatus();
}

int64_t Backend::weight_bytes() const {
  return config().num_parameters() * static_cast<int64_t>(sizeof(float));
}

int64_t Backend::kv_bytes_per_token() const { return KvBlockBytes(config(), 1, kv_cache().dtype); }

}  // namespace coalesce::engine
