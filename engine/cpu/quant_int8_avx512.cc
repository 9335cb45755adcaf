// The int8 kernel (quant_int8.h), compiled with -mavx512f -mavx512vnni and
// run only where BestInt8Isa() says the processor has both.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine/cpu/quant_int8.h"

namespace coalesce::engine::cpu {
namespace {

// How far ahead of the block in use its successors are prefetched.
constexpr int64_t kAhead = 4096;

inline __m512 Halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 Unsigned16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512i Signed16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i Load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512i Dot(__m512i acc, __m512i weights, int32_t quad) {
  return _mm512_dpbusd_epi32(acc, weights, _mm512_set1_epi32(quad));
}
// (a & b) | c, one instruction.
inline __m512i AndOr(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0xEA);
}

// One block (32 columns) of 16 rows against one quantized activation block:
// adds its terms (quant_int8.h) to `total`. Two or four independent integer
// sums (a chain of vpdpbusd would wait on each one's latency), added at the
// end: integers, so exact.
template <QuantType kType>
inline __m512 Block(const uint8_t* blk, const uint8_t* header, const int32_t quad[8], float dx,
                    int32_t sx, int32_t s1, __m512 total) {
  const __m512i low = _mm512_set1_epi32(0x0F0F0F0F);
  if constexpr (kType == QuantType::kQ8_0) {
    __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()};
    for (int q = 0; q < 8; ++q) dots[q % 4] = Dot(dots[q % 4], Load(blk + 32 + 64 * q), quad[q]);
    // The weights were stored as q + 128.
    const __m512i dot = _mm512_sub_epi32(
        _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]), _mm512_add_epi32(dots[2], dots[3])),
        _mm512_set1_epi32(128 * sx));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(Halves(blk), _mm512_set1_ps(dx)),
                           total);
  } else if constexpr (kType == QuantType::kQ6_K) {
    const __m512i high = _mm512_set1_epi32(0x30303030);
    const __m512i h[2] = {Load(blk + 288), Load(blk + 352)};
    // The high bits of quad j's low (first) and high (second) nibbles, at
    // bits 4-5 of each byte: bits 2 (j % 2) and 2 (j % 2) + 4 of h[j / 2].
    const __m512i first_high[4] = {_mm512_and_si512(_mm512_slli_epi32(h[0], 4), high),
                                   _mm512_and_si512(_mm512_slli_epi32(h[0], 2), high),
                                   _mm512_and_si512(_mm512_slli_epi32(h[1], 4), high),
                                   _mm512_and_si512(_mm512_slli_epi32(h[1], 2), high)};
    const __m512i second_high[4] = {
        _mm512_and_si512(h[0], high), _mm512_and_si512(_mm512_srli_epi32(h[0], 2), high),
        _mm512_and_si512(h[1], high), _mm512_and_si512(_mm512_srli_epi32(h[1], 2), high)};
    __m512i first[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i second[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int j = 0; j < 4; ++j) {
      const __m512i v = Load(blk + 32 + 64 * j);
      first[j % 2] = Dot(first[j % 2], AndOr(v, low, first_high[j]), quad[j]);
      second[j % 2] =
          Dot(second[j % 2], AndOr(_mm512_srli_epi32(v, 4), low, second_high[j]), quad[j + 4]);
    }
    const __m512i i1 =
        _mm512_sub_epi32(_mm512_add_epi32(first[0], first[1]), _mm512_set1_epi32(32 * s1));
    const __m512i i2 =
        _mm512_sub_epi32(_mm512_add_epi32(second[0], second[1]), _mm512_set1_epi32(32 * (sx - s1)));
    const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(Signed16(blk), i1),
                                         _mm512_mullo_epi32(Signed16(blk + 16), i2));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                           _mm512_mul_ps(Halves(header), _mm512_set1_ps(dx)), total);
  } else {
    // Q4_0, Q4_1, Q4_K: nibbles, byte c of quad q holding columns 4q + c
    // (low) and 4q + 16 + c (high).
    const uint8_t* n = blk + (kType == QuantType::kQ4_1 ? 64 : 32);
    __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()};
    for (int q = 0; q < 4; ++q) {
      const __m512i v = Load(n + 64 * q);
      const int a = (q % 2) * 2;
      dots[a] = Dot(dots[a], _mm512_and_si512(v, low), quad[q]);
      dots[a + 1] = Dot(dots[a + 1], _mm512_and_si512(_mm512_srli_epi32(v, 4), low), quad[q + 4]);
    }
    __m512i dot =
        _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]), _mm512_add_epi32(dots[2], dots[3]));
    if constexpr (kType == QuantType::kQ4_0) {
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * sx));  // q for q - 8
    }
    const __m512 dxv = _mm512_set1_ps(dx);
    if constexpr (kType == QuantType::kQ4_K) {
      const __m512 dl = _mm512_mul_ps(Halves(header), Unsigned16(blk));
      const __m512 ml = _mm512_mul_ps(Halves(header + 32), Unsigned16(blk + 16));
      total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dl, dxv), total);
      return _mm512_fmadd_ps(ml, _mm512_set1_ps(-(dx * static_cast<float>(sx))), total);
    } else {
      total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(Halves(blk), dxv), total);
      if constexpr (kType == QuantType::kQ4_1) {
        total =
            _mm512_fmadd_ps(Halves(blk + 32), _mm512_set1_ps(dx * static_cast<float>(sx)), total);
      }
      return total;
    }
  }
}

