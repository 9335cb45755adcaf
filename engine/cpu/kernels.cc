#include "engine/cpu/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "engine/cpu/matmul_panels.h"
#include "engine/cpu/quant_panels.h"
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

// The first n lanes (n clamped to 0..8).
inline __m256i FirstLanes(int n) { return TailMask(std::clamp(n, 0, 8)); }

// In-register transpose of 8 rows of 8 floats: afterwards r[c] holds column c.
inline void Transpose8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    // Per 128-bit lane L: (a[4L], b[4L], a[4L+1], b[4L+1]) and the same for 4L+2, 4L+3.
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    // u[4i + c], lane L: rows 4i..4i+3 at column 4L + c.
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);      // lane 0 of each
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);  // lane 1 of each
  }
}

// AVX2: a panel is 4 ymm vectors per k, processed as two halves of 16 rows;
// a tile is 2 x 6 (12 accumulators + 2 W vectors + 1 broadcast of the 16
// ymm registers), so both FMA ports stay busy.
struct Avx2Kernel {
  static constexpr int kTileX = 6;

  // 16 rows at a time, as the AVX-512 kernel (which says why).
  static void Pack(const float* w, int64_t ldw, int rows, int kb, float* panel) {
    for (int r0 = 0; r0 < kPanel; r0 += 16) {
      for (int k0 = 0; k0 < kb; k0 += 8) {
        const int nk = std::min(8, kb - k0);
        const __m256i kmask = FirstLanes(nk);
        for (int q = r0; q < r0 + 16; q += 8) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) {
            const int row = q + i;
            r[i] = row < rows ? _mm256_maskload_ps(w + row * ldw + k0, kmask) : _mm256_setzero_ps();
          }
          Transpose8x8(r);
          for (int c = 0; c < nk; ++c) _mm256_store_ps(panel + (k0 + c) * kPanel + q, r[c]);
        }
      }
    }
  }

  template <int RX>
  static void Tile(const float* x, int64_t ldx, const float* panel, int kb, bool accumulate,
                   int rows, float* y, int64_t ldy, const Prefetch& next) {
    for (int half = 0; half * 16 < rows; ++half) {
      const int r0 = half * 16;
      const __m256i m0 = FirstLanes(rows - r0), m1 = FirstLanes(rows - r0 - 8);
      __m256 acc[RX][2];
      for (int a = 0; a < RX; ++a) {
        if (accumulate) {
          acc[a][0] = _mm256_maskload_ps(y + a * ldy + r0, m0);
          acc[a][1] = _mm256_maskload_ps(y + a * ldy + r0 + 8, m1);
        } else {
          acc[a][0] = acc[a][1] = _mm256_setzero_ps();
        }
      }
      for (int kk = 0; kk < kb; ++kk) {
        if (half == 0) next.At(kk);
        const __m256 w0 = _mm256_load_ps(panel + kk * kPanel + r0);
        const __m256 w1 = _mm256_load_ps(panel + kk * kPanel + r0 + 8);
        for (int a = 0; a < RX; ++a) {
          const __m256 xv = _mm256_broadcast_ss(x + a * ldx + kk);
          acc[a][0] = _mm256_fmadd_ps(w0, xv, acc[a][0]);
          acc[a][1] = _mm256_fmadd_ps(w1, xv, acc[a][1]);
        }
      }
      for (int a = 0; a < RX; ++a) {
        _mm256_maskstore_ps(y + a * ldy + r0, m0, acc[a][0]);
        _mm256_maskstore_ps(y + a * ldy + r0 + 8, m1, acc[a][1]);
      }
    }
  }
};

// Columns k0..k0+7 of 8 rows: c[i] holds the 8 rows' values at k0 + i.
// Rows r and r + 4 share a vector (low and high 128 bits), so each half is a
// 4x4 transpose within the 128-bit lanes: 16 shuffles for 64 values.
inline void ColumnsOf8Rows(const float* const rows[8], int64_t k0, __m256 c[8]) {
  for (int h = 0; h < 2; ++h) {
    __m256 t[4];
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(rows[i] + k0 + 4 * h)),
                                  _mm_loadu_ps(rows[i + 4] + k0 + 4 * h), 1);
    }
    const __m256 a = _mm256_unpacklo_ps(t[0], t[1]);  // rows 0, 1 at k 0, 1 (lane: +4)
    const __m256 b = _mm256_unpackhi_ps(t[0], t[1]);  // rows 0, 1 at k 2, 3
    const __m256 e = _mm256_unpacklo_ps(t[2], t[3]);  // rows 2, 3 at k 0, 1
    const __m256 f = _mm256_unpackhi_ps(t[2], t[3]);  // rows 2, 3 at k 2, 3
    c[4 * h + 0] = _mm256_shuffle_ps(a, e, _MM_SHUFFLE(1, 0, 1, 0));
    c[4 * h + 1] = _mm256_shuffle_ps(a, e, _MM_SHUFFLE(3, 2, 3, 2));
    c[4 * h + 2] = _mm256_shuffle_ps(b, f, _MM_SHUFFLE(1, 0, 1, 0));
    c[4 * h + 3] = _mm256_shuffle_ps(b, f, _MM_SHUFFLE(3, 2, 3, 2));
  }
}

