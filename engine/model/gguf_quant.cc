// Block layouts and dequantization of the ggml tensor types. Every formula
// below is the one gguf.quants.dequantize evaluates with numpy in float32, one
// rounding per operation and in the same order. (For the types here every
// product is exact in float32, an f16 scale times small integers, so only
// the final add rounds; the file is still compiled with -ffp-contract=off,
// engine/model/CMakeLists.txt, so that a fused multiply-add can never change
// a last bit.)
#include "engine/model/gguf_quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace coalesce::engine {
namespace {

constexpr int64_t kQK = 256;  // elements per block of the K-quants

// name, block size, bytes per block, dequantizable. The sizes are the
// format's (GGML_QUANT_SIZES in gguf's constants.py).
constexpr std::array<GgmlTypeInfo, 34> kTypes = {{
    {GgmlType::kF32, "F32", 1, 4, true},
    {GgmlType::kF16, "F16", 1, 2, true},
    {GgmlType::kQ4_0, "Q4_0", 32, 2 + 16, true},
    {GgmlType::kQ4_1, "Q4_1", 32, 2 + 2 + 16, true},
    {GgmlType::kQ5_0, "Q5_0", 32, 2 + 4 + 16, true},
    {GgmlType::kQ5_1, "Q5_1", 32, 2 + 2 + 4 + 16, true},
    {GgmlType::kQ8_0, "Q8_0", 32, 2 + 32, true},
    {GgmlType::kQ8_1, "Q8_1", 32, 4 + 4 + 32, false},
    {GgmlType::kQ2_K, "Q2_K", kQK, 2 + 2 + kQK / 16 + kQK / 4, true},
    {GgmlType::kQ3_K, "Q3_K", kQK, 2 + kQK / 4 + kQK / 8 + 12, true},
    {GgmlType::kQ4_K, "Q4_K", kQK, 2 + 2 + kQK / 2 + 12, true},
    {GgmlType::kQ5_K, "Q5_K", kQK, 2 + 2 + kQK / 2 + kQK / 8 + 12, true},
    {GgmlType::kQ6_K, "Q6_K", kQK, 2 + kQK / 2 + kQK / 4 + kQK / 16, true},
    {GgmlType::kQ8_K, "Q8_K", kQK, 4 + kQK + kQK / 8, false},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", kQK, 2 + kQK / 4, false},
    {GgmlType::kIQ2_XS, "IQ2_XS", kQK, 2 + kQK / 4 + kQK / 32, false},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", kQK, 2 + kQK / 4 + kQK / 8, false},
    {GgmlType::kIQ1_S, "IQ1_S", kQK, 2 + kQK / 8 + kQK / 16, false},
    {GgmlType::kIQ4_NL, "IQ4_NL", 32, 2 + 16, false},
    {GgmlType::kIQ3_S, "IQ3_S", kQK, 2 + kQK / 4 + kQK / 8 + kQK / 32 + 4, false},
    {GgmlType::kIQ2_S, "IQ2_S", kQK, 2 + kQK / 4 + kQK / 16, false},
    {GgmlType::kIQ4_XS, "IQ4_XS", kQK, 2 + 2 + kQK / 2 + kQK / 64, false},
    {GgmlType::kI8, "I8", 1, 1, false},
    {GgmlType::kI16, "I16", 1, 2, false},
    {GgmlType::kI32, "I32", 1, 4, false},
    {GgmlType::kI64, "I64", 1, 8, false},
    {GgmlType::kF64, "F64", 1, 8, false},
    {GgmlType::kIQ1_M, "IQ1_M", kQK, kQK / 8 + kQK / 16 + kQK / 32, false},
    {GgmlType::kBF16, "BF16", 1, 2, true},
    {GgmlType::kTQ1_0, "TQ1_0", kQK, 2 + 4 * 13, false},
    {GgmlType::kTQ2_0, "TQ2_0", kQK, 2 + 64, false},
    {GgmlType::kMXFP4, "MXFP4", 32, 1 + 16, false},
    {GgmlType::kNVFP4, "NVFP4", 64, 4 + 32, false},
    {GgmlType::kQ1_0, "Q1_0", 128, 2 + 16, false},
}};

const GgmlTypeInfo* Lookup(uint32_t id) {
  for (const GgmlTypeInfo& info : kTypes) {
    if (static_cast<uint32_t>(info.type) == id) return &info;
  }
  return nullptr;
}

uint16_t Load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
uint32_t Load32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
float Half(const uint8_t* p) { return HalfToFloat(Load16(p)); }
float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Each DequantizeBlock* turns one block at `b` into its elements at `y`, in
// the order of the row.

// Q4_0: d (f16), 16 bytes of 4-bit q: element i < 16 is the low nibble of
// byte i, element 16 + i its high nibble. y = d * (q - 8).
void DequantizeBlockQ4_0(const uint8_t* b, float* y) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>((qs[i] & 0x0F) - 8);
    y[i + 16] = d * static_cast<float>((qs[i] >> 4) - 8);
  }
}

