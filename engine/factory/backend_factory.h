// Which backend runs the model, and the backend made from the settings the
// command line gives: the one place outside the backend rooms (cpu/, cuda/,
// null/) that knows each of them. A user of the engine (the service, a tool)
// includes this and engine/backend.h, never a backend's own header; each
// backend's settings are translated into its options in its own file here
// (cpu_options.cc, cuda_options.cc, null_options.cc; backend_options.h).
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
// KV cache: the CPU reads --kv_cache_memory as KvCacheBlocks says, with
// blocks of the --kv_cache_dtype's bytes, so that a given memory holds 2x the
// tokens in bf16 or fp16 and about 4x in int8; and so does the null backend,
// which only accounts for the blocks (the batcher admits and preempts as it
// would on the CPU) and holds no memory. On CUDA, "auto" is 0.9 and a
// fraction is that fraction of the device memory still free once weights and
// activations are allocated (the backend measures it), and a size is
// num_blocks = size / block bytes at the chosen precision.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "engine/precision.h"

namespace coalesce::engine {

// Where the model runs (--device). kAuto: the GPU when one is usable, else
// the CPU (PlanBackend decides). kNull: nowhere, the null backend, which does
// no arithmetic, for measuring the server's own cost; its output is
// meaningless.
enum class Device { kAuto, kCpu, kCuda, kNull };
const char* DeviceName(Device device);                        // "auto", "cpu", "cuda", "null"
absl::StatusOr<Device> ParseDevice(const std::string& text);  // --device

// What the command line asks of the backend, parsed: the settings every
// backend reads, then each backend's own, which only its file here
// translates into its options.
struct BackendSpec {
  Device device = Device::kAuto;
  // Weights and KV cache; nullopt is auto: bf16 on CUDA, fp32 on the CPU
  // (which computes only in fp32).
  std::optional<Precision> precision = std::nullopt;
  // The KV cache's element type; nullopt is auto: fp32 on the CPU, the
  // weights' precision on CUDA.
  std::optional<KvDtype> kv_cache_dtype = std::nullopt;
  int kv_block_size = 16;                // token positions per KV block
  std::string kv_cache_memory = "auto";  // ParseKvCacheMemory's text
  // The batcher's limits, which size the KV cache (auto) and CUDA's buffers.
  int max_batch_size = 16;      // sequences in one step at most
  int max_batch_tokens = 2048;  // tokens in one step at most
  // The CPU backend's own (engine::CpuBackendOptions).
  int threads = 0;  // compute threads; 0: one per core
  bool int8_activations = false;
  std::optional<bool> float_panels = std::nullopt;  // nullopt is auto
  // The CUDA backend's own (engine::CudaBackendOptions).
  bool cuda_graphs = true;  // replay captured graphs for decode steps
};

// --kv_cache_memory: "auto", a byte count with an optional unit ("512MiB",
// "2GB", "1048576"), or a fraction of physical memory in (0, 1] ("0.25").
struct KvCacheMemory {
  bool automatic = false;
  double fraction = 0;  // of physical memory, when > 0
  int64_t bytes = 0;    // when > 0
};
absl::StatusOr<KvCacheMemory> ParseKvCacheMemory(const std::string& text);

// KV blocks to allocate on the CPU. "auto": enough for max_batch_size
// sequences of the full context, but at most a quarter of physical memory.
// (The CUDA backend sizes its own from free device memory: see above.)
int64_t KvCacheBlocks(const KvCacheMemory& memory, int64_t block_bytes, int64_t full_context_blocks,
                      int max_batch_size, int64_t physical_memory_bytes);

// --float_panels (the CPU backend's): "auto" (nullopt), "true" or "false".
// INVALID_ARGUMENT, naming the flag, for anything else.
absl::StatusOr<std::optional<bool>> ParseFloatPanelsFlag(const std::string& text);

struct BackendPlan {
  Device device = Device::kCpu;  // kCpu, kCuda or kNull, never kAuto
  Precision precision = Precision::kFp32;
  KvDtype kv_dtype = KvDtype::kFp32;  // what the KV cache holds
  // Why --device=auto chose the CPU; empty otherwise.
  std::string fallback_reason;
};

// The device rule above, given what engine::CudaDeviceUsable said
// (`cuda_usable`, and `cuda_why_not` when false). --device=cuda without a
// device is FAILED_PRECONDITION; a --dtype the CPU cannot run, or any but
// auto with --device=null, and a --kv_cache_dtype the chosen backend does not
// hold, are INVALID_ARGUMENT.
absl::StatusOr<BackendPlan> PlanBackend(const BackendSpec& spec, bool cuda_usable,
                                        const std::string& cuda_why_not);

// Whether the model should keep a quantized file's matrices in their block
// types (engine::ModelSpec::keep_quantized): when it will run on the CPU
// (--device=cpu, or auto without a usable GPU), which computes with them
// directly. The CUDA backend takes float weights.
bool KeepQuantizedWeights(const BackendSpec& spec);

// All of the above with the real device query: plans, logs the fallback of
// --device=auto, and creates the backend. `eos_ids` are the tokenizer's
// end-of-sequence ids (only the null backend uses them). Errors say which
// flag or which device; a bad flag value is INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendSpec& spec,
                                                       std::shared_ptr<const Model> model,
                                                       std::span<const int32_t> eos_ids);

// Logs what the start-up log says of `backend` beyond its Describe(): for
// one that reads its weights from host memory (the CPU backend), how much of
// them the kernel backed with huge pages, and --int8_activations ignored on a
// processor without AVX2. Nothing for the others.
void LogBackendNotes(const Backend& backend, const BackendSpec& spec);

// Bytes per second the host's memory is read at, measured now on as many
// threads as the CPU backend computes with (spec.threads; 0: one per core):
// the bound on a decode step of a backend whose weights are in host memory.
// Takes about a tenth of a second.
double MeasureHostMemoryBandwidth(const BackendSpec& spec);

}  // namespace coalesce::engine
