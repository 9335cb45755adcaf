#include "engine/tokenizer/gguf_tokenizer.h"

namespace coalesce::engine {

absl::StatusOr<std::unique_ptr<HfTokenizer>> BuildGgufTokenizer(const GgufVocab& vocab) {
  return absl::UnimplementedError(vocab.source + ": GGUF tokenizers are not loadable yet");
}

}  // namespace coalesce::engine
