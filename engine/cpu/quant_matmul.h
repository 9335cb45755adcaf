// The CPU matrix product with weights in a quantized block type (model.h,
// QuantType), computed without a float32 copy of the weights.
//
// The arithmetic. A row's weights in one sub-block (the values of k that
// share a scale: 32, or 16 for Q6_K) are w = dl * q + ml, with q the
// block's integers and dl, ml exact products of the file's fields (Q8_0
// has no ml). So x . w over the sub-block is dl * (q . x) + ml * sum(x),
// and that is how it is computed, in float32 (fma: one rounding):
//   y = 0
//   for each sub-block b, in increasing k:
//     t = 0;  for k in b: t = fma(q[k], x[k], t)
//     y = fma(dl_b, t, fma(ml_b, s_b, y))        (Q8_0: y = fma(dl_b, t, y))
// where s_b is the sum of x over the sub-block, added in k order from 0
// (QuantBlockSums). QuantMatmulReference is this, one element at a time.
// It is the product of the dequantized weights with x in exact arithmetic;
// in float32 it differs from Matmul on the dequantized matrix only by the
// roundings (one chain of k fmas there; here a chain per sub-block, and
// the scales applied once per sub-block). quant_matmul_test bounds that
// difference, and gguf_model_parity the logits against transformers.
//
// The dequantized weight costs no instruction: a decode step's product is
// one fma per weight and at most one conversion of an integer to float
// (CodeFloats), bound by the memory that holds the quantized bytes. No
// output depends on the other rows of X or W, the thread, the tile or the
// instruction set (the AVX-512 build runs the same 256-bit code), so a
// sequence decodes the same bits alone or in any batch.
//
// The weights are laid out once, at load, as panels of 32 rows in their
// block type (PackedMatrix): every weight byte read from memory is a
// quantized one (a decode step reads Q4_0 weights in 18 bytes per 32
// weights, not 128).
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "engine/cpu/huge_page_memory.h"
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
//   Q4_0  d[32], q[16 pairs of k][8][2] 16-bit words: word [p][c][h]
//         holds column 2p + h's rows c, c + 8, c + 16, c + 24 at bits
//         0, 4, 8, 12                                                 576
//   Q4_1  d[32], m[32], q as Q4_0                                     640
//   Q4_K  d[32], dmin[32], sc[8][32], mn[8][32] (6-bit, one byte each),
//         q[128 pairs of k][8][2] as Q4_0                            4736
//   Q6_K  d[32], sc[16][32] int8, q[256 k] of 24 bytes: 8 lanes of 24 bits,
//         lane c in bytes 3c to 3c + 2 (little-endian), holding rows c,
//         c + 8, c + 16, c + 24 at bits 0, 6, 12, 18                  6720
// The same bytes per weight as the file, but for Q4_K's scales (148 bytes
// per row and block instead of 144). A pair of 4-bit columns is one load of
// 8 lanes of 32 bits (the odd column shifted down 16 bits), and a Q6_K
// column one load and one shuffle into 8 lanes; each row's bits are masked
// where they lie (quant_panels.h).
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
  const uint8_t* panel(int p) const { return data_.data() + p * panel_bytes_; }

  // Row r's dequantized weights (cols floats), one at a time: the embedding
  // lookup of a quantized embedding, and the tests' reference.
  void DequantizeRow(int r, float* out) const;
  // Row r's integers (cols floats) and its sub-blocks' scales (cols / sub
  // each; ml zero for Q8_0), such that weight k is dl[k / sub] * q[k] +
  // ml[k / sub] (sub: QuantSubBlockSize(type())).
  void RowCodes(int r, float* q, float* dl, float* ml) const;

 private:
  QuantType type_ = QuantType::kQ8_0;
  int rows_ = 0, cols_ = 0;
  int64_t group_bytes_ = 0, panel_bytes_ = 0;
  HugePageMemory data_;  // huge_page_memory.h
};

// Bytes of one group of `type` (above).
int64_t QuantGroupBytes(QuantType type);

// Values of k in a sub-block of `type` (above): 16 for Q6_K, else 32.
constexpr int QuantSubBlockSize(QuantType type) { return type == QuantType::kQ6_K ? 16 : 32; }