template <QuantType kType>
void Groups(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y, int64_t ldy) {
  const int blocks = w.cols() / 32, per_header = w.blocks_per_header();
  for (int g = g0; g < g1; ++g) {
    const int j = g * kInt8GroupRows, rows = std::min(kInt8GroupRows, w.rows() - j);
    for (int i = 0; i < x.rows; ++i) {
      const size_t first = static_cast<size_t>(i) * blocks;
      const int8_t* xq = x.xq.get() + first * 32;
      const float* dx = x.scale.get() + first;
      const int32_t* sx = x.sum.get() + first;
      const int32_t* s1 = x.first_sum.get() + first;
      __m512 total = _mm512_setzero_ps();
      for (int b0 = 0; b0 < blocks; b0 += per_header) {
        const uint8_t* header = w.header(g, b0);
        const uint8_t* blk = header + w.header_bytes();
        for (int b = b0; b < b0 + per_header; ++b, blk += w.block_bytes()) {
          // The bytes kAhead on, asked for now: a core keeps few misses of
          // one sequential stream in flight, and memory delivers more.
          for (int64_t line = 0; line < w.block_bytes(); line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
          }
          int32_t quad[8];
          std::memcpy(quad, xq + b * 32, 32);
          total = Block<kType>(blk, header, quad, dx[b], sx[b], s1[b], total);
        }
      }
      alignas(64) float out[kInt8GroupRows];
      _mm512_store_ps(out, total);
      std::copy_n(out, rows, y + i * ldy + j);
    }
  }
}

}  // namespace

// Groups [g0, g1) of w against the m quantized rows (quant_int8.cc).
void Int8MatmulGroupsAvx512(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                            int64_t ldy) {
  switch (w.type()) {
    case QuantType::kQ8_0:
      return Groups<QuantType::kQ8_0>(x, w, g0, g1, y, ldy);
    case QuantType::kQ4_0:
      return Groups<QuantType::kQ4_0>(x, w, g0, g1, y, ldy);
    case QuantType::kQ4_1:
      return Groups<QuantType::kQ4_1>(x, w, g0, g1, y, ldy);
    case QuantType::kQ4_K:
      return Groups<QuantType::kQ4_K>(x, w, g0, g1, y, ldy);
    case QuantType::kQ6_K:
      return Groups<QuantType::kQ6_K>(x, w, g0, g1, y, ldy);
  }
}

}  // namespace coalesce::engine::cpu
