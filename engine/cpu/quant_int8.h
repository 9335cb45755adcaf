// The CPU engine's faster numerics for quantized weights (--int8_activations):
// Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights times activations quantized to
// int8, with integer dot products: AVX512-VNNI's vpdpbusd (four byte products
// summed into each 32-bit lane per instruction) where the processor has it,
// else AVX2's vpmaddubsw and vpmaddwd (the same sums in two), chosen at run
// time, with the same bits.
//
// Each row of activations is quantized per block of 32 values as Q8_0 is:
// dx = max|x| / 127, xq = x / dx rounded to nearest, ties to even (dividing
// as multiplying by 1 / dx; a non-finite value gives 0). For one weight row and one block,
// with integer dot I = sum_k q[k] * xq[k] over the block's stored integers,
// S = sum_k xq[k], and I1, S1 (I2, S2) the same over its first (last) 16:
//   Q8_0: w = d q              ->  d dx I
//   Q4_0: w = d (q - 8)        ->  d dx (I - 8 S)
//   Q4_1: w = d q + m          ->  d dx I + m dx S
//   Q4_K: w = d sc q - dmin mn ->  (d sc) dx I - (dmin mn) dx S     (sc, mn: the block's)
//   Q6_K: w = d sc (q - 32)    ->  d dx (sc1 (I1 - 32 S1) + sc2 (I2 - 32 S2))
//                                  (sc1, sc2: the scales of the block's two 16s)
// summed over the blocks in increasing order, one fused multiply-add per
// term, in float32. The integer parts are exact; only the activations'
// rounding (half a step of 1/127 of a block's largest value) departs from
// the float32 product. A row's result depends on that row alone, so a
// sequence still decodes the same alone or in any batch; but its logits are
// no longer within float32 rounding of the dequantized model's
// (docs/quality.md measures the difference).
//
// The weights are laid out once, at load, in groups of 16 rows (one 32-bit
// lane each) and blocks of 32 columns: the 16 rows' scales together, then
// their integers as vpdpbusd reads them, four consecutive columns of a row in
// a lane (Int8Matrix). The same bytes per weight as the file (Q4_K: 2.8%
// more, its 6-bit scales a byte each).
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>

#include "absl/status/statusor.h"
#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/thread_pool.h"
#include "engine/model.h"

namespace coalesce::engine::cpu {

// Whether this processor runs the int8 kernels: AVX2 at least (the engine's
// baseline, x86-64-v3).
bool Int8DotSupported();

// The int8 kernels' instruction sets; both compute the same bits.
enum class Int8Isa { kAvx2, kAvx512Vnni };
// AVX512-VNNI where the processor has it (and AVX-512F), else AVX2.
Int8Isa BestInt8Isa();

// Whether a type has int8 kernels: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K.
bool Int8DotType(QuantType type);

// Rows of a group (one per 32-bit lane of a 512-bit vector).
inline constexpr int kInt8GroupRows = 16;

// Tasks per thread that a product's groups are split into for m rows of
// activations. One row is bound by memory: few tasks, because a task starts
// its streams from memory cold (the first reads of each wait for memory
// before the prefetches ahead of them run), yet more than one, so that a
// thread the machine delays is made up for by the others
// (docs/performance.md measures 2 against 4). More rows are bound by
// arithmetic, and more tasks balance the threads better.
inline constexpr int Int8TasksPerThread(int m) { return m == 1 ? 2 : 4; }

// Bytes of a group's header and of one of its blocks in Int8Matrix's layout
// (below), and the blocks of 32 columns under a header (the file's own block:
// 256 columns for Q4_K and Q6_K), for each type with int8 kernels.
constexpr int Int8BlocksPerHeader(QuantType type) {
  return type == QuantType::kQ4_K || type == QuantType::kQ6_K ? 8 : 1;
}
constexpr int64_t Int8HeaderBytes(QuantType type) {
  return type == QuantType::kQ4_K ? 64 : type == QuantType::kQ6_K ? 32 : 0;
}
constexpr int64_t Int8BlockBytes(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
      return 544;
    case QuantType::kQ4_0:
    case QuantType::kQ4_K:
      return 288;
    case QuantType::kQ4_1:
      return 320;
    case QuantType::kQ6_K:
      return 416;
  }
  return 0;
}

