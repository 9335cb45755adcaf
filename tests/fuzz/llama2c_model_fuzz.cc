// libFuzzer target: arbitrary bytes as a llama2.c checkpoint. Loading must
// return a model or a clear error, never crash or read out of bounds.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "engine/model/llama2c.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/coalesce-fuzz-model-" + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  auto model = coalesce::engine::LoadLlama2cModel(path);
  if (model.ok()) {
    // Touch every weight the loader promised.
    volatile float sink = 0;
    for (float w : model->weights.token_embedding) sink = sink + w;
    for (float w : model->weights.classifier) sink = sink + w;
  }
  return 0;
}
