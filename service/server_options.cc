#include "service/server_options.h"

#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace coalesce::service {

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

}  // namespace coalesce::service
