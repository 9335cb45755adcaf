// Turns --model/--tokenizer into a model and the tokenizer that goes with it.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

namespace coalesce::service {

struct LoadedModel {
  std::shared_ptr<const engine::Model> model;
  std::unique_ptr<engine::Tokenizer> tokenizer;
};

// `model_path` is "synthetic:NAME", a Hugging Face folder (tokenizer.json and
// the end-of-sequence ids of its config), or a llama2.c checkpoint
// (tokenizer.bin beside it). `tokenizer_path` overrides the tokenizer file.
// Errors name the file and the problem.
absl::StatusOr<LoadedModel> LoadModel(const std::string& model_path,
                                      const std::string& tokenizer_path);

}  // namespace coalesce::service