MatmulPanelsFn ChosenKernel(MatmulIsa isa) {
  return isa == MatmulIsa::kAvx512 ? MatmulPanelsAvx512 : MatmulPanelsAvx2;
}

}  // namespace

void MatmulPanelsAvx2(const float* x, int64_t ldx, int m, const float* w, int n, int j0, int j1,
                      int k, float* y, int64_t ldy) {
  MatmulPanelsWith<Avx2Kernel>(x, ldx, m, w, n, j0, j1, k, y, ldy);
}

void QuantMatmulPanelsAvx2(const float* x, int64_t ldx, int m, const QuantRows& rows,
                           const PackedMatrix& w, int p0, int p1, float* y, int64_t ldy) {
  QuantMatmulPanelsOf(x, ldx, m, rows, w, p0, p1, y, ldy);
}

namespace {

// Rows of X that share one pass over W's rows (one chain each, in 16
// registers with the transposed columns; with 6 to 8 the sums spilled to
// memory and the pass took twice as long).
constexpr int kMaxPassRows = 5;
// Rows of X up to which AVX2 reads W straight (MatmulFewRowsAvx2), in
// passes of up to kMaxPassRows over each 8 rows of W (the later ones from
// cache), rather than packing W into panels for the tile kernel: on an
// AVX2-only AMD EPYC, coalesce-quant-bench --types=fp32 timed 1 to 12 rows
// in 8% to 45% less time that way, and 16 in about the same.
constexpr int kMaxFewRowsAvx2 = 12;

// 8 rows of W (row[i] the start of row i; `rows` of them real, the rest
// repeating the last and never stored) against R rows of X: y[r, i] for
// i < rows. The 8 rows are one vector of outputs for each row of X, and
// each 8 columns of them, transposed in registers, serve all R.
template <int R>
void EightRowsOfWAgainstFewX(const float* x, int64_t ldx, const float* const row[8], int rows,
                             int k, float* y, int64_t ldy) {
  __m256 acc[R];
  for (__m256& v : acc) v = _mm256_setzero_ps();
  // The 8 columns from k0 on (the first nk of them) into every chain.
  auto step = [&](const float* const* rows8, int64_t at, int k0, int nk) {
    __m256 c[8];
    ColumnsOf8Rows(rows8, at, c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      if (i >= nk) break;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(c[i], _mm256_broadcast_ss(x + r * ldx + k0 + i), acc[r]);
      }
    }
  };
  int k0 = 0;
  for (; k0 + 8 <= k; k0 += 8) step(row, k0, k0, 8);
  if (k0 < k) {
    // The last k % 8 columns, through a zero-padded copy.
    const int nk = k - k0;
    alignas(32) float tail[8][8] = {};
    const float* tail_rows[8];
    for (int i = 0; i < 8; ++i) {
      std::memcpy(tail[i], row[i] + k0, sizeof(float) * nk);
      tail_rows[i] = tail[i];
    }
    step(tail_rows, 0, k0, nk);
  }
  for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * ldy, FirstLanes(rows), acc[r]);
}

}  // namespace

void MatmulFewRowsAvx2(const float* x, int64_t ldx, int m, const float* w, int n, int j0, int j1,
                       int k, float* y, int64_t ldy) {
  // 8 rows of W at a time, read straight from the matrix, against up to 5
  // rows of X at a time: one chain per row of X, 8 streams from memory a
  // thread. No software prefetch. On an AVX2-only AMD EPYC, 16 or 32 rows
  // at a time (two or four chains for one row of X, a faster kernel in
  // cache) read memory slower, and asking for the next rows ahead, as
  // MatvecAvx512 does, or each row's own continuation, made the product
  // slower still (docs/performance.md).
  for (int j = j0; j < j1; j += 8) {
    const int rows = std::min(8, n - j);
    const float* row[8];
    for (int i = 0; i < 8; ++i) row[i] = w + (int64_t{j} + std::min(i, rows - 1)) * k;
    // The rows of X in as few passes of up to kMaxPassRows as there can
    // be, of about equal size.
    const int passes = (m + kMaxPassRows - 1) / kMaxPassRows;
    for (int i = 0, pass = 0; i < m; ++pass) {
      const int r = (m - i + (passes - pass) - 1) / (passes - pass);
      const float* xi = x + i * ldx;
      float* yi = y + i * ldy + j;
      switch (r) {
        case 1:
          EightRowsOfWAgainstFewX<1>(xi, ldx, row, rows, k, yi, ldy);
          break;
        case 2:
          EightRowsOfWAgainstFewX<2>(xi, ldx, row, rows, k, yi, ldy);
          break;
        case 3:
          EightRowsOfWAgainstFewX<3>(xi, ldx, row, rows, k, yi, ldy);
          break;
        case 4:
          EightRowsOfWAgainstFewX<4>(xi, ldx, row, rows, k, yi, ldy);
          break;
        default:
          EightRowsOfWAgainstFewX<5>(xi, ldx, row, rows, k, yi, ldy);
      }
      i += r;
    }
  }
}

