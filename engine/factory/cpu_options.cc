// The CPU backend's settings (--threads, --int8_activations, --float_panels,
// and the KV cache it holds) translated into its options, and what the
// start-up log says of it.
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/memory_bandwidth.h"
#include "engine/cpu/quant_int8.h"
#include "engine/factory/backend_options.h"

namespace coalesce::engine {

absl::StatusOr<std::optional<bool>> ParseFloatPanelsFlag(const std::string& text) {
  if (text == "auto") return std::nullopt;
  if (text == "true" || text == "false") return text == "true";
  return absl::InvalidArgumentError(
      absl::StrCat("--float_panels=", text, ": expected auto, true or false"));
}

absl::StatusOr<CpuBackendOptions> CpuOptions(const BackendSpec& spec, const ModelConfig& config,
                                             int64_t physical_memory_bytes) {
  ASSIGN_OR_RETURN(const KvCacheMemory memory, ParseKvCacheMemory(spec.kv_cache_memory));
  const KvDtype dtype = spec.kv_cache_dtype.value_or(KvDtype::kFp32);
  const int64_t block_bytes = KvBlockBytes(config, spec.kv_block_size, dtype);
  const int64_t context_blocks = (config.max_seq_len + spec.kv_block_size - 1) / spec.kv_block_size;
  const int64_t num_blocks = KvCacheBlocks(memory, block_bytes, context_blocks, spec.max_batch_size,
                                           physical_memory_bytes);
  RETURN_IF_ERROR(CheckNumBlocks(num_blocks, block_bytes, spec.kv_cache_memory));
  CpuBackendOptions out;
  out.kv_cache = {spec.kv_block_size, static_cast<int>(num_blocks), dtype};
  out.threads = spec.threads;
  out.int8_activations = spec.int8_activations;
  out.float_panels = spec.float_panels;
  return out;
}

void LogCpuNotes(const BackendSpec& spec) {
  // The laid-out weights ask for huge pages (engine/cpu/huge_page_memory.h);
  // whether the kernel granted them shows here.
  if (const std::optional<cpu::HugePageUse> use = cpu::ReadHugePageUse();
      use.has_value() && use->resident_bytes > 0) {
    LogF(LogLevel::kInfo, "weights: %.1f of %.1f MB laid out at load on huge pages%s",
         use->huge_bytes / 1e6, use->resident_bytes / 1e6,
         use->huge_bytes < use->resident_bytes / 2
             ? " (/sys/kernel/mm/transparent_hugepage/enabled: `madvise` or `always` "
               "lets the kernel grant them; decoding reads faster from them)"
             : "");
  }
  if (spec.int8_activations && !cpu::Int8DotSupported()) {
    Log(LogLevel::kWarning,
        "--int8_activations: this processor has no AVX2; the quantized weights multiply "
        "float32 activations, exactly");
  }
}

double MeasureHostMemoryBandwidth(const BackendSpec& spec) {
  return MeasureMemoryReadBandwidth(
      spec.threads > 0 ? spec.threads : static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace coalesce::engine
