// The one entry that loads a model in any format, with the tokenizer that
// goes with it: what the server, the benchmarks and the tools call.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/tokenizer/tokenizer.h"

namespace coalesce::engine {

struct ModelSpec {
  // "synthetic:NAME" (engine/model/synthetic.h), a Hugging Face folder
  // (config.json and safetensors; tokenizer.json with the end-of-sequence ids
  // of its config), a GGUF file (engine/model/gguf_model.h; the tokenizer its
  // metadata describes), or a llama2.c checkpoint (tokenizer.bin beside it).
  std::string model = {};
  // Overrides the format's tokenizer file (a tokenizer.json, or a llama2.c
  // tokenizer.bin); empty for the default.
  std::string tokenizer = {};
  // A file holding a chat template (Jinja) that overrides the model's own;
  // empty for the model's.
  std::string chat_template = {};
  // A GGUF file's matrices in Q8_0, Q4_0, Q4_1, Q4_K or Q6_K stay in their
  // blocks (model.h, QuantizedMatrix) instead of becoming float32: for the
  // CPU backend, which computes with them directly. Other formats ignore it.
  bool keep_quantized = false;
  // --quantize: every float32 weight matrix (model/quantize.h) quantized
  // to this type at load, for the CPU backend; nullopt keeps them float32.
  std::optional<QuantType> quantize = std::nullopt;
};

struct LoadedModel {
  std::shared_ptr<const Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  // The model's chat template (Jinja): ModelSpec::chat_template's file, else
  // the one its files carry (a GGUF file's tokenizer.chat_template, a
  // folder's tokenizer_config.json chat_template); "" when there is none.
  std::string chat_template;
  // What the template knows as bos_token and eos_token: the tokenizer's
  // strings (tokenizer_config.json's, or the GGUF vocabulary's tokens at
  // tokenizer.ggml.bos_token_id and eos_token_id); "" when it has none.
  std::string bos_token, eos_token;
};

// Picks the format from `spec.model`. Errors name the file and the problem; a
// Hugging Face folder in a build without those formats
// (-DCOALESCE_HF_FORMATS=OFF) is an Unimplemented error that says so.
absl::StatusOr<LoadedModel> LoadModel(const ModelSpec& spec);

}  // namespace coalesce::engine
