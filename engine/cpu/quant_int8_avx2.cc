// The int8 kernel (quant_int8.h) for processors without AVX512-VNNI: AVX2
// (the engine's baseline, x86-64-v3). A 16-row group runs as two halves of
// 8 rows, one 32-bit lane each. vpmaddubsw multiplies unsigned weight bytes by
// signed activation bytes and adds pairs into 16 bits, and vpmaddwd adds the
// pairs into the lane: vpdpbusd's sum of four, in two instructions. The
// pairs never saturate: the 4- and 6-bit integers stay below 64, and Q8_0's
// signed weights go in as |q| (at most 128) against x with q's sign, so a
// pair is at most 2 * 128 * 127. The integer sums are exact, so the results
// are the AVX-512 kernel's, bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine/cpu/quant_int8.h"

namespace coalesce::engine::cpu {
namespace {

constexpr int64_t kAhead = 4096;  // as the AVX-512 kernel's prefetch

inline __m256 Halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 Unsigned8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i Signed8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i Load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// acc + the sums of four products of unsigned `weights` and signed x bytes
// per lane (no pair above 32767: above).
inline __m256i Dot(__m256i acc, __m256i weights, __m256i x) {
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(weights, x), _mm256_set1_epi16(1)));
}

// Half h (rows 8h .. 8h + 7) of one block of a group: as the AVX-512
// kernel's Block, on 8 lanes.
template <QuantType kType>
inline __m256 HalfBlock(const uint8_t* blk, const uint8_t* header, int h, const __m256i quad[8],
                        float dx, int32_t sx, int32_t s1, __m256 total) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int lanes = 32 * h;  // this half's bytes in each 64-byte quad
  const __m256 dxv = _mm256_set1_ps(dx);
  if constexpr (kType == QuantType::kQ8_0) {
    __m256i dots[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int q = 0; q < 8; ++q) {
      // Stored as q + 128: back to q, then |q| against x with q's sign.
      const __m256i w = _mm256_xor_si256(Load(blk + 32 + 64 * q + lanes), _mm256_set1_epi8(-128));
      dots[q % 2] = Dot(dots[q % 2], _mm256_abs_epi8(w), _mm256_sign_epi8(quad[q], w));
    }
    const __m256i dot = _mm256_add_epi32(dots[0], dots[1]);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(Halves(blk + 16 * h), dxv),
                           total);
  } else if constexpr (kType == QuantType::kQ6_K) {
    const __m256i high = _mm256_set1_epi8(0x30);
    const __m256i hb[2] = {Load(blk + 288 + lanes), Load(blk + 352 + lanes)};
    const __m256i first_high[4] = {_mm256_and_si256(_mm256_slli_epi32(hb[0], 4), high),
                                   _mm256_and_si256(_mm256_slli_epi32(hb[0], 2), high),
                                   _mm256_and_si256(_mm256_slli_epi32(hb[1], 4), high),
                                   _mm256_and_si256(_mm256_slli_epi32(hb[1], 2), high)};
    const __m256i second_high[4] = {
        _mm256_and_si256(hb[0], high), _mm256_and_si256(_mm256_srli_epi32(hb[0], 2), high),
        _mm256_and_si256(hb[1], high), _mm256_and_si256(_mm256_srli_epi32(hb[1], 2), high)};
    __m256i first = _mm256_setzero_si256(), second = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = Load(blk + 32 + 64 * j + lanes);
      first = Dot(first, _mm256_or_si256(_mm256_and_si256(v, low), first_high[j]), quad[j]);
      second = Dot(second,
                   _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v, 4), low), second_high[j]),
                   quad[j + 4]);
    }
    const __m256i i1 = _mm256_sub_epi32(first, _mm256_set1_epi32(32 * s1));
    const __m256i i2 = _mm256_sub_epi32(second, _mm256_set1_epi32(32 * (sx - s1)));
    const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(Signed8(blk + 8 * h), i1),
                                         _mm256_mullo_epi32(Signed8(blk + 16 + 8 * h), i2));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(Halves(header + 16 * h), dxv),
                           total);
  } else {
    const uint8_t* n = blk + (kType == QuantType::kQ4_1 ? 64 : 32) + lanes;
    __m256i dots[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int q = 0; q < 4; ++q) {
      const __m256i v = Load(n + 64 * q);
      dots[0] = Dot(dots[0], _mm256_and_si256(v, low), quad[q]);
      dots[1] = Dot(dots[1], _mm256_and_si256(_mm256_srli_epi32(v, 4), low), quad[q + 4]);
    }
    __m256i dot = _mm256_add_epi32(dots[0], dots[1]);
    if constexpr (kType == QuantType::kQ4_0) {
      dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * sx));
    }
    if constexpr (kType == QuantType::kQ4_K) {
      const __m256 dl = _mm256_mul_ps(Halves(header + 16 * h), Unsigned8(blk + 8 * h));
      const __m256 ml = _mm256_mul_ps(Halves(header + 32 + 16 * h), Unsigned8(blk + 16 + 8 * h));
      total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dl, dxv), total);
      return _mm256_fmadd_ps(ml, _mm256_set1_ps(-(dx * static_cast<float>(sx))), total);
    } else {
      total =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(Halves(blk + 16 * h), dxv), total);
      if constexpr (kType == QuantType::kQ4_1) {
        total = _mm256_fmadd_ps(Halves(blk + 32 + 16 * h),
                                _mm256_set1_ps(dx * static_cast<float>(sx)), total);
      }
      return total;
    }
  }
}

