// Tokenizers described by GGUF metadata (the tokenizer.ggml.* keys llama.cpp
// writes), built on the tokenizer.json implementation (hf_tokenizer.h): the
// metadata is turned into the components Hugging Face `tokenizers` would run
// for the same vocabulary, and from there on it is that tokenizer.
//
// This room knows nothing of the GGUF container: engine/model/gguf_vocab.h
// reads the keys into a GgufVocab.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/hf_tokenizer.h"

namespace coalesce::engine {

// The tokenizer.ggml.* metadata of one file, as written (absent keys empty or
// nullopt).
struct GgufVocab {
  std::string source;                // the file, for messages
  std::string model;                 // tokenizer.ggml.model: "llama" or "gpt2"
  std::string pre;                   // tokenizer.ggml.pre ("" when absent)
  std::vector<std::string> tokens;   // tokenizer.ggml.tokens
  std::vector<float> scores;         // tokenizer.ggml.scores
  std::vector<int32_t> token_types;  // tokenizer.ggml.token_type
  std::vector<std::string> merges;   // tokenizer.ggml.merges ("left right")
  std::optional<int32_t> bos_id, eos_id, eot_id, eom_id, unk_id, pad_id;
  std::optional<bool> add_bos, add_eos, add_space_prefix;
};

// Builds the tokenizer. Anything unsupported (a tokenizer.ggml.model other
// than "llama" and "gpt2", an unknown tokenizer.ggml.pre, inconsistent
// arrays or ids) is an error with one message naming vocab.source, the key and
// the value.
absl::StatusOr<std::unique_ptr<HfTokenizer>> BuildGgufTokenizer(const GgufVocab& vocab);

}  // namespace coalesce::engine
