// The element types the CPU backend's KV cache can hold besides float32
// (--kv_cache_dtype: bf16, fp16, int8), and the conversions into them, which
// the backend applies as it writes each token's K and V. The attention
// kernels (kernels.h) read them back as the floats they stand for: bf16 and
// fp16 widen to float exactly, and an int8 value q of scale s stands for
// q * s.
#pragma once

#include <cstdint>
#include <cstring>

namespace coalesce::engine::cpu {

// The bits of a bfloat16 and of an IEEE half, as the cache stores them: two
// types, so that the kernels' overloads tell them apart.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

// float -> bfloat16, rounding to nearest with ties to even (the carry into
// the exponent rounds past the largest bf16 to infinity, as IEEE rounding
// does); a NaN stays a (quiet) NaN.
inline Bf16 ToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((u >> 16) | 0x0040u)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

inline float ToFloat(Bf16 h) {
  const uint32_t u = uint32_t{h.bits} << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// float -> IEEE half, rounding to nearest with ties to even (F16C, part of
// x86-64-v3, which engine/ is built for). Beyond 65504 a value rounds to
// infinity: fp16's range is the price of its precision.
Fp16 ToFp16(float x);
float ToFloat(Fp16 h);

// out[i] = ToBf16(x[i]) or ToFp16(x[i]) for i < n: one token's K or V of one
// KV head, as the backend writes it.
void Convert(const float* x, int n, Bf16* out);
void Convert(const float* x, int n, Fp16* out);

// Symmetric int8 over one token's values of one KV head: returns the scale
// s = max|x| / 127 and writes q[i] = x[i] / s rounded to nearest (ties to
// even), which lies in [-127, 127]; x[i] is then q[i] * s within s / 2. All
// zeros give s = 0 and q = 0. A head holding an infinity or a NaN gives
// s = NaN and q = 0, so that it reads back as NaN, as a float32 cache holding
// it would poison attention too.
//   x: [n]   q: [n]
float QuantizeInt8(const float* x, int n, int8_t* q);

}  // namespace coalesce::engine::cpu
