// The loop nest of the CPU matrix product, shared by its two kernels: AVX2
// (kernels.cc) and AVX-512 (kernels_avx512.cc, compiled with -mavx512f and
// used only where the processor has it). A kernel is a register tile,
// Kernel::Tile<RW, RX>, that computes RW rows of W against RX rows of X,
// every output element a fixed function of its two input rows.
#pragma once

#include <algorithm>
#include <cstdint>

namespace coalesce::engine::cpu {

// Rows [j0, j1) of W against all m rows of X: y[i, j] = x[i, :] . w[j, :].
using MatmulRowsFn = void (*)(const float* x, int64_t ldx, int m, const float* w, int j0, int j1,
                              int k, float* y, int64_t ldy);

void MatmulRowsAvx512(const float* x, int64_t ldx, int m, const float* w, int j0, int j1, int k,
                      float* y, int64_t ldy);
// Rows of W per AVX-512 tile (MatmulRowsAvx512's tasks split W on these).
inline constexpr int kAvx512TileW = 4;

// Rows of X per pass over a block of W (rounded up to whole tiles): the W
// tile stays in L1 while this many rows stream past it; more would push the
// rows of X out of L2.
inline constexpr int kRowChunk = 32;

// Rows [i, i + r) of X against one W tile, 0 < r < Kernel::kTileX, as one
// tile of r rows: a batch that is not a multiple of the tile height pays for
// its last rows once, not once per row. (Each element's arithmetic is the
// same for every tile height.)
template <typename Kernel, int RW, int R = Kernel::kTileX - 1>
inline void PartialTile(int r, const float* x, int64_t ldx, const float* w, int k, float* y,
                        int64_t ldy) {
  if constexpr (R >= 1) {
    if (r == R) {
      Kernel::template Tile<RW, R>(x, ldx, w, k, y, ldy);
    } else {
      PartialTile<Kernel, RW, R - 1>(r, x, ldx, w, k, y, ldy);
    }
  }
}

template <typename Kernel>
inline void MatmulRowsWith(const float* x, int64_t ldx, int m, const float* w, int j0, int j1,
                           int k, float* y, int64_t ldy) {
  constexpr int kW = Kernel::kTileW, kX = Kernel::kTileX;
  // Chunks of whole tiles of X rows.
  constexpr int kChunk = (kRowChunk + kX - 1) / kX * kX;
  for (int i0 = 0; i0 < m; i0 += kChunk) {
    const int i1 = std::min(m, i0 + kChunk);
    int j = j0;
    for (; j + kW <= j1; j += kW) {
      const float* wj = w + int64_t{j} * k;
      int i = i0;
      for (; i + kX <= i1; i += kX) {
        Kernel::template Tile<kW, kX>(x + i * ldx, ldx, wj, k, y + i * ldy + j, ldy);
      }
      if (i < i1) PartialTile<Kernel, kW>(i1 - i, x + i * ldx, ldx, wj, k, y + i * ldy + j, ldy);
    }
    for (; j < j1; ++j) {
      const float* wj = w + int64_t{j} * k;
      int i = i0;
      for (; i + kX <= i1; i += kX) {
        Kernel::template Tile<1, kX>(x + i * ldx, ldx, wj, k, y + i * ldy + j, ldy);
      }
      if (i < i1) PartialTile<Kernel, 1>(i1 - i, x + i * ldx, ldx, wj, k, y + i * ldy + j, ldy);
    }
  }
}

}  // namespace coalesce::engine::cpu
