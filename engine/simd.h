// Small AVX2 helpers shared by the sampler and the CPU kernels. Everything in
// engine/ is built for x86-64-v3 (COALESCE_ARCH_FLAGS).
#pragma once

#include <immintrin.h>

#include <cmath>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "engine/ needs AVX2 and FMA: build with COALESCE_ARCH_FLAGS=-march=x86-64-v3 or newer"
#endif

namespace coalesce::engine::simd {

// Lanes (0+4, 1+5, 2+6, 3+7), then (a+c, b+d), then the two: one fixed order,
// so a sum depends only on the lanes, never on the caller.
inline float HorizontalSum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// e^x for x <= 0 to about 2 ulp (Cephes expf: x = k ln2 + r, a degree-5
// polynomial for e^r, 2^k through the exponent bits); x below -87 gives
// about 0 and NaN gives 0. libm's scalar expf costs ~5 ns; this is 8 at once.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 is_number = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_k =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(two_k)), is_number);
}

// x[i] *= scale for i < n; returns the largest of `max` and the results (a
// maximum is the same in any order: only NaN, which no caller passes on,
// would depend on it).
inline float ScaleInPlaceAndMax(float* x, int n, float scale, float max) {
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(max);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vscale);
    _mm256_storeu_ps(x + i, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  const __m128 quad = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  const __m128 pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
  float out = _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
  for (; i < n; ++i) {
    x[i] *= scale;
    out = x[i] > out ? x[i] : out;
  }
  return out;
}

// x[i] *= scale for i < n.
inline void ScaleInPlace(float* x, int n, float scale) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vscale));
  for (; i < n; ++i) x[i] *= scale;
}

// x[i] = e^((x[i] - max) * scale) for i < n, with scale > 0 and max >= every
// x[i]; returns the sum of the results (8 lane sums, then HorizontalSum).
inline float ExpShiftedInPlace(float* x, int n, float max, float scale) {
  const __m256 vmax = _mm256_set1_ps(max), vscale = _mm256_set1_ps(scale);
  __m256 vsum = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e =
        ExpNonPositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax), vscale));
    _mm256_storeu_ps(x + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (i < n) {
    // The tail through the same polynomial, so every element is computed
    // alike wherever it sits.
    alignas(32) float tail[8] = {};
    for (int j = 0; j < n - i; ++j) tail[j] = x[i + j];
    for (int j = n - i; j < 8; ++j) tail[j] = NAN;  // NaN -> 0: adds nothing
    const __m256 e =
        ExpNonPositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(tail), vmax), vscale));
    _mm256_store_ps(tail, e);
    for (int j = 0; j < n - i; ++j) x[i + j] = tail[j];
    vsum = _mm256_add_ps(vsum, e);
  }
  return HorizontalSum(vsum);
}

}  // namespace coalesce::engine::simd
