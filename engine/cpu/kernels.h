// The CPU backend's arithmetic, written so that every output element is
// computed by the same instruction sequence whatever else is in the batch.
//
// Why not BLAS: the rows of an OpenBLAS sgemm result (0.3.21, the Debian
// build) depend on how many rows share the call. Measured on this project's
// machines: with the SkylakeX/Cooperlake kernels, products under 1e6
// multiply-adds take a "small matrix" kernel (used while rows * out_dim <=
// 1200) whose summation order differs from the blocked kernel's, so a row
// computed alone differs in the last bits from the same row computed next to
// 18 others; with the Haswell and Prescott kernels (other CPUs, or
// OPENBLAS_CORETYPE set) even the blocked kernel's result depends on the
// row's position within its tile. A last-bit difference flips a greedy argmax
// sooner or later (cpu_backend_test's BatchMatesDoNotChangeLogits fails with
// sgemm), so a sequence would decode differently depending on its
// batch-mates.
//
// Matmul computes each element as one chain of fused multiply-adds over k in
// increasing order (MatmulReference, one element at a time, is the
// definition), vectorised across rows of W the way BLAS kernels are
// (matmul_panels.h): a pure function of the two input rows, whatever the
// batch, the tile, the thread or the instruction set (AVX2 and AVX-512 give
// the same bits). The other kernels here (Dot, RmsNorm) are fixed-order too.
#pragma once

#include <cstdint>

#include "engine/cpu/kv_quant.h"
#include "engine/cpu/thread_pool.h"

namespace coalesce::engine::cpu {

// The matrix product's kernels. Both compute the same bits; AVX-512 is
// faster where the processor has it.
enum class MatmulIsa { kAvx2, kAvx512 };
// AVX-512 where the processor has it, else AVX2 (decided once per process).
MatmulIsa BestMatmulIsa();

// y[i, j] = sum_k x[i, k] * w[j, k] for i < m, j < n: X times W transposed,
// with W stored [out][in] as llama2.c stores it. Parallel over blocks of W's
// rows, so W streams from memory once per call however many rows x has.
//   x: [m, k] (row stride ldx)   w: [n, k]   y: [m, n] (row stride ldy)
void Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const float* w, int n, int k,
            float* y, int64_t ldy, MatmulIsa isa = BestMatmulIsa());

// Matmul's pieces, for running several products in one parallel loop (the
// CPU backend's projections that read the same X): where MatmulSplitsRows(m)
// holds, Matmul is MatmulRows over ranges of W's rows [j0, j1) (j0 a
// multiple of kMatmulRowUnit, j1 too or n), run on any threads, each range
// once; for more rows of X it prepares X first and must be called whole.
inline constexpr int kMatmulRowUnit = 32;
bool MatmulSplitsRows(int m, MatmulIsa isa = BestMatmulIsa());
void MatmulRows(const float* x, int64_t ldx, int m, const float* w, int n, int k, int j0, int j1,
                float* y, int64_t ldy, MatmulIsa isa = BestMatmulIsa());

// The same product one element at a time, in scalar code: the definition
// Matmul must equal bit for bit (tests compare the two).
void MatmulReference(const float* x, int64_t ldx, int m, const float* w, int n, int k, float* y,
                     int64_t ldy);

// Dot product of two length-n vectors: 8 interleaved partial sums over k
// (one AVX2 lane each, fused multiply-add), then the lanes in one fixed order.
float Dot(const float* a, const float* b, int n);

// scores[o] = Dot(q, keys + o * stride, n) for o < count: the same bits as
// Dot, four rows at a time (attention's q . k over a run of cached keys).
void DotRows(const float* q, const float* keys, int64_t stride, int count, int n, float* scores);

// out[i] = fma(weights[o], rows[o * stride + i], out[i]) for o = 0, 1, ...,
// count - 1 in that order, for every i < n (attention's p . V over a run of
// cached values; out stays in registers across the run).
void AccumulateRows(const float* weights, const float* rows, int64_t stride, int count, int n,
                    float* out);

// The same two over a KV cache of bf16, fp16 or int8 rows (kv_quant.h),
// dequantized as they are read, 8 elements at a time in registers: the
// arithmetic of the float32 kernels on the floats each row stands for, bit
// for bit (bf16, fp16 and int8 widen to float exactly). An int8 row o stands
// for scales[o] times its integers, so
//   DotRows:        scores[o] = Dot(q, float(keys row o), n) * scales[o]
//   AccumulateRows: out[i] = fma(weights[o] * scales[o], float(rows[o * stride + i]), out[i])
// (the scale applied once per row, not per element).
//   keys, rows: [count rows, stride apart]   scales: [count]
void DotRows(const float* q, const Bf16* keys, int64_t stride, int count, int n, float* scores);
void DotRows(const float* q, const Fp16* keys, int64_t stride, int count, int n, float* scores);
void DotRows(const float* q, const int8_t* keys, const float* scales, int64_t stride, int count,
             int n, float* scores);
void AccumulateRows(const float* weights, const Bf16* rows, int64_t stride, int count, int n,
                    float* out);
void AccumulateRows(const float* weights, const Fp16* rows, int64_t stride, int count, int n,
                    float* out);
void AccumulateRows(const float* weights, const int8_t* rows, const float* scales, int64_t stride,
                    int count, int n, float* out);

// DotRows and AccumulateRows for `num` queries at once over rows given by
// pointers (a sequence's positions, wherever its KV blocks are; attention's
// query heads and prompt tokens that share a KV head): the same bits as
// DotRows and AccumulateRows called for each query on those rows (scores[r]
// for q[r]; out[r] from weights[r]), with each row read once for every pair
// of queries and each query's sums kept in registers across all the rows.
// int8: scales[o] is row o's scale.
void DotRowsGathered(const float* const* q, int num, const float* const* keys, int count, int n,
                     float* const* scores);
void DotRowsGathered(const float* const* q, int num, const Bf16* const* keys, int count, int n,
                     float* const* scores);
void DotRowsGathered(const float* const* q, int num, const Fp16* const* keys, int count, int n,
                     float* const* scores);
void DotRowsGathered(const float* const* q, int num, const int8_t* const* keys, const float* scales,
                     int count, int n, float* const* scores);
void AccumulateRowsGathered(const float* const* weights, int num, const float* const* rows,
                            int count, int n, float* const* out);
void AccumulateRowsGathered(const float* const* weights, int num, const Bf16* const* rows,
                            int count, int n, float* const* out);
void AccumulateRowsGathered(const float* const* weights, int num, const Fp16* const* rows,
                            int count, int n, float* const* out);
void AccumulateRowsGathered(const float* const* weights, int num, const int8_t* const* rows,
                            const float* scales, int count, int n, float* const* out);

// out[i] = weight[i] * (x[i] / sqrt(mean(x^2) + eps)), as run.c's rmsnorm.
//   x, weight, out: [n]
void RmsNorm(const float* x, const float* weight, int n, float eps, float* out);

}  // namespace coalesce::engine::cpu
