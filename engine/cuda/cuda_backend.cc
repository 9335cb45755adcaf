// The CUDA backend (cuda_backend.h). One step, for `rows` tokens of `seqs`
// sequences, enqueues on one stream:
//
//   embed -> for each layer:
//              RMSNorm (+ previous residual)  -> x_norm      [rows, dim]   T
//              cuBLAS  x_norm . Wqkv^T         -> qkv         [rows, q+2kv] f32
//              RoPE, K/V into the paged cache
//              paged attention (+ combine)     -> att         [rows, dim]   T
//              cuBLAS  att . Wo^T              -> delta       [rows, dim]   f32
//              RMSNorm (+ residual, + bias)    -> x_norm
//              cuBLAS  x_norm . W13^T          -> gate_up     [rows, 2h]    f32
//              SwiGLU                          -> act         [rows, h]     T
//              cuBLAS  act . W2^T              -> delta
//         -> final RMSNorm of each sequence's last row (+ residual) -> last [seqs, dim] T
//         -> cuBLAS last . classifier^T        -> logits      [seqs, vocab] f32
//         -> sampling                          -> tokens      [seqs]        int32
//
// The per-step inputs (token ids, positions, KV slots, block tables,
// sampling) travel in one host-to-device copy into buffers whose addresses
// never change, so a decode step can replay a CUDA graph captured for its
// batch-size bucket: a batch of n decoding sequences runs as the smallest
// bucket >= n, the extra rows decoding a dummy token into a scratch KV block.
// Where the head size allows (cuda::SplitAttentionSupported), attention cuts
// each token's context into splits of a fixed number of positions
// (split_size_), so that a token's result is the same in any batch; a graph
// is then captured per (bucket, splits of the longest context, rounded up:
// NumSplits).
// ("cuBLAS" above: a step of one token takes the skinny product of
// cuda/kernels.h instead, which reads the weights faster; see Gemm.)
#include "engine/cuda/cuda_backend.h"

#include <cublas_v2.h>  // types only: the library is loaded with dlopen (LoadCublas)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/cuda/kernels.h"
#include "engine/cuda/runtime.h"

