// The quantized matrix product's kernels (quant_matmul.h, which defines
// the arithmetic): one or two rows of X read each panel's blocks straight
// into their chains (FewRowsPanels); more go through tiles over the panel's
// integers and scales, unpacked into buffers kKBlock values of k at a time
// (ManyRowsPanels). Every path computes the same definition, so a row's
// result does not depend on the others.
//
// Included by kernels.cc (AVX2) and kernels_avx512.cc, into an anonymous
// namespace. The code is AVX2 + F16C (x86-64-v3, which the engine is built
// for) in both, so both give the same bits; the AVX-512 file's compiler may
// use its 32 registers.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

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

// The integers of a column of 32 rows come out of their bytes in 32-bit
// lanes, lane c holding rows c, c + 8, c + 16 and c + 24 side by side
// (quant_matmul.h's layout), and each row's bits are masked where they lie,
// never shifted down (a mask runs on more of the processor's vector pipes
// than a shift). So rows 8i .. 8i + 7 come out times a power of two,
// CodeScale(type, i), which their scales undo (Scales): exactly, as long as
// the products stay in float32's normal range. It is 2^(4i) for the 4-bit
// types; 2^(6i) for Q6_K's first three rows of a lane, and 1 for its last,
// shifted down; 1 for Q8_0, whose bytes are not in lanes.
constexpr float CodeScale(QuantType type, int i) {
  if (type == QuantType::kQ8_0) return 1.0f;
  if (type == QuantType::kQ6_K) return static_cast<float>(i == 3 ? 1 : 1 << (6 * i));
  return static_cast<float>(1 << (4 * i));
}

// Column 2p + odd of a pair's 32 bytes of nibbles (lane c: column 2p's
// 16-bit word c, rows c, c + 8, c + 16, c + 24, in its low half, column
// 2p + 1's in its high half) -> the 32 rows' integers, 8 rows a vector: one
// load (and for the odd column a shift), then each nibble masked in place.
inline void Nibbles(const uint8_t* pair, bool odd, __m256i out[4]) {
  __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
  if (odd) w = _mm256_srli_epi32(w, 16);
  out[0] = _mm256_and_si256(w, _mm256_set1_epi32(0x000f));  // rows 0-7
  out[1] = _mm256_and_si256(w, _mm256_set1_epi32(0x00f0));  // rows 8-15, times 16
  out[2] = _mm256_and_si256(w, _mm256_set1_epi32(0x0f00));  // rows 16-23, times 256
  out[3] = _mm256_and_si256(w, _mm256_set1_epi32(0xf000));  // rows 24-31, times 4096
}

// One column of a Q6_K group (24 bytes: lane c's 24 bits in bytes 3c to
// 3c + 2, rows c, c + 8, c + 16, c + 24 at bits 0, 6, 12, 18) -> its 32
// rows' 6-bit integers, 8 rows a vector, as Nibbles. One load from 4 bytes
// before the column puts lanes 0-3's bytes in its low 16 and lanes 4-7's in
// its high 16, so one shuffle within each half spreads them into the 8
// lanes. (The load reads 4 bytes before a column, in its group, and 4 after
// the last one: PackedMatrix leaves room.) The last row, whose top bit would
// fall in a float's exponent, is shifted down.
inline void Q6Column(const uint8_t* p, __m256i out[4]) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p - 4));
  const __m256i spread = _mm256_setr_epi8(4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1,
                                          0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  const __m256i lane = _mm256_shuffle_epi8(raw, spread);
  out[0] = _mm256_and_si256(lane, _mm256_set1_epi32(0x3f));     // rows 0-7
  out[1] = _mm256_and_si256(lane, _mm256_set1_epi32(0xfc0));    // rows 8-15, times 64
  out[2] = _mm256_and_si256(lane, _mm256_set1_epi32(0x3f000));  // rows 16-23, times 4096
  out[3] = _mm256_srli_epi32(lane, 18);                         // rows 24-31
}

// Values of k in a group (QuantBlockSize, as a constant).
constexpr int GroupSize(QuantType type) {
  return type == QuantType::kQ4_K || type == QuantType::kQ6_K ? 256 : 32;
}
constexpr bool HasOffset(QuantType type) { return type != QuantType::kQ8_0; }

