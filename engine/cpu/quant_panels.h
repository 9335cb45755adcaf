// The quantized matrix product's loop (quant_matmul.h): each packed panel is
// dequantized into the panel buffer, kKBlock values of k at a time, and then
// runs against every row of X through the float32 product's own tile kernel
// (matmul_panels.h), so the arithmetic is Matmul's.
//
// Included by kernels.cc (AVX2) and kernels_avx512.cc, into an anonymous
// namespace, so that each file's instructions stay its own: the AVX-512
// file (compiled with -mavx512f, __AVX512F__) dequantizes 16 rows a vector,
// the AVX2 one 8 (AVX2 + F16C, x86-64-v3, which the engine is built for).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine/cpu/matmul_panels.h"
#include "engine/cpu/quant_matmul.h"

namespace coalesce::engine::cpu {
namespace {  // NOLINT(google-build-namespaces): one copy per instruction set

// 8 f16 values -> 8 floats (exact).
inline __m256 Halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 unsigned or signed bytes -> 8 floats.
inline __m256 Unsigned8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 Signed8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 16 bytes of nibbles (byte c: row c low, row c + 16 high) -> the 32 rows'
// integers, 8 rows a vector: each 8 bytes widened to 32-bit lanes once (a
// load and a widening in one instruction), then split there.
inline void Nibbles(const uint8_t* p, __m256i out[4]) {
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  out[0] = _mm256_and_si256(a, mask);  // rows 0-7
  out[1] = _mm256_and_si256(b, mask);  // rows 8-15
  out[2] = _mm256_srli_epi32(a, 4);    // rows 16-23
  out[3] = _mm256_srli_epi32(b, 4);    // rows 24-31
}

// One column of a Q6_K group -> its 32 rows' 6-bit integers, 8 rows a
// vector, from 16 bytes of low nibbles (byte c: rows c and c + 16) and 8 of
// high bits (byte c: rows c, c + 8, c + 16, c + 24 at bits 0, 2, 4, 6). As
// Nibbles: each 8 bytes widened to 32-bit lanes once, as they load, so that
// lane c holds every byte with bits for rows c (+ 8, 16, 24), and each row's
// two high bits are shifted to bits 4-5 of its lane there.
inline void Q6Column(const uint8_t* low, const uint8_t* high, __m256i out[4]) {
  __m256i n[4];
  Nibbles(low, n);
  const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(high)));
  const __m256i two = _mm256_set1_epi32(0x30);
  out[0] = _mm256_or_si256(n[0], _mm256_and_si256(_mm256_slli_epi32(h, 4), two));  // rows 0-7
  out[1] = _mm256_or_si256(n[1], _mm256_and_si256(_mm256_slli_epi32(h, 2), two));  // 8-15
  out[2] = _mm256_or_si256(n[2], _mm256_and_si256(h, two));                        // 16-23
  out[3] = _mm256_or_si256(n[3], _mm256_and_si256(_mm256_srli_epi32(h, 2), two));  // 24-31
}

