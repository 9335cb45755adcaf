#include "engine/model/gguf_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "engine/model/gguf_file.h"
#include "engine/model/gguf_quant.h"

namespace coalesce::engine {
namespace {

// The architectures, by general.architecture. Both are the same decoder;
// they differ in the q/k/v biases Qwen2 has and in the RoPE layout of the
// q/k rows llama.cpp's converter writes (see PlannedTensor::rope_heads).
enum class Arch { kLlama, kQwen2 };

// ---------------------------------------------------------------------------
// Metadata
// ---------------------------------------------------------------------------

// Typed reads of metadata keys. Every error is INVALID_ARGUMENT and names the
// file, the key and what it holds.
class Metadata {
 public:
  explicit Metadata(const GgufFile& file) : file_(file) {}

  const GgufValue* Find(std::string_view key) const { return file_.Find(key); }

  absl::Status Error(std::string_view key, std::string_view problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat(file_.path(), ": ", std::string(key), " ", std::string(problem)));
  }

  // A positive integer that fits in int32; `fallback` when absent, or an
  // error when there is none.
  absl::StatusOr<int> PositiveInt(std::string_view key,
                                  std::optional<int> fallback = std::nullopt) const {
    const GgufValue* v = Find(key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Error(key, "is missing");
    }
    const std::optional<int64_t> i = v->AsInt();
    if (!i || *i <= 0 || *i > std::numeric_limits<int32_t>::max()) {
      return Error(key, absl::StrCat("is ", v->Describe(), ", need a positive 32-bit integer"));
    }
    return static_cast<int>(*i);
  }

  // A finite positive number (float, or an integer written as one).
  absl::StatusOr<double> PositiveNumber(std::string_view key,
                                        std::optional<double> fallback = std::nullopt) const {
    const GgufValue* v = Find(key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Error(key, "is missing");
    }
    std::optional<double> d = v->AsFloat();
    if (!d && v->AsInt()) d = static_cast<double>(*v->AsInt());
    if (!d || !std::isfinite(*d) || !(*d > 0) ||
        *d > static_cast<double>(std::numeric_limits<float>::max())) {
      return Error(key, absl::StrCat("is ", v->Describe(), ", need a finite positive number"));
    }
    return *d;
  }

  // A string, or nullopt when absent.
  absl::StatusOr<std::optional<std::string_view>> String(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (v == nullptr) return std::optional<std::string_view>();
    if (!v->AsString()) return Error(key, absl::StrCat("is ", v->Describe(), ", need a string"));
    return v->AsString();
  }

  // A token id below `vocab_size`, or nullopt when absent or llama.cpp's
  // "none" (kGgufNoTokenId).
  absl::StatusOr<std::optional<int32_t>> TokenId(std::string_view key, int vocab_size) const {
    const GgufValue* v = Find(key);
    if (v == nullptr || v->AsUint() == kGgufNoTokenId) return std::optional<int32_t>();
    const std::optional<int64_t> id = v->AsInt();
    if (!id || *id < 0 || *id >= vocab_size) {
      return Error(key, absl::StrCat("is ", v->Describe(),
                                     ", need a token id below the vocabulary size ", vocab_size));
    }
    return std::optional<int32_t>(static_cast<int32_t>(*id));
  }