// The integers of column 2 pair + h of a group (its layout: quant_matmul.h)
// as floats (exact), times CodeScale: q[i] holds rows 8i .. 8i + 7. With
// kSubnormal (CodeFloats::kSubnormal; not Q8_0, whose bytes are signed)
// there is no conversion: the masked lane, read as a float, is its integer
// times 2^-149, a subnormal (quant_matmul.h).
template <QuantType kType, bool kSubnormal = false>
inline void Codes(const uint8_t* group, int pair, int h, __m256 q[4]) {
  static_assert(!kSubnormal || kType != QuantType::kQ8_0);
  const int kk = 2 * pair + h;
  __m256i n[4];
  if constexpr (kType == QuantType::kQ8_0) {
    for (int i = 0; i < 4; ++i) q[i] = Signed8(group + 64 + kk * 32 + 8 * i);
    return;
  } else if constexpr (kType == QuantType::kQ6_K) {
    Q6Column(group + 576 + kk * 24, n);
  } else {
    constexpr int kAt = kType == QuantType::kQ4_0 ? 64 : kType == QuantType::kQ4_1 ? 128 : 640;
    Nibbles(group + kAt + pair * 32, h == 1, n);
  }
  for (int i = 0; i < 4; ++i) {
    q[i] = kSubnormal ? _mm256_castsi256_ps(n[i]) : _mm256_cvtepi32_ps(n[i]);
  }
}

// What a group's sub-blocks share of their scales, as floats (Q4_K and
// Q6_K, whose 8 or 16 sub-blocks each multiply them by their own integer
// scale): d divided by CodeScale, and Q4_K's -dmin. Converted once a group
// (LoadGroupScales), not once a sub-block.
struct GroupScales {
  alignas(32) float d[kPanel];
  alignas(32) float dmin[kPanel];
};

template <QuantType kType>
inline void LoadGroupScales(const uint8_t* group, GroupScales& g) {
  for (int i = 0; i < 4; ++i) {
    _mm256_store_ps(g.d + 8 * i, _mm256_mul_ps(Halves(group + 16 * i),
                                               _mm256_set1_ps(1.0f / CodeScale(kType, i))));
    if constexpr (kType == QuantType::kQ4_K) {
      _mm256_store_ps(g.dmin + 8 * i,
                      _mm256_xor_ps(Halves(group + 64 + 16 * i), _mm256_set1_ps(-0.0f)));
    }
  }
}

// The scales of sub-block j of a group: a weight is dl * q + ml (Q8_0's ml
// is 0, and unused), rows 8i .. 8i + 7 in [i]. Each is an exact product of
// the file's fields: Q4_0's ml is -8 d, Q4_1's m, Q4_K's -dmin * min, Q6_K's
// -32 dl. dl comes divided by CodeScale, as Codes' integers come
// multiplied. The K types' shared fields come from g (LoadGroupScales).
template <QuantType kType>
inline void Scales(const uint8_t* group, int j, const GroupScales& g, __m256 dl[4], __m256 ml[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m256 undo = _mm256_set1_ps(1.0f / CodeScale(kType, i));
    if constexpr (kType == QuantType::kQ8_0) {
      dl[i] = Halves(group + 16 * i);
      ml[i] = _mm256_setzero_ps();
    } else if constexpr (kType == QuantType::kQ4_0) {
      const __m256 d = Halves(group + 16 * i);
      dl[i] = _mm256_mul_ps(d, undo);
      ml[i] = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    } else if constexpr (kType == QuantType::kQ4_1) {
      dl[i] = _mm256_mul_ps(Halves(group + 16 * i), undo);
      ml[i] = Halves(group + 64 + 16 * i);
    } else if constexpr (kType == QuantType::kQ4_K) {
      dl[i] = _mm256_mul_ps(_mm256_load_ps(g.d + 8 * i), Unsigned8(group + 128 + j * 32 + 8 * i));
      ml[i] =
          _mm256_mul_ps(_mm256_load_ps(g.dmin + 8 * i), Unsigned8(group + 384 + j * 32 + 8 * i));
    } else {
      dl[i] = _mm256_mul_ps(_mm256_load_ps(g.d + 8 * i), Signed8(group + 64 + j * 32 + 8 * i));
      ml[i] = _mm256_mul_ps(dl[i], _mm256_set1_ps(-32.0f * CodeScale(kType, i)));
    }
  }
}

