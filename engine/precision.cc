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

const char* KvDtypeName(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFp32:
      return "fp32";
    case KvDtype::kBf16:
      return "bf16";
    case KvDtype::kFp16:
      return "fp16";
    case KvDtype::kInt8:
      return "int8";
    case KvDtype::kFp8:
      return "fp8";
  }
  return "unknown";
}

absl::StatusOr<KvDtype> ParseKvDtype(const std::string& text) {
  for (KvDtype dtype :
       {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kFp16, KvDtype::kInt8, KvDtype::kFp8}) {
    if (text == KvDtypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown KV cache dtype \"", text,
                                                 "\" (expected fp32, bf16, fp16, int8 or fp8)"));
}

int KvDtypeBytes(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFp32:
      return 4;
    case KvDtype::kBf16:
    case KvDtype::kFp16:
      return 2;
    case KvDtype::kInt8:
    case KvDtype::kFp8:
      return 1;
  }
  return 4;
}

int KvDtypeScaleBytes(KvDtype dtype) { return dtype == KvDtype::kInt8 ? 4 : 0; }

KvDtype KvDtypeOf(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return KvDtype::kBf16;
    case Precision::kFp16:
      return KvDtype::kFp16;
    case Precision::kFp32:
      return KvDtype::kFp32;
  }
  return KvDtype::kFp32;
}

}  // namespace coalesce::engine