namespace {

// P panels side by side (laid out ahead: P * kPanel rows of W, each panel
// [k][kPanel] floats, `stride` floats after the one before) against R rows
// of X: 4 * P chains for each row of X, all advanced one k at a time. Of the
// P * kPanel rows the first `rows` are stored to y.
template <int P, int R>
void PanelsAgainstRows(const float* x, int64_t ldx, const float* panel, int64_t stride, int k,
                       int rows, float* y, int64_t ldy, bool accumulate) {
  __m256 acc[R][P][4];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      for (int v = 0; v < 4; ++v) {
        const int first = p * kPanel + 8 * v;
        acc[r][p][v] = accumulate && first < rows
                           ? _mm256_maskload_ps(y + r * ldy + first, FirstLanes(rows - first))
                           : _mm256_setzero_ps();
      }
    }
  }
  for (int kk = 0; kk < k; ++kk) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_broadcast_ss(x + r * ldx + kk);
    for (int p = 0; p < P; ++p) {
      const float* at = panel + p * stride + int64_t{kk} * kPanel;
      for (int v = 0; v < 4; ++v) {
        const __m256 wv = _mm256_load_ps(at + 8 * v);
        for (int r = 0; r < R; ++r) acc[r][p][v] = _mm256_fmadd_ps(wv, xv[r], acc[r][p][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      for (int v = 0; v < 4; ++v) {
        const int first = p * kPanel + 8 * v;
        if (first + 8 <= rows) {
          _mm256_storeu_ps(y + r * ldy + first, acc[r][p][v]);
        } else if (first < rows) {
          _mm256_maskstore_ps(y + r * ldy + first, FirstLanes(rows - first), acc[r][p][v]);
        }
      }
    }
  }
}

// Rows of X up to which laid-out panels are read as two panels side by
// side, one row of X after another, kLaidOutKBlock values of k at a time
// (16 KiB of the pair, which the later rows read from the first level of
// cache), rather than by the tile kernel. coalesce-quant-bench --types=fp32
// on an AVX2-only AMD EPYC: one panel at a time (one stream from memory a
// thread) read memory slower than the row-major kernel for 2 to 12 rows,
// and two side by side faster; passes over whole panels, which the later
// rows read from the second level of cache, were slower than over 64 values
// of k; from 16 rows the tile kernel was as fast or faster.
constexpr int kMaxRowsSideBySide = 12;
constexpr int kLaidOutKBlock = 64;

}  // namespace

