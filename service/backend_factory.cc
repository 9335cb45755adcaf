#include "service/backend_factory.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "service/fault_injection.h"

namespace coalesce::service {
namespace {

int64_t PhysicalMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

// KV block ids are int32 in the block tables.
absl::Status CheckNumBlocks(int64_t num_blocks, int64_t block_bytes, const std::string& flag) {
  if (num_blocks < 1 || num_blocks > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_memory=", flag, " gives ",
                                                   num_blocks, " KV blocks of ", block_bytes,
                                                   " bytes; need at least one"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BackendPlan> PlanBackend(const ServerOptions& options, bool cuda_usable,
                                        const std::string& cuda_why_not) {
  BackendPlan plan;
  switch (options.device) {
    case Device::kCuda:
      if (!cuda_usable) {
        return absl::FailedPreconditionError(
            absl::StrCat("--device=cuda: no usable CUDA device: ", cuda_why_not));
      }
      plan.device = Device::kCuda;
      break;
    case Device::kCpu:
      plan.device = Device::kCpu;
      break;
    case Device::kNull:
      // No arithmetic, so no precision to choose.
      if (options.precision.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--dtype=", engine::PrecisionName(*options.precision),
            ": the null backend does no arithmetic and has no precision; leave --dtype=auto"));
      }
      plan.device = Device::kNull;
      plan.precision = engine::Precision::kFp32;
      break;
    case Device::kAuto:
      plan.device = cuda_usable ? Device::kCuda : Device::kCpu;
      if (!cuda_usable) plan.fallback_reason = cuda_why_not;
      break;
  }
  // With --device=auto, what the errors below add about the device it chose.
  const std::string auto_chose =
      options.device != Device::kAuto
          ? ""
          : (plan.device == Device::kCuda
                 ? " (--device=auto chose the GPU; --device=cpu runs the CPU backend)"
                 : absl::StrCat(" (--device=auto chose the CPU: ", cuda_why_not, ")"));
  if (plan.device == Device::kCuda) {
    plan.precision = options.precision.value_or(engine::Precision::kBf16);
    plan.kv_dtype = options.kv_cache_dtype.value_or(engine::KvDtypeOf(plan.precision));
    engine::CudaBackendOptions cuda;
    cuda.precision = plan.precision;
    cuda.kv_cache_dtype = options.kv_cache_dtype;
    if (absl::Status s = engine::CheckCudaKvCacheDtype(cuda); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_cache_dtype=", engine::KvDtypeName(plan.kv_dtype), ": ", s.message(), auto_chose));
    }
    return plan;
  }
  // The CPU, and the null backend, which accounts for the CPU's blocks.
  plan.kv_dtype = options.kv_cache_dtype.value_or(engine::KvDtype::kFp32);
  if (plan.kv_dtype == engine::KvDtype::kFp8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_dtype=fp8: e4m3 is a CUDA type; the CPU backend holds fp32, bf16, fp16 or "
        "int8",
        auto_chose));
  }
  if (plan.device == Device::kNull) return plan;
  plan.precision = engine::Precision::kFp32;
  if (options.precision.has_value() && *options.precision != engine::Precision::kFp32) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", engine::PrecisionName(*options.precision),
                     ": the CPU backend computes in fp32 only; pass --dtype=fp32 or auto "
                     "(--kv_cache_dtype chooses what its KV cache holds)",
                     auto_chose));
  }
  return plan;
}

absl::StatusOr<engine::CpuBackendOptions> CpuOptions(const ServerOptions& options,
                                                     const engine::ModelConfig& config,
                                                     int64_t physical_memory_bytes) {
  ASSIGN_OR_RETURN(const KvCacheMemory memory, ParseKvCacheMemory(options.kv_cache_memory));
  const engine::KvDtype dtype = options.kv_cache_dtype.value_or(engine::KvDtype::kFp32);
  const int64_t block_bytes = engine::KvBlockBytes(config, options.kv_block_size, dtype);
  const int64_t context_blocks =
      (config.max_seq_len + options.kv_block_size - 1) / options.kv_block_size;
  const int64_t num_blocks = KvCacheBlocks(memory, block_bytes, context_blocks,
                                           options.scheduler.max_batch_size, physical_memory_bytes);
  RETURN_IF_ERROR(CheckNumBlocks(num_blocks, block_bytes, options.kv_cache_memory));
  engine::CpuBackendOptions out;
  out.kv_cache = {options.kv_block_size, static_cast<int>(num_blocks), dtype};
  out.threads = options.threads;
  out.int8_activations = options.int8_activations;
  out.float_panels = options.float_panels;
  return out;
}

