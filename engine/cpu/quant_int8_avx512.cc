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
// (a & b) | c, one instruction.
inline __m512i AndOr(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0xEA);
}

// One block (32 columns) of a group's 16 rows, unpacked for vpdpbusd:
// w[q] meets activation quad q (columns 4q .. 4q + 3, as bytes), and the
// block's scales, once for every row of activations that meets it.
template <QuantType kType>
struct Unpacked {
  __m512i w[8];
  __m512 d;       // d; Q4_K's d sc
  __m512 m;       // Q4_1's m; Q4_K's dmin mn
  __m512i sc[2];  // Q6_K's scales of columns 0-15 and 16-31
};

template <QuantType kType>
inline Unpacked<kType> Unpack(const uint8_t* blk, const uint8_t* header) {
  Unpacked<kType> u;
  const __m512i low = _mm512_set1_epi32(0x0F0F0F0F);
  if constexpr (kType == QuantType::kQ8_0) {
    for (int q = 0; q < 8; ++q) u.w[q] = Load(blk + 32 + 64 * q);  // q + 128
    u.d = Halves(blk);
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
    for (int j = 0; j < 4; ++j) {
      const __m512i v = Load(blk + 32 + 64 * j);
      u.w[j] = AndOr(v, low, first_high[j]);
      u.w[j + 4] = AndOr(_mm512_srli_epi32(v, 4), low, second_high[j]);
    }
    u.sc[0] = Signed16(blk);
    u.sc[1] = Signed16(blk + 16);
    u.d = Halves(header);
  } else {
    // Q4_0, Q4_1, Q4_K: nibbles, byte c of quad q holding columns 4q + c
    // (low) and 4q + 16 + c (high). The high nibbles stay in place, 16 times
    // their value (vpdpbusd multiplies bytes up to 255): Apply divides their
    // integer sum by 16, exactly, which saves a shift a vector.
    const uint8_t* n = blk + (kType == QuantType::kQ4_1 ? 64 : 32);
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xF0F0F0F0u));
    for (int q = 0; q < 4; ++q) {
      const __m512i v = Load(n + 64 * q);
      u.w[q] = _mm512_and_si512(v, low);
      u.w[q + 4] = _mm512_and_si512(v, high);
    }
    if constexpr (kType == QuantType::kQ4_K) {
      u.d = _mm512_mul_ps(Halves(header), Unsigned16(blk));
      u.m = _mm512_mul_ps(Halves(header + 32), Unsigned16(blk + 16));
    } else {
      u.d = Halves(blk);
      if constexpr (kType == QuantType::kQ4_1) u.m = Halves(blk + 32);
    }
  }
  return u;
}

// One row's quantized activation block as vpdpbusd meets it: quad q
// (columns 4q .. 4q + 3, as bytes) in every lane, broadcast from memory.
struct Quads {
  __m512i q[8];
};
inline Quads LoadQuads(const int8_t* xq) {
  Quads out;
  for (int q = 0; q < 8; ++q) out.q[q] = _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 4 * q));
  return out;
}

// An unpacked block against one quantized activation block: adds its terms
// (quant_int8.h) to `total`. Independent integer sums (a chain of vpdpbusd
// would wait on each one's latency), added at the end: integers, so exact.
template <QuantType kType>
inline __m512 Apply(const Unpacked<kType>& u, const Quads& x, float dx, int32_t sx, int32_t s1,
                    __m512 total) {
  const __m512 dxv = _mm512_set1_ps(dx);
  if constexpr (kType == QuantType::kQ6_K) {
    __m512i first[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i second[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int j = 0; j < 4; ++j) {
      first[j % 2] = _mm512_dpbusd_epi32(first[j % 2], u.w[j], x.q[j]);
      second[j % 2] = _mm512_dpbusd_epi32(second[j % 2], u.w[j + 4], x.q[j + 4]);
    }
    const __m512i i1 =
        _mm512_sub_epi32(_mm512_add_epi32(first[0], first[1]), _mm512_set1_epi32(32 * s1));
    const __m512i i2 =
        _mm512_sub_epi32(_mm512_add_epi32(second[0], second[1]), _mm512_set1_epi32(32 * (sx - s1)));
    const __m512i dot =
        _mm512_add_epi32(_mm512_mullo_epi32(u.sc[0], i1), _mm512_mullo_epi32(u.sc[1], i2));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(u.d, dxv), total);
  } else {
    __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()};
    for (int q = 0; q < 8; ++q) dots[q / 2] = _mm512_dpbusd_epi32(dots[q / 2], u.w[q], x.q[q]);
    __m512i dot;
    if constexpr (kType == QuantType::kQ8_0) {
      dot =
          _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]), _mm512_add_epi32(dots[2], dots[3]));
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * sx));  // stored as q + 128
    } else {
      // The high nibbles' sum is 16 times theirs (Unpack): a multiple of 16,
      // so the arithmetic shift is exact.
      dot = _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]),
                             _mm512_srai_epi32(_mm512_add_epi32(dots[2], dots[3]), 4));
      if constexpr (kType == QuantType::kQ4_0) {
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * sx));  // q for q - 8
      }
    }
    total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(u.d, dxv), total);
    if constexpr (kType == QuantType::kQ4_1) {
      total = _mm512_fmadd_ps(u.m, _mm512_set1_ps(dx * static_cast<float>(sx)), total);
    } else if constexpr (kType == QuantType::kQ4_K) {
      total = _mm512_fmadd_ps(u.m, _mm512_set1_ps(-(dx * static_cast<float>(sx))), total);
    }
    return total;
  }
}

