// The null backend's options: the CPU's KV accounting, and the ids it never
// emits.
#include "common/status_macros.h"
#include "engine/factory/backend_options.h"

namespace coalesce::engine {

absl::StatusOr<NullBackendOptions> NullOptions(const BackendSpec& spec, const ModelConfig& config,
                                               int64_t physical_memory_bytes,
                                               std::span<const int32_t> eos_ids) {
  ASSIGN_OR_RETURN(const CpuBackendOptions cpu, CpuOptions(spec, config, physical_memory_bytes));
  NullBackendOptions out;
  out.kv_cache = cpu.kv_cache;
  out.never_emit.assign(eos_ids.begin(), eos_ids.end());
  return out;
}

}  // namespace coalesce::engine