// Calls sink(kk, i, v) with the dequantized weights of one group (its
// layout: quant_matmul.h): v holds rows 8i .. 8i + 7 at column kk of the
// group, kk in increasing order. Each value is the block formula's float, as
// gguf.quants.dequantize computes it.
template <typename Kernel, typename Sink>
inline void ForEachValue(QuantType type, const uint8_t* group, Sink&& sink) {
  static_assert(kPanel == 32, "a group holds 32 rows");
  __m256 d[4];
  for (int i = 0; i < 4; ++i) d[i] = Halves(group + 16 * i);
  switch (type) {
    case QuantType::kQ8_0: {
      const uint8_t* q = group + 64;
      for (int kk = 0; kk < 32; ++kk) {
        for (int i = 0; i < 4; ++i) sink(kk, i, _mm256_mul_ps(Signed8(q + kk * 32 + 8 * i), d[i]));
      }
      break;
    }
    case QuantType::kQ4_0: {
      // d * (q - 8) as fma(d, q, -8 d): d * q and 8 d are exact, and so is
      // their difference, so the fused form's one rounding changes nothing
      // (and saves an instruction).
      __m256 c[4];
      for (int i = 0; i < 4; ++i) c[i] = _mm256_mul_ps(d[i], _mm256_set1_ps(-8.0f));
      for (int kk = 0; kk < 32; ++kk) {
        __m256i n[4];
        Nibbles(group + 64 + kk * 16, n);
        for (int i = 0; i < 4; ++i) {
          sink(kk, i, _mm256_fmadd_ps(d[i], _mm256_cvtepi32_ps(n[i]), c[i]));
        }
      }
      break;
    }
    case QuantType::kQ4_1: {
      __m256 m[4];
      for (int i = 0; i < 4; ++i) m[i] = Halves(group + 64 + 16 * i);
      for (int kk = 0; kk < 32; ++kk) {
        __m256i n[4];
        Nibbles(group + 128 + kk * 16, n);
        for (int i = 0; i < 4; ++i) {
          // d * q is exact, so a fused d * q + m rounds as the two steps do.
          sink(kk, i, _mm256_fmadd_ps(d[i], _mm256_cvtepi32_ps(n[i]), m[i]));
        }
      }
      break;
    }
    case QuantType::kQ4_K: {
      __m256 dmin[4];
      for (int i = 0; i < 4; ++i) dmin[i] = Halves(group + 64 + 16 * i);
      for (int j = 0; j < 8; ++j) {
        __m256 dl[4], ml[4];
        for (int i = 0; i < 4; ++i) {
          dl[i] = _mm256_mul_ps(d[i], Unsigned8(group + 128 + j * 32 + 8 * i));
          ml[i] = _mm256_mul_ps(dmin[i], Unsigned8(group + 384 + j * 32 + 8 * i));
        }
        for (int kk = 32 * j; kk < 32 * j + 32; ++kk) {
          __m256i n[4];
          Nibbles(group + 640 + kk * 16, n);
          for (int i = 0; i < 4; ++i) {
            // dl * q is exact (17 bits by 4): fused, the one rounding is the
            // subtraction's.
            sink(kk, i, _mm256_fmsub_ps(dl[i], _mm256_cvtepi32_ps(n[i]), ml[i]));
          }
        }
      }
      break;
    }
    case QuantType::kQ6_K: {
      // dl * (q - 32) as fma(dl, q, -32 dl): exact, as Q4_0's.
      for (int j = 0; j < 16; ++j) {
        __m256 dl[4], c[4];
        for (int i = 0; i < 4; ++i) {
          dl[i] = _mm256_mul_ps(d[i], Signed8(group + 64 + j * 32 + 8 * i));
          c[i] = _mm256_mul_ps(dl[i], _mm256_set1_ps(-32.0f));
        }
        for (int kk = 16 * j; kk < 16 * j + 16; ++kk) {
          __m256i q[4];
          Q6Column(group + 576 + kk * 16, group + 576 + 4096 + kk * 8, q);
          for (int i = 0; i < 4; ++i) {
            sink(kk, i, _mm256_fmadd_ps(dl[i], _mm256_cvtepi32_ps(q[i]), c[i]));
          }
        }
      }
      break;
    }
  }
}

#ifdef __AVX512F__
// The same values 16 rows at a time (the AVX-512 file only): sink(kk, i, v)
// with v holding rows 16i .. 16i + 15, i < 2. Half the instructions of the
// AVX2 sequence for the same arithmetic.
inline __m512 Halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 Unsigned16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 Signed16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 bytes of nibbles -> rows 0..15 (low nibbles) and 16..31 (high): the
// bytes widened once, then split in their 32-bit lanes.
inline void Nibbles16(const uint8_t* p, __m512i out[2]) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  out[0] = _mm512_and_si512(v, _mm512_set1_epi32(15));
  out[1] = _mm512_srli_epi32(v, 4);
}