// Groups gs[0 .. kGroups) against rows [i0, i0 + kTile) of x: each block
// unpacked once for all kTile rows, and the groups read in lockstep, block
// by block (kGroups streams from memory at once: a core keeps more reads in
// flight over several sequential streams than over one).
template <QuantType kType, int kTile, int kGroups>
void GroupRows(const Int8Rows& x, const Int8Matrix& w, const int* gs, int i0, float* y,
               int64_t ldy) {
  // The layout's sizes as constants, for the loops below to unroll.
  constexpr int64_t kBytes = Int8BlockBytes(kType), kHeaderBytes = Int8HeaderBytes(kType);
  constexpr int kPer = Int8BlocksPerHeader(kType);
  const int blocks = w.cols() / 32;
  __m512 total[kGroups][kTile];
#pragma GCC unroll 8
  for (int s = 0; s < kGroups; ++s) {
#pragma GCC unroll 8
    for (int t = 0; t < kTile; ++t) total[s][t] = _mm512_setzero_ps();
  }
  const uint8_t* header[kGroups];
#pragma GCC unroll 8
  for (int s = 0; s < kGroups; ++s) header[s] = w.group(gs[s]);
  for (int b0 = 0; b0 < blocks; b0 += kPer) {
    for (int b = b0; b < b0 + kPer; ++b) {
#pragma GCC unroll 8
      for (int s = 0; s < kGroups; ++s) {
        const uint8_t* blk = header[s] + kHeaderBytes + (b - b0) * kBytes;
        // The bytes kAhead on, asked for now: a core keeps few misses of
        // one sequential stream in flight, and memory delivers more.
#pragma GCC unroll 16
        for (int64_t line = 0; line < kBytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
        }
        const Unpacked<kType> u = Unpack<kType>(blk, header[s]);
#pragma GCC unroll 8
        for (int t = 0; t < kTile; ++t) {
          const size_t at = static_cast<size_t>(i0 + t) * blocks + b;
          total[s][t] = Apply<kType>(u, LoadQuads(x.xq.get() + at * 32), x.scale[at], x.sum[at],
                                     x.first_sum[at], total[s][t]);
        }
      }
    }
#pragma GCC unroll 8
    for (int s = 0; s < kGroups; ++s) header[s] += kHeaderBytes + kPer * kBytes;
  }
  for (int s = 0; s < kGroups; ++s) {
    const int j = gs[s] * kInt8GroupRows, rows = std::min(kInt8GroupRows, w.rows() - j);
    for (int t = 0; t < kTile; ++t) {
      alignas(64) float out[kInt8GroupRows];
      _mm512_store_ps(out, total[s][t]);
      std::copy_n(out, rows, y + (i0 + t) * ldy + j);
    }
  }
}

// Rows of activations that meet each unpacked block together.
constexpr int kRowTile = 4;

// Streams from memory for one row of activations: groups read in lockstep.
// Memory bound; a core keeps more reads in flight over several sequential
// streams than over one (coalesce-engine-bench --limits prints the
// bandwidth of one stream a thread and of 8), and on the 2-vCPU machine
// four read faster than two.
constexpr int kStreams = 4;

// The groups gs[0 .. count) in lockstep against row 0.
template <QuantType kType>
void RowStreams(const Int8Rows& x, const Int8Matrix& w, const int* gs, int count, float* y,
                int64_t ldy) {
  static_assert(kStreams == 4);
  switch (count) {
    case 1:
      return GroupRows<kType, 1, 1>(x, w, gs, 0, y, ldy);
    case 2:
      return GroupRows<kType, 1, 2>(x, w, gs, 0, y, ldy);
    case 3:
      return GroupRows<kType, 1, 3>(x, w, gs, 0, y, ldy);
    default:
      return GroupRows<kType, 1, 4>(x, w, gs, 0, y, ldy);
  }
}

template <QuantType kType>
void Groups(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y, int64_t ldy) {
  if (x.rows == 1) {
    // kStreams runs of consecutive groups, the t-th group of each together.
    const int n = g1 - g0, per = (n + kStreams - 1) / kStreams;
    for (int t = 0; t < per; ++t) {
      int gs[kStreams];
      int count = 0;
      for (int s = 0; s < kStreams; ++s) {
        if (s * per + t < n) gs[count++] = g0 + s * per + t;
      }
      RowStreams<kType>(x, w, gs, count, y, ldy);
    }
    return;
  }
  for (int g = g0; g < g1; ++g) {
    int i = 0;
    for (; i + kRowTile <= x.rows; i += kRowTile) {
      GroupRows<kType, kRowTile, 1>(x, w, &g, i, y, ldy);
    }
    for (; i < x.rows; ++i) GroupRows<kType, 1, 1>(x, w, &g, i, y, ldy);
  }
}

}  // namespace

// Groups [g0, g1) of w against the m quantized rows (quant_int8.cc).
void Int8MatmulGroupsAvx512(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                            int64_t ldy) {
  ForInt8Type(w.type(), [&](auto type) { Groups<decltype(type)::value>(x, w, g0, g1, y, ldy); });
}

}  // namespace coalesce::engine::cpu
