// Precision names and sizes (precision.h): in every build, with or without
// the CUDA backend, so flags and tools parse them the same way.
#include "engine/precision.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace coalesce::engine {

const char* PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
    case Precision::kFp32:
      return "fp32";
  }
  return "unknown";
}

int PrecisionBytes(Precision precision) { return precision == Precision::kFp32 ? 4 : 2; }

absl::StatusOr<Precision> ParsePrecision(const std::string& text) {
  for (Precision precision : {Precision::kBf16, Precision::kFp16, Precision::kFp32}) {
    if (text == PrecisionName(precision)) return precision;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown precision \"", text, "\" (expected bf16, fp16 or fp32)"));
}

}  // namespace coalesce::engine