void MatmulLaidOutAvx2(const float* x, int64_t ldx, int m, const float* panels, int rows, int k,
                       float* y, int64_t ldy) {
  const int64_t stride = int64_t{k} * kPanel;
  const int num = (rows + kPanel - 1) / kPanel;
  if (m <= kMaxRowsSideBySide) {
    // Two panels side by side (the last one alone), one row of X at a
    // time. Several rows go over kLaidOutKBlock values of k at a time: the
    // later rows read them from the first level of cache, and each chain
    // continues from the partial sum the block before stored in y. One row
    // reads each pair front to back.
    const int k_block = m == 1 ? k : kLaidOutKBlock;
    for (int p = 0; p < num; p += 2) {
      const int left = rows - p * kPanel;
      for (int k0 = 0; k0 < k; k0 += k_block) {
        const int kb = std::min(k_block, k - k0);
        const float* panel = panels + p * stride + int64_t{k0} * kPanel;
        for (int i = 0; i < m; ++i) {
          const float* xi = x + i * ldx + k0;
          float* yi = y + i * ldy + p * kPanel;
          if (p + 2 <= num) {
            PanelsAgainstRows<2, 1>(xi, ldx, panel, stride, kb, left, yi, ldy, k0 > 0);
          } else {
            PanelsAgainstRows<1, 1>(xi, ldx, panel, stride, kb, left, yi, ldy, k0 > 0);
          }
        }
      }
    }
    return;
  }
  const int tiles = (m + Avx2Kernel::kTileX - 1) / Avx2Kernel::kTileX;
  for (int p = 0; p < num; ++p) {
    const int height_rows = std::min(kPanel, rows - p * kPanel);
    for (int k0 = 0; k0 < k; k0 += kKBlock) {
      const int kb = std::min(kKBlock, k - k0);
      const float* panel = panels + p * stride + int64_t{k0} * kPanel;
      const float* next = panel + int64_t{kb} * kPanel;
      // What the tiles read next, the next block of this panel or the first
      // of the next, contiguous: asked for while they compute, as kPanel
      // runs of nb floats, the tiles sharing them.
      const int nb = k0 + kb < k ? std::min(kKBlock, k - k0 - kb) : std::min(kKBlock, k);
      const int next_runs = k0 + kb < k || p + 1 < num ? kPanel : 0;
      const int per_tile = (next_runs + tiles - 1) / tiles;
      // The block copied into this thread's panel buffer (a plain copy, no
      // transpose), which the tiles then read: reading it in place instead
      // took 7% to 15% more time for 64 rows (coalesce-quant-bench
      // --types=fp32 --rows=16,64 on an AVX2-only AMD EPYC).
      float* buffer = PanelBuffer();
      std::memcpy(buffer, panel, sizeof(float) * kb * kPanel);
      for (int tile = 0, i = 0; tile < tiles; ++tile) {
        const int height = std::min(Avx2Kernel::kTileX, m - i);
        const int first_run = std::min(next_runs, tile * per_tile);
        const Prefetch ahead{next + int64_t{first_run} * nb, nb,
                             std::min(per_tile, next_runs - first_run)};
        TileOf<Avx2Kernel>(height, x + i * ldx + k0, ldx, buffer, kb, k0 > 0, height_rows,
                           y + i * ldy + p * kPanel, ldy, ahead);
        i += height;
      }
    }
  }
}

MatmulIsa BestMatmulIsa() {
  static const MatmulIsa isa =
      __builtin_cpu_supports("avx512f") ? MatmulIsa::kAvx512 : MatmulIsa::kAvx2;
  return isa;
}

namespace {

// Rows of X from which, on AVX-512, the product runs across rows of X
// (MatmulTokensAvx512) instead of across rows of W: below this, the panel
// kernel's lanes are better used than a partly empty last vector of X rows.
constexpr int kMinRowsAcrossLanes = 48;

// This thread's buffer for X transposed, grown as needed, 64-byte aligned.
float* TransposeBuffer(size_t floats) {
  struct Buffer {
    std::unique_ptr<float, void (*)(void*)> data{nullptr, std::free};
    size_t capacity = 0;
  };
  thread_local Buffer buffer;
  if (buffer.capacity < floats) {
    buffer.data.reset(static_cast<float*>(std::aligned_alloc(64, sizeof(float) * floats)));
    buffer.capacity = floats;
  }
  return buffer.data.get();
}

}  // namespace

void Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const float* w, int n, int k,
            float* y, int64_t ldy, MatmulIsa isa) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int i = 0; i < m; ++i) std::fill(y + i * ldy, y + i * ldy + n, 0.0f);
    return;
  }
  // Rows [j0, j1) of W against every row of X by `rows`, on the pool when
  // the product is large enough.
  auto run = [&](auto rows) {
    // Below ~64K multiply-adds a thread handoff costs more than it saves.
    const int64_t work = int64_t{m} * n * k;
    const int threads = pool.size();
    if (threads == 1 || work < (int64_t{1} << 16)) {
      rows(0, n);
      return;
    }
    // A few tasks per thread for balance, each a whole number of panels.
    const int num_panels = (n + kPanel - 1) / kPanel;
    const int tasks = std::min(num_panels, threads * 4);
    pool.ParallelFor(tasks, [&](int task, int) {
      const int j0 = std::min(n, static_cast<int>(int64_t{num_panels} * task / tasks) * kPanel);
      const int j1 =
          std::min(n, static_cast<int>(int64_t{num_panels} * (task + 1) / tasks) * kPanel);
      rows(j0, j1);
    });
  };
  // Every kernel computes the same bits.
  if (MatmulSplitsRows(m, isa)) {
    run([=](int j0, int j1) { MatmulRows(x, ldx, m, w, n, k, j0, j1, y, ldy, isa); });
  } else {
    const int64_t ldxt = (m + 15) / 16 * 16;
    float* xt = TransposeBuffer(static_cast<size_t>(ldxt) * k);
    TransposeRowsAvx512(x, ldx, m, k, xt, ldxt);
    run([=](int j0, int j1) { MatmulTokensAvx512(xt, ldxt, m, w, j0, j1, k, y, ldy); });
  }
}

