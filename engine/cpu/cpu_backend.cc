// The forward pass is llama2.c's (run.c forward()), batched: every weight
// matrix is applied to all rows of a step at once, attention runs per token
// over its own sequence's paged KV blocks.
#include "engine/cpu/cpu_backend.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/cpu/float_panels.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/kv_quant.h"
#include "engine/cpu/products.h"
#include "engine/cpu/quant_int8.h"
#include "engine/cpu/quant_matmul.h"
#include "engine/cpu/thread_pool.h"
#include "engine/simd.h"

namespace coalesce::engine {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// calloc of a large size maps fresh zero pages: no time spent touching a
// pool that may be gigabytes, and never-written slots read as 0 (in every
// KV type, an int8 slot's scale included), not NaN.
template <typename T>
std::unique_ptr<T[], FreeDeleter> Zeroed(int64_t count) {
  return std::unique_ptr<T[], FreeDeleter>(
      static_cast<T*>(std::calloc(std::max<int64_t>(count, 1), sizeof(T))));
}

// Tokens of one sequence whose attention one task computes together
// (AttentionOver), reading each KV block once for all of them.
constexpr int64_t kAttentionTile = 8;

// The attention kernels (kernels.h) for the cache's element type T, for
// `num` queries that read the same rows, given by pointers; `scales` (one
// per row) is read for int8 only.
template <typename T>
void DotCached(const float* const* q, int num, const T* const* keys, const float* scales, int count,
               int n, float* const* scores) {
  if constexpr (std::is_same_v<T, int8_t>) {
    cpu::DotRowsGathered(q, num, keys, scales, count, n, scores);
  } else {
    cpu::DotRowsGathered(q, num, keys, count, n, scores);
  }
}
template <typename T>
void AccumulateCached(const float* const* weights, int num, const T* const* rows,
                      const float* scales, int count, int n, float* const* out) {
  if constexpr (std::is_same_v<T, int8_t>) {
    cpu::AccumulateRowsGathered(weights, num, rows, scales, count, n, out);
  } else {
    cpu::AccumulateRowsGathered(weights, num, rows, count, n, out);
  }
}

// rows[t, i] += bias[i] for every row: the bias follows the product, as in
// nn.Linear, and touches each element alone, so it keeps batch invariance.
//   bias: [n]   rows: [num_rows, n]
void AddBias(std::span<const float> bias, int num_rows, float* rows) {
  const size_t n = bias.size();
  for (int t = 0; t < num_rows; ++t) {
    float* row = rows + static_cast<size_t>(t) * n;
    for (size_t i = 0; i < n; ++i) row[i] += bias[i];
  }
}

// A weight matrix laid out again at creation, as the backend computes with
// it: a quantized one as panels whose product is the float32 one on the
// dequantized weights (cpu/quant_matmul.h), or, with --int8_activations, in
// the int8 layout (cpu/quant_int8.h); a float32 one as the product's panels
// (cpu/float_panels.h), the same bits as the model's rows.
class LaidOutWeight {
 public:
  explicit LaidOutWeight(cpu::PackedMatrix panels) : panels_(std::move(panels)) {}
  explicit LaidOutWeight(cpu::Int8Matrix int8) : int8_(std::move(int8)) {}
  explicit LaidOutWeight(cpu::FloatPanels f) : float_(std::move(f)) {}

  int64_t bytes() const {
    return panels_ ? panels_->bytes() : int8_ ? int8_->bytes() : float_->bytes();
  }
  // Row r's weights as floats (a lookup of the embedding).
  void Row(int r, float* out) const {
    if (panels_) {
      panels_->DequantizeRow(r, out);
    } else if (int8_) {
      int8_->DequantizeRow(r, out);
    } else {
      float_->Row(r, out);
    }
  }
  void Apply(cpu::ThreadPool& pool, const float* x, int64_t ldx, int m, float* y,
             int64_t ldy) const {
    if (panels_) {
      cpu::QuantMatmul(pool, x, ldx, m, *panels_, y, ldy);
    } else if (int8_) {
      cpu::Int8Matmul(pool, x, ldx, m, *int8_, y, ldy);
    } else {
      cpu::FloatPanelsMatmul(pool, x, ldx, m, *float_, y, ldy);
    }
  }
  // This matrix for cpu::MatmulTogether.
  cpu::MatmulWeights weights() const {
    return {.float_panels = float_ ? &*float_ : nullptr,
            .panels = panels_ ? &*panels_ : nullptr,
            .int8 = int8_ ? &*int8_ : nullptr};
  }

