// The tokenizer.ggml.* metadata of a GGUF file (engine/model/gguf_file.h)
// read into a GgufVocab (engine/tokenizer/gguf_tokenizer.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/gguf_file.h"
#include "engine/tokenizer/gguf_tokenizer.h"

namespace coalesce::engine {

// Reads the keys. A key of the wrong type or an id out of range is an error
// naming the file, the key and the value.
absl::StatusOr<GgufVocab> ReadGgufVocab(const GgufFile& file);

// Opens `path` and builds its tokenizer (ReadGgufVocab, BuildGgufTokenizer).
absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadGgufTokenizer(const std::string& path);

}  // namespace coalesce::engine