// One sub-block's sum of codes times x, t, into its output y (the block
// sum of x: s): y = fma(dl, t, fma(ml, s, y)), ml's term only where the
// type has one (quant_matmul.h).
template <QuantType kType>
inline __m256 Settle(__m256 y, __m256 t, __m256 dl, __m256 ml, __m256 s) {
  if constexpr (HasOffset(kType)) y = _mm256_fmadd_ps(ml, s, y);
  return _mm256_fmadd_ps(dl, t, y);
}

// Runs of panels that one row of X reads in lockstep (FewRowsPanels): a
// core keeps more reads in flight over several sequential streams than over
// one, and more chains hide the FMAs' latency. Two rows of X read one. A
// parallel loop hands out this many panels at a time (QuantPanelsPerUnit).
inline constexpr int kMatvecRuns = QuantPanelsPerUnit(1);

// How far ahead of the bytes it reads a one-row kernel asks for memory:
// past a panel's end come the next one's groups (the panels of a run lie
// one after another). 2 KiB for every type: on an AMD EPYC (Zen 3) with the
// weights in huge pages, Q4_K's and Q6_K's one-row steps came a few points
// nearer their floor than with two groups (9 and 13 KiB) ahead, the other
// types' the same within the noise (performance.md); 3 KiB and more was
// slower, 1 to 1.5 KiB no faster.
inline constexpr int64_t kPrefetchDistance = 2048;

// Asks for the line at p. Forced inline: GCC 12 drops a call whose only
// effect is a prefetch (a lambda or an inline function it does not
// inline), and the kernels then ask for nothing (test kernel_prefetches).
// A prefetch never faults: past the matrix's end it asks for nothing useful.
[[gnu::always_inline]] inline void PrefetchLine(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// kNx rows of X (1 or 2) against panels ps[0 .. kRuns), group by group in
// lockstep: each sub-block's codes go from their bytes into one chain per
// output (t), which then settles into the output (in `out`, in memory: 16
// vector registers hold the chains and the codes). Every 2 columns each
// run asks for one line, kPrefetchDistance ahead, stepping through its
// group's bytes as the columns step through the group: spread out, not a
// burst of lines at each sub-block (which cost time even in cache). With
// kSubnormal the codes are subnormal floats (Codes), x holds X's rows times
// 2^s (QuantRows::scaled), and a chain is multiplied by its row's
// unscale, 2^(149 - s), before it settles: the same bits as converted codes
// against X (quant_matmul.h).
template <QuantType kType, int kRuns, int kNx, bool kSubnormal>
void RunsOf(const float* x, int64_t ldx, const float* sums, const float* unscale,
            const PackedMatrix& w, const int* ps, float* y, int64_t ldy) {
  static_assert(kRuns * kNx <= 2, "eight chains");
  constexpr int kSub = QuantSubBlockSize(kType), kGroup = GroupSize(kType), kSubs = kGroup / kSub;
  const int groups = w.cols() / kGroup, nsub = w.cols() / kSub;
  const uint8_t* group[kRuns];
  for (int s = 0; s < kRuns; ++s) group[s] = w.panel(ps[s]);
  alignas(32) float out[kRuns][kNx][kPanel] = {};
  // Bytes of a group per 2 columns (rounded down: a line a group may go
  // unasked, and the processor's own prefetcher follows the stream anyway).
  const int64_t distance = kPrefetchDistance, step = w.group_bytes() / (kGroup / 2);
  GroupScales shared[kRuns];
  for (int gi = 0; gi < groups; ++gi) {
    if constexpr (kSubs > 1) {
      for (int s = 0; s < kRuns; ++s) LoadGroupScales<kType>(group[s], shared[s]);
    }
    for (int j = 0; j < kSubs; ++j) {
      // The chains, t[(s * kNx + r) * 4 + i], as eight named variables:
      // kept in registers (an array of them was stored on every step).
      __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0, t4 = t0, t5 = t0, t6 = t0,
             t7 = t0;
      const float* xj = x + gi * kGroup + j * kSub;
      for (int pair = j * kSub / 2; pair < (j + 1) * kSub / 2; ++pair) {
        for (int s = 0; s < kRuns; ++s) PrefetchLine(group[s] + distance + pair * step);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h, ++xj) {
          __m256 q[4];
          Codes<kType, kSubnormal>(group[0], pair, h, q);
          const __m256 x0 = _mm256_broadcast_ss(xj);
          t0 = _mm256_fmadd_ps(q[0], x0, t0);
          t1 = _mm256_fmadd_ps(q[1], x0, t1);
          t2 = _mm256_fmadd_ps(q[2], x0, t2);
          t3 = _mm256_fmadd_ps(q[3], x0, t3);
          if constexpr (kNx == 2) {
            const __m256 x1 = _mm256_broadcast_ss(xj + ldx);
            t4 = _mm256_fmadd_ps(q[0], x1, t4);
            t5 = _mm256_fmadd_ps(q[1], x1, t5);
            t6 = _mm256_fmadd_ps(q[2], x1, t6);
            t7 = _mm256_fmadd_ps(q[3], x1, t7);
          } else if constexpr (kRuns == 2) {
            Codes<kType, kSubnormal>(group[1], pair, h, q);
            t4 = _mm256_fmadd_ps(q[0], x0, t4);
            t5 = _mm256_fmadd_ps(q[1], x0, t5);
            t6 = _mm256_fmadd_ps(q[2], x0, t6);
            t7 = _mm256_fmadd_ps(q[3], x0, t7);
          }
        }
      }
      const __m256 t[8] = {t0, t1, t2, t3, t4, t5, t6, t7};
      for (int s = 0; s < kRuns; ++s) {
        __m256 dl[4], ml[4];
        Scales<kType>(group[s], j, shared[s], dl, ml);
        for (int r = 0; r < kNx; ++r) {
          const __m256 sv = _mm256_broadcast_ss(sums + r * nsub + gi * kSubs + j);
          for (int i = 0; i < 4; ++i) {
            float* o = out[s][r] + 8 * i;
            __m256 ti = t[(s * kNx + r) * 4 + i];
            if constexpr (kSubnormal) ti = _mm256_mul_ps(ti, _mm256_set1_ps(unscale[r]));
            _mm256_store_ps(o, Settle<kType>(_mm256_load_ps(o), ti, dl[i], ml[i], sv));
          }
        }
      }
      // The outputs stay in memory between sub-blocks, as in Tile: without
      // this GCC 12 kept a second copy of them on the stack and stored
      // both at every sub-block (coalesce-quant-bench's `of fma peak`:
      // performance.md).
      asm volatile("" ::: "memory");
    }
    for (int s = 0; s < kRuns; ++s) group[s] += w.group_bytes();
  }
  for (int s = 0; s < kRuns; ++s) {
    const int j = ps[s] * kPanel, rows = std::min(kPanel, w.rows() - j);
    for (int r = 0; r < kNx; ++r) std::copy_n(out[s][r], rows, y + r * ldy + j);
  }
}

