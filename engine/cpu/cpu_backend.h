// The CPU backend: float32, batched. Each weight matrix is applied to all rows
// of a step in one matrix product (cpu/kernels.h: a batch-invariant product of
// our own, not BLAS sgemm, whose rows depend on their batch-mates); attention
// runs per token over its sequence's paged KV blocks, parallel across tokens
// and heads. A sequence gets bit-identical logits whatever shares its batch.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace coalesce::engine {

struct CpuBackendOptions {
  KvCacheConfig kv_cache;
  int threads = 0;  // compute threads; 0: one per core
};

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(std::shared_ptr<const Model> model,
                                                          const CpuBackendOptions& options);

}  // namespace coalesce::engine
