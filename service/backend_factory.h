// Turns --device, --dtype, --kv_cache_dtype, --kv_cache_memory and the batch
// limits into a backend: the CUDA one on a usable GPU, else the CPU one; or, when asked
// for, the null one.
//
// Device rule: --device=cuda needs a usable CUDA device (engine::
// CudaDeviceUsable) and fails at start-up, naming the reason, without one;
// --device=cpu is the CPU; --device=auto is the GPU when usable, else the CPU
// with one log line saying why. --dtype=auto is bf16 on CUDA and fp32 on the
// CPU, which computes only in fp32. --device=null is the null backend
// (engine/null/null_backend.h): no arithmetic, for measuring the server's own
// cost, with meaningless output; it never touches the CUDA driver, has no
// precision (only --dtype=auto) and never emits the tokenizer's EOS ids.
//
// KV cache type (--kv_cache_dtype): auto is fp32 on the CPU (and the null
// backend, whose accounting follows the CPU's) and the weights' precision on
// CUDA. The CPU takes fp32, bf16, fp16 and int8; fp8 is a CUDA type. CUDA
// takes only its weights' precision so far (engine::CheckCudaKvCacheDtype):
// anything else is a start-up error.
//
// KV cache: the CPU reads --kv_cache_memory as ServerOptions documents
// (KvCacheBlocks, with blocks of the --kv_cache_dtype's bytes, so that a given
// memory holds 2x the tokens in bf16 or fp16 and about 4x in int8), and so
// does the null backend, which only accounts for the
// blocks (the batcher admits and preempts as it would on the CPU) and holds
// no memory. On CUDA, "auto" is 0.9 and a fraction is that fraction of
// the device memory still free once weights and activations are allocated
// (the backend measures it), and a size is num_blocks = size / block bytes at
// the chosen precision.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model.h"
#include "engine/null/null_backend.h"
#include "service/server_options.h"

namespace coalesce::service {

struct BackendPlan {
  Device device = Device::kCpu;  // kCpu, kCuda or kNull, never kAuto
  engine::Precision precision = engine::Precision::kFp32;
  engine::KvDtype kv_dtype = engine::KvDtype::kFp32;  // what the KV cache holds
  // Why --device=auto chose the CPU; empty otherwise.
  std::string fallback_reason;
};

// The device rule above, given what engine::CudaDeviceUsable said
// (`cuda_usable`, and `cuda_why_not` when false). --device=cuda without a
// device is FAILED_PRECONDITION; a --dtype the CPU cannot run, or any but
// auto with --device=null, and a --kv_cache_dtype the chosen backend does not
// hold, are INVALID_ARGUMENT.
absl::StatusOr<BackendPlan> PlanBackend(const ServerOptions& options, bool cuda_usable,
                                        const std::string& cuda_why_not);

// Whether the model should keep a quantized file's matrices in their block
// types (engine::ModelSpec::keep_quantized): when it will run on the CPU
// (--device=cpu, or auto without a usable GPU), which computes with them
// directly. The CUDA backend takes float weights.
bool KeepQuantizedWeights(const ServerOptions& options);

// The CPU backend's options: --kv_cache_memory against `physical_memory_bytes`,
// in blocks of --kv_cache_dtype (auto: fp32).
absl::StatusOr<engine::CpuBackendOptions> CpuOptions(const ServerOptions& options,
                                                     const engine::ModelConfig& config,
                                                     int64_t physical_memory_bytes);

// The CUDA backend's options: precision, block size, KV sizing (above),
// max_batch_tokens, max_batch_size (as max_seqs), CUDA graphs.
absl::StatusOr<engine::CudaBackendOptions> CudaOptions(const ServerOptions& options,
                                                       const engine::ModelConfig& config,
                                                       engine::Precision precision);

// The null backend's options: the CPU's KV accounting (CpuOptions), and
// `eos_ids` (the tokenizer's) as the ids it must never emit, so that every
// generation runs to its max_new_tokens.
absl::StatusOr<engine::NullBackendOptions> NullOptions(const ServerOptions& options,
                                                       const engine::ModelConfig& config,
                                                       int64_t physical_memory_bytes,
                                                       std::span<const int32_t> eos_ids);

// All of the above with the real device query: plans, logs the fallback of
// --device=auto, creates the backend, and wraps it in the fault injector when
// --fault_injection asks. `eos_ids` are the tokenizer's end-of-sequence ids
// (only the null backend uses them). Errors say which flag or which device; a
// bad flag value is INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<engine::Backend>> CreateBackend(
    const ServerOptions& options, std::shared_ptr<const engine::Model> model,
    std::span<const int32_t> eos_ids);

}  // namespace coalesce::service