 private:
  std::optional<cpu::PackedMatrix> panels_;
  std::optional<cpu::Int8Matrix> int8_;
  std::optional<cpu::FloatPanels> float_;
};

// A weight matrix as the backend reads it: the model's float32 rows, or
// laid out again.
struct Matrix {
  const float* f = nullptr;
  const LaidOutWeight* q = nullptr;
};

// The model's matrices as the backend computes with them; a tied quantized
// classifier shares the embedding's.
struct PackedWeights {
  struct Layer {
    std::unique_ptr<LaidOutWeight> wq, wk, wv, wo, w1, w2, w3;
  };
  std::vector<Layer> layers;
  std::unique_ptr<LaidOutWeight> token_embedding, classifier;
  // What the step reads: the classifier laid out (its own, or the tied
  // quantized embedding's), and the rows an embedding lookup reads (the
  // quantized embedding's, or a tied float32 classifier's panels); null
  // where the model's float32 rows are read instead.
  const LaidOutWeight* lm_head = nullptr;
  const LaidOutWeight* lookup = nullptr;
  bool int8 = false;              // --int8_activations, where the processor has it
  int64_t bytes = 0;              // of the laid-out quantized matrices
  int64_t elements = 0;           // weights they hold
  int int8_matrices = 0;          // of which in the int8 layout
  int code_matrices = 0;          // of which 4- or 6-bit as panels (cpu::CodeFloats)
  bool subnormal_codes = false;   // cpu::QuantCodeFloats(), asked at load where it counts
  std::string types;              // "Q8_0, Q4_1": the types held, for Describe()
  int64_t float_panel_bytes = 0;  // of the float32 matrices laid out as panels
};

absl::StatusOr<std::unique_ptr<LaidOutWeight>> PackIf(const QuantizedMatrix& m,
                                                      PackedWeights& out) {
  if (m.empty()) return nullptr;
  std::unique_ptr<LaidOutWeight> weight;
  if (out.int8 && cpu::Int8DotType(m.type)) {
    absl::StatusOr<cpu::Int8Matrix> packed = cpu::Int8Matrix::Pack(m);
    if (!packed.ok()) return packed.status();
    weight = std::make_unique<LaidOutWeight>(*std::move(packed));
    ++out.int8_matrices;
  } else {
    absl::StatusOr<cpu::PackedMatrix> packed = cpu::PackedMatrix::Pack(m);
    if (!packed.ok()) return packed.status();
    weight = std::make_unique<LaidOutWeight>(*std::move(packed));
    if (m.type != QuantType::kQ8_0) ++out.code_matrices;
  }
  out.bytes += weight->bytes();
  out.elements += m.rows * m.cols;
  const std::string name = QuantTypeName(m.type);
  if (out.types.find(name) == std::string::npos) {
    absl::StrAppend(&out.types, out.types.empty() ? "" : ", ", name);
  }
  return weight;
}

// A float32 matrix [rows][cols] as panels, where `float_panels` asks for
// them; null for an empty span (the matrix is quantized) or without.
absl::StatusOr<std::unique_ptr<LaidOutWeight>> FloatPanelsIf(std::span<const float> f, int64_t rows,
                                                             int64_t cols, bool float_panels,
                                                             PackedWeights& out) {
  if (!float_panels || f.empty()) return nullptr;
  absl::StatusOr<cpu::FloatPanels> panels = cpu::FloatPanels::Pack(f.data(), rows, cols);
  if (!panels.ok()) return panels.status();
  out.float_panel_bytes += panels->bytes();
  return std::make_unique<LaidOutWeight>(*std::move(panels));
}

absl::StatusOr<PackedWeights> PackWeights(const ModelConfig& c, const ModelWeights& w, bool int8,
                                          bool float_panels) {
  PackedWeights out;
  out.int8 = int8;
  const int64_t dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim;
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim();
  for (const LayerWeights& l : w.layers) {
    PackedWeights::Layer& p = out.layers.emplace_back();
    const LayerWeights::Quantized& q = l.quantized;
    struct Of {
      const QuantizedMatrix* quantized;
      std::span<const float> f;
      int64_t rows, cols;
      std::unique_ptr<LaidOutWeight>* to;
    };
    for (const Of& m : {Of{&q.wq, l.wq, q_dim, dim, &p.wq},
                        {&q.wk, l.wk, kv_dim, dim, &p.wk},
                        {&q.wv, l.wv, kv_dim, dim, &p.wv},
                        {&q.wo, l.wo, dim, q_dim, &p.wo},
                        {&q.w1, l.w1, hidden, dim, &p.w1},
                        {&q.w2, l.w2, dim, hidden, &p.w2},
                        {&q.w3, l.w3, hidden, dim, &p.w3}}) {
      absl::StatusOr<std::unique_ptr<LaidOutWeight>> packed =
          m.quantized->empty() ? FloatPanelsIf(m.f, m.rows, m.cols, float_panels, out)
                               : PackIf(*m.quantized, out);
      if (!packed.ok()) return packed.status();
      *m.to = *std::move(packed);
    }
  }
  absl::StatusOr<std::unique_ptr<LaidOutWeight>> embedding =
      PackIf(w.quantized_token_embedding, out);
  if (!embedding.ok()) return embedding.status();
  out.token_embedding = *std::move(embedding);
  absl::StatusOr<std::unique_ptr<LaidOutWeight>> classifier = nullptr;
  if (!w.quantized_classifier.empty()) {
    if (w.quantized_classifier.data != w.quantized_token_embedding.data) {
      classifier = PackIf(w.quantized_classifier, out);
    }
  } else {
    // A float32 classifier, tied to the embedding or not, gets panels; a
    // tied embedding's lookups read them (Row).
    classifier = FloatPanelsIf(w.classifier, c.vocab_size, dim, float_panels, out);
  }
  if (!classifier.ok()) return classifier.status();
  out.classifier = *std::move(classifier);
  const bool tied_quantized = !w.quantized_classifier.empty() &&
                              w.quantized_classifier.data == w.quantized_token_embedding.data;
  out.lm_head = tied_quantized ? out.token_embedding.get() : out.classifier.get();
  const bool tied_float = !w.classifier.empty() && w.classifier.data() == w.token_embedding.data();
  out.lookup = out.token_embedding != nullptr ? out.token_embedding.get()
                                              : (tied_float ? out.classifier.get() : nullptr);
  return out;
}

// Whether the step reads no matrix of the model's: every one is laid out.
bool AllLaidOut(const PackedWeights& p) {
  for (const PackedWeights::Layer& l : p.layers) {
    for (const auto* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w1, &l.w2, &l.w3}) {
      if (*m == nullptr) return false;
    }
  }
  return p.lm_head != nullptr;
}

