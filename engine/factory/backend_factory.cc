#include "engine/factory/backend_factory.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/factory/backend_options.h"

namespace coalesce::engine {
namespace {

int64_t PhysicalMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

}  // namespace

const char* DeviceName(Device device) {
  switch (device) {
    case Device::kAuto:
      return "auto";
    case Device::kCpu:
      return "cpu";
    case Device::kCuda:
      return "cuda";
    case Device::kNull:
      return "null";
  }
  return "unknown";
}

absl::StatusOr<Device> ParseDevice(const std::string& text) {
  for (Device device : {Device::kAuto, Device::kCpu, Device::kCuda, Device::kNull}) {
    if (text == DeviceName(device)) return device;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device=", text, ": expected auto, cpu, cuda or null"));
}

absl::StatusOr<KvCacheMemory> ParseKvCacheMemory(const std::string& text) {
  KvCacheMemory out;
  if (text == "auto") {
    out.automatic = true;
    return out;
  }
  const auto bad = absl::InvalidArgumentError(
      absl::StrCat("--kv_cache_memory=", text,
                   ": expected auto, a size such as 512MiB or 2GB, or a fraction such as 0.25"));
  // Split into number and unit.
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    ++i;
  }
  double number;
  if (i == 0 || !absl::SimpleAtod(text.substr(0, i), &number)) return bad;
  const std::string unit = absl::AsciiStrToLower(text.substr(i));
  if (unit.empty() && number > 0 && number <= 1 && text.find('.') != std::string::npos) {
    out.fraction = number;
    return out;
  }
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},        {"b", 1},         {"kb", 1e3},      {"mb", 1e6},
      {"gb", 1e9},    {"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30},
      {"k", 1 << 10}, {"m", 1 << 20},   {"g", 1 << 30}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      out.bytes = static_cast<int64_t>(number * scale);
      if (out.bytes <= 0) return bad;
      return out;
    }
  }
  return bad;
}

int64_t KvCacheBlocks(const KvCacheMemory& memory, int64_t block_bytes, int64_t full_context_blocks,
                      int max_batch_size, int64_t physical_memory_bytes) {
  int64_t bytes;
  if (memory.automatic) {
    bytes = std::min(full_context_blocks * max_batch_size * block_bytes, physical_memory_bytes / 4);
  } else if (memory.fraction > 0) {
    bytes = static_cast<int64_t>(memory.fraction * physical_memory_bytes);
  } else {
    bytes = memory.bytes;
  }
  return bytes / block_bytes;
}

absl::Status CheckNumBlocks(int64_t num_blocks, int64_t block_bytes, const std::string& flag) {
  if (num_blocks < 1 || num_blocks > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_memory=", flag, " gives ",
                                                   num_blocks, " KV blocks of ", block_bytes,
                                                   " bytes; need at least one"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BackendPlan> PlanBackend(const BackendSpec& spec, bool cuda_usable,
                                        const std::string& cuda_why_not) {
  BackendPlan plan;
  switch (spec.device) {
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
      if (spec.precision.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--dtype=", PrecisionName(*spec.precision),
            ": the null backend does no arithmetic and has no precision; leave --dtype=auto"));
      }
      plan.device = Device::kNull;
      plan.precision = Precision::kFp32;
      break;
    case Device::kAuto:
      plan.device = cuda_usable ? Device::kCuda : Device::kCpu;
      if (!cuda_usable) plan.fallback_reason = cuda_why_not;
      break;
  }
  // With --device=auto, what the errors below add about the device it chose.
  const std::string auto_chose =
      spec.device != Device::kAuto
          ? ""
          : (plan.device == Device::kCuda
                 ? " (--device=auto chose the GPU; --device=cpu runs the CPU backend)"
                 : absl::StrCat(" (--device=auto chose the CPU: ", cuda_why_not, ")"));
  if (plan.device == Device::kCuda) {
    plan.precision = spec.precision.value_or(Precision::kBf16);
    plan.kv_dtype = spec.kv_cache_dtype.value_or(KvDtypeOf(plan.precision));
    CudaBackendOptions cuda;
    cuda.precision = plan.precision;
    cuda.kv_cache_dtype = spec.kv_cache_dtype;
    if (absl::Status s = CheckCudaKvCacheDtype(cuda); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_cache_dtype=", KvDtypeName(plan.kv_dtype), ": ", s.message(), auto_chose));
    }
    return plan;
  }
  // The CPU, and the null backend, which accounts for the CPU's blocks.
  plan.kv_dtype = spec.kv_cache_dtype.value_or(KvDtype::kFp32);
  if (plan.kv_dtype == KvDtype::kFp8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_dtype=fp8: e4m3 is a CUDA type; the CPU backend holds fp32, bf16, fp16 or "
        "int8",
        auto_chose));
  }
  if (plan.device == Device::kNull) return plan;
  plan.precision = Precision::kFp32;
  if (spec.precision.has_value() && *spec.precision != Precision::kFp32) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", PrecisionName(*spec.precision),
                     ": the CPU backend computes in fp32 only; pass --dtype=fp32 or auto "
                     "(--kv_cache_dtype chooses what its KV cache holds)",
                     auto_chose));
  }
  return plan;
}

bool KeepQuantizedWeights(const BackendSpec& spec) {
  if (spec.device == Device::kCpu) return true;
  std::string why_not;
  return spec.device == Device::kAuto && !CudaDeviceUsable(&why_not);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendSpec& spec,
                                                       std::shared_ptr<const Model> model,
                                                       std::span<const int32_t> eos_ids) {
  // --device=cpu and --device=null never touch the CUDA driver.
  std::string why_not;
  const bool cuda_usable =
      (spec.device == Device::kAuto || spec.device == Device::kCuda) && CudaDeviceUsable(&why_not);
  ASSIGN_OR_RETURN(const BackendPlan plan, PlanBackend(spec, cuda_usable, why_not));
  if (!plan.fallback_reason.empty()) {
    LogF(LogLevel::kInfo, "device auto: using the CPU: %s", plan.fallback_reason);
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend;
  if (plan.device == Device::kCuda) {
    ASSIGN_OR_RETURN(const CudaBackendOptions cuda,
                     CudaOptions(spec, model->config, plan.precision));
    backend = CreateCudaBackend(std::move(model), cuda);
  } else if (plan.device == Device::kNull) {
    ASSIGN_OR_RETURN(const NullBackendOptions null,
                     NullOptions(spec, model->config, PhysicalMemoryBytes(), eos_ids));
    backend = CreateNullBackend(model->config, null);
  } else {
    ASSIGN_OR_RETURN(const CpuBackendOptions cpu,
                     CpuOptions(spec, model->config, PhysicalMemoryBytes()));
    backend = CreateCpuBackend(std::move(model), cpu);
  }
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("cannot start the ", DeviceName(plan.device),
                                     " engine: ", backend.status().message()));
  }
  return backend;
}

void LogBackendNotes(const Backend& backend, const BackendSpec& spec) {
  if (backend.capabilities().weights_in_host_memory) LogCpuNotes(spec);
}

}  // namespace coalesce::engine