// Q4_1: d, m (f16), nibbles as Q4_0. y = d * q + m.
void DequantizeBlockQ4_1(const uint8_t* b, float* y) {
  const float d = Half(b), m = Half(b + 2);
  const uint8_t* qs = b + 4;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(qs[i] & 0x0F) + m;
    y[i + 16] = d * static_cast<float>(qs[i] >> 4) + m;
  }
}

// Q5_0: d (f16), qh (32 bits, little-endian: bit i is the fifth bit of
// element i), nibbles as Q4_0. y = d * (q - 16).
void DequantizeBlockQ5_0(const uint8_t* b, float* y) {
  const float d = Half(b);
  const uint32_t qh = Load32(b + 2);
  const uint8_t* qs = b + 6;
  for (int i = 0; i < 16; ++i) {
    const int lo = (qs[i] & 0x0F) | ((qh >> i) & 1) << 4;
    const int hi = (qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4;
    y[i] = d * static_cast<float>(lo - 16);
    y[i + 16] = d * static_cast<float>(hi - 16);
  }
}

// Q5_1: d, m (f16), qh, nibbles as Q5_0. y = d * q + m.
void DequantizeBlockQ5_1(const uint8_t* b, float* y) {
  const float d = Half(b), m = Half(b + 2);
  const uint32_t qh = Load32(b + 4);
  const uint8_t* qs = b + 8;
  for (int i = 0; i < 16; ++i) {
    const int lo = (qs[i] & 0x0F) | ((qh >> i) & 1) << 4;
    const int hi = (qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4;
    y[i] = d * static_cast<float>(lo) + m;
    y[i + 16] = d * static_cast<float>(hi) + m;
  }
}

// Q8_0: d (f16), 32 signed bytes. y = q * d.
void DequantizeBlockQ8_0(const uint8_t* b, float* y) {
  const float d = Half(b);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

// Q2_K: 16 scale bytes (low nibble: scale, high nibble: min, of each group of
// 16 elements), 64 bytes of 2-bit q, d, dmin (f16). Element
// e = 128h + 32s + l (h < 2, s < 4, l < 32) is bits 2s..2s+1 of byte 32h + l.
// y = (d * scale) * q - dmin * min.
void DequantizeBlockQ2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = Half(b + 80), dmin = Half(b + 82);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(scales[g] & 0x0F);
    const float ml = dmin * static_cast<float>(scales[g] >> 4);
    for (int k = 0; k < 16; ++k) {
      const int e = g * 16 + k;
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int q = (qs[32 * h + l] >> (2 * s)) & 3;
      y[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

// Q3_K: hmask (32 bytes: bit e / 32 of byte e % 32 is element e's high bit),
// 64 bytes of 2-bit low parts (as Q2_K's q), 12 bytes of 6-bit scales, d
// (f16). Scale k < 16: low 4 bits from byte k (k < 8, low nibble) or byte
// k - 8 (high nibble), high 2 bits from bits 2(k / 4) of byte 8 + k % 4; it is
// used minus 32. q = low - (high bit set ? 0 : 4). y = (d * scale) * q.
void DequantizeBlockQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = Half(b + 108);
  for (int g = 0; g < 16; ++g) {
    const int low = g < 8 ? sc[g] & 0x0F : sc[g - 8] >> 4;
    const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
    const float dl = d * static_cast<float>((low | high << 4) - 32);
    for (int k = 0; k < 16; ++k) {
      const int e = g * 16 + k;
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int q_low = (qs[32 * h + l] >> (2 * s)) & 3;
      const int q_high = (hmask[l] >> (e / 32)) & 1;
      y[e] = dl * static_cast<float>(q_low - (q_high ? 0 : 4));
    }
  }
}

// The 6-bit scales and mins of the 8 sub-blocks of Q4_K and Q5_K, packed in
// 12 bytes: for j < 4, scale = byte j & 63 and min = byte j + 4 & 63; for
// j >= 4, scale = (byte j + 4 & 15) | (byte j - 4 >> 6) << 4 and
// min = (byte j + 4 >> 4) | (byte j >> 6) << 4.
void UnpackScalesMins(const uint8_t* s, int* scale, int* min) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scale[j] = s[j] & 63;
      min[j] = s[j + 4] & 63;
    } else {
      scale[j] = (s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4;
      min[j] = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
  }
}

// Q4_K: d, dmin (f16), 12 bytes of scales and mins, 128 bytes of nibbles:
// sub-block j = 2c + s (32 elements) is nibble s of bytes 32c .. 32c + 31.
// y = (d * scale) * q - dmin * min.
void DequantizeBlockQ4_K(const uint8_t* b, float* y) {
  const float d = Half(b), dmin = Half(b + 2);
  int scale[8], min[8];
  UnpackScalesMins(b + 4, scale, min);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>(scale[j]);
    const float ml = dmin * static_cast<float>(min[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      y[32 * j + l] = dl * static_cast<float>((q[l] >> shift) & 0x0F) - ml;
    }
  }
}

// Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles: bit j of
// byte l is element 32j + l's.
void DequantizeBlockQ5_K(const uint8_t* b, float* y) {
  const float d = Half(b), dmin = Half(b + 2);
  int scale[8], min[8];
  UnpackScalesMins(b + 4, scale, min);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>(scale[j]);
    const float ml = dmin * static_cast<float>(min[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 0x0F) | ((qh[l] >> j) & 1) << 4;
      y[32 * j + l] = dl * static_cast<float>(v) - ml;
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit parts, 16 signed
// scales (one per 16 elements), d (f16). Element e = 128h + r (h < 2,
// r < 128): low = nibble r / 64 of byte 64h + r % 64, high = bits
// 2(r / 32)..+1 of byte 128 + 32h + r % 32. y = (d * scale) * (q - 32).
void DequantizeBlockQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const uint8_t* scales = b + 192;
  const float d = Half(b + 208);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(static_cast<int8_t>(scales[g]));
    for (int k = 0; k < 16; ++k) {
      const int e = g * 16 + k;
      const int h = e / 128, r = e % 128;
      const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      y[e] = dl * static_cast<float>((low | high << 4) - 32);
    }
  }
}

template <void (*Block)(const uint8_t*, float*)>
void DequantizeBlocks(const uint8_t* src, int64_t blocks, int64_t block_size, int64_t block_bytes,
                      float* dst) {
  for (int64_t i = 0; i < blocks; ++i) Block(src + i * block_bytes, dst + i * block_size);
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  if (exponent == 0x1F) return BitsToFloat(sign | 0x7F800000u | mantissa << 13);  // Inf, NaN
  if (exponent != 0) return BitsToFloat(sign | (exponent + 127 - 15) << 23 | mantissa << 13);
  // Zero or subnormal: mantissa * 2^-24, exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t magnitude = x & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {  // NaN: quiet, top of the payload kept
    return static_cast<uint16_t>(sign | 0x7E00 | ((magnitude >> 13) & 0x3FF));
  }
  // 65520 and up (the tie between 65504 and 65536 included) round to infinity.
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00);
  if (magnitude >= 0x38800000u) {
    // A normal half: round the 13 dropped bits to nearest even (a carry
    // moves into the exponent), then rebias the exponent from 127 to 15.
    const uint32_t rounded = magnitude + 0x0FFFu + ((magnitude >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  // A subnormal half (or zero): units of 2^-24, rounded to nearest even.
  const float units = BitsToFloat(magnitude) * 0x1p24f;  // exact, below 2^10
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(units)));
}

namespace {

void Store16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// One block of 32 floats, as gguf.quants' quantize_blocks writes it.
void QuantizeBlockQ8_0(const float* x, uint8_t* b) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  Store16(b, FloatToHalf(d));
  for (int i = 0; i < 32; ++i) {
    b[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[i] * id)));
  }
}

