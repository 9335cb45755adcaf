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
// batch-mates. The kernels below compute each dot product as 8 interleaved
// partial sums over k (one AVX2 lane each, fused multiply-add, k in
// increasing order), then add the lanes in one fixed order: a pure function
// of the two input rows, whatever the batch, the tile or the thread. On a
// processor with AVX-512 the matrix product uses 16 lanes instead
// (kernels_avx512.cc), chosen once per process, so the same holds there.
//
// Cost: about the same as sgemm for decode-sized batches (rows <= 64; faster
// at 1 to 4 rows, where sgemm packs the whole weight matrix per call), and
// about 1.7x slower than OpenBLAS's AVX-512 kernels for long prefills.
#pragma once

#include <cstdint>

#include "engine/cpu/thread_pool.h"

namespace coalesce::engine::cpu {

// y[i, j] = sum_k x[i, k] * w[j, k] for i < m, j < n: X times W transposed,
// with W stored [out][in] as llama2.c stores it. Parallel over blocks of W's
// rows, so W streams from memory once per call however many rows x has.
//   x: [m, k] (row stride ldx)   w: [n, k]   y: [m, n] (row stride ldy)
void Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const float* w, int n, int k,
            float* y, int64_t ldy);

// Dot product of two length-n vectors in the fixed order described above.
float Dot(const float* a, const float* b, int n);

// out[i] = weight[i] * (x[i] / sqrt(mean(x^2) + eps)), as run.c's rmsnorm.
//   x, weight, out: [n]
void RmsNorm(const float* x, const float* weight, int n, float eps, float* out);

}  // namespace coalesce::engine::cpu
