// libFuzzer target: a Hugging Face model folder. The input is a 2-byte
// little-endian length n, then n bytes of config.json, then the bytes of
// model.safetensors (corpus/hf_model_fuzz holds small valid folders in this
// form, made by corpus/make_seeds.py). Loading must return a model or a clear
// error, never crash, read out of bounds or allocate without bound; a model
// it returns must have every weight readable.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>

#include "engine/model/hf_model.h"

namespace {

bool WriteFile(const std::string& path, std::string_view bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

volatile float sink = 0;

void Touch(std::span<const float> weights) {
  float sum = 0;
  for (const float w : weights) sum += w;
  sink = sink + sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = "/dev/shm/coalesce-fuzz-hf-" + std::to_string(getpid());
  static const bool made = mkdir(dir.c_str(), 0700) == 0 || errno == EEXIST;
  if (!made || size < 2) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 2, size - 2);
  const size_t config_size = std::min<size_t>(data[0] | data[1] << 8, bytes.size());
  if (!WriteFile(dir + "/config.json", bytes.substr(0, config_size)) ||
      !WriteFile(dir + "/model.safetensors", bytes.substr(config_size))) {
    return 0;
  }
  auto model = coalesce::engine::LoadHfModel(dir);
  if (!model.ok()) return 0;
  // Every span has the size config.json implies (a smaller one would let the
  // backends read past it), and every weight can be read.
  const coalesce::engine::ModelConfig& c = model->config;
  const coalesce::engine::ModelWeights& w = model->weights;
  const size_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  auto check = [](std::span<const float> s, size_t n) {
    if (s.size() != n) __builtin_trap();
    Touch(s);
  };
  check(w.token_embedding, v * d);
  check(w.final_norm, d);
  check(w.classifier, v * d);
  if (w.layers.size() != static_cast<size_t>(c.n_layers)) __builtin_trap();
  for (const coalesce::engine::LayerWeights& l : w.layers) {
    check(l.attn_norm, d);
    check(l.wq, d * d);
    check(l.wk, kv * d);
    check(l.wv, kv * d);
    check(l.wo, d * d);
    check(l.ffn_norm, d);
    check(l.w1, h * d);
    check(l.w2, d * h);
    check(l.w3, h * d);
    check(l.bq, c.qkv_bias ? d : 0);
    check(l.bk, c.qkv_bias ? kv : 0);
    check(l.bv, c.qkv_bias ? kv : 0);
    check(l.bo, c.o_bias ? d : 0);
  }
  return 0;
}
