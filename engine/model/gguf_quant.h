// The tensor types of GGUF files (ggml's type ids) and their dequantization
// to float32. Written from the format's block layouts; the reference for every
// value is PyPI's `gguf` package (gguf.quants.dequantize), which
// tests/engine/model/test_gguf_parity.py holds this code to bit for bit.
//
// A quantized type stores elements in blocks: `block_size` consecutive
// elements of a row in `block_bytes` bytes. A row of n elements (n a multiple
// of the block size) takes n / block_size * block_bytes bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model.h"

namespace coalesce::engine {

// Every type id whose block layout is known. Only those of
// GgmlTypeCanDequantize can be dequantized; the rest (Q8_1, Q8_K, the IQ and
// TQ types, the integer types, F64, MXFP4, NVFP4, Q1_0) can be laid out in a
// file (GgufFile opens it) but not converted. Ids 4, 5, 31 to 33 and 36 to 38
// belonged to types since removed from ggml and are unknown here.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

// The layout of one type.
struct GgmlTypeInfo {
  GgmlType type;
  const char* name;     // as ggml and gguf name it: "Q4_K", "BF16"
  int64_t block_size;   // elements per block (1 for the plain types)
  int64_t block_bytes;  // bytes per block
  bool can_dequantize;  // DequantizeToFloat supports it
};

// The type with this id, or nullopt for an id no known type has.
std::optional<GgmlTypeInfo> FindGgmlType(uint32_t id);
// The info of a type of the enum (every one is known).
const GgmlTypeInfo& GetGgmlTypeInfo(GgmlType type);

// "Q4_K"; for an unknown id, "unknown".
const char* GgmlTypeName(GgmlType type);
// "Q4_K (id 12)", "id 4 (unknown)": for messages about a type id.
std::string DescribeGgmlTypeId(uint32_t id);

// Whether DequantizeToFloat supports the type: F32, F16, BF16, Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.
bool GgmlTypeCanDequantize(GgmlType type);

// Bytes of a row of n elements: n must be >= 0 and a multiple of the type's
// block size, and the result must fit in int64; otherwise INVALID_ARGUMENT
// naming the type and n.
absl::StatusOr<int64_t> GgmlRowBytes(GgmlType type, int64_t n);

// Converts n elements of `type` at `src` (GgmlRowBytes(type, n) bytes, any
// alignment) to float32 at `dst` (n floats), bit for bit as
// gguf.quants.dequantize does: F32 and BF16 bits are kept exactly (NaN
// payloads included), F16 is widened exactly (signalling NaNs stay
// signalling, as numpy keeps them), and each quantized element is computed in
// float32 with one rounding per operation of the block formula (no fused
// multiply-add). Errors: UNIMPLEMENTED for a type that cannot be dequantized
// (named), INVALID_ARGUMENT for a bad n.
absl::Status DequantizeToFloat(GgmlType type, const void* src, int64_t n, float* dst);

// The ggml type whose blocks a quantized matrix of the engine holds
// (model.h's QuantType: the same layout, byte for byte).
GgmlType GgmlTypeOf(QuantType type);

// The float32 value of an IEEE binary16 (exact; NaN payloads kept).
float HalfToFloat(uint16_t h);

// The IEEE binary16 nearest to f, ties to even (numpy's astype(float16)):
// past 65504 it rounds to infinity; a NaN stays a quiet NaN.
uint16_t FloatToHalf(float f);

// The reverse of DequantizeToFloat for Q8_0, Q4_0 and Q4_1: n floats at src
// (n a multiple of 32) to n / 32 blocks at dst, byte for byte what
// gguf.quants.quantize (ggml's reference quantization) writes, in float32
// with one rounding per operation:
//   Q8_0: d = max|x| / 127, q = round(x / d) (halves away from zero)
//   Q4_0: d = x_max / -8 (x_max: the first element of largest magnitude),
//         q = min(15, trunc(x / d + 8.5))
//   Q4_1: d = (max - min) / 15, m = min, q = min(15, trunc((x - m) / d + 0.5))
// (dividing by d as multiplying by 1 / d, 0 when d is 0). INVALID_ARGUMENT
// for another type, a bad n, or a value that is not finite.
absl::Status QuantizeFromFloat(GgmlType type, const float* src, int64_t n, void* dst);

}  // namespace coalesce::engine
