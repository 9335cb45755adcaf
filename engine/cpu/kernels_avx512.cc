// The AVX-512 kernel of the CPU matrix product (matmul_panels.h), compiled
// with -mavx512f and chosen at run time only on processors that have it
// (ChosenKernel in kernels.cc). Same arithmetic as the AVX2 kernel, so the
// two give the same bits.
#include <immintrin.h>

#include <cstdint>

#include "engine/cpu/matmul_panels.h"
#include "engine/cpu/quant_panels.h"

namespace coalesce::engine::cpu {
namespace {

static_assert(kPanel == 32, "a panel row is two zmm vectors");

// The first n lanes (n clamped to 0..16).
inline __mmask16 FirstLanes(int n) {
  if (n <= 0) return 0;
  return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1);
}

// In-register transpose of 16 rows of 16 floats: afterwards r[c] holds
// column c of the input.
inline void Transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    // Per 128-bit lane L: (a[4L], b[4L], a[4L+1], b[4L+1]) and the same for 4L+2, 4L+3.
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {
    // u[4i + c], lane L: rows 4i..4i+3 at column 4L + c.
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    // Column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
    const __m512 lo01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);  // u[c].L0 .L1 u[4+c].L0 .L1
    const __m512 hi01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);  // lanes 2, 3
    const __m512 lo23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 hi23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);       // lane 0 of each
    r[4 + c] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);   // lane 1
    r[8 + c] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);   // lane 2
    r[12 + c] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);  // lane 3
  }
}

// 2 x 12: 24 accumulators + 2 W vectors + 1 broadcast of the 32 zmm
// registers; per k, 2 loads and 12 broadcasts feed 24 multiply-adds, so the
// FMA unit sets the pace.
struct Avx512Kernel {
  static constexpr int kTileX = 12;

  // One half of the panel (16 rows) at a time: 16 streams from memory, which
  // the hardware prefetcher follows better than 32.
  static void Pack(const float* w, int64_t ldw, int rows, int kb, float* panel) {
    for (int half = 0; half < 2; ++half) {
      for (int k0 = 0; k0 < kb; k0 += 16) {
        const int nk = std::min(16, kb - k0);
        const __mmask16 kmask = FirstLanes(nk);
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          const int row = half * 16 + i;
          r[i] =
              row < rows ? _mm512_maskz_loadu_ps(kmask, w + row * ldw + k0) : _mm512_setzero_ps();
        }
        Transpose16x16(r);
        for (int c = 0; c < nk; ++c) {
          _mm512_store_ps(panel + (k0 + c) * kPanel + half * 16, r[c]);
        }
      }
    }
  }

  template <int RX>
  static void Tile(const float* x, int64_t ldx, const float* panel, int kb, bool accumulate,
                   int rows, float* y, int64_t ldy, const Prefetch& next) {
    const __mmask16 m0 = FirstLanes(rows), m1 = FirstLanes(rows - 16);
    __m512 acc[RX][2];
    for (int a = 0; a < RX; ++a) {
      if (accumulate) {
        acc[a][0] = _mm512_maskz_loadu_ps(m0, y + a * ldy);
        acc[a][1] = _mm512_maskz_loadu_ps(m1, y + a * ldy + 16);
      } else {
        acc[a][0] = acc[a][1] = _mm512_setzero_ps();
      }
    }
    for (int kk = 0; kk < kb; ++kk) {
      next.At(kk);
      const __m512 w0 = _mm512_load_ps(panel + kk * kPanel);
      const __m512 w1 = _mm512_load_ps(panel + kk * kPanel + 16);
      for (int a = 0; a < RX; ++a) {
        const __m512 xv = _mm512_set1_ps(x[a * ldx + kk]);
        acc[a][0] = _mm512_fmadd_ps(w0, xv, acc[a][0]);
        acc[a][1] = _mm512_fmadd_ps(w1, xv, acc[a][1]);
      }
    }
    for (int a = 0; a < RX; ++a) {
      _mm512_mask_storeu_ps(y + a * ldy, m0, acc[a][0]);
      _mm512_mask_storeu_ps(y + a * ldy + 16, m1, acc[a][1]);
    }
  }
};

