// GGUF model files (llama.cpp's format): architectures "llama" (Llama 1/2/3,
// Mistral, TinyLlama, SmolLM) and "qwen2", every tensor dequantized at load
// to float32 (engine/model/gguf_quant.h), which every backend reads; the CUDA
// backend converts that to its own precision when it uploads the weights.
// With GgufLoadOptions::keep_quantized, matrices in the block types the CPU
// backend computes with stay as the file stores them.
//
// The metadata under "{arch}." gives the shape: block_count,
// embedding_length, feed_forward_length, attention.head_count,
// attention.head_count_kv (default: head_count), context_length (the
// config's max_seq_len), attention.layer_norm_rms_epsilon, rope.freq_base
// (default 10000) and vocab_size (else the length of tokenizer.ggml.tokens,
// else token_embd.weight's rows). rope.dimension_count and
// attention.key_length / value_length, when present, must equal
// embedding_length / head_count; RoPE scaling (rope.scaling.type other than
// "none", a scaling factor other than 1) and mixture-of-experts are refused.
// Llama 3.1's rope_freqs.weight (per-pair frequency factors) goes to
// config.rope_scaling.freq_factors. The special tokens are
// tokenizer.ggml.bos_token_id, and eos_token_id then eot_token_id as the
// end-of-sequence ids; config.name is general.name, else the file's stem.
//
// Tensors (llama.cpp's names): token_embd, output_norm, output (absent: the
// classifier is tied to the embedding), and per block attn_norm, attn_q,
// attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down, plus
// attn_q/k/v.bias for qwen2. Each must have the shape the metadata implies
// (ggml lists dims innermost first: a [out][in] matrix is {in, out}); any
// other tensor is an error. llama.cpp's converter stores Llama's q/k rows
// with RoPE pairs interleaved, the backends' order, so they are used as they
// are; Qwen2's it leaves in Hugging Face's rotate-half order (ggml's NEOX
// RoPE), so those rows and their biases are permuted to interleaved here.
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
  int64_t weight_bytes = 0;     // the weights in memory (float32 and quantized)
  int64_t quantized_bytes = 0;  // of which matrices kept in their block types
  // Tensor type name ("Q4_1", "F32") -> how many tensors of it the file has.
  std::map<std::string, int> tensors_by_type;
  std::string chat_template;  // tokenizer.chat_template, "" when absent
};

struct GgufLoadOptions {
  // Matrices of the types a backend can compute with directly (QuantType in
  // model.h: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) stay in their blocks
  // (LayerWeights::quantized) instead of being dequantized; every other
  // tensor is float32 as without it.
  bool keep_quantized = false;
};

// Loads the model in `path`. Hyper-parameters, RoPE settings and context
// length come from the metadata; anything unsupported (architecture, tensor
// type, RoPE scaling) or inconsistent (a missing tensor, a shape that does not
// match the metadata) is an error naming the file, the key or tensor, and the
// value.
absl::StatusOr<Model> LoadGgufModel(const std::string& path, GgufLoadReport* report = nullptr,
                                    const GgufLoadOptions& options = {});

// Whether `path` starts with the GGUF magic ("GGUF").
bool IsGgufFile(const std::string& path);

}  // namespace coalesce::engine