// One row of X (a decode step of one sequence, bound by reading the
// blocks) or two against panels [p0, p1): one row reads kMatvecRuns runs of
// consecutive panels, the t-th panel of each together; two rows read one.
template <QuantType kType, bool kSubnormal>
void FewRowsPanelsWith(const float* x, int64_t ldx, int m, const float* sums, const float* unscale,
                       const PackedMatrix& w, int p0, int p1, float* y, int64_t ldy) {
  if (m == 2) {
    for (int p = p0; p < p1; ++p) {
      RunsOf<kType, 1, 2, kSubnormal>(x, ldx, sums, unscale, w, &p, y, ldy);
    }
    return;
  }
  const int n = p1 - p0, per = (n + kMatvecRuns - 1) / kMatvecRuns;
  for (int t = 0; t < per; ++t) {
    int ps[kMatvecRuns];
    int count = 0;
    for (int s = 0; s < kMatvecRuns; ++s) {
      if (s * per + t < n) ps[count++] = p0 + s * per + t;
    }
    if (count == kMatvecRuns) {
      RunsOf<kType, kMatvecRuns, 1, kSubnormal>(x, ldx, sums, unscale, w, ps, y, ldy);
    } else {
      for (int s = 0; s < count; ++s) {
        RunsOf<kType, 1, 1, kSubnormal>(x, ldx, sums, unscale, w, ps + s, y, ldy);
      }
    }
  }
}

// MXCSR's denormals-are-zero bit: set (by a library, on this thread), it
// would read the subnormal codes as zeros.
inline bool SubnormalsAreZero() { return (_mm_getcsr() & 0x0040) != 0; }

