#include "engine/model/gguf_model.h"

#include <fstream>

namespace coalesce::engine {

absl::StatusOr<Model> LoadGgufModel(const std::string& path, GgufLoadReport*) {
  return absl::UnimplementedError(path + ": GGUF models are not loadable yet");
}

bool IsGgufFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == "GGUF";
}

}  // namespace coalesce::engine