// The part of `m` the step reads once every matrix is laid out (AllLaidOut):
// its shape, norms and biases, and a float32 embedding that no laid-out
// matrix stands for, copied. The backend keeps this instead of `m`, so the
// model's rows are freed once nothing else holds it (the server lets go of
// it after start-up), and the process holds the weights once.
std::shared_ptr<const Model> WhatTheStepReads(const Model& m, const PackedWeights& p) {
  auto pieces = std::make_shared<std::vector<std::vector<float>>>();
  pieces->reserve(8 * m.weights.layers.size() + 2);
  auto keep = [&](std::span<const float> f) -> std::span<const float> {
    if (f.empty()) return {};
    // Moving a vector into the list keeps its elements where they are.
    pieces->emplace_back(f.begin(), f.end());
    return pieces->back();
  };
  Model out;
  out.config = m.config;
  for (const LayerWeights& l : m.weights.layers) {
    LayerWeights& o = out.weights.layers.emplace_back();
    o.attn_norm = keep(l.attn_norm);
    o.ffn_norm = keep(l.ffn_norm);
    o.bq = keep(l.bq);
    o.bk = keep(l.bk);
    o.bv = keep(l.bv);
    o.bo = keep(l.bo);
  }
  out.weights.final_norm = keep(m.weights.final_norm);
  if (p.lookup == nullptr) out.weights.token_embedding = keep(m.weights.token_embedding);
  out.storage = std::move(pieces);
  return std::make_shared<const Model>(std::move(out));
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::shared_ptr<const Model> model, const KvCacheConfig& kv, int threads,
             std::unique_ptr<unsigned char[], FreeDeleter> cache,
             std::unique_ptr<float[], FreeDeleter> scales, PackedWeights packed)
      : model_(std::move(model)),
        c_(model_->config),
        kv_(kv),
        pool_(threads),
        cache_(std::move(cache)),
        scales_(std::move(scales)),
        block_owner_(kv.num_blocks, -1),
        packed_(std::move(packed)) {
    // RoPE angles as run.c computes them, in float, one row per position:
    // angle = pos * inv_freq[i], inv_freq from the (possibly scaled) theta.
    const int half = c_.head_dim() / 2;
    const std::vector<float> inv_freq = RopeInverseFrequencies(c_);  // [half]
    rope_cos_.resize(static_cast<size_t>(c_.max_seq_len) * half);
    rope_sin_.resize(rope_cos_.size());
    for (int pos = 0; pos < c_.max_seq_len; ++pos) {
      for (int i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pos) * inv_freq[i];
        rope_cos_[static_cast<size_t>(pos) * half + i] = std::cos(angle);
        rope_sin_[static_cast<size_t>(pos) * half + i] = std::sin(angle);
      }
    }
  }

  absl::Status Step(const StepBatch& batch, std::span<float> logits) override;
  const ModelConfig& config() const override { return c_; }
  const KvCacheConfig& kv_cache() const override { return kv_; }
  std::string_view name() const override { return "cpu"; }
  // The float32 parameters' bytes, and the quantized matrices' panels.
  int64_t weight_bytes() const override {
    return (c_.num_parameters() - packed_.elements) * static_cast<int64_t>(sizeof(float)) +
           packed_.bytes;
  }
  // "cpu" as ever with float32 weights, read as the model's rows, and KV
  // cache; otherwise it names the weights' layout and types and the cache's.
  std::string Describe() const override {
    const double panels_mb = packed_.float_panel_bytes / 1e6;
    const std::string weights =
        packed_.types.empty()
            ? (panels_mb > 0 ? absl::StrFormat("fp32 weights as panels (%.1f MB)", panels_mb)
                             : std::string("fp32 weights"))
            : absl::StrFormat(
                  "%s weights (%.1f MB; the rest fp32%s)%s", packed_.types, packed_.bytes / 1e6,
                  panels_mb > 0 ? absl::StrFormat(", its matrices as panels: %.1f MB", panels_mb)
                                : "",
                  packed_.int8_matrices > 0 ? " with int8 activations"
                  : packed_.subnormal_codes ? ", one-row codes as subnormal floats"
                                            : "");
    if (kv_.dtype == KvDtype::kFp32 && packed_.types.empty() && panels_mb == 0) return "cpu";
    return absl::StrCat("cpu: ", weights, ", KV cache ", KvDtypeName(kv_.dtype),
                        kv_.dtype == KvDtype::kInt8 ? " (a scale per token and KV head)" : "");
  }
  BackendCapabilities capabilities() const override {
    return {.runs_model = true,
            .weights_in_host_memory = true,
            .overlap_pays = true,
            .copies_blocks = true,
            .all_logits = true,
            .samples_on_host = true};
  }
  absl::Status CopyBlocks(std::span<const BlockCopy> copies) override {
    if (absl::Status s = ValidateBlockCopies(kv_, copies); !s.ok()) return s;
    // A block's layers, K and V, are contiguous (see cache_), and so are its
    // scales (scales_).
    const int64_t slabs = int64_t{c_.n_layers} * 2;
    for (const BlockCopy& c : copies) {
      std::memcpy(cache_.get() + c.to * slabs * slab_bytes_,
                  cache_.get() + c.from * slabs * slab_bytes_, slabs * slab_bytes_);
      if (scales_ != nullptr) {
        std::memcpy(Scales(c.to, 0, 0), Scales(c.from, 0, 0),
                    sizeof(float) * slabs * ScalesPerSlab());
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Validate(const StepBatch& batch, std::span<float> logits);
  void Resize(int num_tokens, int logit_rows);
  // K (kind 0) or V (kind 1) of `layer` in `block`, as T (the cache's
  // element type): [n_kv_heads, block_size, head_dim].
  template <typename T>
  T* Cache(int32_t block, int layer, int kind) {
    const int64_t slab = (int64_t{block} * c_.n_layers + layer) * 2 + kind;
    return reinterpret_cast<T*>(cache_.get() + slab * slab_bytes_);
  }
  // Their scales (int8 only): [n_kv_heads, block_size].
  int64_t ScalesPerSlab() const { return int64_t{c_.n_kv_heads} * kv_.block_size; }
  float* Scales(int32_t block, int layer, int kind) {
    const int64_t slab = (int64_t{block} * c_.n_layers + layer) * 2 + kind;
    return scales_.get() + slab * ScalesPerSlab();
  }
  // Writes one token's K or V, x [kv_dim], at `offset` in `block`,
  // converting it to the cache's type.
  template <typename T>
  void Store(int32_t block, int layer, int kind, int offset, const float* x);
  void Attention(const StepBatch& batch, int layer);
  template <typename T>
  void AttentionOver(const StepBatch& batch, int layer);
  // y = x W^T for the m rows of x: W [n][k], float32 or quantized.
  void Apply(const Matrix& w, const float* x, int64_t ldx, int m, int n, int k, float* y,
             int64_t ldy) {
    if (w.q != nullptr) {
      w.q->Apply(pool_, x, ldx, m, y, ldy);
    } else {
      cpu::Matmul(pool_, x, ldx, m, w.f, n, k, y, ldy);
    }
  }
  // One product of ApplyTogether: y = x W^T, W [n][k].
  struct Output {
    Matrix w;
    int n = 0;
    float* y = nullptr;
    int64_t ldy = 0;
  };
  // Products of matrices that read the same x [m, k], in one parallel loop
  // (cpu/products.h): the same bits as Apply on each.
  void ApplyTogether(std::initializer_list<Output> outs, const float* x, int64_t ldx, int m, int k);
  static Matrix Of(std::span<const float> f, const std::unique_ptr<LaidOutWeight>& q) {
    return {f.data(), q.get()};
  }

  const std::shared_ptr<const Model> model_;
  const ModelConfig& c_;
  const KvCacheConfig kv_;
  cpu::ThreadPool pool_;
  cpu::Int8Rows int8_rows_;  // ApplyTogether's activations, quantized once
  // [num_blocks, n_layers, 2 (K, V), n_kv_heads, block_size, head_dim] of
  // kv_.dtype: one block holds everything a run of block_size positions
  // needs, so the caller's block accounting is the only accounting; and a
  // head's rows within a block are contiguous, so attention reads each
  // block's share as one run.
  std::unique_ptr<unsigned char[], FreeDeleter> cache_;
  // int8 only (else null): [num_blocks, n_layers, 2 (K, V), n_kv_heads,
  // block_size], the scale of each token's values of each KV head.
  std::unique_ptr<float[], FreeDeleter> scales_;
  // Bytes of one [n_kv_heads, block_size, head_dim] slab.
  const int64_t slab_bytes_ = int64_t{kv_.block_size} * c_.kv_dim() * KvDtypeBytes(kv_.dtype);
  std::vector<float> rope_cos_, rope_sin_;  // [max_seq_len, head_dim / 2]

  // Scratch, grown to the largest step seen and reused.
  std::vector<float> x_;              // [num_tokens, dim] residual stream
  std::vector<float> xb_;             // [num_tokens, dim] normed input / projection output
  std::vector<float> q_;              // [num_tokens, dim]
  std::vector<float> k_;              // [num_tokens, kv_dim]
  std::vector<float> v_;              // [num_tokens, kv_dim]
  std::vector<float> att_;            // [num_tokens, dim] attention output, before wo
  std::vector<float> hb_;             // [num_tokens, hidden_dim] gate, then silu(gate) * up
  std::vector<float> hb2_;            // [num_tokens, hidden_dim] up
  std::vector<float> last_;           // [LogitRows, dim] final-normed rows that get logits
  std::vector<int32_t> pos_;          // [num_tokens] position of each token
  std::vector<int32_t> seq_;          // [num_tokens] sequence of each token
  std::vector<int32_t> block_owner_;  // [num_blocks] validation: sequence writing it, or -1
  // Attention weights per worker: [threads, tile x kv_mul, positions] for
  // the largest step so far (AttentionOver), and its tiles' first tokens.
  std::vector<float> scores_;
  std::vector<const float*> inputs_;  // [threads, tile x kv_mul] a kernel call's rows
  std::vector<float*> outputs_;       // [threads, tile x kv_mul]
  std::vector<int> tiles_;
  const PackedWeights packed_;  // the quantized matrices, as panels
};

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

absl::Status CpuBackend::Validate(const StepBatch& batch, std::span<float> logits) {
  const size_t rows = LogitRows(batch);
  if (logits.size() < rows * c_.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits has ", logits.size(),
                     " floats, need LogitRows * vocab_size = ", rows * c_.vocab_size));
  }
  return ValidateStep(c_, kv_, batch, block_owner_);
}