template <typename Sink>
inline void ForEachValue16(QuantType type, const uint8_t* group, Sink&& sink) {
  __m512 d[2];
  for (int i = 0; i < 2; ++i) d[i] = Halves16(group + 32 * i);
  switch (type) {
    case QuantType::kQ8_0: {
      const uint8_t* q = group + 64;
      for (int kk = 0; kk < 32; ++kk) {
        for (int i = 0; i < 2; ++i)
          sink(kk, i, _mm512_mul_ps(Signed16(q + kk * 32 + 16 * i), d[i]));
      }
      break;
    }
    case QuantType::kQ4_0: {
      // No conversion: with byte c (rows c and c + 16) at bits 12-19 of a
      // lane, row c's nibble q lies in the mantissa of 2048 + q (exponent
      // bits of 2^11 over bits 12-15 alone) and row c + 16's in that of
      // 128 + q (2^7 over bits 16-19). Then d (q - 8) = fma(d, 2048 + q,
      // -2056 d), and fma(d, 128 + q, -136 d): every product of d (11
      // significant bits) with these (at most 12) is exact, and so is d (q -
      // 8), so the one rounding leaves it as it is, as in the other types'
      // formulas (ForEachValue).
      const __m512i mask[2] = {_mm512_set1_epi32(0x0000F000), _mm512_set1_epi32(0x000F0000)};
      const __m512i exponent[2] = {_mm512_set1_epi32(0x45000000), _mm512_set1_epi32(0x43000000)};
      const __m512 c[2] = {_mm512_mul_ps(d[0], _mm512_set1_ps(-2056.0f)),
                           _mm512_mul_ps(d[1], _mm512_set1_ps(-136.0f))};
      for (int kk = 0; kk < 32; ++kk) {
        const __m512i v = _mm512_slli_epi32(
            _mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 64 + kk * 16))),
            12);
        for (int i = 0; i < 2; ++i) {
          // (v & mask) | exponent
          const __m512 f =
              _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, mask[i], exponent[i], 0xEA));
          sink(kk, i, _mm512_fmadd_ps(d[i], f, c[i]));
        }
      }
      break;
    }
    case QuantType::kQ4_1: {
      __m512 m[2];
      for (int i = 0; i < 2; ++i) m[i] = Halves16(group + 64 + 32 * i);
      for (int kk = 0; kk < 32; ++kk) {
        __m512i n[2];
        Nibbles16(group + 128 + kk * 16, n);
        for (int i = 0; i < 2; ++i) {
          sink(kk, i, _mm512_fmadd_ps(d[i], _mm512_cvtepi32_ps(n[i]), m[i]));  // exact, as above
        }
      }
      break;
    }
    case QuantType::kQ4_K: {
      __m512 dmin[2];
      for (int i = 0; i < 2; ++i) dmin[i] = Halves16(group + 64 + 32 * i);
      for (int j = 0; j < 8; ++j) {
        __m512 dl[2], ml[2];
        for (int i = 0; i < 2; ++i) {
          dl[i] = _mm512_mul_ps(d[i], Unsigned16(group + 128 + j * 32 + 16 * i));
          ml[i] = _mm512_mul_ps(dmin[i], Unsigned16(group + 384 + j * 32 + 16 * i));
        }
        for (int kk = 32 * j; kk < 32 * j + 32; ++kk) {
          __m512i n[2];
          Nibbles16(group + 640 + kk * 16, n);
          for (int i = 0; i < 2; ++i) {
            sink(kk, i, _mm512_fmsub_ps(dl[i], _mm512_cvtepi32_ps(n[i]), ml[i]));  // as above
          }
        }
      }
      break;
    }
    case QuantType::kQ6_K: {
      // The rotations that bring lane c's two high bits to bits 4-5, for
      // rows c (from bit 2 (c / 8)) and c + 16 (from 4 + 2 (c / 8)).
      const __m512i rotate_low = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4);
      const __m512i rotate_high =
          _mm512_set_epi32(30, 30, 30, 30, 30, 30, 30, 30, 0, 0, 0, 0, 0, 0, 0, 0);
      for (int j = 0; j < 16; ++j) {
        __m512 dl[2], c[2];  // fma(dl, q, -32 dl), exact
        for (int i = 0; i < 2; ++i) {
          dl[i] = _mm512_mul_ps(d[i], Signed16(group + 64 + j * 32 + 16 * i));
          c[i] = _mm512_mul_ps(dl[i], _mm512_set1_ps(-32.0f));
        }
        for (int kk = 16 * j; kk < 16 * j + 16; ++kk) {
          // In 32-bit lanes: lane c holds byte c of the low bits (row c's
          // low nibble, row c + 16's high one) and byte c % 8 of the high
          // bits (the 8 bytes twice, widened), whose two bits for row c (at
          // 2 (c / 8)) and for row c + 16 (at 4 + 2 (c / 8)) a per-lane
          // rotation brings to bits 4-5.
          const __m512i low = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 576 + kk * 16)));
          int64_t bits;
          std::memcpy(&bits, group + 576 + 4096 + kk * 8, 8);
          const __m512i high = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bits));
          const __m512i two = _mm512_set1_epi32(0x30);
          const __m512i q[2] = {
              // (low & 15) | (rotated & 0x30)
              _mm512_ternarylogic_epi32(low, _mm512_set1_epi32(15),
                                        _mm512_and_si512(_mm512_rolv_epi32(high, rotate_low), two),
                                        0xEA),
              _mm512_or_si512(_mm512_srli_epi32(low, 4),
                              _mm512_and_si512(_mm512_rolv_epi32(high, rotate_high), two))};
          for (int i = 0; i < 2; ++i) {
            sink(kk, i, _mm512_fmadd_ps(dl[i], _mm512_cvtepi32_ps(q[i]), c[i]));
          }
        }
      }
      break;
    }
  }
}
#endif  // __AVX512F__