static_assert(kMatmulRowUnit == kPanel, "Matmul splits W's rows by panels");

bool MatmulSplitsRows(int m, MatmulIsa isa) {
  return isa != MatmulIsa::kAvx512 || m < kMinRowsAcrossLanes;
}

void MatmulRows(const float* x, int64_t ldx, int m, const float* w, int n, int k, int j0, int j1,
                float* y, int64_t ldy, MatmulIsa isa) {
  if (isa == MatmulIsa::kAvx512 && m == 1) {
    MatvecAvx512(x, w, n, j0, j1, k, y);
  } else if (isa == MatmulIsa::kAvx2 && m <= kMaxFewRowsAvx2) {
    MatmulFewRowsAvx2(x, ldx, m, w, n, j0, j1, k, y, ldy);
  } else {
    ChosenKernel(isa)(x, ldx, m, w, n, j0, j1, k, y, ldy);
  }
}

void MatmulReference(const float* x, int64_t ldx, int m, const float* w, int n, int k, float* y,
                     int64_t ldy) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int kk = 0; kk < k; ++kk) acc = std::fma(w[int64_t{j} * k + kk], x[i * ldx + kk], acc);
      y[i * ldy + j] = acc;
    }
  }
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

namespace {

// Attention reads a head's run of cached rows, one block after another, the
// blocks scattered through the pool: the kernels ask for the row kRowsAhead
// positions on while they work on this one. (Prefetching past the end of a
// block reads nothing that faults.)
constexpr int kRowsAhead = 8;
inline void PrefetchRows(const void* first, int64_t stride_bytes, int rows, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  for (int r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(p + r * stride_bytes + i, 0, 3);
  }
}

// How the attention kernels read 8 cached elements as floats: Load the 8 at
// p, LoadFirst the first `rem` (< 8) of them and zeros. Every conversion is
// exact, so a typed row is read as exactly the floats it stands for.
struct LoadF32 {
  using T = float;
  static __m256 Load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 LoadFirst(const float* p, int rem) { return _mm256_maskload_ps(p, TailMask(rem)); }
};
struct LoadBf16 {
  using T = Bf16;
  // bf16 is the top half of a float32: widen each to 32 bits, shift up.
  static __m256 Load(const Bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static __m256 LoadFirst(const Bf16* p, int rem) {
    Bf16 tail[8] = {};
    std::memcpy(tail, p, sizeof(Bf16) * rem);
    return Load(tail);
  }
};
struct LoadFp16 {
  using T = Fp16;
  static __m256 Load(const Fp16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256 LoadFirst(const Fp16* p, int rem) {
    Fp16 tail[8] = {};
    std::memcpy(tail, p, sizeof(Fp16) * rem);
    return Load(tail);
  }
};
struct LoadInt8 {
  using T = int8_t;
  static __m256 Load(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  static __m256 LoadFirst(const int8_t* p, int rem) {
    int8_t tail[8] = {};
    std::memcpy(tail, p, rem);
    return Load(tail);
  }
};

// Dot's arithmetic against one cached row.
template <typename L>
float DotRow(const float* q, const typename L::T* k, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), L::Load(k + i), acc);
  if (i < n) {
    const __m256i mask = TailMask(n - i);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + i, mask), L::LoadFirst(k + i, n - i), acc);
  }
  return HorizontalSum(acc);
}

// DotRows over rows read by L; `scales` (int8) multiply each row's sum, or
// nullptr.
template <typename L>
void DotRowsOf(const float* q, const typename L::T* keys, const float* scales, int64_t stride,
               int count, int n, float* scores) {
  using T = typename L::T;
  int o = 0;
  for (; o + 4 <= count; o += 4) {
    // Four chains of Dot's arithmetic, interleaved so they overlap.
    const T* k[4] = {keys + o * stride, keys + (o + 1) * stride, keys + (o + 2) * stride,
                     keys + (o + 3) * stride};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    PrefetchRows(keys + (o + kRowsAhead) * stride, stride * sizeof(T), 4, n * sizeof(T));
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(qv, L::Load(k[r] + i), acc[r]);
    }
    if (i < n) {
      const __m256i mask = TailMask(n - i);
      const __m256 qv = _mm256_maskload_ps(q + i, mask);
      for (int r = 0; r < 4; ++r) {
        acc[r] = _mm256_fmadd_ps(qv, L::LoadFirst(k[r] + i, n - i), acc[r]);
      }
    }
    for (int r = 0; r < 4; ++r) scores[o + r] = HorizontalSum(acc[r]);
  }
  for (; o < count; ++o) scores[o] = DotRow<L>(q, keys + o * stride, n);
  if (scales != nullptr) {
    for (o = 0; o < count; ++o) scores[o] *= scales[o];
  }
}