void CpuBackend::Resize(int num_tokens, int logit_rows) {
  const size_t t = num_tokens;
  auto grow = [](std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  };
  grow(x_, t * c_.dim);
  grow(xb_, t * c_.dim);
  grow(q_, t * c_.dim);
  grow(k_, t * c_.kv_dim());
  grow(v_, t * c_.kv_dim());
  grow(att_, t * c_.dim);
  grow(hb_, t * c_.hidden_dim);
  grow(hb2_, t * c_.hidden_dim);
  grow(last_, static_cast<size_t>(logit_rows) * c_.dim);
  pos_.resize(t);
  seq_.resize(t);
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

template <typename T>
void CpuBackend::Store(int32_t block, int layer, int kind, int offset, const float* x) {
  const int hs = c_.head_dim(), bs = kv_.block_size;
  T* slab = Cache<T>(block, layer, kind);
  for (int h = 0; h < c_.n_kv_heads; ++h) {
    const float* src = x + h * hs;                    // [head_dim]
    T* row = slab + (int64_t{h} * bs + offset) * hs;  // [head_dim]
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(row, src, sizeof(float) * hs);
    } else if constexpr (std::is_same_v<T, cpu::Bf16> || std::is_same_v<T, cpu::Fp16>) {
      cpu::Convert(src, hs, row);
    } else {
      static_assert(std::is_same_v<T, int8_t>);
      Scales(block, layer, kind)[h * bs + offset] = cpu::QuantizeInt8(src, hs, row);
    }
  }
}

