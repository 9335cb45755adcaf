// The embedded default model: random weights from a fixed seed, in the shapes
// of real models, so the server runs with no files at all and benchmarks can
// use large shapes. Its output is not language, and GetModelInfo says so.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/tokenizer/llama2c_tokenizer.h"

namespace coalesce::engine {

struct SyntheticPreset {
  std::string name;  // "synthetic:tiny", ...
  std::string description;
  ModelConfig shape;  // name/source/synthetic are filled in by the builder
};

// tiny, 15m, 110m (llama2.c stories shapes), 1b (TinyLlama-1.1B shape); every
// one with a context of 2048 tokens.
const std::vector<SyntheticPreset>& SyntheticPresets();

// Builds the named preset's model. Same name, same weights, on every machine.
absl::StatusOr<Model> BuildSyntheticModel(const std::string& name);

// The vocabulary synthetic models use: llama2.c's layout (specials, 256 byte
// tokens) followed by deterministic merged pieces up to `vocab_size`.
std::unique_ptr<Llama2cTokenizer> BuildSyntheticTokenizer(int vocab_size);

}  // namespace coalesce::engine