// AccumulateRows on NV vectors of 8 (the last `tail` lanes wide when tail >
// 0) of rows read by L; `scales` (int8) multiply each row's weight, or
// nullptr.
template <int NV, typename L>
void AccumulateChunk(const float* weights, const float* scales, const typename L::T* rows,
                     int64_t stride, int count, int tail, float* out) {
  using T = typename L::T;
  const __m256i last = tail > 0 ? TailMask(tail) : FirstLanes(8);
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) {
    acc[v] = v + 1 < NV ? _mm256_loadu_ps(out + 8 * v) : _mm256_maskload_ps(out + 8 * v, last);
  }
  for (int o = 0; o < count; ++o) {
    PrefetchRows(rows + (o + kRowsAhead) * stride, stride * sizeof(T), 1, 8 * NV * sizeof(T));
    const __m256 a = _mm256_set1_ps(scales != nullptr ? weights[o] * scales[o] : weights[o]);
    const T* row = rows + o * stride;
    for (int v = 0; v + 1 < NV; ++v) acc[v] = _mm256_fmadd_ps(a, L::Load(row + 8 * v), acc[v]);
    const __m256 end =
        tail > 0 ? L::LoadFirst(row + 8 * (NV - 1), tail) : L::Load(row + 8 * (NV - 1));
    acc[NV - 1] = _mm256_fmadd_ps(a, end, acc[NV - 1]);
  }
  for (int v = 0; v + 1 < NV; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
  _mm256_maskstore_ps(out + 8 * (NV - 1), last, acc[NV - 1]);
}

template <typename L>
void AccumulateRowsOf(const float* weights, const float* scales, const typename L::T* rows,
                      int64_t stride, int count, int n, float* out) {
  using ChunkFn =
      void (*)(const float*, const float*, const typename L::T*, int64_t, int, int, float*);
  static constexpr ChunkFn kChunk[8] = {
      AccumulateChunk<1, L>, AccumulateChunk<2, L>, AccumulateChunk<3, L>, AccumulateChunk<4, L>,
      AccumulateChunk<5, L>, AccumulateChunk<6, L>, AccumulateChunk<7, L>, AccumulateChunk<8, L>};
  // Chunks of up to 64 columns, each held in registers for the whole run.
  for (int c0 = 0; c0 < n; c0 += 64) {
    const int width = std::min(64, n - c0);
    kChunk[(width + 7) / 8 - 1](weights, scales, rows + c0, stride, count, width % 8, out + c0);
  }
}

// Gathered attention kernels: cached rows given by pointers (positions of a
// sequence whose blocks lie anywhere in the pool), for Q = 1 or 2 queries at
// once, each row read once for both. Every score and every output column is
// computed by the same chain as DotRowsOf's and AccumulateRowsOf's, so the
// bits are theirs.

// scores[r][0..3] for 4 key rows.
template <int Q, typename L>
__attribute__((always_inline)) inline void DotGroup(const float* const* q,
                                                    const typename L::T* const* k, int n,
                                                    float* const* scores, int at) {
  __m256 acc[Q][4];
  for (int r = 0; r < Q; ++r) {
    for (int kk = 0; kk < 4; ++kk) acc[r][kk] = _mm256_setzero_ps();
  }
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 qv[Q];
    for (int r = 0; r < Q; ++r) qv[r] = _mm256_loadu_ps(q[r] + i);
    for (int kk = 0; kk < 4; ++kk) {
      const __m256 key = L::Load(k[kk] + i);
      for (int r = 0; r < Q; ++r) acc[r][kk] = _mm256_fmadd_ps(qv[r], key, acc[r][kk]);
    }
  }
  if (i < n) {
    const __m256i mask = TailMask(n - i);
    __m256 qv[Q];
    for (int r = 0; r < Q; ++r) qv[r] = _mm256_maskload_ps(q[r] + i, mask);
    for (int kk = 0; kk < 4; ++kk) {
      const __m256 key = L::LoadFirst(k[kk] + i, n - i);
      for (int r = 0; r < Q; ++r) acc[r][kk] = _mm256_fmadd_ps(qv[r], key, acc[r][kk]);
    }
  }
  for (int r = 0; r < Q; ++r) {
    for (int kk = 0; kk < 4; ++kk) scores[r][at + kk] = HorizontalSum(acc[r][kk]);
  }
}