void CpuBackend::ApplyTogether(std::initializer_list<Output> outs, const float* x, int64_t ldx,
                               int m, int k) {
  std::array<cpu::MatmulProduct, 3> products;
  size_t count = 0;
  for (const Output& o : outs) {
    products.at(count++) = {
        .w = o.w.q != nullptr ? o.w.q->weights() : cpu::MatmulWeights{.f = o.w.f},
        .n = o.n,
        .y = o.y,
        .ldy = o.ldy};
  }
  cpu::MatmulTogether(pool_, std::span(products.data(), count), x, ldx, m, k, int8_rows_);
}

void CpuBackend::Attention(const StepBatch& batch, int layer) {
  switch (kv_.dtype) {
    case KvDtype::kBf16:
      return AttentionOver<cpu::Bf16>(batch, layer);
    case KvDtype::kFp16:
      return AttentionOver<cpu::Fp16>(batch, layer);
    case KvDtype::kInt8:
      return AttentionOver<int8_t>(batch, layer);
    default:  // fp32 (CreateCpuBackend refuses the rest)
      return AttentionOver<float>(batch, layer);
  }
}

// softmax(q . K / sqrt(head_size)) . V for every token and query head, over
// positions 0..pos of the token's own sequence, K and V dequantized as the
// kernels read them. One task per tile of consecutive tokens of one sequence
// (a prompt chunk; a decode is a tile of one) and KV head: it reads each
// cache block once for all the tile's tokens and the query heads that share
// the KV head (GQA), instead of once per token and head: the kernels
// (kernels.h, DotRowsGathered) read each cached row once for two of them and
// keep their sums in registers across all of a sequence's positions, which
// is what makes a long prompt's chunks cheaper at long contexts. Each (token, head) is
// computed by the same calls in the same order whatever tile it is in, and
// each task writes only its own rows, so the result does not depend on the
// batch, the chunking, or which thread runs it.
template <typename T>
void CpuBackend::AttentionOver(const StepBatch& batch, int layer) {
  const int num_tokens = static_cast<int>(batch.tokens.size());
  const int hs = c_.head_dim(), dim = c_.dim;
  const int kv_mul = c_.n_heads / c_.n_kv_heads;  // query heads per KV head (GQA)
  const int bs = kv_.block_size;
  const float inv_sqrt = 1.0f / std::sqrt(static_cast<float>(hs));
  // Tiles: runs of at most `tile` consecutive tokens of one sequence, so
  // that a worker's score rows (tile x kv_mul x positions) stay a few MiB.
  int max_pos = 0;
  for (int t = 0; t < num_tokens; ++t) max_pos = std::max(max_pos, pos_[t]);
  const int64_t span = int64_t{max_pos} + 1;
  const int tile = static_cast<int>(
      std::clamp<int64_t>((int64_t{1} << 20) / (int64_t{kv_mul} * span), 1, kAttentionTile));
  tiles_.clear();
  for (int t = 0; t < num_tokens;) {
    int end = t + 1;
    while (end < num_tokens && end - t < tile && seq_[end] == seq_[t]) ++end;
    tiles_.push_back(t);
    t = end;
  }
  tiles_.push_back(num_tokens);
  const size_t rows_per_worker = static_cast<size_t>(tile) * kv_mul;
  const size_t scores_needed = static_cast<size_t>(pool_.size()) * rows_per_worker * span;
  if (scores_.size() < scores_needed) scores_.resize(scores_needed);
  const size_t per_worker = static_cast<size_t>(pool_.size()) * rows_per_worker;
  inputs_.resize(std::max(inputs_.size(), per_worker));
  outputs_.resize(std::max(outputs_.size(), per_worker));

  auto task = [&](int task, int worker) {
    const int i = task / c_.n_kv_heads, kv_head = task % c_.n_kv_heads;
    const int first = tiles_[i], count = tiles_[i + 1] - first;
    const int last_pos = pos_[first + count - 1];  // the tile's positions ascend
    const std::span<const int32_t> table = batch.seqs[seq_[first]].block_table;
    // This head's rows and scales within a block (see cache_, scales_).
    const int64_t rows_at = int64_t{kv_head} * bs * hs, scales_at = int64_t{kv_head} * bs;
    // Row r = j * kv_mul + g: token first + j, query head kv_head * kv_mul + g.
    const int rows = count * kv_mul;
    float* att = scores_.data() + static_cast<size_t>(worker) * rows_per_worker * span;
    auto row_scores = [&](int r) { return att + static_cast<size_t>(r) * span; };
    auto row_q = [&](int r) {
      return q_.data() + static_cast<size_t>(first + r / kv_mul) * dim +
             (kv_head * kv_mul + r % kv_mul) * hs;
    };
    auto row_out = [&](int r) { return att_.data() + (row_q(r) - q_.data()); };  // [head_size]
    // Every position's K and V row of this head (and its int8 scales), in
    // position order, wherever its block is.
    thread_local std::vector<const T*> keys, values;
    thread_local std::vector<float> key_scales, value_scales;
    keys.resize(last_pos + 1);
    values.resize(last_pos + 1);
    for (int b = 0; b * bs <= last_pos; ++b) {
      const T* k = Cache<T>(table[b], layer, 0) + rows_at;  // [block_size, head_size]
      const T* v = Cache<T>(table[b], layer, 1) + rows_at;
      for (int o = 0; o < bs && b * bs + o <= last_pos; ++o) {
        keys[b * bs + o] = k + o * hs;
        values[b * bs + o] = v + o * hs;
      }
    }
    const float* ks = nullptr;
    const float* vs = nullptr;
    if constexpr (std::is_same_v<T, int8_t>) {
      key_scales.resize(last_pos + 1);
      value_scales.resize(last_pos + 1);
      for (int p = 0; p <= last_pos; ++p) {
        key_scales[p] = Scales(table[p / bs], layer, 0)[scales_at + p % bs];
        value_scales[p] = Scales(table[p / bs], layer, 1)[scales_at + p % bs];
      }
      ks = key_scales.data();
      vs = value_scales.data();
    }
    // Token j's rows (and every later token's) read positions pos_j-1 + 1 to
    // pos_j (from 0 for the first): causality, in one kernel call per token.
    const float** inputs = inputs_.data() + static_cast<size_t>(worker) * rows_per_worker;
    float** outputs = outputs_.data() + static_cast<size_t>(worker) * rows_per_worker;
    auto for_spans = [&](auto&& run) {
      for (int j = 0; j < count; ++j) {
        const int from = j == 0 ? 0 : pos_[first + j - 1] + 1, to = pos_[first + j] + 1;
        run(j * kv_mul, from, to - from);
      }
    };
    for_spans([&](int r0, int from, int n) {
      for (int r = r0; r < rows; ++r) {
        inputs[r - r0] = row_q(r);
        outputs[r - r0] = row_scores(r) + from;
      }
      DotCached(inputs, rows - r0, keys.data() + from, ks == nullptr ? nullptr : ks + from, n, hs,
                outputs);
    });
    for (int r = 0; r < rows; ++r) {
      const int pos = pos_[first + r / kv_mul];
      float* scores = row_scores(r);
      const float max = simd::ScaleInPlaceAndMax(scores, pos + 1, inv_sqrt, -INFINITY);
      const float inv_sum = 1.0f / simd::ExpShiftedInPlace(scores, pos + 1, max, 1.0f);
      simd::ScaleInPlace(scores, pos + 1, inv_sum);
      std::fill(row_out(r), row_out(r) + hs, 0.0f);
    }
    for_spans([&](int r0, int from, int n) {
      for (int r = r0; r < rows; ++r) {
        inputs[r - r0] = row_scores(r) + from;
        outputs[r - r0] = row_out(r);
      }
      AccumulateCached(inputs, rows - r0, values.data() + from, vs == nullptr ? nullptr : vs + from,
                       n, hs, outputs);
    });
  };
  // About 4 flops per cached position and head dimension; below ~64K a
  // thread handoff costs more than it saves.
  int64_t work = 0;
  for (int t = 0; t < num_tokens; ++t) work += int64_t{pos_[t] + 1} * c_.dim * 4;
  const int num_tasks = (static_cast<int>(tiles_.size()) - 1) * c_.n_kv_heads;
  if (work < (int64_t{1} << 16)) {
    for (int i = 0; i < num_tasks; ++i) task(i, 0);
  } else {
    pool_.ParallelFor(num_tasks, task);
  }
}

