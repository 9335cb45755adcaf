// The storage precision of weights and the KV cache: what --dtype names. The
// CPU backend holds float32; the CUDA backend any of the three (arithmetic is
// float32 throughout). And what the KV cache alone may hold (--kv_cache_dtype),
// which can be narrower than the weights.
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

// The element type of the KV cache. kInt8 is symmetric int8 with one float
// scale per token position and KV head (scale = max|x| / 127 over the head's
// head_dim values, x = q * scale); kFp8 is e4m3, a CUDA type (the CPU backend
// refuses it).
enum class KvDtype { kFp32, kBf16, kFp16, kInt8, kFp8 };

// "fp32", "bf16", "fp16", "int8", "fp8".
const char* KvDtypeName(KvDtype dtype);
// Parses the names above; InvalidArgument otherwise.
absl::StatusOr<KvDtype> ParseKvDtype(const std::string& text);
// Bytes of one cached element: 4, 2, 2, 1, 1.
int KvDtypeBytes(KvDtype dtype);
// Bytes of scale per token position and KV head: 4 (a float) for kInt8, 0
// for the float types.
int KvDtypeScaleBytes(KvDtype dtype);
// The KV cache type of weights held at `precision` (what a backend whose KV
// cache follows its weights holds).
KvDtype KvDtypeOf(Precision precision);

}  // namespace coalesce::engine