template <typename L>
void DotRowsGatheredOf(const float* const* q, int num, const typename L::T* const* keys,
                       const float* scales, int count, int n, float* const* scores) {
  int o = 0;
  for (; o + 4 <= count; o += 4) {
    if (o + 4 + 4 <= count) {
      for (int kk = 0; kk < 4; ++kk) PrefetchRows(keys[o + 4 + kk], 0, 1, n * sizeof(keys[0][0]));
    }
    int r = 0;
    for (; r + 2 <= num; r += 2) DotGroup<2, L>(q + r, keys + o, n, scores + r, o);
    if (r < num) DotGroup<1, L>(q + r, keys + o, n, scores + r, o);
  }
  for (; o < count; ++o) {
    for (int r = 0; r < num; ++r) scores[r][o] = DotRow<L>(q[r], keys[o], n);
  }
  if (scales != nullptr) {
    for (int r = 0; r < num; ++r) {
      for (o = 0; o < count; ++o) scores[r][o] *= scales[o];
    }
  }
}

// out[r][c0..] for Q weight rows over NV vectors of columns from c0 (the
// last `tail` lanes wide when kTail). No branch inside the row loop, so the
// Q x NV chains stay in registers.
template <int Q, int NV, bool kTail, typename L>
void AccumulateGroup(const float* const* weights, const float* scales,
                     const typename L::T* const* rows, int c0, int count, int tail,
                     float* const* out) {
  const __m256i last = kTail ? TailMask(tail) : FirstLanes(8);
  __m256 acc[Q][NV];
  for (int r = 0; r < Q; ++r) {
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = v + 1 < NV ? _mm256_loadu_ps(out[r] + c0 + 8 * v)
                             : _mm256_maskload_ps(out[r] + c0 + 8 * v, last);
    }
  }
  auto step = [&](const typename L::T* row, const __m256* a) {
    for (int v = 0; v < NV; ++v) {
      const __m256 x =
          kTail && v + 1 == NV ? L::LoadFirst(row + 8 * v, tail) : L::Load(row + 8 * v);
      for (int r = 0; r < Q; ++r) acc[r][v] = _mm256_fmadd_ps(a[r], x, acc[r][v]);
    }
  };
  for (int o = 0; o < count; ++o) {
    if (o + kRowsAhead < count)
      PrefetchRows(rows[o + kRowsAhead] + c0, 0, 1, 8 * NV * sizeof(rows[0][0]));
    __m256 a[Q];
    for (int r = 0; r < Q; ++r) {
      a[r] = _mm256_set1_ps(scales != nullptr ? weights[r][o] * scales[o] : weights[r][o]);
    }
    step(rows[o] + c0, a);
  }
  for (int r = 0; r < Q; ++r) {
    for (int v = 0; v + 1 < NV; ++v) _mm256_storeu_ps(out[r] + c0 + 8 * v, acc[r][v]);
    _mm256_maskstore_ps(out[r] + c0 + 8 * (NV - 1), last, acc[r][NV - 1]);
  }
}

template <typename L>
void AccumulateRowsGatheredOf(const float* const* weights, int num, const float* scales,
                              const typename L::T* const* rows, int count, int n,
                              float* const* out) {
  using GroupFn = void (*)(const float* const*, const float*, const typename L::T* const*, int, int,
                           int, float* const*);
  // [queries - 1][tail][vectors - 1]: 32 columns at a time for a pair, 64
  // for one query.
  static constexpr GroupFn kGroup[2][2][8] = {
      {{AccumulateGroup<1, 1, false, L>, AccumulateGroup<1, 2, false, L>,
        AccumulateGroup<1, 3, false, L>, AccumulateGroup<1, 4, false, L>,
        AccumulateGroup<1, 5, false, L>, AccumulateGroup<1, 6, false, L>,
        AccumulateGroup<1, 7, false, L>, AccumulateGroup<1, 8, false, L>},
       {AccumulateGroup<1, 1, true, L>, AccumulateGroup<1, 2, true, L>,
        AccumulateGroup<1, 3, true, L>, AccumulateGroup<1, 4, true, L>,
        AccumulateGroup<1, 5, true, L>, AccumulateGroup<1, 6, true, L>,
        AccumulateGroup<1, 7, true, L>, AccumulateGroup<1, 8, true, L>}},
      {{AccumulateGroup<2, 1, false, L>, AccumulateGroup<2, 2, false, L>,
        AccumulateGroup<2, 3, false, L>, AccumulateGroup<2, 4, false, L>, nullptr, nullptr, nullptr,
        nullptr},
       {AccumulateGroup<2, 1, true, L>, AccumulateGroup<2, 2, true, L>,
        AccumulateGroup<2, 3, true, L>, AccumulateGroup<2, 4, true, L>, nullptr, nullptr, nullptr,
        nullptr}}};
  // Runs of kRun rows, each run for every query before the next: a run
  // (16 KiB of float rows of 64) stays in L1 while the queries read it. Each
  // column's chain goes on from run to run in row order, through `out`.
  constexpr int kRun = 64;
  for (int o0 = 0; o0 < count; o0 += kRun) {
    const int run = std::min(kRun, count - o0);
    for (int r = 0; r < num;) {
      const int q = std::min(2, num - r);
      const int step = q == 2 ? 32 : 64;
      const float* w[2] = {weights[r] + o0, q == 2 ? weights[r + 1] + o0 : nullptr};
      for (int c0 = 0; c0 < n; c0 += step) {
        const int width = std::min(step, n - c0);
        kGroup[q - 1][width % 8 != 0][(width + 7) / 8 - 1](
            w, scales == nullptr ? nullptr : scales + o0, rows + o0, c0, run, width % 8, out + r);
      }
      r += q;
    }
  }
}

}  // namespace

