// The int8 kernel (quant_int8.h), compiled with -mavx512f -mavx512vnni and
// run only where Int8DotSupported() says the processor has both.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine/cpu/quant_int8.h"

namespace coalesce::engine::cpu {

// How far ahead of the block in use its successors are prefetched.
constexpr int64_t kAhead = 4096;

void Int8MatmulGroupsAvx512(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                            int64_t ldy) {
  const int blocks = w.cols() / 32;
  const QuantType type = w.type();
  const __m512i low = _mm512_set1_epi32(0x0F0F0F0F);
  for (int g = g0; g < g1; ++g) {
    const uint8_t* group = w.group(g);
    const int j = g * kInt8GroupRows, rows = std::min(kInt8GroupRows, w.rows() - j);
    for (int i = 0; i < x.rows; ++i) {
      const int8_t* xq = x.xq.get() + static_cast<size_t>(i) * blocks * 32;
      const float* dx = x.scale.get() + static_cast<size_t>(i) * blocks;
      const int32_t* sx = x.sum.get() + static_cast<size_t>(i) * blocks;
      __m512 total = _mm512_setzero_ps();
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* blk = group + b * w.block_bytes();
        // The block kAhead bytes on, asked for now: a core keeps few misses
        // of one sequential stream in flight, and memory delivers more.
        for (int64_t line = 0; line < w.block_bytes(); line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
        }
        int32_t quad[8];
        std::memcpy(quad, xq + b * 32, 32);
        // Four independent sums (a chain of eight vpdpbusd would wait on
        // each one's latency), added at the end: integers, so exact.
        __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                           _mm512_setzero_si512()};
        if (type == QuantType::kQ8_0) {
          for (int q = 0; q < 8; ++q) {
            const __m512i v = _mm512_loadu_si512(blk + 32 + 64 * q);
            dots[q % 4] = _mm512_dpbusd_epi32(dots[q % 4], v, _mm512_set1_epi32(quad[q]));
          }
        } else {
          const int base = type == QuantType::kQ4_1 ? 64 : 32;
          for (int q = 0; q < 4; ++q) {
            const __m512i v = _mm512_loadu_si512(blk + base + 64 * q);
            const int a = (q % 2) * 2;
            dots[a] =
                _mm512_dpbusd_epi32(dots[a], _mm512_and_si512(v, low), _mm512_set1_epi32(quad[q]));
            dots[a + 1] =
                _mm512_dpbusd_epi32(dots[a + 1], _mm512_and_si512(_mm512_srli_epi32(v, 4), low),
                                    _mm512_set1_epi32(quad[q + 4]));
          }
        }
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]),
                                       _mm512_add_epi32(dots[2], dots[3]));
        // Q8_0's weights were stored as q + 128; Q4_0's are q for q - 8.
        if (type == QuantType::kQ8_0) {
          dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * sx[b]));
        } else if (type == QuantType::kQ4_0) {
          dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * sx[b]));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(dx[b]));
        total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, total);
        if (type == QuantType::kQ4_1) {
          const __m512 m =
              _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
          total = _mm512_fmadd_ps(m, _mm512_set1_ps(dx[b] * static_cast<float>(sx[b])), total);
        }
      }
      alignas(64) float out[kInt8GroupRows];
      _mm512_store_ps(out, total);
      std::copy_n(out, rows, y + i * ldy + j);
    }
  }
}

}  // namespace coalesce::engine::cpu
