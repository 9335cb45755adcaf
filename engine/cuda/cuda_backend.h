// The CUDA backend: the same Backend as the CPU engine, on one NVIDIA GPU.
//
// A step runs the whole batch through the model at once: cuBLAS applies each
// weight matrix to every token of the step in one call (q/k/v fused into one
// matrix, gate/up into another; a one-token step uses our own skinny product
// instead), and our own kernels (cuda/kernels.h) do the
// rest: embedding lookup, RMSNorm fused with the residual add, rotary
// embeddings fused with writing K and V into the paged cache, attention over
// the paged blocks (split along the sequence, one K/V read per group of query
// heads), SwiGLU, and sampling, so that only token ids cross to the host.
// Decode steps replay a CUDA graph captured once per batch-size bucket.
//
// Weights and the KV cache are BF16 or FP16 with FP32 accumulation, or FP32
// throughout for exact comparison with the CPU engine. Every CUDA and cuBLAS
// call is checked; an error becomes a Status naming the call. A sticky device
// error (the context is unusable) comes back with kDeviceLostCode.
//
// This header needs no CUDA headers: a build without the CUDA toolkit gets a
// CreateCudaBackend that says so.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "engine/precision.h"

namespace coalesce::engine {

// Where a step's device time goes, for benchmarks: with
// CudaBackendOptions::stage_times set, every step runs eagerly (no graphs)
// with a CUDA event after each stage, and each stage's time is added here.
struct StageTimes {
  std::vector<std::string> names;  // stages, in the order first seen
  std::vector<double> seconds;     // [names.size()] summed over steps and layers
  int steps = 0;
};

struct CudaBackendOptions {
  int device = 0;                          // CUDA device ordinal
  Precision precision = Precision::kBf16;  // weights and KV cache
  // The KV cache's type; nullopt: the weights' precision. Only that is built
  // so far (CheckCudaKvCacheDtype): the quantized types wait for a GPU to be
  // built and measured on.
  std::optional<KvDtype> kv_cache_dtype;
  int block_size = 16;  // token positions per KV block
  // KV blocks: num_blocks when > 0; otherwise kv_memory_fraction of the
  // device memory still free once weights and activations are allocated.
  int num_blocks = 0;
  double kv_memory_fraction = 0.9;
  int max_batch_tokens = 2048;  // tokens in one step at most
  int max_seqs = 256;           // sequences in one step at most
  bool cuda_graphs = true;      // replay captured graphs for decode steps
  // Steps of at most this many tokens (up to cuda::kMaxSkinnyRows) apply the
  // weights with our own skinny product (cuda/kernels.h) instead of cuBLAS;
  // 0: always cuBLAS. coalesce-gpu-bench compares the two to set it.
  int skinny_gemm_rows = 1;
  // Attention over splits of a fixed number of positions where the head size
  // allows (cuda::SplitAttentionSupported); false: the older kernel, whose
  // split count follows the step's rows. coalesce-gpu-bench compares the two.
  bool fixed_size_splits = true;
  // Positions per split: 0 for 128; a multiple of cuda::kSplitTile (32).
  // Raised where max_seq_len would need more than cuda::kMaxSplits splits.
  int attention_split_size = 0;
  std::shared_ptr<StageTimes> stage_times;  // benchmarks only
  // Benchmarks of large shapes: fill the weights on the device from this
  // seed (uniform in +-1/sqrt(fan_in)) instead of copying model.weights,
  // which may then be empty.
  bool random_weights = false;
  uint64_t random_seed = 1;
  // Benchmarks of decode at long contexts: fill the KV cache with random
  // values, so that decode steps can start at any position without a prefill.
  bool fill_kv_cache_random = false;
};

// The KV cache types the CUDA backend holds: for now only its weights'
// precision (options.precision), which is also what nullopt means. Anything
// else is INVALID_ARGUMENT, naming what it takes. CreateCudaBackend checks it;
// it needs no GPU, so that every build can test it.
inline absl::Status CheckCudaKvCacheDtype(const CudaBackendOptions& options) {
  const KvDtype held = KvDtypeOf(options.precision);
  if (!options.kv_cache_dtype.has_value() || *options.kv_cache_dtype == held) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the CUDA backend holds its KV cache only in its weights' precision (", KvDtypeName(held),
      ") so far, not ", KvDtypeName(*options.kv_cache_dtype),
      ": KV caches of other types (int8, fp8 e4m3, or a float type other than the weights') are "
      "not built for CUDA yet"));
}

// Whether a CUDA device is usable here. False with the reason in *why:
// "built without CUDA", "no CUDA device (cudaGetDeviceCount: ...)", ...
bool CudaDeviceUsable(std::string* why);

// Uploads the model (converting to options.precision), sizes the KV cache,
// and captures nothing yet (graphs are captured on first use of a bucket).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<const Model> model,
                                                           const CudaBackendOptions& options);

}  // namespace coalesce::engine
