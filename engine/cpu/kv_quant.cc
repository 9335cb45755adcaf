#include "engine/cpu/kv_quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace coalesce::engine::cpu {

namespace {
constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
}  // namespace

Fp16 ToFp16(float x) { return {static_cast<uint16_t>(_cvtss_sh(x, kNearestEven))}; }

float ToFloat(Fp16 h) { return _cvtsh_ss(h.bits); }

void Convert(const float* x, int n, Bf16* out) {
  for (int i = 0; i < n; ++i) out[i] = ToBf16(x[i]);
}

void Convert(const float* x, int n, Fp16* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), kNearestEven);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = ToFp16(x[i]);
}

float QuantizeInt8(const float* x, int n, int8_t* q) {
  float max = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    max = std::max(max, std::fabs(x[i]));
  }
  const float scale = max / 127.0f;
  if (!finite || scale == 0.0f) {
    std::fill(q, q + n, int8_t{0});
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  for (int i = 0; i < n; ++i) {
    // |x[i] / scale| <= 127 up to float rounding, which the clamp absorbs.
    // nearbyint rounds ties to even (the default rounding mode).
    const float r = std::nearbyint(x[i] / scale);
    q[i] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
  }
  return scale;
}

}  // namespace coalesce::engine::cpu