void QuantizeBlockQ4_0(const float* x, uint8_t* b) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < 32; ++i) {
    if (std::fabs(x[i]) > amax) {  // the first of the largest magnitude
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  const float d = max / -8.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  Store16(b, FloatToHalf(d));
  auto q = [&](int i) {
    const float t = std::trunc(x[i] * id + 8.5f);
    return static_cast<uint8_t>(std::clamp(t, 0.0f, 15.0f));
  };
  for (int i = 0; i < 16; ++i) b[2 + i] = static_cast<uint8_t>(q(i) | q(i + 16) << 4);
}

void QuantizeBlockQ4_1(const float* x, uint8_t* b) {
  float max = x[0], min = x[0];
  for (int i = 1; i < 32; ++i) {
    max = std::max(max, x[i]);
    min = std::min(min, x[i]);
  }
  const float d = (max - min) / 15.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  Store16(b, FloatToHalf(d));
  Store16(b + 2, FloatToHalf(min));
  auto q = [&](int i) {
    const float t = std::trunc((x[i] - min) * id + 0.5f);
    return static_cast<uint8_t>(std::clamp(t, 0.0f, 15.0f));
  };
  for (int i = 0; i < 16; ++i) b[4 + i] = static_cast<uint8_t>(q(i) | q(i + 16) << 4);
}

}  // namespace

