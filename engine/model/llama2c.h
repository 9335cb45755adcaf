// llama2.c's checkpoint: 7 int32 header fields, then float32 weights. See
// karpathy/llama2.c run.c; its tokenizer.bin is engine/tokenizer/llama2c_tokenizer.h.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"

namespace coalesce::engine {

// Loads a llama2.c checkpoint. A negative vocab_size in the header means an
// untied classifier follows the weights. Every size is checked against the
// file's length: a truncated or inconsistent file is an error naming the file.
absl::StatusOr<Model> LoadLlama2cModel(const std::string& path);

}  // namespace coalesce::engine
