// Hugging Face model folders: config.json, generation_config.json (optional)
// and model.safetensors or a sharded model.safetensors.index.json, as
// transformers' save_pretrained writes them.
//
// Supported: LlamaForCausalLM (Llama 1/2/3, with Llama 3.1 "llama3" RoPE
// scaling and optional attention biases), MistralForCausalLM and
// Qwen2ForCausalLM (q/k/v biases); F32, F16 and BF16 weights (F16/BF16 are
// converted to float32 at load); tied or untied classifiers; grouped-query
// attention. Rejected with an error naming config.json and the field: any
// other architecture, head_dim != hidden_size / num_attention_heads, RoPE
// scaling other than "llama3", mlp_bias, activations other than silu.
//
// Sliding-window attention (Mistral's sliding_window, Qwen2's with
// use_sliding_window) is not implemented; instead the context is clamped to
// the window. Within the window full attention is exactly what the model
// computes, so every position the engine accepts is computed correctly, and
// positions past the window are refused rather than computed wrongly.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"

namespace coalesce::engine {

struct HfLoadOptions {
  // Called after each tensor is placed, with the checkpoint bytes processed so
  // far and in all. Converting a large F16/BF16 model takes a while; the engine
  // does not log, so the caller may. May be empty.
  std::function<void(int64_t done_bytes, int64_t total_bytes)> progress;
};

// Loads the model in folder `dir`. Every tensor's dtype and shape is checked
// against config.json; a missing or unexpected tensor, a corrupt file or an
// unsupported setting is an error naming the file and the tensor or field.
// F32 tensors are used in place from the memory mapping where their layout
// allows it (everything but q_proj/k_proj, whose rows are permuted from
// Hugging Face's rotate-half RoPE order into the interleaved order the
// backends use: the inverse of llama2.c export.py's permutation).
//
// config.name is the folder's name, config.architecture the model_type
// ("llama", "mistral", "qwen2"); bos_token_id and eos_token_ids come from
// generation_config.json, else config.json.
absl::StatusOr<Model> LoadHfModel(const std::string& dir, const HfLoadOptions& options = {});

}  // namespace coalesce::engine