absl::StatusOr<engine::NullBackendOptions> NullOptions(const ServerOptions& options,
                                                       const engine::ModelConfig& config,
                                                       int64_t physical_memory_bytes,
                                                       std::span<const int32_t> eos_ids) {
  ASSIGN_OR_RETURN(const engine::CpuBackendOptions cpu,
                   CpuOptions(options, config, physical_memory_bytes));
  engine::NullBackendOptions out;
  out.kv_cache = cpu.kv_cache;
  out.never_emit.assign(eos_ids.begin(), eos_ids.end());
  return out;
}

absl::StatusOr<engine::CudaBackendOptions> CudaOptions(const ServerOptions& options,
                                                       const engine::ModelConfig& config,
                                                       engine::Precision precision) {
  ASSIGN_OR_RETURN(const KvCacheMemory memory, ParseKvCacheMemory(options.kv_cache_memory));
  engine::CudaBackendOptions out;
  out.precision = precision;
  out.kv_cache_dtype = options.kv_cache_dtype;
  out.block_size = options.kv_block_size;
  out.max_batch_tokens = options.max_batch_tokens;
  out.max_seqs = options.scheduler.max_batch_size;
  out.cuda_graphs = options.cuda_graphs;
  // Free device memory is known only once the weights are on the device, so
  // a fraction is the backend's to apply; a size is ours.
  out.num_blocks = 0;
  if (memory.automatic) {
    out.kv_memory_fraction = 0.9;
  } else if (memory.fraction > 0) {
    out.kv_memory_fraction = memory.fraction;
  } else {
    const int64_t block_bytes =
        engine::KvBlockBytes(config, options.kv_block_size,
                             options.kv_cache_dtype.value_or(engine::KvDtypeOf(precision)));
    const int64_t num_blocks = memory.bytes / block_bytes;
    RETURN_IF_ERROR(CheckNumBlocks(num_blocks, block_bytes, options.kv_cache_memory));
    out.num_blocks = static_cast<int>(num_blocks);
  }
  return out;
}

bool KeepQuantizedWeights(const ServerOptions& options) {
  if (options.device == Device::kCpu) return true;
  std::string why_not;
  return options.device == Device::kAuto && !engine::CudaDeviceUsable(&why_not);
}

absl::StatusOr<std::unique_ptr<engine::Backend>> CreateBackend(
    const ServerOptions& options, std::shared_ptr<const engine::Model> model,
    std::span<const int32_t> eos_ids) {
  // --device=cpu and --device=null never touch the CUDA driver.
  std::string why_not;
  const bool cuda_usable = (options.device == Device::kAuto || options.device == Device::kCuda) &&
                           engine::CudaDeviceUsable(&why_not);
  ASSIGN_OR_RETURN(const BackendPlan plan, PlanBackend(options, cuda_usable, why_not));
  if (!plan.fallback_reason.empty()) {
    LogF(LogLevel::kInfo, "device auto: using the CPU: %s", plan.fallback_reason);
  }
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend;
  if (plan.device == Device::kCuda) {
    ASSIGN_OR_RETURN(const engine::CudaBackendOptions cuda,
                     CudaOptions(options, model->config, plan.precision));
    backend = engine::CreateCudaBackend(std::move(model), cuda);
  } else if (plan.device == Device::kNull) {
    ASSIGN_OR_RETURN(const engine::NullBackendOptions null,
                     NullOptions(options, model->config, PhysicalMemoryBytes(), eos_ids));
    backend = engine::CreateNullBackend(model->config, null);
  } else {
    ASSIGN_OR_RETURN(const engine::CpuBackendOptions cpu,
                     CpuOptions(options, model->config, PhysicalMemoryBytes()));
    backend = engine::CreateCpuBackend(std::move(model), cpu);
  }
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("cannot start the ", DeviceName(plan.device),
                                     " engine: ", backend.status().message()));
  }
  if (options.fault_device_lost_after_steps >= 0) {
    *backend = std::make_unique<DeviceLossInjector>(*std::move(backend),
                                                    options.fault_device_lost_after_steps);
  }
  return backend;
}

}  // namespace coalesce::service
