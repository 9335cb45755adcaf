// The one entry that loads a model in any format, with the tokenizer that
// goes with it: what the server, the benchmarks and the tools call.
#pragma once

#include <memory>
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
};

struct LoadedModel {
  std::shared_ptr<const Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  // The model's chat template (Jinja), when its files carry one (GGUF's
  // tokenizer.chat_template); "" otherwise.
  std::string chat_template;
};

// Picks the format from `spec.model`. Errors name the file and the problem; a
// Hugging Face folder in a build without those formats
// (-DCOALESCE_HF_FORMATS=OFF) is an Unimplemented error that says so.
absl::StatusOr<LoadedModel> LoadModel(const ModelSpec& spec);

}  // namespace coalesce::engine
