// Each backend's options from a BackendSpec (backend_factory.h), one file
// per backend: cpu_options.cc, cuda_options.cc, null_options.cc. What
// CreateBackend builds each backend with; its tests check them without a GPU.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/factory/backend_factory.h"
#include "engine/model.h"
#include "engine/null/null_backend.h"

namespace coalesce::engine {

// The CPU backend's options: --kv_cache_memory against `physical_memory_bytes`,
// in blocks of --kv_cache_dtype (auto: fp32); its threads, int8 activations
// and float panels.
absl::StatusOr<CpuBackendOptions> CpuOptions(const BackendSpec& spec, const ModelConfig& config,
                                             int64_t physical_memory_bytes);

// The CUDA backend's options: precision, block size, KV sizing
// (backend_factory.h), max_batch_tokens, max_batch_size (as max_seqs), CUDA
// graphs.
absl::StatusOr<CudaBackendOptions> CudaOptions(const BackendSpec& spec, const ModelConfig& config,
                                               Precision precision);

// The null backend's options: the CPU's KV accounting (CpuOptions), and
// `eos_ids` (the tokenizer's) as the ids it must never emit, so that every
// generation runs to its max_new_tokens.
absl::StatusOr<NullBackendOptions> NullOptions(const BackendSpec& spec, const ModelConfig& config,
                                               int64_t physical_memory_bytes,
                                               std::span<const int32_t> eos_ids);

// KV block ids are int32 in the block tables: INVALID_ARGUMENT, naming
// --kv_cache_memory's `flag` text, for fewer than one block or more than
// int32 holds.
absl::Status CheckNumBlocks(int64_t num_blocks, int64_t block_bytes, const std::string& flag);

// The CPU backend's part of LogBackendNotes (backend_factory.h).
void LogCpuNotes(const BackendSpec& spec);

}  // namespace coalesce::engine
