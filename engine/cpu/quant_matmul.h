// The CPU matrix product with weights in a quantized block type (model.h,
// QuantType), computed without a float32 copy of the weights.
//
// The arithmetic is Matmul's (kernels.h): every output element is one chain
// of fused multiply-adds over k in increasing order, of x and the weight's
// dequantized value, which is exactly the float gguf.quants.dequantize gives
// (each block formula's products are exact in float32, and the one addition
// of Q4_1 and Q4_K rounds once however it is computed). So a product with a
// quantized matrix gives the same bits as Matmul with that matrix
// dequantized: a sequence decodes the same alone or in any batch, on AVX2 or
// AVX-512, and exactly as the float32 engine does on the dequantized file.
//
// What changes is the memory traffic. Matmul transposes ("packs") panels of
// 32 rows of float32 weights into a small buffer before it computes with
// them; here the weights are laid out once, at load, as those panels in
// their block type (PackedMatrix), and each panel is dequantized straight
// into the buffer. Every weight byte read from memory is a quantized one: a
// decode step reads Q4_0 weights in 18 bytes per 32 weights, not 128.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/thread_pool.h"
#include "engine/model.h"

namespace coalesce::engine::cpu {

// Rows of a panel: matmul_panels.h's kPanel.
inline constexpr int kQuantPanelRows = 32;

// A quantized matrix laid out as panels of 32 rows (the last one padded with
// zero weights), each a run of groups: a group is the 32 rows' blocks of one
// block of columns, with each field of the 32 blocks stored together so that
// one vector load reads a value of many rows. Per group (little-endian, f16
// scales as in the file):
//   Q8_0  d[32] f16, q[32 k][32 rows] int8                          1088 bytes
//   Q4_0  d[32], q[32 k][16]: byte c holds row c (low nibble) and row c + 16
//         (high nibble)                                               576
//   Q4_1  d[32], m[32], q as Q4_0                                     640
//   Q4_K  d[32], dmin[32], sc[8][32], mn[8][32] (6-bit, one byte each),
//         q[256 k][16] as Q4_0                                       4736
//   Q6_K  d[32], sc[16][32] int8, ql[256 k][16] (low 4 bits, as Q4_0),
//         qh[256 k][8]: byte c holds the high 2 bits of rows c, c + 8,
//         c + 16, c + 24 at bits 0, 2, 4, 6                           6720
// The same bytes per weight as the file, but for Q4_K's scales (148 bytes
// per row and block instead of 144).
class PackedMatrix {
 public:
  // Lays `m` out as panels. InvalidArgument for a shape the product cannot
  // take (rows or columns beyond int, columns not whole blocks).
  static absl::StatusOr<PackedMatrix> Pack(const QuantizedMatrix& m);

  QuantType type() const { return type_; }
  int rows() const { return rows_; }
  int cols() const { return cols_; }
  // Bytes of one group, and of one panel (cols / block size groups).
  int64_t group_bytes() const { return group_bytes_; }
  int64_t panel_bytes() const { return panel_bytes_; }
  int64_t bytes() const { return panel_bytes_ * num_panels(); }
  int num_panels() const { return (rows_ + kQuantPanelRows - 1) / kQuantPanelRows; }
  const uint8_t* panel(int p) const { return data_.get() + p * panel_bytes_; }

  // Row r's dequantized weights (cols floats), one at a time: the embedding
  // lookup of a quantized embedding, and the tests' reference.
  void DequantizeRow(int r, float* out) const;

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  QuantType type_ = QuantType::kQ8_0;
  int rows_ = 0, cols_ = 0;
  int64_t group_bytes_ = 0, panel_bytes_ = 0;
  std::unique_ptr<uint8_t[], Free> data_;
};

// Bytes of one group of `type` (above).
int64_t QuantGroupBytes(QuantType type);

// y[i, j] = sum_k x[i, k] * w[j, k] for i < m, j < w.rows(), as Matmul does
// with w dequantized, bit for bit.
//   x: [m, w.cols()] (row stride ldx)   y: [m, w.rows()] (row stride ldy)
void QuantMatmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const PackedMatrix& w,
                 float* y, int64_t ldy, MatmulIsa isa = BestMatmulIsa());

// The panels [p0, p1) of w against all m rows of x, on this thread: the
// kernels QuantMatmul runs, one per instruction set (same bits).
void QuantMatmulPanelsAvx2(const float* x, int64_t ldx, int m, const PackedMatrix& w, int p0,
                           int p1, float* y, int64_t ldy);
void QuantMatmulPanelsAvx512(const float* x, int64_t ldx, int m, const PackedMatrix& w, int p0,
                             int p1, float* y, int64_t ldy);

}  // namespace coalesce::engine::cpu