void DotRows(const float* q, const float* keys, int64_t stride, int count, int n, float* scores) {
  DotRowsOf<LoadF32>(q, keys, nullptr, stride, count, n, scores);
}
void DotRows(const float* q, const Bf16* keys, int64_t stride, int count, int n, float* scores) {
  DotRowsOf<LoadBf16>(q, keys, nullptr, stride, count, n, scores);
}
void DotRows(const float* q, const Fp16* keys, int64_t stride, int count, int n, float* scores) {
  DotRowsOf<LoadFp16>(q, keys, nullptr, stride, count, n, scores);
}
void DotRows(const float* q, const int8_t* keys, const float* scales, int64_t stride, int count,
             int n, float* scores) {
  DotRowsOf<LoadInt8>(q, keys, scales, stride, count, n, scores);
}

void AccumulateRows(const float* weights, const float* rows, int64_t stride, int count, int n,
                    float* out) {
  AccumulateRowsOf<LoadF32>(weights, nullptr, rows, stride, count, n, out);
}
void AccumulateRows(const float* weights, const Bf16* rows, int64_t stride, int count, int n,
                    float* out) {
  AccumulateRowsOf<LoadBf16>(weights, nullptr, rows, stride, count, n, out);
}
void AccumulateRows(const float* weights, const Fp16* rows, int64_t stride, int count, int n,
                    float* out) {
  AccumulateRowsOf<LoadFp16>(weights, nullptr, rows, stride, count, n, out);
}
void AccumulateRows(const float* weights, const int8_t* rows, const float* scales, int64_t stride,
                    int count, int n, float* out) {
  AccumulateRowsOf<LoadInt8>(weights, scales, rows, stride, count, n, out);
}

void DotRowsGathered(const float* const* q, int num, const float* const* keys, int count, int n,
                     float* const* scores) {
  DotRowsGatheredOf<LoadF32>(q, num, keys, nullptr, count, n, scores);
}
void DotRowsGathered(const float* const* q, int num, const Bf16* const* keys, int count, int n,
                     float* const* scores) {
  DotRowsGatheredOf<LoadBf16>(q, num, keys, nullptr, count, n, scores);
}
void DotRowsGathered(const float* const* q, int num, const Fp16* const* keys, int count, int n,
                     float* const* scores) {
  DotRowsGatheredOf<LoadFp16>(q, num, keys, nullptr, count, n, scores);
}
void DotRowsGathered(const float* const* q, int num, const int8_t* const* keys, const float* scales,
                     int count, int n, float* const* scores) {
  DotRowsGatheredOf<LoadInt8>(q, num, keys, scales, count, n, scores);
}

void AccumulateRowsGathered(const float* const* weights, int num, const float* const* rows,
                            int count, int n, float* const* out) {
  AccumulateRowsGatheredOf<LoadF32>(weights, num, nullptr, rows, count, n, out);
}
void AccumulateRowsGathered(const float* const* weights, int num, const Bf16* const* rows,
                            int count, int n, float* const* out) {
  AccumulateRowsGatheredOf<LoadBf16>(weights, num, nullptr, rows, count, n, out);
}
void AccumulateRowsGathered(const float* const* weights, int num, const Fp16* const* rows,
                            int count, int n, float* const* out) {
  AccumulateRowsGatheredOf<LoadFp16>(weights, num, nullptr, rows, count, n, out);
}
void AccumulateRowsGathered(const float* const* weights, int num, const int8_t* const* rows,
                            const float* scales, int count, int n, float* const* out) {
  AccumulateRowsGatheredOf<LoadInt8>(weights, num, scales, rows, count, n, out);
}

void RmsNorm(const float* x, const float* weight, int n, float eps, float* out) {
  float ss = Dot(x, x, n) / static_cast<float>(n);
  const float scale = 1.0f / std::sqrt(ss + eps);
  for (int i = 0; i < n; ++i) out[i] = weight[i] * (scale * x[i]);
}

}  // namespace coalesce::engine::cpu