namespace coalesce::engine {
namespace {

using cuda::CublasApi;
using cuda::CublasError;
using cuda::DeviceBuffer;
using cuda::LoadCublas;
using cuda::PinnedBuffer;

// CUDA_RETURN_IF_ERROR comes with runtime.h; this one reports through the
// backend's cublas_api_.
#define CUBLAS_RETURN_IF_ERROR(expr)                                       \
  do {                                                                     \
    if (const cublasStatus_t st_ = (expr); st_ != CUBLAS_STATUS_SUCCESS) { \
      return CublasError(*cublas_api_, st_, #expr);                        \
    }                                                                      \
  } while (false)

// One layer's weights on the device; T is the backend's storage type.
struct Layer {
  DeviceBuffer attn_norm, ffn_norm;  // f32 [dim]
  DeviceBuffer wqkv;                 // T [q_dim + 2 kv_dim, dim]: wq, wk, wv
  DeviceBuffer bqkv;                 // f32 [q_dim + 2 kv_dim], when qkv_bias
  DeviceBuffer wo;                   // T [dim, dim]
  DeviceBuffer bo;                   // f32 [dim], when o_bias
  DeviceBuffer w13;                  // T [2 hidden, dim]: gate (w1), up (w3)
  DeviceBuffer w2;                   // T [dim, hidden]
};

// ---------------------------------------------------------------------------
// Precision
// ---------------------------------------------------------------------------

template <typename T>
struct TypeInfo;
template <>
struct TypeInfo<float> {
  static constexpr cudaDataType_t kCublas = CUDA_R_32F;
  static constexpr Precision kPrecision = Precision::kFp32;
};
template <>
struct TypeInfo<__half> {
  static constexpr cudaDataType_t kCublas = CUDA_R_16F;
  static constexpr Precision kPrecision = Precision::kFp16;
};
template <>
struct TypeInfo<__nv_bfloat16> {
  static constexpr cudaDataType_t kCublas = CUDA_R_16BF;
  static constexpr Precision kPrecision = Precision::kBf16;
};

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Batch-size buckets of the decode graphs: 1, 2, 4, ..., and max_seqs.
int DecodeBucket(int n, int max_seqs) {
  int bucket = 1;
  while (bucket < n) bucket *= 2;
  return std::min(bucket, max_seqs);
}

// Positions per attention split: `asked` (0: 128, four tiles of the split
// kernel), or more where the longest context would otherwise need more than
// cuda::kMaxSplits splits.
int SplitSize(int asked, int max_seq_len) {
  const int most = (max_seq_len + cuda::kMaxSplits - 1) / cuda::kMaxSplits;
  return std::max(asked > 0 ? asked : 128,
                  (most + cuda::kSplitTile - 1) / cuda::kSplitTile * cuda::kSplitTile);
}

// ---------------------------------------------------------------------------
// The backend
// ---------------------------------------------------------------------------

template <typename T>
class CudaBackend final : public Backend {
 public:
  CudaBackend(std::shared_ptr<const Model> model, const CudaBackendOptions& options)
      : model_(std::move(model)), c_(model_->config), options_(options) {}
  ~CudaBackend() override;

  absl::Status Init();

  absl::Status Step(const StepBatch& batch, std::span<float> logits) override {
    return Run(batch, {}, logits, {});
  }
  absl::Status StepAndSample(const StepBatch& batch, std::span<const SampleSpec> sampling,
                             std::span<int32_t> tokens) override {
    RETURN_IF_ERROR(CheckSampleSizes(batch, sampling.size(), tokens.size()));
    return Run(batch, sampling, {}, tokens);
  }
  // Copies on the step's stream: after every step enqueued before, before
  // every one after.
  absl::Status CopyBlocks(std::span<const BlockCopy> copies) override;
  BackendCapabilities capabilities() const override {
    return {.runs_model = true,
            .weights_in_host_memory = false,
            .overlap_pays = true,
            .copies_blocks = true};
  }
  const ModelConfig& config() const override { return c_; }
  const KvCacheConfig& kv_cache() const override { return kv_; }
  std::string_view name() const override { return "cuda"; }
  std::string Describe() const override;
  int64_t weight_bytes() const override { return weight_bytes_; }
  int64_t kv_bytes_per_token() const override {
    return KvBlockBytes(c_, 1, TypeInfo<T>::kPrecision);
  }

 private:
  // Offsets, in int32 units, of the per-step inputs within meta_/meta_host_.
  struct MetaLayout {
    size_t tokens, positions, token_seq, slots, last_row, specs, block_tables, total;
  };

  absl::Status UploadWeights();
  absl::Status RandomWeights();
  // Copies `parts` (float spans) one after another into `dst` as T.
  absl::Status UploadMatrix(std::initializer_list<std::span<const float>> parts, DeviceBuffer& dst);
  absl::Status UploadFloat(std::span<const float> src, DeviceBuffer& dst);
  absl::Status AllocateActivations();
  absl::Status AllocateKvCache();

  // Validates the step and lays out its inputs in meta_host_, then Execute.
  absl::Status Run(const StepBatch& batch, std::span<const SampleSpec> sampling,
                   std::span<float> logits, std::span<int32_t> tokens);
  // Copies the inputs up, runs the step (a graph for a captured decode
  // bucket), and copies the tokens (or, without sampling, the logits) back.
  absl::Status Execute(size_t meta_bytes, int rows, int seqs, bool decode, int n, int splits,
                       std::span<float> logits, std::span<int32_t> tokens);
  // Enqueues the forward pass (and the sampling when `sample`) for the
  // inputs already in meta_.
  absl::Status Forward(int rows, int seqs, bool sample, int splits);
  absl::Status Gemm(const T* x, int rows, int in, const T* w, int out, float* y);
  // The attention splits of a step of `rows` tokens whose longest context is
  // `context` positions (a graph's: its rounded count).
  int NumSplits(int rows, int context, bool graph) const;
  // With options_.stage_times: records an event that ends `stage` (nullptr:
  // the start of the step).
  absl::Status Mark(const char* stage);
  absl::Status CaptureDecodeGraph(int bucket, int splits);
  absl::Status Check(absl::Status status);  // records a lost device

  T* KCache(int layer) const {
    return kv_cache_.get<T>() + (int64_t{layer} * 2) * kv_slots_ * c_.kv_dim();
  }
  T* VCache(int layer) const {
    return kv_cache_.get<T>() + (int64_t{layer} * 2 + 1) * kv_slots_ * c_.kv_dim();
  }

  const std::shared_ptr<const Model> model_;
  const ModelConfig& c_;
  const CudaBackendOptions options_;
  KvCacheConfig kv_;
  cudaDeviceProp props_{};
  cudaStream_t stream_ = nullptr;
  const CublasApi* cublas_api_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  absl::Status lost_ = absl::OkStatus();  // set once the device is unusable

  // Weights.
  DeviceBuffer embedding_, classifier_, final_norm_;  // classifier_ empty when tied
  std::vector<Layer> layers_;
  int64_t weight_bytes_ = 0;
  DeviceBuffer rope_cos_, rope_sin_;  // f32 [max_seq_len, head_dim / 2]

  // Activations, sized for max_batch_tokens rows and max_seqs sequences.
  int max_rows_ = 0, max_seqs_ = 0, max_blocks_per_seq_ = 0, partial_capacity_ = 0;
  int split_size_ = 0;  // AttentionShape::split_size: 0 for the count-based splits
  DeviceBuffer x_, delta_, x_norm_, qkv_, att_, gate_up_, act_, last_;
  DeviceBuffer partial_out_, partial_ml_, logits_, probs_, next_tokens_;
  DeviceBuffer cublas_workspace_;
  MetaLayout meta_layout_{};
  DeviceBuffer meta_;
  PinnedBuffer meta_host_, tokens_host_;

  // KV cache: [n_layers][K, V][kv_slots_][kv_dim]; the last block is scratch
  // for the padding rows of a graph bucket.
  DeviceBuffer kv_cache_;
  int64_t kv_slots_ = 0;

  std::map<std::pair<int, int>, cudaGraphExec_t> graphs_;  // (bucket, splits) -> graph
  std::vector<int32_t> block_owner_;                       // ValidateStep's scratch
  std::vector<cudaEvent_t> marks_;                         // Mark's events, reused each step
  std::vector<const char*> mark_names_;                    // [marks_.size()] the stage each ends
  size_t num_marks_ = 0;                                   // marks recorded in this step
};

template <typename T>
CudaBackend<T>::~CudaBackend() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  for (cudaEvent_t event : marks_) cudaEventDestroy(event);
  if (cublas_ != nullptr) cublas_api_->destroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

template <typename T>
absl::Status CudaBackend<T>::Check(absl::Status status) {
  if (status.code() == kDeviceLostCode && lost_.ok()) lost_ = status;
  return status;
}

template <typename T>
absl::Status CudaBackend<T>::CopyBlocks(std::span<const BlockCopy> copies) {
  if (!lost_.ok()) return lost_;
  if (absl::Status s = ValidateBlockCopies(kv_, copies); !s.ok()) return s;
  // The caller's thread may not be the one that made the backend (Execute).
  CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  // A block's K (or V) of one layer is block_size contiguous slots, and the
  // 2 * n_layers slabs of the cache are kv_slots_ slots apart: one strided
  // copy per block.
  const size_t block = size_t{sizeof(T)} * kv_.block_size * c_.kv_dim();
  const size_t pitch = size_t{sizeof(T)} * kv_slots_ * c_.kv_dim();
  char* base = kv_cache_.get<char>();
  for (const BlockCopy& c : copies) {
    const cudaError_t err =
        cudaMemcpy2DAsync(base + block * c.to, pitch, base + block * c.from, pitch, block,
                          size_t{2} * c_.n_layers, cudaMemcpyDeviceToDevice, stream_);
    if (err != cudaSuccess) return Check(cuda::CudaError(err, "cudaMemcpy2DAsync"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::Init() {
  kv_.block_size = options_.block_size;
  kv_.dtype = KvDtypeOf(TypeInfo<T>::kPrecision);
  CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props_, options_.device));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  absl::StatusOr<const CublasApi*> cublas = LoadCublas();
  if (!cublas.ok()) return cublas.status();
  cublas_api_ = *cublas;
  CUBLAS_RETURN_IF_ERROR(cublas_api_->create(&cublas_));
  CUBLAS_RETURN_IF_ERROR(cublas_api_->set_stream(cublas_, stream_));
  // Our own workspace, so that cuBLAS allocates nothing while a graph is
  // being captured.
  if (absl::Status s = cublas_workspace_.Allocate(kCublasWorkspaceBytes); !s.ok()) return s;
  CUBLAS_RETURN_IF_ERROR(
      cublas_api_->set_workspace(cublas_, cublas_workspace_.get<void>(), kCublasWorkspaceBytes));
  CUDA_RETURN_IF_ERROR(cuda::ConfigureAttention<T>(c_.head_dim(), c_.n_heads / c_.n_kv_heads));

  absl::Status status = options_.random_weights ? RandomWeights() : UploadWeights();
  if (!status.ok()) return status;

  // RoPE tables exactly as the CPU backend builds them.
  const int half = c_.head_dim() / 2;
  const std::vector<float> inv_freq = RopeInverseFrequencies(c_);
  std::vector<float> cos(static_cast<size_t>(c_.max_seq_len) * half), sin(cos.size());
  for (int pos = 0; pos < c_.max_seq_len; ++pos) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos) * inv_freq[i];
      cos[static_cast<size_t>(pos) * half + i] = std::cos(angle);
      sin[static_cast<size_t>(pos) * half + i] = std::sin(angle);
    }
  }
  if (status = UploadFloat(cos, rope_cos_); !status.ok()) return status;
  if (status = UploadFloat(sin, rope_sin_); !status.ok()) return status;

  if (status = AllocateActivations(); !status.ok()) return status;
  if (status = AllocateKvCache(); !status.ok()) return status;
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::UploadFloat(std::span<const float> src, DeviceBuffer& dst) {
  if (absl::Status s = dst.Allocate(src.size_bytes()); !s.ok()) return s;
  // On stream_, like everything else: a plain cudaMemcpy runs on the legacy
  // default stream, which a non-blocking stream does not wait for, and from
  // pageable memory it can return before the data has reached the device.
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.get<float>(), src.data(), src.size_bytes(),
                                       cudaMemcpyHostToDevice, stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::UploadMatrix(std::initializer_list<std::span<const float>> parts,
                                          DeviceBuffer& dst) {
  size_t total = 0, largest = 0;
  for (const auto& part : parts) {
    total += part.size();
    largest = std::max(largest, part.size());
  }
  if (absl::Status s = dst.Allocate(total * sizeof(T)); !s.ok()) return s;
  weight_bytes_ += static_cast<int64_t>(total * sizeof(T));
  // Each part goes up as float and is converted on the device.
  DeviceBuffer staging;
  if (absl::Status s = staging.Allocate(largest * sizeof(float)); !s.ok()) return s;
  size_t offset = 0;
  for (const auto& part : parts) {
    // The copy and the conversion both on stream_, in order (see UploadFloat).
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.get<float>(), part.data(), part.size_bytes(),
                                         cudaMemcpyHostToDevice, stream_));
    CUDA_RETURN_IF_ERROR(cuda::ConvertFromFloat<T>(
        staging.get<float>(), static_cast<int64_t>(part.size()), dst.get<T>() + offset, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));  // before staging is reused
    offset += part.size();
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::UploadWeights() {
  const ModelWeights& w = model_->weights;
  absl::Status s = UploadMatrix({w.token_embedding}, embedding_);
  if (!s.ok()) return s;
  if (w.classifier.data() != w.token_embedding.data()) {
    // A step reads a few rows of the embedding but all of the classifier:
    // only the classifier counts towards the bytes a step reads.
    weight_bytes_ -= static_cast<int64_t>(w.token_embedding.size() * sizeof(T));
    if (s = UploadMatrix({w.classifier}, classifier_); !s.ok()) return s;
  }
  if (s = UploadFloat(w.final_norm, final_norm_); !s.ok()) return s;
  layers_ = std::vector<Layer>(c_.n_layers);
  for (int l = 0; l < c_.n_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    Layer& d = layers_[l];
    if (s = UploadFloat(lw.attn_norm, d.attn_norm); !s.ok()) return s;
    if (s = UploadFloat(lw.ffn_norm, d.ffn_norm); !s.ok()) return s;
    if (s = UploadMatrix({lw.wq, lw.wk, lw.wv}, d.wqkv); !s.ok()) return s;
    if (s = UploadMatrix({lw.wo}, d.wo); !s.ok()) return s;
    if (s = UploadMatrix({lw.w1, lw.w3}, d.w13); !s.ok()) return s;
    if (s = UploadMatrix({lw.w2}, d.w2); !s.ok()) return s;
    if (c_.qkv_bias) {
      std::vector<float> bias(lw.bq.begin(), lw.bq.end());
      bias.insert(bias.end(), lw.bk.begin(), lw.bk.end());
      bias.insert(bias.end(), lw.bv.begin(), lw.bv.end());
      if (s = UploadFloat(bias, d.bqkv); !s.ok()) return s;
    }
    if (c_.o_bias) {
      if (s = UploadFloat(lw.bo, d.bo); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::RandomWeights() {
  uint64_t seed = options_.random_seed;
  auto fill = [&](DeviceBuffer& dst, int64_t rows, int64_t cols, bool count) -> absl::Status {
    if (absl::Status s = dst.Allocate(rows * cols * sizeof(T)); !s.ok()) return s;
    if (count) weight_bytes_ += rows * cols * static_cast<int64_t>(sizeof(T));
    CUDA_RETURN_IF_ERROR(cuda::FillUniform<T>(dst.get<T>(), rows * cols, ++seed,
                                              1.0f / std::sqrt(static_cast<float>(cols)), 0.0f,
                                              stream_));
    return absl::OkStatus();
  };
  auto ones = [&](DeviceBuffer& dst, int64_t n) -> absl::Status {
    if (absl::Status s = dst.Allocate(n * sizeof(float)); !s.ok()) return s;
    CUDA_RETURN_IF_ERROR(
        cuda::FillUniform<float>(dst.get<float>(), n, ++seed, 0.0f, 1.0f, stream_));
    return absl::OkStatus();
  };
  const int64_t dim = c_.dim, q = c_.n_heads * c_.head_dim(), kv = c_.kv_dim(), h = c_.hidden_dim;
  absl::Status s = fill(embedding_, c_.vocab_size, dim, c_.tied_classifier);
  if (s.ok() && !c_.tied_classifier) s = fill(classifier_, c_.vocab_size, dim, true);
  if (s.ok()) s = ones(final_norm_, dim);
  layers_ = std::vector<Layer>(c_.n_layers);
  for (int l = 0; l < c_.n_layers && s.ok(); ++l) {
    Layer& d = layers_[l];
    s = ones(d.attn_norm, dim);
    if (s.ok()) s = ones(d.ffn_norm, dim);
    if (s.ok()) s = fill(d.wqkv, q + 2 * kv, dim, true);
    if (s.ok()) s = fill(d.wo, dim, q, true);
    if (s.ok()) s = fill(d.w13, 2 * h, dim, true);
    if (s.ok()) s = fill(d.w2, dim, h, true);
    if (s.ok() && c_.qkv_bias) s = ones(d.bqkv, q + 2 * kv);
    if (s.ok() && c_.o_bias) s = ones(d.bo, dim);
  }
  return s;
}

template <typename T>
int CudaBackend<T>::NumSplits(int rows, int context, bool graph) const {
  if (split_size_ > 0) {
    int splits = std::max(1, (context + split_size_ - 1) / split_size_);
    if (graph) {
      // A graph per count would be many: round up to 1, 2, 3, 4, 6, 8, 12,
      // ... (at most a third of the splits past the contexts, which end at
      // once).
      int rounded = 1;
      while (rounded < splits) {
        if (rounded >= 2 && rounded * 3 / 2 >= splits) {
          rounded = rounded * 3 / 2;
          break;
        }
        rounded *= 2;
      }
      splits = std::min(rounded, partial_capacity_ / max_rows_);
    }
    return splits;
  }
  // Enough (token, KV head, split) blocks for two waves over the
  // multiprocessors; long prompts need no split.
  const int blocks = std::max(1, rows * c_.n_kv_heads);
  int splits = (2 * props_.multiProcessorCount + blocks - 1) / blocks;
  splits = std::clamp(splits, 1, cuda::kMaxSplits);
  return std::max(1, std::min(splits, partial_capacity_ / std::max(rows, 1)));
}

template <typename T>
absl::Status CudaBackend<T>::AllocateActivations() {
  max_rows_ = std::max(options_.max_batch_tokens, 1);
  max_seqs_ = std::clamp(options_.max_seqs, 1, max_rows_);
  max_blocks_per_seq_ = (c_.max_seq_len + kv_.block_size - 1) / kv_.block_size;
  // Fixed-size splits: every row may need the most splits. Otherwise the
  // count shrinks as rows grow (NumSplits).
  if (options_.fixed_size_splits && cuda::SplitAttentionSupported(c_.head_dim())) {
    split_size_ = SplitSize(options_.attention_split_size, c_.max_seq_len);
    partial_capacity_ = max_rows_ * ((c_.max_seq_len + split_size_ - 1) / split_size_);
  } else {
    split_size_ = 0;
    partial_capacity_ = max_rows_ + 2 * props_.multiProcessorCount;
  }
  const int64_t rows = max_rows_, seqs = max_seqs_, dim = c_.dim, h = c_.hidden_dim;
  const int64_t qkv_width = c_.n_heads * c_.head_dim() + 2 * c_.kv_dim();
  const std::pair<DeviceBuffer*, int64_t> buffers[] = {
      {&x_, rows * dim * 4},
      {&delta_, rows * dim * 4},
      {&x_norm_, rows * dim * int64_t{sizeof(T)}},
      {&qkv_, rows * qkv_width * 4},
      {&att_, rows * dim * int64_t{sizeof(T)}},
      {&gate_up_, rows * 2 * h * 4},
      {&act_, rows * h * int64_t{sizeof(T)}},
      {&last_, seqs * dim * int64_t{sizeof(T)}},
      {&partial_out_, int64_t{partial_capacity_} * c_.n_heads * c_.head_dim() * 4},
      {&partial_ml_, int64_t{partial_capacity_} * c_.n_heads * 2 * 4},
      {&logits_, seqs * c_.vocab_size * 4},
      {&probs_, seqs * c_.vocab_size * 4},
      {&next_tokens_, seqs * 4},
  };
  for (const auto& [buffer, bytes] : buffers) {
    if (absl::Status s = buffer->Allocate(bytes); !s.ok()) return s;
  }
  static_assert(sizeof(cuda::DeviceSampleSpec) == 4 * sizeof(int32_t));
  MetaLayout& m = meta_layout_;
  m.tokens = 0;
  m.positions = m.tokens + rows;
  m.token_seq = m.positions + rows;
  m.slots = m.token_seq + rows;
  m.last_row = m.slots + rows;
  m.specs = m.last_row + seqs;
  m.block_tables = m.specs + 4 * seqs;
  m.total = m.block_tables + seqs * max_blocks_per_seq_;
  if (absl::Status s = meta_.Allocate(m.total * sizeof(int32_t)); !s.ok()) return s;
  if (absl::Status s = meta_host_.Allocate(m.total * sizeof(int32_t)); !s.ok()) return s;
  return tokens_host_.Allocate(seqs * sizeof(int32_t));
}

template <typename T>
absl::Status CudaBackend<T>::AllocateKvCache() {
  const int64_t block_bytes = kv_bytes_per_token() * kv_.block_size;
  int64_t num_blocks = options_.num_blocks;
  if (num_blocks <= 0) {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    num_blocks =
        static_cast<int64_t>(options_.kv_memory_fraction * static_cast<double>(free_bytes)) /
            block_bytes -
        1;
  }
  // The block allocator counts blocks in int32; the scratch block is extra.
  num_blocks = std::min<int64_t>(num_blocks, (int64_t{1} << 30));
  if (num_blocks < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no device memory left for the KV cache (a block of ", kv_.block_size,
                     " positions takes ", block_bytes, " bytes)"));
  }
  kv_.num_blocks = static_cast<int>(num_blocks);
  kv_slots_ = (num_blocks + 1) * kv_.block_size;
  if (absl::Status s = kv_cache_.Allocate((num_blocks + 1) * block_bytes); !s.ok()) return s;
  if (options_.fill_kv_cache_random) {
    CUDA_RETURN_IF_ERROR(cuda::FillUniform<T>(kv_cache_.get<T>(),
                                              static_cast<int64_t>(kv_cache_.bytes() / sizeof(T)),
                                              options_.random_seed + 7777, 1.0f, 0.0f, stream_));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::Mark(const char* stage) {
  if (options_.stage_times == nullptr) return absl::OkStatus();
  if (num_marks_ == marks_.size()) {
    cudaEvent_t event = nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventCreate(&event));
    marks_.push_back(event);
    mark_names_.push_back(nullptr);
  }
  mark_names_[num_marks_] = stage;
  CUDA_RETURN_IF_ERROR(cudaEventRecord(marks_[num_marks_++], stream_));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::Gemm(const T* x, int rows, int in, const T* w, int out, float* y) {
  if (rows <= std::min(options_.skinny_gemm_rows, cuda::kMaxSkinnyRows) &&
      cuda::SkinnyGemmSupported<T>(in)) {
    CUDA_RETURN_IF_ERROR(cuda::SkinnyGemm<T>(x, rows, in, w, out, y, stream_));
    return absl::OkStatus();
  }
  // Row-major y[rows, out] = x[rows, in] . w[out, in]^T is, column-major,
  // y^T[out, rows] = (w viewed as [in, out])^T . (x viewed as [in, rows]).
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_RETURN_IF_ERROR(cublas_api_->gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in,
                                              &alpha, w, TypeInfo<T>::kCublas, in, x,
                                              TypeInfo<T>::kCublas, in, &beta, y, CUDA_R_32F, out,
                                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::Forward(int rows, int seqs, bool sample, int splits) {
  const int32_t* meta = meta_.get<int32_t>();
  const MetaLayout& m = meta_layout_;
  const int dim = c_.dim, hidden = c_.hidden_dim, hd = c_.head_dim();
  const int qkv_width = c_.n_heads * hd + 2 * c_.kv_dim();
  const float eps = c_.norm_eps;
  float* x = x_.get<float>();
  float* delta = delta_.get<float>();
  float* qkv = qkv_.get<float>();
  T* x_norm = x_norm_.get<T>();

  cuda::AttentionShape shape;
  shape.rows = rows;
  shape.n_heads = c_.n_heads;
  shape.n_kv_heads = c_.n_kv_heads;
  shape.head_dim = hd;
  shape.block_size = kv_.block_size;
  shape.max_blocks_per_seq = max_blocks_per_seq_;
  shape.num_splits = splits;
  shape.split_size = split_size_;
  shape.q_stride = qkv_width;

  num_marks_ = 0;
  RETURN_IF_ERROR(Mark(nullptr));
  CUDA_RETURN_IF_ERROR(
      cuda::EmbedTokens<T>(embedding_.get<T>(), meta + m.tokens, rows, dim, x, stream_));
  RETURN_IF_ERROR(Mark("embedding"));
  for (int l = 0; l < c_.n_layers; ++l) {
    const Layer& w = layers_[l];
    // Attention block; the first norm also adds the previous layer's output.
    CUDA_RETURN_IF_ERROR(cuda::RmsNorm<T>(x, l == 0 ? nullptr : delta, nullptr,
                                          w.attn_norm.get<float>(), nullptr, rows, dim, eps, x_norm,
                                          stream_));
    RETURN_IF_ERROR(Mark("rmsnorm"));
    RETURN_IF_ERROR(Gemm(x_norm, rows, dim, w.wqkv.get<T>(), qkv_width, qkv));
    RETURN_IF_ERROR(Mark("qkv projection"));
    CUDA_RETURN_IF_ERROR(cuda::RopeAndCacheKv<T>(
        qkv, c_.qkv_bias ? w.bqkv.get<float>() : nullptr, rope_cos_.get<float>(),
        rope_sin_.get<float>(), meta + m.positions, meta + m.slots, rows, c_.n_heads, c_.n_kv_heads,
        hd, KCache(l), VCache(l), stream_));
    RETURN_IF_ERROR(Mark("rope + kv write"));
    CUDA_RETURN_IF_ERROR(cuda::PagedAttention<T>(
        qkv, KCache(l), VCache(l), meta + m.positions, meta + m.token_seq, meta + m.block_tables,
        shape, partial_out_.get<float>(), partial_ml_.get<float>(), att_.get<T>(), stream_));
    RETURN_IF_ERROR(Mark("attention"));
    RETURN_IF_ERROR(Gemm(att_.get<T>(), rows, dim, w.wo.get<T>(), dim, delta));
    RETURN_IF_ERROR(Mark("output projection"));
    // Feed-forward block.
    CUDA_RETURN_IF_ERROR(cuda::RmsNorm<T>(x, delta, c_.o_bias ? w.bo.get<float>() : nullptr,
                                          w.ffn_norm.get<float>(), nullptr, rows, dim, eps, x_norm,
                                          stream_));
    RETURN_IF_ERROR(Mark("rmsnorm"));
    RETURN_IF_ERROR(Gemm(x_norm, rows, dim, w.w13.get<T>(), 2 * hidden, gate_up_.get<float>()));
    RETURN_IF_ERROR(Mark("gate/up projection"));
    CUDA_RETURN_IF_ERROR(
        cuda::SwiGlu<T>(gate_up_.get<float>(), rows, hidden, act_.get<T>(), stream_));
    RETURN_IF_ERROR(Mark("swiglu"));
    RETURN_IF_ERROR(Gemm(act_.get<T>(), rows, hidden, w.w2.get<T>(), dim, delta));
    RETURN_IF_ERROR(Mark("down projection"));
  }
  // The last row of each sequence: final norm (+ the last residual),
  // classifier, sampling.
  CUDA_RETURN_IF_ERROR(cuda::RmsNorm<T>(x, delta, nullptr, final_norm_.get<float>(),
                                        meta + m.last_row, seqs, dim, eps, last_.get<T>(),
                                        stream_));
  RETURN_IF_ERROR(Mark("final rmsnorm"));
  const T* classifier = classifier_.bytes() > 0 ? classifier_.get<T>() : embedding_.get<T>();
  RETURN_IF_ERROR(Gemm(last_.get<T>(), seqs, dim, classifier, c_.vocab_size, logits_.get<float>()));
  RETURN_IF_ERROR(Mark("classifier"));
  if (sample) {
    CUDA_RETURN_IF_ERROR(cuda::SampleTokens(
        logits_.get<float>(), reinterpret_cast<const cuda::DeviceSampleSpec*>(meta + m.specs), seqs,
        c_.vocab_size, probs_.get<float>(), next_tokens_.get<int32_t>(), stream_));
    RETURN_IF_ERROR(Mark("sampling"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::CaptureDecodeGraph(int bucket, int splits) {
  cudaGraph_t graph = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status forward = Forward(bucket, bucket, /*sample=*/true, splits);
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  if (!forward.ok()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return forward;
  }
  CUDA_RETURN_IF_ERROR(end);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiate = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  CUDA_RETURN_IF_ERROR(instantiate);
  graphs_[{bucket, splits}] = exec;
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaBackend<T>::Run(const StepBatch& batch, std::span<const SampleSpec> sampling,
                                 std::span<float> logits, std::span<int32_t> tokens) {
  if (!lost_.ok()) return lost_;
  const int n = static_cast<int>(batch.seqs.size());
  const int total = static_cast<int>(batch.tokens.size());
  const bool sample = !tokens.empty();
  if (!sample && logits.size() < static_cast<size_t>(n) * c_.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits has ", logits.size(),
        " floats, need num_seqs * vocab_size = ", static_cast<int64_t>(n) * c_.vocab_size));
  }
  if (absl::Status s = ValidateStep(c_, kv_, batch, block_owner_); !s.ok()) return s;
  if (total > max_rows_ || n > max_seqs_) {
    return absl::InvalidArgumentError(absl::StrCat("step of ", total, " tokens in ", n,
                                                   " sequences exceeds the backend's ", max_rows_,
                                                   " tokens and ", max_seqs_, " sequences"));
  }
  if (total == 0) return absl::OkStatus();

  // A decode step (one token per sequence) runs as its bucket's graph.
  bool decode = sample && options_.cuda_graphs && options_.stage_times == nullptr;
  for (const SequenceStep& seq : batch.seqs) decode = decode && seq.num_tokens == 1;
  const int seqs = decode ? DecodeBucket(n, max_seqs_) : n;
  const int rows = decode ? seqs : total;

  // The step's inputs, laid out as meta_layout_ says.
  int32_t* h = meta_host_.get<int32_t>();
  const MetaLayout& m = meta_layout_;
  const int bs = kv_.block_size;
  const int32_t scratch_block = kv_.num_blocks;
  for (int s = 0, t = 0; s < seqs; ++s) {
    const bool pad = s >= n;
    const int count = pad ? 1 : batch.seqs[s].num_tokens;
    for (int i = 0; i < count; ++i, ++t) {
      const int pos = pad ? 0 : batch.seqs[s].start_pos + i;
      const int32_t block = pad ? scratch_block : batch.seqs[s].block_table[pos / bs];
      h[m.tokens + t] = pad ? 0 : batch.tokens[t];
      h[m.positions + t] = pos;
      h[m.token_seq + t] = s;
      h[m.slots + t] = block * bs + pos % bs;
    }
    h[m.last_row + s] = t - 1;
    cuda::DeviceSampleSpec spec;
    if (sample && !pad) {
      const SampleSpec& in = sampling[s];
      spec.temperature = in.params.temperature;
      spec.top_k = in.params.top_k;
      spec.top_p = in.params.top_p;
      spec.uniform = in.uniform;
    }
    std::memcpy(h + m.specs + 4 * s, &spec, sizeof(spec));
    int32_t* table = h + m.block_tables + static_cast<size_t>(s) * max_blocks_per_seq_;
    if (pad) {
      table[0] = scratch_block;
    } else {
      const SequenceStep& seq = batch.seqs[s];
      const size_t used = (seq.start_pos + seq.num_tokens + bs - 1) / bs;
      std::copy(seq.block_table.begin(), seq.block_table.begin() + used, table);
    }
  }
  const size_t meta_bytes =
      (m.block_tables + static_cast<size_t>(seqs) * max_blocks_per_seq_) * sizeof(int32_t);
  int context = 1;  // the longest, in positions
  for (const SequenceStep& seq : batch.seqs) {
    context = std::max(context, seq.start_pos + seq.num_tokens);
  }
  const int splits = NumSplits(rows, context, decode);
  return Check(Execute(meta_bytes, rows, seqs, decode, n, splits, logits, tokens));
}

template <typename T>
absl::Status CudaBackend<T>::Execute(size_t meta_bytes, int rows, int seqs, bool decode, int n,
                                     int splits, std::span<float> logits,
                                     std::span<int32_t> tokens) {
  const bool sample = !tokens.empty();
  // A step may run on another thread than the one that made the backend (the
  // engine loop's step thread, with --overlap_steps), and CUDA's current
  // device is per thread.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_.get<void>(), meta_host_.get<void>(), meta_bytes,
                                       cudaMemcpyHostToDevice, stream_));
  const auto graph = decode ? graphs_.find({seqs, splits}) : graphs_.end();
  if (graph != graphs_.end()) {
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graph->second, stream_));
  } else if (absl::Status s = Forward(rows, seqs, sample, splits); !s.ok()) {
    return s;
  }
  if (sample) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_host_.get<int32_t>(), next_tokens_.get<int32_t>(),
                                         n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  } else {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data(), logits_.get<float>(),
                                         static_cast<size_t>(n) * c_.vocab_size * sizeof(float),
                                         cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (sample) std::copy_n(tokens_host_.get<int32_t>(), n, tokens.begin());
  if (StageTimes* times = options_.stage_times.get(); times != nullptr) {
    for (size_t i = 1; i < num_marks_; ++i) {
      float ms = 0.0f;
      CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, marks_[i - 1], marks_[i]));
      const auto at = std::find(times->names.begin(), times->names.end(), mark_names_[i]);
      if (at == times->names.end()) {
        times->names.push_back(mark_names_[i]);
        times->seconds.push_back(ms / 1e3);
      } else {
        times->seconds[at - times->names.begin()] += ms / 1e3;
      }
    }
    ++times->steps;
  }
  // The first decode step of a bucket ran eagerly, which also loaded every
  // kernel it needs; now capture it for the next ones.
  if (decode && graph == graphs_.end()) return CaptureDecodeGraph(seqs, splits);
  return absl::OkStatus();
}

template <typename T>
std::string CudaBackend<T>::Describe() const {
  const int64_t kv_tokens = int64_t{kv_.num_blocks} * kv_.block_size;
  return absl::StrFormat(
      "cuda: %s (sm_%d%d, %d SMs, %.1f GiB), %s weights %.2f GiB, KV cache %d blocks of %d = "
      "%d tokens (%.1f sequences of %d), max %d tokens and %d sequences per step, CUDA graphs %s",
      props_.name, props_.major, props_.minor, props_.multiProcessorCount,
      static_cast<double>(props_.totalGlobalMem) / (1 << 30),
      PrecisionName(TypeInfo<T>::kPrecision), static_cast<double>(weight_bytes_) / (1 << 30),
      kv_.num_blocks, kv_.block_size, kv_tokens, static_cast<double>(kv_tokens) / c_.max_seq_len,
      c_.max_seq_len, max_rows_, max_seqs_, options_.cuda_graphs ? "on" : "off");
}

template <typename T>
absl::StatusOr<std::unique_ptr<Backend>> Create(std::shared_ptr<const Model> model,
                                                const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend<T>>(std::move(model), options);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return backend;
}

}  // namespace

bool CudaDeviceUsable(std::string* why) {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    *why =
        absl::StrCat("no usable CUDA device or driver (cudaGetDeviceCount: ", cudaGetErrorName(err),
                     ": ", cudaGetErrorString(err), ")");
    return false;
  }
  if (count == 0) {
    *why = "no CUDA device";
    return false;
  }
  // The kernels are built for the architectures CMake was given (sm_90 and
  // its PTX by default); an older GPU has no image to run.
  if (const cudaError_t err = cuda::CheckKernelImage(); err != cudaSuccess) {
    cudaDeviceProp props{};
    cudaGetDeviceProperties(&props, 0);
    *why = absl::StrCat("the kernels were not built for ", props.name, " (sm_", props.major,
                        props.minor, "): ", cudaGetErrorString(err),
                        "; rebuild with -DCMAKE_CUDA_ARCHITECTURES=", props.major, props.minor);
    return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<const Model> model,
                                                           const CudaBackendOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("CreateCudaBackend: no model");
  if (absl::Status s = ValidateModel(*model, !options.random_weights); !s.ok()) return s;
  const ModelConfig& c = model->config;
  if (HasQuantizedWeights(model->weights)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", c.name,
                     ": the CUDA backend takes float weights; load the model "
                     "without keep_quantized (its weights then dequantized)"));
  }
  if (c.head_dim() > cuda::kMaxHeadDim || c.n_heads / c.n_kv_heads > cuda::kMaxGqaRatio) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", c.name, ": head size ", c.head_dim(), " and ", c.n_heads / c.n_kv_heads,
        " query heads per KV head; the CUDA backend supports up to ", cuda::kMaxHeadDim, " and ",
        cuda::kMaxGqaRatio));
  }
  if (options.block_size < 1 || options.max_batch_tokens < 1 || options.max_seqs < 1 ||
      !(options.kv_memory_fraction > 0.0 && options.kv_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA backend options: block_size ", options.block_size, ", max_batch_tokens ",
        options.max_batch_tokens, ", max_seqs ", options.max_seqs, " must be >= 1 and ",
        "kv_memory_fraction ", options.kv_memory_fraction, " in (0, 1]"));
  }
  if (options.attention_split_size < 0 || options.attention_split_size % cuda::kSplitTile != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA backend options: attention_split_size ", options.attention_split_size,
                     " must be 0 (automatic) or a positive multiple of ", cuda::kSplitTile));
  }
  if (absl::Status s = CheckCudaKvCacheDtype(options); !s.ok()) return s;
  switch (options.precision) {
    case Precision::kFp32:
      return Create<float>(std::move(model), options);
    case Precision::kFp16:
      return Create<__half>(std::move(model), options);
    case Precision::kBf16:
      return Create<__nv_bfloat16>(std::move(model), options);
  }
  return absl::InvalidArgumentError("unknown precision");
}

}  // namespace coalesce::engine