 private:
  const GgufFile& file_;
};

absl::StatusOr<Arch> ParseArch(const Metadata& m) {
  constexpr std::string_view kKey = "general.architecture";
  const GgufValue* v = m.Find(kKey);
  if (v == nullptr) return m.Error(kKey, "is missing");
  const std::optional<std::string_view> name = v->AsString();
  if (name == "llama") return Arch::kLlama;
  if (name == "qwen2") return Arch::kQwen2;
  return m.Error(kKey, absl::StrCat("is ", v->Describe(),
                                    ", which is not supported (supported: llama, "
                                    "qwen2)"));
}

// The RoPE keys: plain RoPE only (Llama 3.1's per-pair factors come as a
// tensor, read with the weights). llama.cpp reads a frequency scale from
// rope.scaling.factor, or the older rope.scale_linear, whatever the type, so
// any factor but 1 (or 0, its "unset") is refused too.
absl::Status CheckRopeScaling(const Metadata& m, const std::string& prefix) {
  const std::string type_key = prefix + "rope.scaling.type";
  ASSIGN_OR_RETURN(const std::optional<std::string_view> type, m.String(type_key));
  if (type && *type != "none") {
    return m.Error(type_key, absl::StrCat("is ", m.Find(type_key)->Describe(),
                                          ": RoPE scaling is not supported (supported: none)"));
  }
  for (const std::string& key : {prefix + "rope.scaling.factor", prefix + "rope.scale_linear"}) {
    const GgufValue* v = m.Find(key);
    if (v == nullptr) continue;
    const std::optional<double> f = v->AsFloat();
    if (!f || (*f != 0 && *f != 1)) {
      return m.Error(key, absl::StrCat("is ", v->Describe(),
                                       ": RoPE scaling is not supported (only 1, no scaling)"));
    }
  }
  return absl::OkStatus();
}

// The hyper-parameters and special tokens. vocab_size is the key, else the
// length of tokenizer.ggml.tokens, else `embedding_rows` (token_embd's rows;
// -1 when that tensor is missing or not a matrix).
absl::StatusOr<ModelConfig> ParseConfig(const GgufFile& file, Arch arch, int64_t embedding_rows) {
  const Metadata m(file);
  ModelConfig c;
  c.architecture = arch == Arch::kLlama ? "llama" : "qwen2";
  const std::string p = c.architecture + ".";
  c.source = file.path();
  ASSIGN_OR_RETURN(const std::optional<std::string_view> name, m.String("general.name"));
  c.name = name && !name->empty() ? std::string(*name)
                                  : std::filesystem::path(file.path()).stem().string();

  ASSIGN_OR_RETURN(c.n_layers, m.PositiveInt(p + "block_count"));
  ASSIGN_OR_RETURN(c.dim, m.PositiveInt(p + "embedding_length"));
  ASSIGN_OR_RETURN(c.hidden_dim, m.PositiveInt(p + "feed_forward_length"));
  ASSIGN_OR_RETURN(c.n_heads, m.PositiveInt(p + "attention.head_count"));
  ASSIGN_OR_RETURN(c.n_kv_heads, m.PositiveInt(p + "attention.head_count_kv", c.n_heads));
  ASSIGN_OR_RETURN(c.max_seq_len, m.PositiveInt(p + "context_length"));
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || (c.dim / c.n_heads) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": ", p, "embedding_length (", c.dim, ") must be a multiple of ", p,
        "attention.head_count (", c.n_heads, ") with an even quotient, and ", p,
        "attention.head_count a multiple of ", p, "attention.head_count_kv (", c.n_kv_heads, ")"));
  }
  // A head size of its own, or RoPE over part of each head, is not what the
  // backends compute.
  for (const char* key :
       {"rope.dimension_count", "attention.key_length", "attention.value_length"}) {
    ASSIGN_OR_RETURN(const int n, m.PositiveInt(p + key, c.head_dim()));
    if (n != c.head_dim()) {
      return m.Error(p + key, absl::StrCat("is ", m.Find(p + key)->Describe(), " but ", p,
                                           "embedding_length / ", p, "attention.head_count is ",
                                           c.head_dim(), ": only that is supported"));
    }
  }
  if (const GgufValue* v = m.Find(p + "expert_count"); v != nullptr && v->AsInt() != 0) {
    return m.Error(p + "expert_count", absl::StrCat("is ", v->Describe(),
                                                    ": mixture-of-experts models are not "
                                                    "supported"));
  }
  ASSIGN_OR_RETURN(const double eps, m.PositiveNumber(p + "attention.layer_norm_rms_epsilon"));
  ASSIGN_OR_RETURN(const double theta, m.PositiveNumber(p + "rope.freq_base", 10000.0));
  c.norm_eps = static_cast<float>(eps);
  c.rope_theta = static_cast<float>(theta);
  RETURN_IF_ERROR(CheckRopeScaling(m, p));

  // The vocabulary.
  if (m.Find(p + "vocab_size") != nullptr) {
    ASSIGN_OR_RETURN(c.vocab_size, m.PositiveInt(p + "vocab_size"));
  } else if (const GgufValue* tokens = m.Find("tokenizer.ggml.tokens"); tokens != nullptr) {
    if (!tokens->is_array() || tokens->size() == 0 ||
        tokens->size() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      return m.Error("tokenizer.ggml.tokens",
                     absl::StrCat("is ", tokens->Describe(),
                                  ", need a non-empty array (its length is the vocabulary size, ",
                                  p, "vocab_size being absent)"));
    }
    c.vocab_size = static_cast<int>(tokens->size());
  } else if (embedding_rows > 0 && embedding_rows <= std::numeric_limits<int32_t>::max()) {
    c.vocab_size = static_cast<int>(embedding_rows);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": no vocabulary size: ", p,
                     "vocab_size and tokenizer.ggml.tokens are missing, and so is a "
                     "token_embd.weight matrix"));
  }

  // Special tokens: end of sequence is eos, and eot (end of turn) too.
  ASSIGN_OR_RETURN(const std::optional<int32_t> bos,
                   m.TokenId("tokenizer.ggml.bos_token_id", c.vocab_size));
  if (bos) c.bos_token_id = *bos;
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    ASSIGN_OR_RETURN(const std::optional<int32_t> id, m.TokenId(key, c.vocab_size));
    if (id &&
        std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), *id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(*id);
    }
  }
  c.qkv_bias = arch == Arch::kQwen2;
  return c;
}