// Dequantizes `groups` consecutive groups of a packed panel into
// panel[kk * kPanel + r], kk counting from the first group's first column.
template <typename Kernel>
void UnpackGroups(QuantType type, const uint8_t* group, int groups, int64_t group_bytes,
                  float* panel) {
  const int block = QuantBlockSize(type);
  for (int gi = 0; gi < groups; ++gi, group += group_bytes, panel += block * kPanel) {
#ifdef __AVX512F__
    ForEachValue16(type, group, [panel](int kk, int i, __m512 v) {
      _mm512_store_ps(panel + kk * kPanel + 16 * i, v);
    });
#else
    ForEachValue<Kernel>(type, group, [panel](int kk, int i, __m256 v) {
      _mm256_store_ps(panel + kk * kPanel + 8 * i, v);
    });
#endif
  }
}

// Runs of panels that one row of X reads in lockstep (QuantMatvecPanels): a
// core keeps more reads in flight over several sequential streams than over
// one, and more chains hide the FMAs' latency. With AVX-512 and four runs,
// coalesce-quant-bench --rows=1 --int8=false timed Q8_0, Q4_0 and Q4_1 in
// 13-23% less time than with one (docs/performance.md); Q4_K and Q6_K,
// bound by their instructions, in 4-10% more, so they read one. With AVX2
// (16 registers: a run's sums take four) Q8_0 reads two: on an AMD EPYC it
// reached 85% of its floor against 77% with one, in the mean of six runs
// of each; Q4_0 and Q4_1 ran the same with two, and three or four runs
// spilled and ran slower.
inline constexpr int kMatvecRuns = 4;
inline int MatvecRunsFor(QuantType type) {
#ifdef __AVX512F__
  return type == QuantType::kQ4_K || type == QuantType::kQ6_K ? 1 : kMatvecRuns;
#else
  return type == QuantType::kQ8_0 ? 2 : 1;
#endif
}

