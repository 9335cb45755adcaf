// The CPU backend: float32, batched. Each weight matrix is applied to all rows
// of a step in one matrix product (BLAS sgemm); attention runs per sequence
// over its own paged KV blocks, parallel across sequences and heads.
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

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    std::shared_ptr<const Model> model, const CpuBackendOptions& options);

// Call first thing in main(), before any thread exists. Debian's OpenBLAS
// picks its kernels when the library loads and misdetects some AVX-512 Xeons
// as a 2004 Pentium 4, running 5x slower. When OPENBLAS_CORETYPE is unset and
// the CPU has AVX-512, this sets it and re-executes the program so the
// library loads again with the right kernels. A value already set is kept.
void ConfigureBlasForThisCpu(char** argv);

}  // namespace coalesce::engine
