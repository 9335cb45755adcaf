// Several matrix products of one X, y_i = x W_i^T, in one parallel loop: a
// decode step's q, k and v projections read the same normed activations, and
// so do the feed-forward's w1 and w3. One loop means one thread handoff and
// one wait for the slowest thread instead of one per product, and, for int8
// weights, X quantized once. Each product is computed by the kernels that
// compute it alone (Matmul, QuantMatmul, Int8Matmul), row for row, so the
// bits are the same.
#pragma once

#include <cstdint>
#include <span>

#include "engine/cpu/float_panels.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/quant_int8.h"
#include "engine/cpu/quant_matmul.h"
#include "engine/cpu/thread_pool.h"

namespace coalesce::engine::cpu {

// A weight matrix W [n][k] in one of the CPU engine's layouts: exactly one
// of the four is set.
struct MatmulWeights {
  const float* f = nullptr;  // float32, [n][k]
  const FloatPanels* float_panels = nullptr;
  const PackedMatrix* panels = nullptr;
  const Int8Matrix* int8 = nullptr;
};

struct MatmulProduct {
  MatmulWeights w;
  int n = 0;           // rows of W: outputs
  float* y = nullptr;  // [m, n] (row stride ldy)
  int64_t ldy = 0;
};

// y = x W^T for each product, x [m, k] (row stride ldx). `int8_rows` is the
// caller's scratch for x quantized (int8 weights only). Up to 8 products
// share a loop (more run one after another). One caller of `pool` at a
// time, as ever.
void MatmulTogether(ThreadPool& pool, std::span<const MatmulProduct> products, const float* x,
                    int64_t ldx, int m, int k, Int8Rows& int8_rows);

}  // namespace coalesce::engine::cpu