// Panels ps[0 .. kRuns) against one row of X, group by group in lockstep:
// each weight goes from its block straight into its output's chain, y[j] =
// fma(w[j, k], x[k], y[j]) for k in increasing order, with no panel buffer
// in between. `prefetch(group)` asks for the bytes ahead of a group.
template <typename Kernel, int kRuns, typename Prefetcher>
void MatvecRuns(const float* x, const PackedMatrix& w, const int* ps, float* y,
                const Prefetcher& prefetch) {
  const int block = QuantBlockSize(w.type()), groups = w.cols() / block;
  const uint8_t* group[kRuns];
  for (int s = 0; s < kRuns; ++s) group[s] = w.panel(ps[s]);
  alignas(64) float out[kRuns][kPanel];
#ifdef __AVX512F__
  __m512 acc[kRuns][2];
  for (int s = 0; s < kRuns; ++s) acc[s][0] = acc[s][1] = _mm512_setzero_ps();
  for (int gi = 0; gi < groups; ++gi) {
    const float* xg = x + gi * block;
#pragma GCC unroll 4
    for (int s = 0; s < kRuns; ++s) {
      prefetch(group[s]);
      __m512* a = acc[s];
      ForEachValue16(w.type(), group[s], [a, xg](int kk, int i, __m512 v) {
        a[i] = _mm512_fmadd_ps(v, _mm512_set1_ps(xg[kk]), a[i]);
      });
      group[s] += w.group_bytes();
    }
  }
  for (int s = 0; s < kRuns; ++s) {
    for (int i = 0; i < 2; ++i) _mm512_store_ps(out[s] + 16 * i, acc[s][i]);
  }
#else
  __m256 acc[kRuns][4];
  for (int s = 0; s < kRuns; ++s) {
    for (int i = 0; i < 4; ++i) acc[s][i] = _mm256_setzero_ps();
  }
  for (int gi = 0; gi < groups; ++gi) {
    const float* xg = x + gi * block;
#pragma GCC unroll 4
    for (int s = 0; s < kRuns; ++s) {
      prefetch(group[s]);
      __m256* a = acc[s];
      ForEachValue<Kernel>(w.type(), group[s], [a, xg](int kk, int i, __m256 v) {
        a[i] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(xg + kk), a[i]);
      });
      group[s] += w.group_bytes();
    }
  }
  for (int s = 0; s < kRuns; ++s) {
    for (int i = 0; i < 4; ++i) _mm256_store_ps(out[s] + 8 * i, acc[s][i]);
  }
#endif
  for (int s = 0; s < kRuns; ++s) {
    const int j = ps[s] * kPanel, rows = std::min(kPanel, w.rows() - j);
    std::copy_n(out[s], rows, y + j);
  }
}

// One row of X against panels [p0, p1) (a decode step of one sequence,
// bound by reading the blocks): MatvecRunsFor(type) runs of consecutive
// panels, the t-th panel of each together (MatvecRuns).
template <typename Kernel>
void QuantMatvecPanels(const float* x, const PackedMatrix& w, int p0, int p1, float* y) {
  // Each group asks for the bytes `ahead` of it (the panels of a run lie one
  // after another, so past a panel's end come the next one's groups).
  const int64_t ahead = std::max<int64_t>(4096, 2 * w.group_bytes());
  const uint8_t* base = w.panel(0);
  auto prefetch = [&](const uint8_t* group) {
    const int64_t from = (group - base) + ahead;
    const int64_t to = std::min(from + w.group_bytes(), w.bytes());
    for (int64_t line = from; line < to; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(base + line), _MM_HINT_T0);
    }
  };
  static_assert(kMatvecRuns == 4);
  const int runs = MatvecRunsFor(w.type());
  const int n = p1 - p0, per = (n + runs - 1) / runs;
  for (int t = 0; t < per; ++t) {
    int ps[kMatvecRuns];
    int count = 0;
    for (int s = 0; s < runs; ++s) {
      if (s * per + t < n) ps[count++] = p0 + s * per + t;
    }
    switch (count) {
      case 1:
        MatvecRuns<Kernel, 1>(x, w, ps, y, prefetch);
        break;
      case 2:
        MatvecRuns<Kernel, 2>(x, w, ps, y, prefetch);
        break;
      case 3:
        MatvecRuns<Kernel, 3>(x, w, ps, y, prefetch);
        break;
      default:
        MatvecRuns<Kernel, 4>(x, w, ps, y, prefetch);
    }
  }
}

