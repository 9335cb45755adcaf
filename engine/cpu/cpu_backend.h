// The CPU backend: float32, batched. Each weight matrix is applied to all rows
// of a step in one matrix product (cpu/kernels.h: a batch-invariant product of
// our own, not BLAS sgemm, whose rows depend on their batch-mates); attention
// runs per token over its sequence's paged KV blocks, parallel across tokens
// and heads. A sequence gets bit-identical logits whatever shares its batch.
//
// Float32 matrices are laid out again as the product's panels where that is
// faster (CpuBackendOptions::float_panels). Once every matrix is laid out
// (float32 as panels, quantized as below), the backend keeps only the
// model's norms and biases (and a float32 embedding no panels stand for),
// not the Model it was given: when nothing else holds that, its rows are
// freed, and the process holds the weights once.
//
// Matrices the model holds quantized (model.h, QuantizedMatrix) stay in their
// blocks, laid out again at creation: their product is the float32 one on
// the dequantized weights, each sub-block's scale applied once to its sum
// (cpu/quant_matmul.h), or, with int8_activations, multiplies int8
// activations (cpu/quant_int8.h).
//
// The KV cache holds kv_cache.dtype: fp32, bf16 or fp16 (converted as each
// token's K and V are written, rounding to nearest even), or int8 with one
// float scale per token and KV head (cpu/kv_quant.h); attention dequantizes as
// it reads. fp8 is a CUDA type: refused here.
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace coalesce::engine {

struct CpuBackendOptions {
  KvCacheConfig kv_cache;  // block size, block count, element type
  int threads = 0;         // compute threads; 0: one per core
  // Quantized Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices multiply activations
  // quantized to int8, with integer dot products (cpu/quant_int8.h): faster,
  // but the logits are no longer the dequantized model's. Only where the
  // processor has AVX2 (cpu::Int8DotSupported()); elsewhere ignored.
  bool int8_activations = false;
  // Float32 matrices laid out once more at creation, as the matrix
  // product's panels (cpu/float_panels.h): the same logits, and one stream
  // reads each panel front to back (docs/performance.md). While the model
  // is held elsewhere too, its rows stay in memory beside the panels.
  // nullopt: where the processor's product is AVX2 (cpu::BestMatmulIsa());
  // AVX-512 reads the model's rows.
  std::optional<bool> float_panels = std::nullopt;
};

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(std::shared_ptr<const Model> model,
                                                          const CpuBackendOptions& options);

}  // namespace coalesce::engine