// The other vectorisation (matmul_panels.h, "Many rows of X"): lanes are 16
// rows of X, read from X transposed; each row of W contributes broadcast
// scalars. A tile is RW rows of W x NV vectors of X rows: 6 x 4 (24
// accumulators + 4 X vectors + 1 broadcast); per k, 6 broadcasts and 4 loads
// feed 24 multiply-adds. Every element is the same fused multiply-add chain
// along k, so it equals the panel kernel bit for bit.
template <int RW, int NV>
void TokensTile(const float* xt, int64_t ldxt, int rows_x, const float* w, int k, float* y,
                int64_t ldy) {
  __m512 acc[RW][NV];
  for (int r = 0; r < RW; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int kk = 0; kk < k; ++kk) {
    __m512 xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = _mm512_load_ps(xt + kk * ldxt + 16 * v);
    for (int r = 0; r < RW; ++r) {
      const __m512 wv = _mm512_set1_ps(w[int64_t{r} * k + kk]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(wv, xv[v], acc[r][v]);
    }
  }
  // acc[r][v] lane i is y[16 v + i, r]: out through a small buffer.
  alignas(64) float out[RW][NV * 16];
  for (int r = 0; r < RW; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_store_ps(&out[r][16 * v], acc[r][v]);
  }
  for (int i = 0; i < rows_x; ++i) {
    for (int r = 0; r < RW; ++r) y[i * ldy + r] = out[r][i];
  }
}

template <int RW, int NV = 4>
void TokensTileOf(int rows_w, int nv, const float* xt, int64_t ldxt, int rows_x, const float* w,
                  int k, float* y, int64_t ldy) {
  if constexpr (RW >= 1 && NV >= 1) {
    if (rows_w != RW) {
      TokensTileOf<RW - 1, NV>(rows_w, nv, xt, ldxt, rows_x, w, k, y, ldy);
    } else if (nv != NV) {
      TokensTileOf<RW, NV - 1>(rows_w, nv, xt, ldxt, rows_x, w, k, y, ldy);
    } else {
      TokensTile<RW, NV>(xt, ldxt, rows_x, w, k, y, ldy);
    }
  }
}

}  // namespace

void TransposeRowsAvx512(const float* x, int64_t ldx, int m, int k, float* xt, int64_t ldxt) {
  for (int t0 = 0; t0 < ldxt; t0 += 16) {
    for (int k0 = 0; k0 < k; k0 += 16) {
      const int nk = std::min(16, k - k0);
      const __mmask16 kmask = FirstLanes(nk);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = t0 + i < m ? _mm512_maskz_loadu_ps(kmask, x + (t0 + i) * ldx + k0)
                          : _mm512_setzero_ps();
      }
      Transpose16x16(r);
      for (int c = 0; c < nk; ++c) _mm512_store_ps(xt + (k0 + c) * ldxt + t0, r[c]);
    }
  }
}

void MatmulTokensAvx512(const float* xt, int64_t ldxt, int m, const float* w, int j0, int j1, int k,
                        float* y, int64_t ldy) {
  constexpr int kRows = 6, kTokens = 64;
  for (int j = j0; j < j1; j += kRows) {
    const int rows_w = std::min(kRows, j1 - j);
    // The rows of W stay in L1 while every group of 64 rows of X passes.
    for (int t = 0; t < m; t += kTokens) {
      const int rows_x = std::min(kTokens, m - t);
      TokensTileOf<kRows>(rows_w, (rows_x + 15) / 16, xt + t, ldxt, rows_x, w + int64_t{j} * k, k,
                          y + t * ldy + j, ldy);
    }
  }
}

void MatvecAvx512(const float* x, const float* w, int n, int j0, int j1, int k, float* y) {
  for (int j = j0; j < j1; j += 16) {
    const int rows = std::min(16, n - j);
    const float* first = w + int64_t{j} * k;
    // The next 16 rows (the 16 k floats after these) are asked for as
    // these are read, the same columns of each: a run of 16 k floats ahead.
    // This thread's reads skip across 16 rows, and the next block is what
    // comes next in memory; prefetching each row's own continuation instead
    // (2 KiB ahead) read about 25% slower.
    const int ahead = std::min(16, n - j - 16);  // rows of the next block
    __m512 acc = _mm512_setzero_ps();
    for (int k0 = 0; k0 < k; k0 += 16) {
      const int nk = std::min(16, k - k0);
      const __mmask16 kmask = FirstLanes(nk);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        if (i < rows) {
          const float* row = first + int64_t{i} * k + k0;
          if (i < ahead) {
            _mm_prefetch(reinterpret_cast<const char*>(row + 16 * int64_t{k}), _MM_HINT_T1);
          }
          r[i] = _mm512_maskz_loadu_ps(kmask, row);
        } else {
          r[i] = _mm512_setzero_ps();
        }
      }
      Transpose16x16(r);
      // r[c]: column k0 + c of the 16 rows; the chain goes on in k order.
      for (int c = 0; c < nk; ++c) acc = _mm512_fmadd_ps(r[c], _mm512_set1_ps(x[k0 + c]), acc);
    }
    _mm512_mask_storeu_ps(y + j, FirstLanes(rows), acc);
  }
}

void MatmulPanelsAvx512(const float* x, int64_t ldx, int m, const float* w, int n, int j0, int j1,
                        int k, float* y, int64_t ldy) {
  MatmulPanelsWith<Avx512Kernel>(x, ldx, m, w, n, j0, j1, k, y, ldy);
}

void QuantMatmulPanelsAvx512(const float* x, int64_t ldx, int m, const QuantRows& rows,
                             const PackedMatrix& w, int p0, int p1, float* y, int64_t ldy) {
  QuantMatmulPanelsOf(x, ldx, m, rows, w, p0, p1, y, ldy);
}

}  // namespace coalesce::engine::cpu