// ---------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------

std::string DimsString(const std::vector<int64_t>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

struct PlannedTensor {
  const GgufTensor* tensor;
  // > 0: the rows are `rope_heads` heads in rotate-half (NEOX) order (row
  // h*head_dim + a*half + i holds component a of pair i) and are stored
  // interleaved (row h*head_dim + 2i + a), the order the backends rotate.
  int rope_heads;
  int64_t offset;  // into the float32 buffer, in floats; or, when quantized, bytes
  // Kept in its block type (GgufLoadOptions::keep_quantized) in the byte
  // buffer, rows in the same order as the float ones would be.
  std::optional<QuantType> quantized = std::nullopt;
};

// The block types that may stay quantized (model.h), by ggml type.
std::optional<QuantType> KeepableType(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0:
      return QuantType::kQ8_0;
    case GgmlType::kQ4_0:
      return QuantType::kQ4_0;
    case GgmlType::kQ4_1:
      return QuantType::kQ4_1;
    case GgmlType::kQ4_K:
      return QuantType::kQ4_K;
    case GgmlType::kQ6_K:
      return QuantType::kQ6_K;
    default:
      return std::nullopt;
  }
}

// The buffers a loaded model's weight views point into.
struct GgufStorage {
  std::unique_ptr<float[]> floats;
  std::unique_ptr<uint8_t[]> bytes;
};

// Checks each tensor the model needs against the file (present, the shape
// the metadata implies, a type that dequantizes) and places it in one
// float32 buffer; then fills the buffer.
class TensorPlan {
 public:
  TensorPlan(const GgufFile& file, bool keep_quantized)
      : file_(file), keep_quantized_(keep_quantized) {}

  // The tensor `name`, which must have `dims` (ggml order: innermost first,
  // so a [out][in] matrix is {in, out}). Returns its index for Span() or,
  // for a `matrix` kept in its block type, Matrix().
  absl::StatusOr<size_t> Add(const std::string& name, std::vector<int64_t> dims, int rope_heads = 0,
                             bool matrix = false) {
    ASSIGN_OR_RETURN(const GgufTensor* t, Check(name, dims));
    names_.insert(t->name);
    const std::optional<QuantType> keep =
        keep_quantized_ && matrix && t->dims.size() == 2 ? KeepableType(t->type) : std::nullopt;
    if (keep.has_value()) {
      ASSIGN_OR_RETURN(const int64_t row_bytes, GgmlRowBytes(t->type, t->dims[0]));
      planned_.push_back({t, rope_heads, total_bytes_, keep});
      total_bytes_ += row_bytes * t->dims[1];
    } else {
      planned_.push_back({t, rope_heads, total_});
      total_ += t->num_elements;
    }
    return planned_.size() - 1;
  }