// A quantized matrix laid out for the int8 kernels: groups of 16 rows (the
// last padded with zero weights) by the type's own blocks of columns (32, or
// 256 for Q4_K and Q6_K), each a header and then its 32-column blocks.
// Per group (little-endian, f16 scales as in the file):
//   Q8_0  block: d[16], w[8][16][4] u8: q + 128 (the AVX-512 kernel
//         subtracts 128 S; AVX2's turns it back into q)                544 bytes
//   Q4_0  block: d[16], n[4][16][4]: byte c of lane r in quad j holds
//         columns 4j + c (low nibble) and 4j + 16 + c (high nibble) of
//         row r                                                        288
//   Q4_1  block: d[16], m[16], n as Q4_0                               320
//   Q4_K  header: d[16], dmin[16]                                       64
//         block: sc[16], mn[16] (one byte each), n as Q4_0              288
//   Q6_K  header: d[16]                                                 32
//         block: sc[2][16] int8 (columns 0-15, 16-31), n as Q4_0 (the
//         low 4 bits), h[2][16][4]: byte c of lane r in h[t] holds the
//         high 2 bits of columns 8t + c, 8t + 4 + c, 8t + 16 + c and
//         8t + 20 + c at bits 0, 2, 4 and 6                            416
class Int8Matrix {
 public:
  // InvalidArgument for a type without int8 kernels or a shape the product
  // cannot take.
  static absl::StatusOr<Int8Matrix> Pack(const QuantizedMatrix& m);

  QuantType type() const { return type_; }
  int rows() const { return rows_; }
  int cols() const { return cols_; }
  int num_groups() const { return (rows_ + kInt8GroupRows - 1) / kInt8GroupRows; }
  // Blocks of 32 columns under one header (1, or 8 for Q4_K and Q6_K).
  int blocks_per_header() const { return blocks_per_header_; }
  int64_t header_bytes() const { return header_bytes_; }
  int64_t block_bytes() const { return block_bytes_; }  // of one group and block
  int64_t group_bytes() const {
    return (header_bytes_ + block_bytes_ * blocks_per_header_) * (cols_ / 32 / blocks_per_header_);
  }
  int64_t bytes() const { return group_bytes() * num_groups(); }
  const uint8_t* group(int g) const { return data_.data() + g * group_bytes(); }
  // Block b (of 32 columns) of group g, and its header.
  const uint8_t* header(int g, int b) const {
    return group(g) +
           (b / blocks_per_header_) * (header_bytes_ + block_bytes_ * blocks_per_header_);
  }
  const uint8_t* block(int g, int b) const {
    return header(g, b) + header_bytes_ + (b % blocks_per_header_) * block_bytes_;
  }

  // Row r's weights, dequantized as gguf.quants.dequantize does (the
  // embedding lookup of a quantized embedding).
  void DequantizeRow(int r, float* out) const;

 private:
  QuantType type_ = QuantType::kQ8_0;
  int rows_ = 0, cols_ = 0;
  int blocks_per_header_ = 1;
  int64_t header_bytes_ = 0, block_bytes_ = 0;
  HugePageMemory data_;  // huge_page_memory.h
};

// Activations quantized per block of 32 (above): for row i and block b,
// xq[i * ldq + 32 b + k], scale[i * blocks + b], sum[i * blocks + b] (S),
// and first_sum[i * blocks + b] (S1, of its first 16).
struct Int8Rows {
  int rows = 0, blocks = 0;  // in use
  int64_t capacity = 0;      // blocks allocated
  std::unique_ptr<int8_t[]> xq;
  std::unique_ptr<float[]> scale;
  std::unique_ptr<int32_t[]> sum;
  std::unique_ptr<int32_t[]> first_sum;
};

// Quantizes m rows of x (k columns, k a multiple of 32) into `out`
// (reallocated as needed).
void QuantizeRows(const float* x, int64_t ldx, int m, int k, Int8Rows& out);

// y[i, j] = the formula above for row i of x and row j of w, i < m,
// j < w.rows(). Int8DotSupported() must hold, and the processor must have
// `isa`.
//   x: [m, w.cols()] (row stride ldx)   y: [m, w.rows()] (row stride ldy)
void Int8Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const Int8Matrix& w, float* y,
                int64_t ldy, Int8Isa isa = BestInt8Isa());

// Int8Matmul's pieces, for running several products in one parallel loop:
// Int8Matmul is QuantizeRows, then this over ranges of groups [g0, g1), on
// any threads, each range once.
void Int8MatmulGroups(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y, int64_t ldy,
                      Int8Isa isa = BestInt8Isa());
// The kernels it runs (quant_int8_avx512.cc, quant_int8_avx2.cc), each one
// instantiation per type: ForInt8Type calls fn(std::integral_constant<
// QuantType, T>()) for T = type.
template <typename Fn>
void ForInt8Type(QuantType type, Fn&& fn) {
  switch (type) {
    case QuantType::kQ8_0:
      return fn(std::integral_constant<QuantType, QuantType::kQ8_0>());
    case QuantType::kQ4_0:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_0>());
    case QuantType::kQ4_1:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_1>());
    case QuantType::kQ4_K:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_K>());
    case QuantType::kQ6_K:
      return fn(std::integral_constant<QuantType, QuantType::kQ6_K>());
  }
}
void Int8MatmulGroupsAvx512(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                            int64_t ldy);
void Int8MatmulGroupsAvx2(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                          int64_t ldy);

// The same, one element at a time in scalar code: the definition Int8Matmul
// must equal bit for bit (the tests compare them).
void Int8MatmulReference(const float* x, int64_t ldx, int m, const Int8Matrix& w, float* y,
                         int64_t ldy);

}  // namespace coalesce::engine::cpu
