// The server's backend: ServerOptions' backend flags (--device, --dtype,
// --kv_cache_dtype, --kv_cache_memory, the batch limits and each backend's
// own) handed to the engine's backend factory (engine/factory/
// backend_factory.h, which says which backend they choose and how each reads
// them), and the result wrapped in the fault injector when --fault_injection
// asks.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/factory/backend_factory.h"
#include "engine/model.h"
#include "service/server_options.h"

namespace coalesce::service {

// The backend's settings among `options`, as the engine's factory takes them.
engine::BackendSpec BackendSpecOf(const ServerOptions& options);

// engine::CreateBackend with BackendSpecOf(options), wrapped in the fault
// injector when --fault_injection asks. `eos_ids` are the tokenizer's
// end-of-sequence ids (only the null backend uses them). Errors say which
// flag or which device; a bad flag value is INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<engine::Backend>> CreateBackend(
    const ServerOptions& options, std::shared_ptr<const engine::Model> model,
    std::span<const int32_t> eos_ids);

}  // namespace coalesce::service