  // Like Add, for a tensor kept out of the buffer: its values, dequantized.
  absl::StatusOr<std::vector<float>> Read(const std::string& name, std::vector<int64_t> dims) {
    ASSIGN_OR_RETURN(const GgufTensor* t, Check(name, dims));
    names_.insert(t->name);
    std::vector<float> out(static_cast<size_t>(t->num_elements));
    RETURN_IF_ERROR(Dequantize(*t, 0, t->num_elements, out.data()));
    return out;
  }

  // Every tensor of the file must be one the model uses.
  absl::Status CheckNoneLeft(const ModelConfig& c) const {
    for (const GgufTensor& t : file_.tensors()) {
      if (names_.contains(t.name)) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          file_.path(), ": unexpected tensor ", t.name, " ", DimsString(t.dims),
          " (not part of the ", c.architecture, " model the metadata describes: ", c.n_layers,
          " blocks", c.architecture == "llama" ? ", no biases" : "", ")"));
    }
    return absl::OkStatus();
  }

  int64_t total_floats() const { return total_; }
  int64_t total_quantized_bytes() const { return total_bytes_; }

  // Allocates the buffers and dequantizes (or copies) every planned tensor
  // into them, over up to `threads` threads.
  absl::Status Fill(int threads) {
    buffer_.reset(new (std::nothrow) float[std::max<int64_t>(total_, 1)]);
    bytes_.reset(new (std::nothrow) uint8_t[std::max<int64_t>(total_bytes_, 1)]);
    if (buffer_ == nullptr || bytes_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(file_.path(), ": cannot allocate ",
                                                       (total_ * 4 + total_bytes_) / 1e9,
                                                       " GB for the weights"));
    }
    // Jobs of about a million elements, whole rows each, so that one large
    // tensor (the embedding) spreads over the threads too.
    struct Job {
      const PlannedTensor* p;
      int64_t row_begin, row_end;
    };
    std::vector<Job> jobs;
    for (const PlannedTensor& p : planned_) {
      const int64_t cols = p.tensor->dims.empty() ? 1 : p.tensor->dims[0];
      const int64_t rows = cols == 0 ? 0 : p.tensor->num_elements / cols;
      const int64_t step = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(cols, 1));
      for (int64_t r = 0; r < rows; r += step) jobs.push_back({&p, r, std::min(rows, r + step)});
    }
    std::atomic<size_t> next{0};
    std::mutex mu;
    absl::Status status;
    auto work = [&] {
      for (size_t j = next++; j < jobs.size(); j = next++) {
        absl::Status st = FillRows(*jobs[j].p, jobs[j].row_begin, jobs[j].row_end);
        if (!st.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (status.ok()) status = std::move(st);
        }
      }
    };
    const int n = std::clamp<int>(threads, 1, std::max<int>(1, static_cast<int>(jobs.size())));
    std::vector<std::thread> pool;
    for (int i = 1; i < n; ++i) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
    return status;
  }

  // A tensor planned in float32 (empty for one kept quantized).
  std::span<const float> Span(size_t index) const {
    const PlannedTensor& p = planned_[index];
    if (p.quantized.has_value()) return {};
    return {buffer_.get() + p.offset, static_cast<size_t>(p.tensor->num_elements)};
  }

  // A matrix kept in its block type (empty for one planned in float32).
  QuantizedMatrix Matrix(size_t index) const {
    const PlannedTensor& p = planned_[index];
    if (!p.quantized.has_value()) return {};
    return {.type = *p.quantized,
            .rows = p.tensor->dims[1],
            .cols = p.tensor->dims[0],
            .data = bytes_.get() + p.offset};
  }

  // The buffers, for the Model to own.
  std::shared_ptr<const void> TakeBuffers() {
    auto storage = std::make_shared<GgufStorage>();
    storage->floats = std::move(buffer_);
    storage->bytes = std::move(bytes_);
    return storage;
  }

 private:
  absl::StatusOr<const GgufTensor*> Check(const std::string& name,
                                          const std::vector<int64_t>& dims) const {
    const GgufTensor* t = file_.FindTensor(name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(file_.path(), ": missing tensor ", name));
    }
    if (t->dims != dims) {
      return absl::InvalidArgumentError(absl::StrCat(file_.path(), ": tensor ", name, " has dims ",
                                                     DimsString(t->dims), ", the metadata implies ",
                                                     DimsString(dims), " (innermost first)"));
    }
    if (!GgmlTypeCanDequantize(t->type)) {
      return absl::InvalidArgumentError(absl::StrCat(
          file_.path(), ": tensor ", name, " has type ",
          DescribeGgmlTypeId(static_cast<uint32_t>(t->type)),
          ", which is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
          "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)"));
    }
    return t;
  }

  // `count` elements of `t` from element `first` (whole rows), as float32.
  absl::Status Dequantize(const GgufTensor& t, int64_t first, int64_t count, float* dst) const {
    ASSIGN_OR_RETURN(const int64_t skip, GgmlRowBytes(t.type, first));
    absl::Status st = DequantizeToFloat(t.type, t.data + skip, count, dst);
    if (!st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat(file_.path(), ": tensor ", t.name, ": ", st.message()));
    }
    return absl::OkStatus();
  }

  // Rows [begin, end) of the destination of `p` (for a vector, the whole
  // vector: it is one row).
  absl::Status FillRows(const PlannedTensor& p, int64_t begin, int64_t end) const {
    const GgufTensor& t = *p.tensor;
    const int64_t cols = t.dims.empty() ? 1 : t.dims[0];
    if (p.quantized.has_value()) {
      // Whole rows of blocks, copied (and permuted as the float rows are).
      ASSIGN_OR_RETURN(const int64_t row_bytes, GgmlRowBytes(t.type, cols));
      const int64_t head_dim = p.rope_heads > 0 ? t.dims[1] / p.rope_heads : 0;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t src = p.rope_heads > 0 ? RopeSourceRow(r, head_dim) : r;
        std::memcpy(bytes_.get() + p.offset + r * row_bytes, t.data + src * row_bytes,
                    static_cast<size_t>(row_bytes));
      }
      return absl::OkStatus();
    }
    float* dst = buffer_.get() + p.offset;
    if (p.rope_heads == 0) {
      return Dequantize(t, begin * cols, (end - begin) * cols, dst + begin * cols);
    }
    if (t.dims.size() == 1) {
      // A bias, whose elements are what gets permuted. A quantized block
      // spans several of them, so the whole vector is converted first.
      std::vector<float> src(static_cast<size_t>(t.num_elements));
      RETURN_IF_ERROR(Dequantize(t, 0, t.num_elements, src.data()));
      const int64_t head_dim = t.num_elements / p.rope_heads;
      for (int64_t r = 0; r < t.num_elements; ++r) dst[r] = src[RopeSourceRow(r, head_dim)];
      return absl::OkStatus();
    }
    const int64_t head_dim = t.num_elements / cols / p.rope_heads;
    for (int64_t r = begin; r < end; ++r) {
      RETURN_IF_ERROR(Dequantize(t, RopeSourceRow(r, head_dim) * cols, cols, dst + r * cols));
    }
    return absl::OkStatus();
  }

  // The rotate-half row that interleaved row r reads: row h*head_dim + 2i + a
  // holds what row h*head_dim + a*half + i held (the inverse of llama2.c
  // export.py's permute(), as hf_model.cc applies it).
  static int64_t RopeSourceRow(int64_t r, int64_t head_dim) {
    const int64_t within = r % head_dim, half = head_dim / 2;
    return r - within + (within % 2) * half + within / 2;
  }

  const GgufFile& file_;
  std::vector<PlannedTensor> planned_;
  absl::flat_hash_set<std::string_view> names_;  // views of the file's tensor names
  const bool keep_quantized_;
  int64_t total_ = 0;        // floats
  int64_t total_bytes_ = 0;  // bytes of the matrices kept quantized
  std::unique_ptr<float[]> buffer_;
  std::unique_ptr<uint8_t[]> bytes_;
};

