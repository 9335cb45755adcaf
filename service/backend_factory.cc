#include "service/backend_factory.h"

#include <utility>

#include "common/status_macros.h"
#include "service/fault_injection.h"

namespace coalesce::service {

engine::BackendSpec BackendSpecOf(const ServerOptions& options) {
  return {.device = options.device,
          .precision = options.precision,
          .kv_cache_dtype = options.kv_cache_dtype,
          .kv_block_size = options.kv_block_size,
          .kv_cache_memory = options.kv_cache_memory,
          .max_batch_size = options.scheduler.max_batch_size,
          .max_batch_tokens = options.max_batch_tokens,
          .threads = options.threads,
          .int8_activations = options.int8_activations,
          .float_panels = options.float_panels,
          .cuda_graphs = options.cuda_graphs};
}

absl::StatusOr<std::unique_ptr<engine::Backend>> CreateBackend(
    const ServerOptions& options, std::shared_ptr<const engine::Model> model,
    std::span<const int32_t> eos_ids) {
  ASSIGN_OR_RETURN(std::unique_ptr<engine::Backend> backend,
                   engine::CreateBackend(BackendSpecOf(options), std::move(model), eos_ids));
  if (options.fault_device_lost_after_steps >= 0) {
    backend = std::make_unique<DeviceLossInjector>(std::move(backend),
                                                   options.fault_device_lost_after_steps);
  }
  return backend;
}

}  // namespace coalesce::service