// The sub-block sums of the m rows of X: sums[i * (k / sub) + b] = x[i, b *
// sub] + ... + x[i, b * sub + sub - 1], added in that order from 0.
void QuantBlockSums(const float* x, int64_t ldx, int m, int k, int sub, float* sums);

// How the one- and two-row kernels (a decode step's products) turn a
// column's integers into floats, for every type but Q8_0:
//   kConverted  an integer-to-float conversion per 8 weights.
//   kSubnormal  none: the 32-bit lane that holds an integer q (masked in
//               place, the bits above it zero) read as a float is q times
//               2^-149, a subnormal. The row of X comes multiplied by 2^s,
//               s from its largest magnitude (QuantRows), so that the fmas'
//               sums are normal floats, 2^(s - 149) times the converted
//               ones; each chain is multiplied back by 2^(149 - s) before
//               its scale applies.
// Both give the same bits as long as those sums stay normal: a partial sum
// of a sub-block below about 2^-103 times the row's largest |x| would lose
// bits (a row whose largest |x| is 2^104 or more, or not finite, converts).
// Which is faster depends on the processor: some take a microcode assist
// on a subnormal operand, others none, and then the conversions (one per
// fma) are what bound the kernel. QuantCodeFloats measures both, once.
enum class CodeFloats { kConverted, kSubnormal };

// The faster of the two on this processor, timed once on a small product
// the first time it is asked for (about a millisecond), unless set.
CodeFloats QuantCodeFloats();
// Sets what QuantCodeFloats returns (nullopt: measure), for benchmarks and
// tests that compare the two.
void SetQuantCodeFloats(std::optional<CodeFloats> codes);

// What the kernels read of X besides X, computed once per product on the
// thread that splits it, shared by its tasks.
struct QuantRows {
  // QuantBlockSums of the m rows for w's sub-block size.
  const float* sums = nullptr;
  // For kSubnormal and m <= 2: the rows times 2^s ([m][w.cols()]) and
  // 2^(149 - s), one s per row (Q8_0's kernels, which always convert, do
  // not read them); else null.
  const float* scaled = nullptr;
  float unscale[2] = {1.0f, 1.0f};
};

// QuantRows of the m rows of X for w, in the calling thread's buffers (one
// set per sub-block size, kept until this thread asks again for that size).
QuantRows QuantRowInputs(const float* x, int64_t ldx, int m, const PackedMatrix& w,
                         CodeFloats codes = QuantCodeFloats());

// Panels a parallel loop hands a task at a time for m rows of X: two for
// one row, whose kernel reads two panels in lockstep (a panel left alone
// has half the chains to hide the fmas' latency, and ran a third slower),
// else one.
constexpr int QuantPanelsPerUnit(int m) { return m == 1 ? 2 : 1; }

// Tasks a thread takes of a product with m rows of X: one for one row, whose
// product waits on memory and whose every task starts cold (its first reads
// wait until its prefetches run ahead; performance.md), unless set; else up
// to four, for balance.
int QuantTasksPerThread(int m);
// Sets the one-row figure (nullopt: one), for benchmarks that compare.
void SetQuantTasksPerThread(std::optional<int> tasks);

// y[i, j] = sum_k x[i, k] * w[j, k] for i < m, j < w.rows(), in the
// arithmetic above.
//   x: [m, w.cols()] (row stride ldx)   y: [m, w.rows()] (row stride ldy)
void QuantMatmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const PackedMatrix& w,
                 float* y, int64_t ldy, MatmulIsa isa = BestMatmulIsa(),
                 CodeFloats codes = QuantCodeFloats());

// The definition above, one element at a time from the packed bytes (the
// tests' reference).
void QuantMatmulReference(const float* x, int64_t ldx, int m, const PackedMatrix& w, float* y,
                          int64_t ldy);

// The panels [p0, p1) of w against all m rows of x, on this thread, given
// QuantRowInputs of x for w: the kernels QuantMatmul runs, one per
// instruction set (the same code, so the same bits).
void QuantMatmulPanelsAvx2(const float* x, int64_t ldx, int m, const QuantRows& rows,
                           const PackedMatrix& w, int p0, int p1, float* y, int64_t ldy);
void QuantMatmulPanelsAvx512(const float* x, int64_t ldx, int m, const QuantRows& rows,
                             const PackedMatrix& w, int p0, int p1, float* y, int64_t ldy);

}  // namespace coalesce::engine::cpu