// Indices into the plan of one block's tensors.
struct LayerSlots {
  size_t attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  size_t bq = 0, bk = 0, bv = 0;  // with qkv_bias
};

absl::StatusOr<Model> Load(const GgufFile& file, const GgufLoadOptions& options,
                           GgufLoadReport* report) {
  const Metadata m(file);
  ASSIGN_OR_RETURN(const Arch arch, ParseArch(m));
  ASSIGN_OR_RETURN(const std::optional<std::string_view> chat_template,
                   m.String("tokenizer.chat_template"));
  const GgufTensor* embedding = file.FindTensor("token_embd.weight");
  const int64_t embedding_rows =
      embedding != nullptr && embedding->dims.size() == 2 ? embedding->dims[1] : -1;
  Model model;
  ASSIGN_OR_RETURN(model.config, ParseConfig(file, arch, embedding_rows));
  ModelConfig& c = model.config;

  // llama.cpp's converter permutes Llama's q/k rows from Hugging Face's
  // rotate-half order into interleaved pairs (ggml's "normal" RoPE), the
  // order the backends use; Qwen2's it leaves in rotate-half order (ggml's
  // NEOX RoPE), so those rows, and their biases, are permuted here.
  // (transformers' GGUF loader undoes the permutation for llama only.)
  const int q_heads = arch == Arch::kQwen2 ? c.n_heads : 0;
  const int k_heads = arch == Arch::kQwen2 ? c.n_kv_heads : 0;
  const int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  TensorPlan plan(file, options.keep_quantized);
  constexpr bool kMatrix = true;
  ASSIGN_OR_RETURN(const size_t token_embedding, plan.Add("token_embd.weight", {d, v}, 0, kMatrix));
  ASSIGN_OR_RETURN(const size_t final_norm, plan.Add("output_norm.weight", {d}));
  std::optional<size_t> classifier;
  c.tied_classifier = file.FindTensor("output.weight") == nullptr;
  if (!c.tied_classifier) {
    ASSIGN_OR_RETURN(classifier, plan.Add("output.weight", {d, v}, 0, kMatrix));
  }
  // Blocks are added as their tensors are found: the metadata may claim two
  // billion of them, and only the tensors can show it wrong.
  std::vector<LayerSlots> layers;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string b = absl::StrCat("blk.", l, ".");
    LayerSlots& s = layers.emplace_back();
    ASSIGN_OR_RETURN(s.attn_norm, plan.Add(b + "attn_norm.weight", {d}));
    ASSIGN_OR_RETURN(s.wq, plan.Add(b + "attn_q.weight", {d, d}, q_heads, kMatrix));
    ASSIGN_OR_RETURN(s.wk, plan.Add(b + "attn_k.weight", {d, kv}, k_heads, kMatrix));
    ASSIGN_OR_RETURN(s.wv, plan.Add(b + "attn_v.weight", {d, kv}, 0, kMatrix));
    ASSIGN_OR_RETURN(s.wo, plan.Add(b + "attn_output.weight", {d, d}, 0, kMatrix));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(s.bq, plan.Add(b + "attn_q.bias", {d}, q_heads));
      ASSIGN_OR_RETURN(s.bk, plan.Add(b + "attn_k.bias", {kv}, k_heads));
      ASSIGN_OR_RETURN(s.bv, plan.Add(b + "attn_v.bias", {kv}));
    }
    ASSIGN_OR_RETURN(s.ffn_norm, plan.Add(b + "ffn_norm.weight", {d}));
    ASSIGN_OR_RETURN(s.w1, plan.Add(b + "ffn_gate.weight", {d, h}, 0, kMatrix));
    ASSIGN_OR_RETURN(s.w3, plan.Add(b + "ffn_up.weight", {d, h}, 0, kMatrix));
    ASSIGN_OR_RETURN(s.w2, plan.Add(b + "ffn_down.weight", {h, d}, 0, kMatrix));
  }
  // Llama 3.1's RoPE frequency factors (llama.cpp reads them for llama only).
  if (arch == Arch::kLlama && file.FindTensor("rope_freqs.weight") != nullptr) {
    ASSIGN_OR_RETURN(std::vector<float> factors,
                     plan.Read("rope_freqs.weight", {c.head_dim() / 2}));
    for (size_t i = 0; i < factors.size(); ++i) {
      if (!std::isfinite(factors[i]) || !(factors[i] > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat(file.path(), ": tensor rope_freqs.weight: factor ", i, " is ", factors[i],
                         ", need a finite positive number"));
      }
    }
    c.rope_scaling.freq_factors = std::move(factors);
  }
  RETURN_IF_ERROR(plan.CheckNoneLeft(c));

  const unsigned cores = std::thread::hardware_concurrency();
  RETURN_IF_ERROR(plan.Fill(static_cast<int>(std::clamp(cores, 1u, 32u))));
  ModelWeights& w = model.weights;
  w.token_embedding = plan.Span(token_embedding);
  w.quantized_token_embedding = plan.Matrix(token_embedding);
  w.final_norm = plan.Span(final_norm);
  w.classifier = classifier ? plan.Span(*classifier) : w.token_embedding;
  w.quantized_classifier = classifier ? plan.Matrix(*classifier) : w.quantized_token_embedding;
  w.layers.resize(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerSlots& s = layers[l];
    LayerWeights& lw = w.layers[l];
    lw.attn_norm = plan.Span(s.attn_norm);
    lw.wq = plan.Span(s.wq);
    lw.wk = plan.Span(s.wk);
    lw.wv = plan.Span(s.wv);
    lw.wo = plan.Span(s.wo);
    lw.ffn_norm = plan.Span(s.ffn_norm);
    lw.w1 = plan.Span(s.w1);
    lw.w2 = plan.Span(s.w2);
    lw.w3 = plan.Span(s.w3);
    lw.quantized = {.wq = plan.Matrix(s.wq),
                    .wk = plan.Matrix(s.wk),
                    .wv = plan.Matrix(s.wv),
                    .wo = plan.Matrix(s.wo),
                    .w1 = plan.Matrix(s.w1),
                    .w2 = plan.Matrix(s.w2),
                    .w3 = plan.Matrix(s.w3)};
    if (c.qkv_bias) {
      lw.bq = plan.Span(s.bq);
      lw.bk = plan.Span(s.bk);
      lw.bv = plan.Span(s.bv);
    }
  }
  model.storage = plan.TakeBuffers();

  if (report != nullptr) {
    report->file_bytes = static_cast<int64_t>(file.file_size());
    report->weight_bytes =
        plan.total_floats() * static_cast<int64_t>(sizeof(float)) + plan.total_quantized_bytes();
    report->quantized_bytes = plan.total_quantized_bytes();
    report->tensors_by_type.clear();
    for (const GgufTensor& t : file.tensors()) ++report->tensors_by_type[GgmlTypeName(t.type)];
    report->chat_template = chat_template ? std::string(*chat_template) : "";
  }
  return model;
}

}  // namespace

absl::StatusOr<Model> LoadGgufModel(const std::string& path, GgufLoadReport* report,
                                    const GgufLoadOptions& options) {
  ASSIGN_OR_RETURN(const GgufFile file, GgufFile::Open(path));
  return Load(file, options, report);
}

bool IsGgufFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == "GGUF";
}

}  // namespace coalesce::engine
