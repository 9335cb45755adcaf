// The CPU matrix product's kernels: the panel kernel's loop nest, shared by
// AVX2 (kernels.cc) and AVX-512 (kernels_avx512.cc, compiled with -mavx512f
// and used only where the processor has it), and an AVX-512 kernel for many
// rows of X (below).
//
// The arithmetic: every output element is one chain of fused multiply-adds
// over k in increasing order, starting from 0:
//   acc = 0;  for k: acc = fma(w[j, k], x[i, k], acc);  y[i, j] = acc
// (MatmulReference in kernels.h is exactly this, one element at a time). No
// element's result depends on the other rows of X or W, the tile, the thread
// or the instruction set, so a sequence decodes the same alone or in any
// batch, on any processor.
//
// The vectorisation is a BLAS-style one: a vector holds one k of kPanel
// consecutive rows of W, and each row of X contributes a broadcast scalar, so
// a register tile of W rows x X rows needs no reduction across lanes. W is
// stored [out][in], so each block of kPanel rows is first transposed ("packed")
// into a small buffer, [k][kPanel], kKBlock values of k at a time; the chain
// of a block continues from the partial sum the previous block stored in y,
// which is the same float the chain would have held in a register.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "engine/cpu/thread_pool.h"

namespace coalesce::engine::cpu {

// Rows of W per packed panel (a task of the parallel product is a whole
// number of panels).
inline constexpr int kPanel = 32;
// Values of k per packed panel (128 KiB, in L2): long runs along each row of
// W, which streams from memory, and one pass for the usual widths.
inline constexpr int kKBlock = 1024;

// Rows [j0, j1) of W (j0 a multiple of kPanel) against all m rows of X:
// y[i, j] = x[i, :] . w[j, :].
//   x: [m, k] (row stride ldx)   w: [n, k]   y: [m, n] (row stride ldy)
using MatmulPanelsFn = void (*)(const float* x, int64_t ldx, int m, const float* w, int n, int j0,
                                int j1, int k, float* y, int64_t ldy);

void MatmulPanelsAvx2(const float* x, int64_t ldx, int m, const float* w, int n, int j0, int j1,
                      int k, float* y, int64_t ldy);
void MatmulPanelsAvx512(const float* x, int64_t ldx, int m, const float* w, int n, int j0, int j1,
                        int k, float* y, int64_t ldy);

// Many rows of X (AVX-512 only): packing W transposes every weight on every
// call (about 12% of a batch-64 decode step of synthetic:110m). Instead X is
// transposed, once per call, xt[k, ldxt] with ldxt =
// m rounded up to 16 (zero rows past m), and rows [j0, j1) of W (any j0) run
// against it with the rows of X across the vector lanes. The same bits as
// the panel kernels; Matmul (kernels.cc) picks it from kMinRowsAcrossLanes.
void TransposeRowsAvx512(const float* x, int64_t ldx, int m, int k, float* xt, int64_t ldxt);
void MatmulTokensAvx512(const float* xt, int64_t ldxt, int m, const float* w, int j0, int j1, int k,
                        float* y, int64_t ldy);

// One row of X (AVX-512 only): rows [j0, j1) of W (j0 a multiple of 16)
// against x[k], y[j] = x . w[j, :]. Sixteen rows at a time are read straight
// from W, each 16 values of k transposed in registers and added to the
// rows' chains in k order: the same bits as the panel kernels, without
// packing W into a buffer that the tile then reads again.
void MatvecAvx512(const float* x, const float* w, int n, int j0, int j1, int k, float* y);
// A few rows of X with AVX2 (j0 a multiple of 8): rows [j0, j1) of W read
// straight from W, 8 at a time, each 8 values of k of the 8 rows
// transposed in registers and used by up to 5 rows of X at a time: the
// same bits again.
void MatmulFewRowsAvx2(const float* x, int64_t ldx, int m, const float* w, int n, int j0, int j1,
                       int k, float* y, int64_t ldy);

// W laid out ahead as panels (float_panels.h) with AVX2: `rows` rows of W
// from panels[0] on, panel after panel ([k][kPanel] floats each, zero rows
// past `rows`), against the m rows of X: y[i, j] for j < rows. One row of X
// reads two panels side by side (eight chains, two streams); up to 12 rows
// read two panels 64 values of k at a time, one row of X after another;
// more go through the tile kernel, kKBlock values of k at a time, each
// block copied (not transposed) into the panel buffer. The same bits as the
// panel kernels.
void MatmulLaidOutAvx2(const float* x, int64_t ldx, int m, const float* panels, int rows, int k,
                       float* y, int64_t ldy);

// Tasks to split `units` equal units of work into for `threads` threads,
// at most per_thread a thread: the most that split both the units and the
// threads evenly, where there are such (12 units on 2 threads: 6 tasks of
// 2, where 8 tasks of 1 or 2 units left one thread 7 units to the other's
// 5), else as many as allowed.
inline int EvenTasks(int units, int threads, int per_thread) {
  const int most = std::min(units, threads * per_thread);
  for (int tasks = most; tasks >= threads; --tasks) {
    if (units % tasks == 0 && tasks % threads == 0) return tasks;
  }
  return most;
}

// Runs fn(p0, p1) over runs of whole panels covering [0, num_panels): on
// this thread when the product's `work` (multiply-adds) is below ~64K, where
// a thread handoff costs more than it saves, else as up to per_thread tasks
// per thread (EvenTasks): a few for balance, or one where each task's
// start costs more (its first reads wait on memory).
template <typename Fn>
void ForPanelRuns(ThreadPool& pool, int num_panels, int64_t work, Fn fn, int per_thread = 4) {
  const int threads = pool.size();
  if (threads == 1 || work < (int64_t{1} << 16)) {
    fn(0, num_panels);
    return;
  }
  const int tasks = EvenTasks(num_panels, threads, per_thread);
  pool.ParallelFor(tasks, [&](int task, int) {
    fn(static_cast<int>(int64_t{num_panels} * task / tasks),
       static_cast<int>(int64_t{num_panels} * (task + 1) / tasks));
  });
}

// This thread's packing buffer, kKBlock x kPanel floats, 64-byte aligned.
inline float* PanelBuffer() {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local const std::unique_ptr<float, Free> buffer(
      static_cast<float*>(std::aligned_alloc(64, sizeof(float) * kKBlock * kPanel)));
  return buffer.get();
}

// Rows of W that a tile asks the memory system for while it computes (the
// next panel's, which Pack will read from memory): one cache line of each
// row per 16 values of k, so the loads the product waits for are hidden
// behind its arithmetic.
struct Prefetch {
  const float* first = nullptr;  // row 0 at the tile's first k
  int64_t stride = 0;            // row stride
  int rows = 0;