// ---------------------------------------------------------------------------
// Step
// ---------------------------------------------------------------------------

absl::Status CpuBackend::Step(const StepBatch& batch, std::span<float> logits) {
  if (absl::Status s = Validate(batch, logits); !s.ok()) return s;
  const int num_tokens = static_cast<int>(batch.tokens.size());
  const int num_seqs = static_cast<int>(batch.seqs.size());
  if (num_tokens == 0) return absl::OkStatus();
  Resize(num_tokens, static_cast<int>(LogitRows(batch)));
  const ModelWeights& w = model_->weights;
  const int dim = c_.dim, kv_dim = c_.kv_dim(), hidden = c_.hidden_dim, hs = c_.head_dim();
  const int bs = kv_.block_size;
  const float eps = c_.norm_eps;

  // 1. Token positions and embeddings.
  for (int s = 0, t = 0; s < num_seqs; ++s) {
    for (int i = 0; i < batch.seqs[s].num_tokens; ++i, ++t) {
      pos_[t] = batch.seqs[s].start_pos + i;
      seq_[t] = s;
      if (packed_.lookup != nullptr) {
        packed_.lookup->Row(batch.tokens[t], &x_[static_cast<size_t>(t) * dim]);
      } else {
        std::memcpy(&x_[static_cast<size_t>(t) * dim],
                    &w.token_embedding[static_cast<size_t>(batch.tokens[t]) * dim],
                    sizeof(float) * dim);
      }
    }
  }

  for (int l = 0; l < c_.n_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    const PackedWeights::Layer& pl = packed_.layers[l];
    // 2. Attention block: RMSNorm, Q/K/V projections over all rows at once.
    for (int t = 0; t < num_tokens; ++t) {
      cpu::RmsNorm(&x_[static_cast<size_t>(t) * dim], lw.attn_norm.data(), dim, eps,
                   &xb_[static_cast<size_t>(t) * dim]);
    }
    ApplyTogether({{Of(lw.wq, pl.wq), dim, q_.data(), dim},
                   {Of(lw.wk, pl.wk), kv_dim, k_.data(), kv_dim},
                   {Of(lw.wv, pl.wv), kv_dim, v_.data(), kv_dim}},
                  xb_.data(), dim, num_tokens, dim);
    if (c_.qkv_bias) {
      AddBias(lw.bq, num_tokens, q_.data());
      AddBias(lw.bk, num_tokens, k_.data());
      AddBias(lw.bv, num_tokens, v_.data());
    }

    // 3. RoPE on interleaved pairs of every head of q and k, then K and V
    //    into the token's cache slot (K after rotation, as run.c caches it),
    //    converted to the cache's type.
    for (int t = 0; t < num_tokens; ++t) {
      const float* cos = &rope_cos_[static_cast<size_t>(pos_[t]) * (hs / 2)];
      const float* sin = &rope_sin_[static_cast<size_t>(pos_[t]) * (hs / 2)];
      auto rotate = [&](float* vec, int width) {
        for (int i = 0; i < width; i += 2) {
          const int j = (i % hs) / 2;
          const float v0 = vec[i], v1 = vec[i + 1];
          vec[i] = v0 * cos[j] - v1 * sin[j];
          vec[i + 1] = v0 * sin[j] + v1 * cos[j];
        }
      };
      float* k = &k_[static_cast<size_t>(t) * kv_dim];
      rotate(&q_[static_cast<size_t>(t) * dim], dim);
      rotate(k, kv_dim);
      const int32_t block = batch.seqs[seq_[t]].block_table[pos_[t] / bs];
      const float* v = &v_[static_cast<size_t>(t) * kv_dim];
      const int offset = pos_[t] % bs;
      switch (kv_.dtype) {
        case KvDtype::kBf16:
          Store<cpu::Bf16>(block, l, 0, offset, k);
          Store<cpu::Bf16>(block, l, 1, offset, v);
          break;
        case KvDtype::kFp16:
          Store<cpu::Fp16>(block, l, 0, offset, k);
          Store<cpu::Fp16>(block, l, 1, offset, v);
          break;
        case KvDtype::kInt8:
          Store<int8_t>(block, l, 0, offset, k);
          Store<int8_t>(block, l, 1, offset, v);
          break;
        default:  // fp32
          Store<float>(block, l, 0, offset, k);
          Store<float>(block, l, 1, offset, v);
          break;
      }
    }

    // 4. Attention over each token's own sequence, output projection,
    //    residual.
    Attention(batch, l);
    Apply(Of(lw.wo, pl.wo), att_.data(), dim, num_tokens, dim, dim, xb_.data(), dim);
    if (c_.o_bias) AddBias(lw.bo, num_tokens, xb_.data());
    for (size_t i = 0; i < static_cast<size_t>(num_tokens) * dim; ++i) x_[i] += xb_[i];

    // 5. SwiGLU feed-forward: w2(silu(w1 x) * w3 x), residual.
    for (int t = 0; t < num_tokens; ++t) {
      cpu::RmsNorm(&x_[static_cast<size_t>(t) * dim], lw.ffn_norm.data(), dim, eps,
                   &xb_[static_cast<size_t>(t) * dim]);
    }
    ApplyTogether({{Of(lw.w1, pl.w1), hidden, hb_.data(), hidden},
                   {Of(lw.w3, pl.w3), hidden, hb2_.data(), hidden}},
                  xb_.data(), dim, num_tokens, dim);
    for (size_t i = 0; i < static_cast<size_t>(num_tokens) * hidden; ++i) {
      const float g = hb_[i];
      hb_[i] = g * (1.0f / (1.0f + std::exp(-g))) * hb2_[i];
    }
    Apply(Of(lw.w2, pl.w2), hb_.data(), hidden, num_tokens, dim, hidden, xb_.data(), dim);
    for (size_t i = 0; i < static_cast<size_t>(num_tokens) * dim; ++i) x_[i] += xb_[i];
  }

  // 6. Final norm and classifier, only for the row each sequence samples from
  //    (every row of a sequence with all_logits).
  int rows = 0;
  for (int s = 0, t = 0; s < num_seqs; ++s) {
    const int n = batch.seqs[s].num_tokens;
    for (int r = batch.seqs[s].all_logits ? t : t + n - 1; r < t + n; ++r, ++rows) {
      cpu::RmsNorm(&x_[static_cast<size_t>(r) * dim], w.final_norm.data(), dim, eps,
                   &last_[static_cast<size_t>(rows) * dim]);
    }
    t += n;
  }
  Apply({w.classifier.data(), packed_.lm_head}, last_.data(), dim, rows, c_.vocab_size, dim,
        logits.data(), c_.vocab_size);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(std::shared_ptr<const Model> model,
                                                          const CpuBackendOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("CreateCpuBackend: no model");
  if (absl::Status s = ValidateModel(*model, /*check_weights=*/true); !s.ok()) return s;
  const KvCacheConfig& kv = options.kv_cache;
  if (kv.block_size <= 0 || kv.num_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("invalid KV cache: block_size ", kv.block_size,
                                                   ", num_blocks ", kv.num_blocks));
  }
  switch (kv.dtype) {
    case KvDtype::kFp32:
    case KvDtype::kBf16:
    case KvDtype::kFp16:
    case KvDtype::kInt8:
      break;
    case KvDtype::kFp8:
      return absl::InvalidArgumentError(
          "KV cache dtype fp8 (e4m3) is a CUDA type; the CPU backend holds fp32, bf16, fp16 or "
          "int8");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown KV cache dtype ", static_cast<int>(kv.dtype),
                       "; the CPU backend holds fp32, bf16, fp16 or int8"));
  }
  int threads = options.threads;
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(threads, 1);

  // The elements, and the int8 scales in an array of their own: together
  // KvBlockBytes(config, block_size, dtype) per block.
  const ModelConfig& c = model->config;
  const int64_t slabs = int64_t{kv.num_blocks} * c.n_layers * 2;
  const int64_t bytes = slabs * kv.block_size * c.kv_dim() * KvDtypeBytes(kv.dtype);
  const int64_t num_scales =
      KvDtypeScaleBytes(kv.dtype) > 0 ? slabs * kv.block_size * c.n_kv_heads : 0;
  auto cache = Zeroed<unsigned char>(bytes);
  std::unique_ptr<float[], FreeDeleter> scales;
  if (num_scales > 0) scales = Zeroed<float>(num_scales);
  if (cache == nullptr || (num_scales > 0 && scales == nullptr)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", KvBlockBytes(c, kv.block_size, kv.dtype) * kv.num_blocks,
                     " bytes for ", kv.num_blocks, " KV blocks of ", KvDtypeName(kv.dtype)));
  }
  // --int8_activations where the processor has AVX2 (AVX512-VNNI is faster);
  // elsewhere float32 activations, which the server logs.
  absl::StatusOr<PackedWeights> packed = PackWeights(
      model->config, model->weights, options.int8_activations && cpu::Int8DotSupported(),
      options.float_panels.value_or(cpu::BestMatmulIsa() == cpu::MatmulIsa::kAvx2));
  if (!packed.ok()) return packed.status();
  // Times the two ways once (about a millisecond) at load, not in the
  // first request's decode step.
  packed->subnormal_codes =
      packed->code_matrices > 0 && cpu::QuantCodeFloats() == cpu::CodeFloats::kSubnormal;
  if (AllLaidOut(*packed)) model = WhatTheStepReads(*model, *packed);
  return std::unique_ptr<Backend>(new CpuBackend(std::move(model), kv, threads, std::move(cache),
                                                 std::move(scales), *std::move(packed)));
}

}  // namespace coalesce::engine
