#include "service/server_options.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace coalesce::service {

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

absl::StatusOr<std::optional<engine::Precision>> ParseDtype(const std::string& text) {
  if (text == "auto") return std::optional<engine::Precision>();
  absl::StatusOr<engine::Precision> precision = engine::ParsePrecision(text);
  if (!precision.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", text, ": expected auto, bf16, fp16 or fp32"));
  }
  return std::optional<engine::Precision>(*precision);
}

absl::StatusOr<std::optional<engine::KvDtype>> ParseKvCacheDtype(const std::string& text) {
  if (text == "auto") return std::optional<engine::KvDtype>();
  absl::StatusOr<engine::KvDtype> dtype = engine::ParseKvDtype(text);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_dtype=", text,
        ": expected auto, fp32, bf16, fp16, int8 (the CPU; on CUDA only the weights' precision "
        "so far) or fp8 (CUDA, not built yet)"));
  }
  return std::optional<engine::KvDtype>(*dtype);
}

absl::StatusOr<std::optional<bool>> ParseOverlapSteps(const std::string& text) {
  if (text == "auto") return std::optional<bool>();
  if (text == "on") return std::optional<bool>(true);
  if (text == "off") return std::optional<bool>(false);
  return absl::InvalidArgumentError(
      absl::StrCat("--overlap_steps=", text, ": expected auto, on or off"));
}

absl::StatusOr<int> ParseFaultInjection(const std::string& text) {
  if (text.empty()) return -1;
  constexpr std::string_view kDeviceLost = "device_lost_after_steps:";
  int steps;
  if (text.rfind(kDeviceLost, 0) != 0 ||
      !absl::SimpleAtoi(text.substr(kDeviceLost.size()), &steps) || steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fault_injection=", text, ": expected device_lost_after_steps:N with N >= 0"));
  }
  return steps;
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

}  // namespace coalesce::service