#ifndef __AVX512F__
// Two rows of X with AVX2: each panel's weights go from their blocks
// straight into both rows' chains (8 accumulators), with no panel buffer in
// between, so the dequantization, most of the work, is done once for both.
// On an AVX2-only AMD EPYC, coalesce-quant-bench --rows=2 --int8=false
// timed Q8_0, Q4_K and Q6_K in 28-43% less time this way than through the
// panel buffer, Q4_0 in 15% less, Q4_1 the same; with three or four rows
// (12 or 16 sums in 16 registers) it ran slower than the buffer.
template <typename Kernel>
void QuantTwoRowsPanels(const float* x, int64_t ldx, const PackedMatrix& w, int p0, int p1,
                        float* y, int64_t ldy) {
  const int block = QuantBlockSize(w.type()), groups = w.cols() / block;
  for (int p = p0; p < p1; ++p) {
    const uint8_t* group = w.panel(p);
    __m256 acc[4][2];
    for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
    for (int gi = 0; gi < groups; ++gi, group += w.group_bytes()) {
      const float* xg = x + gi * block;
      ForEachValue<Kernel>(w.type(), group, [&acc, xg, ldx](int kk, int i, __m256 v) {
        acc[i][0] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(xg + kk), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(xg + ldx + kk), acc[i][1]);
      });
    }
    const int j = p * kPanel, rows = std::min(kPanel, w.rows() - j);
    alignas(32) float out[kPanel];
    for (int r = 0; r < 2; ++r) {
      for (int i = 0; i < 4; ++i) _mm256_store_ps(out + 8 * i, acc[i][r]);
      std::copy_n(out, rows, y + r * ldy + j);
    }
  }
}
#endif  // !__AVX512F__

// Panels [p0, p1) of w against all m rows of x (quant_matmul.h).
template <typename Kernel>
void QuantMatmulPanelsWith(const float* x, int64_t ldx, int m, const PackedMatrix& w, int p0,
                           int p1, float* y, int64_t ldy) {
  if (m == 1) {
    QuantMatvecPanels<Kernel>(x, w, p0, p1, y);
    return;
  }
#ifndef __AVX512F__
  if (m == 2) {
    QuantTwoRowsPanels<Kernel>(x, ldx, w, p0, p1, y, ldy);
    return;
  }
#endif
  float* panel = PanelBuffer();
  const int k = w.cols(), block = QuantBlockSize(w.type());
  const int tiles = (m + Kernel::kTileX - 1) / Kernel::kTileX;
  const Prefetch none{};
  for (int p = p0; p < p1; ++p) {
    const int j = p * kPanel;
    const int rows = std::min(kPanel, w.rows() - j);
    for (int k0 = 0; k0 < k; k0 += kKBlock) {
      const int kb = std::min(kKBlock, k - k0);
      UnpackGroups<Kernel>(w.type(), w.panel(p) + int64_t{k0 / block} * w.group_bytes(), kb / block,
                           w.group_bytes(), panel);
      for (int tile = 0, i = 0; tile < tiles; ++tile) {
        const int height = std::min(Kernel::kTileX, m - i);
        TileOf<Kernel>(height, x + i * ldx + k0, ldx, panel, kb, k0 > 0, rows, y + i * ldy + j, ldy,
                       none);
        i += height;
      }
    }
  }
}

}  // namespace
}  // namespace coalesce::engine::cpu