absl::Status QuantizeFromFloat(GgmlType type, const float* src, int64_t n, void* dst) {
  if (type != GgmlType::kQ8_0 && type != GgmlType::kQ4_0 && type != GgmlType::kQ4_1) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantizing to ", DescribeGgmlTypeId(static_cast<uint32_t>(type)),
                     " is not supported (supported: Q8_0, Q4_0, Q4_1)"));
  }
  if (n < 0 || n % 32 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(n, " elements are not a whole number of blocks of 32"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(src[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("element ", i, " is ", src[i], ": only finite values can be quantized"));
    }
  }
  const int64_t bytes = GetGgmlTypeInfo(type).block_bytes;
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t block = 0; block < n / 32; ++block) {
    const float* x = src + block * 32;
    uint8_t* b = out + block * bytes;
    if (type == GgmlType::kQ8_0) {
      QuantizeBlockQ8_0(x, b);
    } else if (type == GgmlType::kQ4_0) {
      QuantizeBlockQ4_0(x, b);
    } else {
      QuantizeBlockQ4_1(x, b);
    }
  }
  return absl::OkStatus();
}

std::optional<GgmlTypeInfo> FindGgmlType(uint32_t id) {
  const GgmlTypeInfo* info = Lookup(id);
  if (info == nullptr) return std::nullopt;
  return *info;
}

const GgmlTypeInfo& GetGgmlTypeInfo(GgmlType type) {
  static constexpr GgmlTypeInfo kUnknown = {GgmlType::kF32, "unknown", 1, 1, false};
  const GgmlTypeInfo* info = Lookup(static_cast<uint32_t>(type));
  return info != nullptr ? *info : kUnknown;
}