// The subnormal codes where the rows were scaled for them (QuantRows) and
// this thread reads subnormals as they are; else the converted ones.
template <QuantType kType>
void FewRowsPanels(const float* x, int64_t ldx, int m, const QuantRows& rows, const PackedMatrix& w,
                   int p0, int p1, float* y, int64_t ldy) {
  if constexpr (kType != QuantType::kQ8_0) {
    if (rows.scaled != nullptr && !SubnormalsAreZero()) {
      return FewRowsPanelsWith<kType, true>(rows.scaled, w.cols(), m, rows.sums, rows.unscale, w,
                                            p0, p1, y, ldy);
    }
  }
  FewRowsPanelsWith<kType, false>(x, ldx, m, rows.sums, nullptr, w, p0, p1, y, ldy);
}

// This thread's scratch buffer number kSlot, of at least `floats` floats,
// 64-byte aligned: on the heap, as PanelBuffer's, so that a thread's own
// storage stays small (a library thread with a small stack cannot start
// where the static thread-local storage outgrows it).
template <int kSlot>
inline float* ScratchBuffer(int64_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buffer;
  thread_local int64_t size = 0;
  if (floats > size) {
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, sizeof(float) * floats)));
    size = floats;
  }
  return buffer.get();
}

// Many rows of X: each panel's codes (as floats) and scales are unpacked
// into this thread's buffers, kKBlock values of k at a time, and tiles of
// kTileRows rows of X run against them (Tile); the outputs settle in a
// buffer of m x 32 floats and go to y once the panel is done.
inline constexpr int kTileRows = 6;

// kRx rows of X (x at the buffer's first k, row stride ldx; their block
// sums from the buffer's first sub-block, row stride nsub) against kb values
// of k of the unpacked panel: 16 rows of W at a time, 2 x kRx chains.
template <QuantType kType, int kRx>
void Tile(const float* x, int64_t ldx, const float* sums, int nsub, const float* codes,
          const float* dl, const float* ml, int kb, float* out) {
  constexpr int kSub = QuantSubBlockSize(kType);
  for (int r0 = 0; r0 < kPanel; r0 += 16) {
    for (int j = 0; j < kb / kSub; ++j) {
      __m256 t[kRx][2];
      for (auto& a : t) a[0] = a[1] = _mm256_setzero_ps();
      // From 0 to the constant kSub, unrolled by 8: the compiler then needs
      // no code for a remainder of steps (performance.md).
      const float* cj = codes + j * kSub * kPanel + r0;
      const float* xj = x + j * kSub;
#pragma GCC unroll 8
      for (int kk = 0; kk < kSub; ++kk) {
        const __m256 w0 = _mm256_load_ps(cj + kk * kPanel);
        const __m256 w1 = _mm256_load_ps(cj + kk * kPanel + 8);
        for (int a = 0; a < kRx; ++a) {
          const __m256 xv = _mm256_broadcast_ss(xj + a * ldx + kk);
          t[a][0] = _mm256_fmadd_ps(w0, xv, t[a][0]);
          t[a][1] = _mm256_fmadd_ps(w1, xv, t[a][1]);
        }
      }
      const float* dj = dl + j * kPanel + r0;
      const float* mj = ml + j * kPanel + r0;
      for (int a = 0; a < kRx; ++a) {
        const __m256 sv = _mm256_broadcast_ss(sums + a * nsub + j);
        for (int h = 0; h < 2; ++h) {
          float* o = out + a * kPanel + r0 + 8 * h;
          _mm256_store_ps(o, Settle<kType>(_mm256_load_ps(o), t[a][h], _mm256_load_ps(dj + 8 * h),
                                           _mm256_load_ps(mj + 8 * h), sv));
        }
      }
      // The outputs stay in memory between sub-blocks: without this the
      // compiler kept a second copy of them on the stack, twice the stores.
      asm volatile("" ::: "memory");
    }
  }
}

template <QuantType kType, int kRx = kTileRows>
inline void TileOfRows(int r, const float* x, int64_t ldx, const float* sums, int nsub,
                       const float* codes, const float* dl, const float* ml, int kb, float* out) {
  if constexpr (kRx >= 1) {
    if (r == kRx) {
      Tile<kType, kRx>(x, ldx, sums, nsub, codes, dl, ml, kb, out);
    } else {
      TileOfRows<kType, kRx - 1>(r, x, ldx, sums, nsub, codes, dl, ml, kb, out);
    }
  }
}

