// The tokenizer.ggml.* metadata of a GGUF file (engine/model/gguf_file.h)
// read into a GgufVocab (engine/tokenizer/gguf_tokenizer.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/gguf_file.h"
#include "engine/tokenizer/gguf_tokenizer.h"

namespace coalesce::engine {

// Reads the keys tokenizer.ggml.{model, pre, tokens, scores, token_type,
// merges, bos_token_id, eos_token_id, eot_token_id, eom_token_id,
// unknown_token_id, padding_token_id, add_bos_token, add_eos_token,
// add_space_prefix}; absent keys stay empty. A key of the wrong type, or an
// id or token type that does not fit in int32, is an error naming the file,
// the key and the value; BuildGgufTokenizer checks the rest. A file without
// tokenizer.ggml.model has no tokenizer: NOT_FOUND, saying to give one with
// --tokenizer.
absl::StatusOr<GgufVocab> ReadGgufVocab(const GgufFile& file);

// Opens `path` and builds its tokenizer (ReadGgufVocab, BuildGgufTokenizer).
absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadGgufTokenizer(const std::string& path);

}  // namespace coalesce::engine