  // Forced inline: GCC 12 drops a call to a function whose only effect is a
  // prefetch, so At must be part of the tile it serves.
  [[gnu::always_inline]] void At(int kk) const {
    if (kk % 16 != 0) return;
    for (int r = 0; r < rows; ++r) {
      __builtin_prefetch(first + r * stride + kk, /*rw=*/0, /*locality=*/2);
    }
  }
};

// Rows [i, i + r) of X against one packed panel, 0 < r <= Kernel::kTileX,
// as one tile of r rows.
template <typename Kernel, int R = Kernel::kTileX>
inline void TileOf(int r, const float* x, int64_t ldx, const float* panel, int kb, bool accumulate,
                   int rows, float* y, int64_t ldy, const Prefetch& next) {
  if constexpr (R >= 1) {
    if (r == R) {
      Kernel::template Tile<R>(x, ldx, panel, kb, accumulate, rows, y, ldy, next);
    } else {
      TileOf<Kernel, R - 1>(r, x, ldx, panel, kb, accumulate, rows, y, ldy, next);
    }
  }
}

// A Kernel provides
//   Pack(w, ldw, rows, kb, panel): panel[kk * kPanel + r] = w[r * ldw + kk]
//     for r < rows, kk < kb, and 0 for rows <= r < kPanel;
//   Tile<RX>(x, ldx, panel, kb, accumulate, rows, y, ldy): for RX rows of X
//     and the panel's first `rows` rows, continue each chain over kb values
//     of k from y (accumulate) or from 0, and store it back to y.
template <typename Kernel>
inline void MatmulPanelsWith(const float* x, int64_t ldx, int m, const float* w, int n, int j0,
                             int j1, int k, float* y, int64_t ldy) {
  float* panel = PanelBuffer();
  const int tiles = (m + Kernel::kTileX - 1) / Kernel::kTileX;
  for (int j = j0; j < j1; j += kPanel) {
    const int rows = std::min(kPanel, n - j);
    for (int k0 = 0; k0 < k; k0 += kKBlock) {
      const int kb = std::min(kKBlock, k - k0);
      const bool accumulate = k0 > 0;
      Kernel::Pack(w + int64_t{j} * k + k0, k, rows, kb, panel);
      // What Pack reads next: this block's k range of the next panel, or
      // the next block of this one. The tiles share its rows.
      const int next_j = k0 + kb < k ? j : j + kPanel;
      const int next_k0 = k0 + kb < k ? k0 + kb : 0;
      const int next_rows = next_j < j1 ? std::min(kPanel, n - next_j) : 0;
      const int per_tile = (next_rows + tiles - 1) / tiles;
      const float* xk = x + k0;
      float* yj = y + j;
      // The m rows of X as tiles of kTileX rows and one shorter last tile.
      for (int tile = 0, i = 0; tile < tiles; ++tile) {
        const int height = std::min(Kernel::kTileX, m - i);
        const int first_row = std::min(next_rows, tile * per_tile);
        const Prefetch next{w + (int64_t{next_j} + first_row) * k + next_k0, k,
                            std::min(per_tile, next_rows - first_row)};
        TileOf<Kernel>(height, xk + i * ldx, ldx, panel, kb, accumulate, rows, yj + i * ldy, ldy,
                       next);
        i += height;
      }
    }
  }
}

}  // namespace coalesce::engine::cpu
