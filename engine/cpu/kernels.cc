#include "engine/cpu/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "engine/cpu/matmul_rows.h"
#include "engine/simd.h"

namespace coalesce::engine::cpu {
namespace {

using simd::HorizontalSum;

// Loads the first `rem` (< 8) lanes and zeroes the rest: fma(0, 0, acc) adds
// nothing, so a k tail costs one more step of the same arithmetic.
inline __m256i TailMask(int rem) {
  alignas(32) static const int32_t kMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask + 8 - rem));
}

// AVX2: a register tile of RW rows of W against RX rows of X, RW * RX
// accumulators. 3 x 4 (12 accumulators + 3 W vectors + 1 X vector = 16 ymm
// registers) keeps both FMA ports busy; the smaller shapes handle the edges
// with the same per-element arithmetic.
struct Avx2Kernel {
  static constexpr int kTileW = 3;
  static constexpr int kTileX = 4;

  template <int RW, int RX>
  static void Tile(const float* x, int64_t ldx, const float* w, int k, float* y, int64_t ldy) {
    __m256 acc[RX][RW];
    for (int a = 0; a < RX; ++a) {
      for (int b = 0; b < RW; ++b) acc[a][b] = _mm256_setzero_ps();
    }
    int kk = 0;
    for (; kk + 8 <= k; kk += 8) {
      __m256 wv[RW];
      for (int b = 0; b < RW; ++b) wv[b] = _mm256_loadu_ps(w + int64_t{b} * k + kk);
      for (int a = 0; a < RX; ++a) {
        const __m256 xv = _mm256_loadu_ps(x + a * ldx + kk);
        for (int b = 0; b < RW; ++b) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
      }
    }
    if (kk < k) {
      const __m256i mask = TailMask(k - kk);
      __m256 wv[RW];
      for (int b = 0; b < RW; ++b) wv[b] = _mm256_maskload_ps(w + int64_t{b} * k + kk, mask);
      for (int a = 0; a < RX; ++a) {
        const __m256 xv = _mm256_maskload_ps(x + a * ldx + kk, mask);
        for (int b = 0; b < RW; ++b) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
      }
    }
    for (int a = 0; a < RX; ++a) {
      for (int b = 0; b < RW; ++b) y[a * ldy + b] = HorizontalSum(acc[a][b]);
    }
  }
};

void MatmulRowsAvx2(const float* x, int64_t ldx, int m, const float* w, int j0, int j1, int k,
                    float* y, int64_t ldy) {
  MatmulRowsWith<Avx2Kernel>(x, ldx, m, w, j0, j1, k, y, ldy);
}

// The product's kernel, chosen once per process from what the processor
// has, so every call (whatever its batch) computes each element the same way.
struct MatmulKernel {
  MatmulRowsFn rows;
  int tile_w;  // rows of W per tile: tasks split W on these
};
const MatmulKernel& ChosenKernel() {
  static const MatmulKernel kernel = __builtin_cpu_supports("avx512f")
                                         ? MatmulKernel{MatmulRowsAvx512, kAvx512TileW}
                                         : MatmulKernel{MatmulRowsAvx2, Avx2Kernel::kTileW};
  return kernel;
}

}  // namespace

void Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const float* w, int n, int k,
            float* y, int64_t ldy) {
  if (m <= 0 || n <= 0) return;
  // Below ~64K multiply-adds a thread handoff costs more than it saves.
  const int64_t work = int64_t{m} * n * k;
  const int threads = pool.size();
  const MatmulKernel& kernel = ChosenKernel();
  if (threads == 1 || work < (int64_t{1} << 16)) {
    kernel.rows(x, ldx, m, w, 0, n, k, y, ldy);
    return;
  }
  // A few tasks per thread for balance, each a whole number of W tiles.
  const int tile_w = kernel.tile_w;
  const int tiles = (n + tile_w - 1) / tile_w;
  const int tasks = std::min(tiles, threads * 4);
  pool.ParallelFor(tasks, [&](int task, int) {
    const int j0 = std::min(n, static_cast<int>(int64_t{tiles} * task / tasks) * tile_w);
    const int j1 = std::min(n, static_cast<int>(int64_t{tiles} * (task + 1) / tasks) * tile_w);
    kernel.rows(x, ldx, m, w, j0, j1, k, y, ldy);
  });
}

float Dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  if (i < n) {
    const __m256i mask = TailMask(n - i);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
  }
  return HorizontalSum(acc);
}

void RmsNorm(const float* x, const float* weight, int n, float eps, float* out) {
  float ss = Dot(x, x, n) / static_cast<float>(n);
  const float scale = 1.0f / std::sqrt(ss + eps);
  for (int i = 0; i < n; ++i) out[i] = weight[i] * (scale * x[i]);
}

}  // namespace coalesce::engine::cpu
