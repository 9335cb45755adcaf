// The AVX-512 kernel of the CPU matrix product (matmul_rows.h), compiled with
// -mavx512f and chosen at run time only on processors that have it (ChosenKernel
// in kernels.cc). Each output element is 16 interleaved partial sums over k
// (one lane each, fused multiply-add, k in increasing order), then one fixed
// reduction: like the AVX2 kernel, a pure function of its two input rows.
#include <immintrin.h>

#include <cstdint>

#include "engine/cpu/matmul_rows.h"

namespace coalesce::engine::cpu {
namespace {

// 4 x 6: 24 accumulators + 4 W vectors + 1 X vector of the 32 zmm registers;
// 10 loads feed 24 multiply-adds, so the FMA units, not the loads, set the
// pace.
struct Avx512Kernel {
  static constexpr int kTileW = kAvx512TileW;
  static constexpr int kTileX = 6;

  template <int RW, int RX>
  static void Tile(const float* x, int64_t ldx, const float* w, int k, float* y, int64_t ldy) {
    __m512 acc[RX][RW];
    for (int a = 0; a < RX; ++a) {
      for (int b = 0; b < RW; ++b) acc[a][b] = _mm512_setzero_ps();
    }
    int kk = 0;
    for (; kk + 16 <= k; kk += 16) {
      __m512 wv[RW];
      for (int b = 0; b < RW; ++b) wv[b] = _mm512_loadu_ps(w + int64_t{b} * k + kk);
      for (int a = 0; a < RX; ++a) {
        const __m512 xv = _mm512_loadu_ps(x + a * ldx + kk);
        for (int b = 0; b < RW; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
      }
    }
    if (kk < k) {
      // The tail: masked lanes load zeros, and fma(0, 0, acc) adds nothing.
      const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1);
      __m512 wv[RW];
      for (int b = 0; b < RW; ++b) wv[b] = _mm512_maskz_loadu_ps(mask, w + int64_t{b} * k + kk);
      for (int a = 0; a < RX; ++a) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + a * ldx + kk);
        for (int b = 0; b < RW; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
      }
    }
    for (int a = 0; a < RX; ++a) {
      for (int b = 0; b < RW; ++b) y[a * ldy + b] = _mm512_reduce_add_ps(acc[a][b]);
    }
  }
};

}  // namespace

void MatmulRowsAvx512(const float* x, int64_t ldx, int m, const float* w, int j0, int j1, int k,
                      float* y, int64_t ldy) {
  MatmulRowsWith<Avx512Kernel>(x, ldx, m, w, j0, j1, k, y, ldy);
}

}  // namespace coalesce::engine::cpu
