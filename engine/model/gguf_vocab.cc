#include "engine/model/gguf_vocab.h"

namespace coalesce::engine {

absl::StatusOr<GgufVocab> ReadGgufVocab(const GgufFile& file) {
  return absl::UnimplementedError("not yet");
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadGgufTokenizer(const std::string& path) {
  return absl::UnimplementedError(path + ": GGUF tokenizers are not loadable yet");
}

}  // namespace coalesce::engine
