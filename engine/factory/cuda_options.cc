// The CUDA backend's settings (--cuda_graphs, the precision and KV cache
// PlanBackend chose, the batcher's limits) translated into its options.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/factory/backend_options.h"

namespace coalesce::engine {

absl::StatusOr<CudaBackendOptions> CudaOptions(const BackendSpec& spec, const ModelConfig& config,
                                               Precision precision) {
  ASSIGN_OR_RETURN(const KvCacheMemory memory, ParseKvCacheMemory(spec.kv_cache_memory));
  CudaBackendOptions out;
  out.precision = precision;
  out.kv_cache_dtype = spec.kv_cache_dtype;
  out.block_size = spec.kv_block_size;
  out.max_batch_tokens = spec.max_batch_tokens;
  out.max_seqs = spec.max_batch_size;
  out.cuda_graphs = spec.cuda_graphs;
  // Free device memory is known only once the weights are on the device, so
  // a fraction is the backend's to apply; a size is ours.
  out.num_blocks = 0;
  if (memory.automatic) {
    out.kv_memory_fraction = 0.9;
  } else if (memory.fraction > 0) {
    out.kv_memory_fraction = memory.fraction;
  } else {
    const int64_t block_bytes = KvBlockBytes(config, spec.kv_block_size,
                                             spec.kv_cache_dtype.value_or(KvDtypeOf(precision)));
    const int64_t num_blocks = memory.bytes / block_bytes;
    RETURN_IF_ERROR(CheckNumBlocks(num_blocks, block_bytes, spec.kv_cache_memory));
    out.num_blocks = static_cast<int>(num_blocks);
  }
  return out;
}

}  // namespace coalesce::engine