const char* GgmlTypeName(GgmlType type) { return GetGgmlTypeInfo(type).name; }

std::string DescribeGgmlTypeId(uint32_t id) {
  const GgmlTypeInfo* info = Lookup(id);
  if (info == nullptr) return absl::StrCat("id ", id, " (unknown)");
  return absl::StrCat(info->name, " (id ", id, ")");
}

bool GgmlTypeCanDequantize(GgmlType type) {
  const GgmlTypeInfo* info = Lookup(static_cast<uint32_t>(type));
  return info != nullptr && info->can_dequantize;
}

absl::StatusOr<int64_t> GgmlRowBytes(GgmlType type, int64_t n) {
  const GgmlTypeInfo* info = Lookup(static_cast<uint32_t>(type));
  if (info == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ggml type ", DescribeGgmlTypeId(static_cast<uint32_t>(type)), " has no known layout"));
  }
  if (n < 0 || n % info->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, " elements of ", info->name, " are not a whole number of blocks of ", info->block_size));
  }
  const int64_t blocks = n / info->block_size;
  if (blocks > INT64_MAX / info->block_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(n, " elements of ", info->name, " take more than 2^63 bytes"));
  }
  return blocks * info->block_bytes;
}

absl::Status DequantizeToFloat(GgmlType type, const void* src, int64_t n, float* dst) {
  const GgmlTypeInfo* info = Lookup(static_cast<uint32_t>(type));
  if (info == nullptr || !info->can_dequantize) {
    return absl::UnimplementedError(
        absl::StrCat("dequantizing ggml type ", DescribeGgmlTypeId(static_cast<uint32_t>(type)),
                     " is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                     "Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)"));
  }
  auto row_bytes = GgmlRowBytes(type, n);
  if (!row_bytes.ok()) return row_bytes.status();
  const auto* in = static_cast<const uint8_t*>(src);
  const int64_t blocks = n / info->block_size;
  const int64_t bs = info->block_size, bb = info->block_bytes;
  switch (type) {
    case GgmlType::kF32:
      if (n > 0) std::memcpy(dst, in, static_cast<size_t>(n) * sizeof(float));
      return absl::OkStatus();
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Half(in + 2 * i);
      return absl::OkStatus();
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i)
        dst[i] = BitsToFloat(static_cast<uint32_t>(Load16(in + 2 * i)) << 16);
      return absl::OkStatus();
    case GgmlType::kQ4_0:
      DequantizeBlocks<DequantizeBlockQ4_0>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ4_1:
      DequantizeBlocks<DequantizeBlockQ4_1>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ5_0:
      DequantizeBlocks<DequantizeBlockQ5_0>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ5_1:
      DequantizeBlocks<DequantizeBlockQ5_1>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ8_0:
      DequantizeBlocks<DequantizeBlockQ8_0>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ2_K:
      DequantizeBlocks<DequantizeBlockQ2_K>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ3_K:
      DequantizeBlocks<DequantizeBlockQ3_K>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ4_K:
      DequantizeBlocks<DequantizeBlockQ4_K>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ5_K:
      DequantizeBlocks<DequantizeBlockQ5_K>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    case GgmlType::kQ6_K:
      DequantizeBlocks<DequantizeBlockQ6_K>(in, blocks, bs, bb, dst);
      return absl::OkStatus();
    default:
      break;
  }
  return absl::InternalError(absl::StrCat("no dequantizer for ", info->name));
}

GgmlType GgmlTypeOf(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
      return GgmlType::kQ8_0;
    case QuantType::kQ4_0:
      return GgmlType::kQ4_0;
    case QuantType::kQ4_1:
      return GgmlType::kQ4_1;
    case QuantType::kQ4_K:
      return GgmlType::kQ4_K;
    case QuantType::kQ6_K:
      return GgmlType::kQ6_K;
  }
  return GgmlType::kF32;
}

}  // namespace coalesce::engine