template <QuantType kType>
void ManyRowsPanels(const float* x, int64_t ldx, int m, const float* sums, const PackedMatrix& w,
                    int p0, int p1, float* y, int64_t ldy) {
  constexpr int kSub = QuantSubBlockSize(kType), kGroup = GroupSize(kType), kSubs = kGroup / kSub;
  static_assert(kKBlock % kGroup == 0);
  float* codes = PanelBuffer();
  // The scales and offsets of kKBlock values of k, and the outputs (aligned:
  // a vector of them split across two cache lines costs the tile more).
  float* dl = ScratchBuffer<0>(2 * kKBlock / 16 * kPanel);
  float* ml = dl + kKBlock / 16 * kPanel;
  float* out = ScratchBuffer<1>(int64_t{m} * kPanel);
  const int k = w.cols(), nsub = k / kSub;
  for (int p = p0; p < p1; ++p) {
    std::fill_n(out, m * kPanel, 0.0f);
    for (int k0 = 0; k0 < k; k0 += kKBlock) {
      const int kb = std::min(kKBlock, k - k0);
      const uint8_t* group = w.panel(p) + int64_t{k0 / kGroup} * w.group_bytes();
      for (int g = 0; g < kb / kGroup; ++g, group += w.group_bytes()) {
        for (int kk = 0; kk < kGroup; ++kk) {
          __m256 q[4];
          Codes<kType>(group, kk / 2, kk % 2, q);
          float* c = codes + (g * kGroup + kk) * kPanel;
          for (int i = 0; i < 4; ++i) _mm256_store_ps(c + 8 * i, q[i]);
        }
        GroupScales shared;
        if constexpr (kSubs > 1) LoadGroupScales<kType>(group, shared);
        for (int j = 0; j < kSubs; ++j) {
          __m256 d[4], o[4];
          Scales<kType>(group, j, shared, d, o);
          const int at = (g * kSubs + j) * kPanel;
          for (int i = 0; i < 4; ++i) {
            _mm256_store_ps(dl + at + 8 * i, d[i]);
            _mm256_store_ps(ml + at + 8 * i, o[i]);
          }
        }
      }
      for (int i = 0; i < m; i += kTileRows) {
        TileOfRows<kType>(std::min(kTileRows, m - i), x + i * ldx + k0, ldx,
                          sums + int64_t{i} * nsub + k0 / kSub, nsub, codes, dl, ml, kb,
                          out + i * kPanel);
      }
    }
    const int j = p * kPanel, rows = std::min(kPanel, w.rows() - j);
    for (int i = 0; i < m; ++i) std::copy_n(out + i * kPanel, rows, y + i * ldy + j);
  }
}

// Panels [p0, p1) of w against all m rows of x (quant_matmul.h).
template <QuantType kType>
void QuantPanelsOf(const float* x, int64_t ldx, int m, const QuantRows& rows, const PackedMatrix& w,
                   int p0, int p1, float* y, int64_t ldy) {
  if (m <= 2) {
    FewRowsPanels<kType>(x, ldx, m, rows, w, p0, p1, y, ldy);
  } else {
    ManyRowsPanels<kType>(x, ldx, m, rows.sums, w, p0, p1, y, ldy);
  }
}

inline void QuantMatmulPanelsOf(const float* x, int64_t ldx, int m, const QuantRows& rows,
                                const PackedMatrix& w, int p0, int p1, float* y, int64_t ldy) {
  switch (w.type()) {
    case QuantType::kQ8_0:
      return QuantPanelsOf<QuantType::kQ8_0>(x, ldx, m, rows, w, p0, p1, y, ldy);
    case QuantType::kQ4_0:
      return QuantPanelsOf<QuantType::kQ4_0>(x, ldx, m, rows, w, p0, p1, y, ldy);
    case QuantType::kQ4_1:
      return QuantPanelsOf<QuantType::kQ4_1>(x, ldx, m, rows, w, p0, p1, y, ldy);
    case QuantType::kQ4_K:
      return QuantPanelsOf<QuantType::kQ4_K>(x, ldx, m, rows, w, p0, p1, y, ldy);
    case QuantType::kQ6_K:
      return QuantPanelsOf<QuantType::kQ6_K>(x, ldx, m, rows, w, p0, p1, y, ldy);
  }
}

}  // namespace
}  // namespace coalesce::engine::cpu
