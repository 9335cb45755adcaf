// A float32 weight matrix laid out once, at load, as the panels the matrix
// product computes with (matmul_panels.h), so that no product transposes W
// again.
//
// Matmul reads W as llama2.c stores it, [out][in]: each output's chain of
// multiply-adds runs along a row, so a vector of outputs needs several rows
// read side by side and transposed in registers. For one row of X that is
// either one chain per 8 outputs (8 rows, 8 streams from memory a thread) or
// more streams than the memory system serves well. Laid out as panels of 32
// rows, [k][32], one row of X reads two panels side by side, each front to
// back (two streams, four chains a panel), and many rows of X read them
// without the transposing step. The arithmetic is Matmul's, bit for bit
// (kernels.h): every output is one chain of fused multiply-adds over k in
// increasing order.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/thread_pool.h"

namespace coalesce::engine::cpu {

class FloatPanels {
 public:
  // Rows of a panel: matmul_panels.h's kPanel.
  static constexpr int kRows = 32;

  // w [rows][cols] laid out as panels: panel p holds rows 32p to 32p + 31 as
  // [cols][32] floats (value (r, c) at c * 32 + r % 32), the last one padded
  // with zero rows. InvalidArgument for a shape the product cannot take;
  // ResourceExhausted when the memory cannot be had.
  static absl::StatusOr<FloatPanels> Pack(const float* w, int64_t rows, int64_t cols);

  int rows() const { return rows_; }
  int cols() const { return cols_; }
  int num_panels() const { return (rows_ + kRows - 1) / kRows; }
  int64_t bytes() const { return int64_t{num_panels()} * cols_ * kRows * sizeof(float); }
  // Panel p: [cols][32], 64-byte aligned.
  const float* panel(int p) const { return data_.as<float>() + int64_t{p} * cols_ * kRows; }
  // Row r (cols floats), as it was given to Pack: a tied embedding's lookup.
  void Row(int r, float* out) const;

 private:
  int rows_ = 0, cols_ = 0;
  HugePageMemory data_;  // huge_page_memory.h
};

// y[i, j] = sum_k x[i, k] * w[j, k] for i < m, j < w.rows(): Matmul's bits
// (the AVX2 kernels, which every x86-64 processor this engine runs on has).
//   x: [m, w.cols()] (row stride ldx)   y: [m, w.rows()] (row stride ldy)
void FloatPanelsMatmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const FloatPanels& w,
                       float* y, int64_t ldy);

// The panels [p0, p1) of w against all m rows of x, on this thread.
void FloatPanelsMatmulPanels(const float* x, int64_t ldx, int m, const FloatPanels& w, int p0,
                             int p1, float* y, int64_t ldy);

}  // namespace coalesce::engine::cpu