// Groups gs[0 .. S) against row i of X, block by block in lockstep: S
// streams from memory, each activation quad loaded once for all of them.
// A group's sums run in the same order whatever S is.
template <QuantType kType, int S>
void GroupsAgainstRow(const Int8Rows& x, int i, const Int8Matrix& w, const int* gs, float* y,
                      int64_t ldy) {
  // The layout's sizes as constants, for the loops below to unroll.
  constexpr int64_t kBytes = Int8BlockBytes(kType), kHeaderBytes = Int8HeaderBytes(kType);
  constexpr int kPer = Int8BlocksPerHeader(kType);
  const int blocks = w.cols() / 32;
  const size_t first = static_cast<size_t>(i) * blocks;
  const int8_t* xq = x.xq.get() + first * 32;
  const float* dx = x.scale.get() + first;
  const int32_t* sx = x.sum.get() + first;
  const int32_t* s1 = x.first_sum.get() + first;
  __m256 total[S][2];
  const uint8_t* header[S];
  for (int s = 0; s < S; ++s) {
    total[s][0] = total[s][1] = _mm256_setzero_ps();
    header[s] = w.group(gs[s]);
  }
  for (int b0 = 0; b0 < blocks; b0 += kPer) {
    for (int b = b0; b < b0 + kPer; ++b) {
      // Quad q of the activation block in every lane, read once for both
      // halves of every group.
      __m256i quad[8];
      for (int q = 0; q < 8; ++q) {
        quad[q] = _mm256_broadcastd_epi32(_mm_loadu_si32(xq + b * 32 + 4 * q));
      }
      for (int s = 0; s < S; ++s) {
        const uint8_t* blk = header[s] + kHeaderBytes + (b - b0) * kBytes;
#pragma GCC unroll 8
        for (int64_t line = 0; line < kBytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
        }
        for (int h = 0; h < 2; ++h) {
          total[s][h] = HalfBlock<kType>(blk, header[s], h, quad, dx[b], sx[b], s1[b], total[s][h]);
        }
      }
    }
    for (int s = 0; s < S; ++s) header[s] += kHeaderBytes + kPer * kBytes;
  }
  for (int s = 0; s < S; ++s) {
    const int j = gs[s] * kInt8GroupRows, rows = std::min(kInt8GroupRows, w.rows() - j);
    alignas(32) float out[kInt8GroupRows];
    _mm256_store_ps(out, total[s][0]);
    _mm256_store_ps(out + 8, total[s][1]);
    std::copy_n(out, rows, y + i * ldy + j);
  }
}

template <QuantType kType>
void Groups(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y, int64_t ldy) {
  if (x.rows == 1) {
    // One row: the thread's groups as two runs side by side (its first
    // half and its second), two streams from memory. On a 2-core AMD EPYC
    // (AVX2), `coalesce-quant-bench --rows=1` at 110M, six alternating runs:
    // each type's best pass rose from 81-90% of the floor to 90-96% (the
    // means); three runs gained nothing more.
    const int half = (g1 - g0 + 1) / 2;
    for (int g = g0; g < g0 + half; ++g) {
      if (g + half < g1) {
        const int gs[2] = {g, g + half};
        GroupsAgainstRow<kType, 2>(x, 0, w, gs, y, ldy);
      } else {
        GroupsAgainstRow<kType, 1>(x, 0, w, &g, y, ldy);
      }
    }
    return;
  }
  for (int g = g0; g < g1; ++g) {
    for (int i = 0; i < x.rows; ++i) GroupsAgainstRow<kType, 1>(x, i, w, &g, y, ldy);
  }
}

}  // namespace

void Int8MatmulGroupsAvx2(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                          int64_t ldy) {
  ForInt8Type(w.type(), [&](auto type) { Groups<decltype(type)::value>(x, w, g0, g1, y, ldy); });
}

}  // namespace coalesce::engine::cpu
