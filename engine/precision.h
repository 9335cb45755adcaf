// The storage precision of weights and the KV cache: what --dtype names. The
// CPU backend holds float32; the CUDA backend any of the three (arithmetic is
// float32 throughout).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace coalesce::engine {

enum class Precision { kBf16, kFp16, kFp32 };

// "bf16", "fp16", "fp32".
const char* PrecisionName(Precision precision);
// Parses "bf16" / "fp16" / "fp32"; InvalidArgument otherwise.
absl::StatusOr<Precision> ParsePrecision(const std::string& text);
// Bytes of one element: 2 or 4.
int PrecisionBytes(Precision precision);

}  // namespace coalesce::engine
