// --quantize: a model whose matrices are float32 (a Hugging Face folder, a
// llama2.c checkpoint, a GGUF file's float tensors) quantized at load into
// Q8_0 or Q4_0 blocks, for the CPU engine's quantized product
// (engine/cpu/quant_matmul.h): the same blocks gguf.quants.quantize (ggml's
// reference quantization) writes for those floats, so a model quantized here
// computes exactly as a GGUF file quantized by llama.cpp's reference code
// from the same weights.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"

namespace coalesce::engine {

// "q8_0" or "q4_0" (--quantize's values); nullopt for "none".
// INVALID_ARGUMENT for anything else.
absl::StatusOr<std::optional<QuantType>> ParseQuantizeFlag(const std::string& text);

struct QuantizeReport {
  int matrices = 0;         // quantized
  int64_t float_bytes = 0;  // they took as float32
  int64_t quantized_bytes = 0;
  int kept_float = 0;  // matrices left float32: columns not a multiple of 32
};

// Every float32 weight matrix of `model` (the projections, the embedding and
// the classifier; a tied classifier once) whose rows are whole blocks of 32,
// quantized to `type` (Q8_0, Q4_0 or Q4_1); matrices already quantized and
// the norms and biases stay as they are. The result shares `model`'s storage.
// INVALID_ARGUMENT for a K type or a weight that is not finite (named).
absl::StatusOr<std::shared_ptr<const Model>> QuantizeModel(std::shared_ptr<const Model> model,
                                                           QuantType type,
                                                           QuantizeReport* report = nullptr);

}  // namespace coalesce::engine
