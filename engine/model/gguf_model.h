// GGUF model files (llama.cpp's format): architectures "llama" (Llama 1/2/3,
// Mistral, TinyLlama, SmolLM) and "qwen2", every tensor dequantized at load
// to float32 (engine/model/gguf_quant.h), which every backend reads; the CUDA
// backend converts that to its own precision when it uploads the weights.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"

namespace coalesce::engine {

// What loading did, for the caller to log.
struct GgufLoadReport {
  int64_t file_bytes = 0;
  int64_t weight_bytes = 0;  // the float32 weights in memory
  // Tensor type name ("Q4_1", "F32") -> how many tensors of it the file has.
  std::map<std::string, int> tensors_by_type;
  std::string chat_template;  // tokenizer.chat_template, "" when absent
};

// Loads the model in `path`. Hyper-parameters, RoPE settings and context
// length come from the metadata; anything unsupported (architecture, tensor
// type, RoPE scaling) or inconsistent (a missing tensor, a shape that does not
// match the metadata) is an error naming the file, the key or tensor, and the
// value.
absl::StatusOr<Model> LoadGgufModel(const std::string& path, GgufLoadReport* report = nullptr);

// Whether `path` starts with the GGUF magic ("GGUF").
bool IsGgufFile(const std::string& path);

}  // namespace coalesce::engine
