// libFuzzer target: a GGUF file (engine/model/gguf_file.h). The input is the
// file's bytes (corpus/gguf_fuzz holds small valid files, made by
// corpus/make_seeds.py). Opening must return a file or a clear error, never
// crash, read out of bounds, hang or allocate without bound; a file it
// returns must have every metadata value readable through the accessors and
// every tensor of a dequantizable type convertible from its bytes. Then the
// file goes through the model loader (engine/model/gguf_model.h) and the
// tokenizer reader (engine/model/gguf_vocab.h), which must load it or refuse it
// with a message; a tokenizer they build must encode and decode. The seeds
// llama-model and qwen2-model are whole (tiny) models with vocabularies.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cpu/quant_int8.h"
#include "engine/cpu/quant_matmul.h"
#include "engine/model/gguf_file.h"
#include "engine/model/gguf_model.h"
#include "engine/model/gguf_quant.h"
#include "engine/model/gguf_vocab.h"

namespace {

using coalesce::engine::GgufFile;
using coalesce::engine::GgufTensor;
using coalesce::engine::GgufValue;
using coalesce::engine::GgufValueType;

volatile size_t sink = 0;

void Touch(const GgufValue& v) {
  sink = sink + v.Describe().size();
  if (!v.is_array()) return;
  if (v.item_type() == GgufValueType::kArray) {
    if (v.arrays().size() != v.size()) __builtin_trap();
    for (const GgufValue& item : v.arrays()) Touch(item);
  } else if (v.item_type() == GgufValueType::kString) {
    if (v.strings().size() != v.size()) __builtin_trap();
    for (const auto& s : v.strings()) sink = sink + s.size();
  } else {
    for (uint64_t i = 0; i < v.size(); ++i) sink = sink + v.At(i).Describe().size();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/coalesce-fuzz-gguf-" + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  const bool written = std::fwrite(data, 1, size, f) == size;
  if (std::fclose(f) != 0 || !written) return 0;

  auto file = GgufFile::Open(path);
  if (!file.ok()) return 0;
  for (const auto& kv : file->metadata()) {
    Touch(kv.value);
    // Every accessor answers, with a value or an error.
    sink = sink + file->GetUint(kv.key).ok() + file->GetInt(kv.key).ok() +
           file->GetFloat(kv.key).ok() + file->GetBool(kv.key).ok() + file->GetString(kv.key).ok() +
           file->GetStringArray(kv.key).ok() + file->GetIntArray(kv.key).ok() +
           file->GetFloatArray(kv.key).ok();
  }
  const auto* begin = static_cast<const std::byte*>(file->mapping().get());
  std::vector<float> values, int8_values;
  for (const GgufTensor& t : file->tensors()) {
    if (file->FindTensor(t.name) != &t) __builtin_trap();
    // Inside the file, and the size its dims and type imply.
    if (t.num_bytes < 0 || t.data < begin ||
        static_cast<uint64_t>(t.data - begin) + static_cast<uint64_t>(t.num_bytes) >
            file->file_size()) {
      __builtin_trap();
    }
    auto bytes = coalesce::engine::GgmlRowBytes(t.type, t.num_elements);
    if (!bytes.ok() || *bytes != t.num_bytes) __builtin_trap();
    if (!coalesce::engine::GgmlTypeCanDequantize(t.type)) continue;
    values.resize(static_cast<size_t>(t.num_elements));
    if (!coalesce::engine::DequantizeToFloat(t.type, t.data, t.num_elements, values.data()).ok()) {
      __builtin_trap();
    }
    float sum = 0;
    for (const float v : values) sum += v;
    sink = sink + static_cast<size_t>(sum == sum);
  }

  auto model = coalesce::engine::LoadGgufModel(path);
  if (model.ok()) {
    if (model->weights.layers.size() != static_cast<size_t>(model->config.n_layers)) {
      __builtin_trap();
    }
  } else if (model.status().message().empty()) {
    __builtin_trap();
  }
  // The same file with its matrices kept quantized, as the server loads it
  // for the CPU: it loads exactly when the dequantizing load does, and its
  // matrices lay out as the CPU backend's panels and as its int8 groups
  // (--int8_activations), and read back the same from both.
  auto kept = coalesce::engine::LoadGgufModel(path, nullptr, {.keep_quantized = true});
  if (kept.ok() != model.ok()) __builtin_trap();
  if (kept.ok()) {
    const coalesce::engine::ModelWeights& w = kept->weights;
    std::vector<const coalesce::engine::QuantizedMatrix*> matrices = {&w.quantized_token_embedding,
                                                                      &w.quantized_classifier};
    for (const coalesce::engine::LayerWeights& l : w.layers) {
      for (const auto* m : {&l.quantized.wq, &l.quantized.wk, &l.quantized.wv, &l.quantized.wo,
                            &l.quantized.w1, &l.quantized.w2, &l.quantized.w3}) {
        matrices.push_back(m);
      }
    }
    for (const coalesce::engine::QuantizedMatrix* m : matrices) {
      if (m->empty()) continue;
      auto packed = coalesce::engine::cpu::PackedMatrix::Pack(*m);
      if (!packed.ok()) __builtin_trap();
      values.resize(static_cast<size_t>(m->cols));
      packed->DequantizeRow(packed->rows() - 1, values.data());
      sink = sink + static_cast<size_t>(values[0] == values[0]);
      auto int8 = coalesce::engine::cpu::Int8Matrix::Pack(*m);
      if (!int8.ok()) __builtin_trap();
      int8_values.resize(values.size());
      int8->DequantizeRow(int8->rows() - 1, int8_values.data());
      for (size_t i = 0; i < values.size(); ++i) {
        // The same bits, but for a NaN's payload.
        const bool nans = values[i] != values[i] && int8_values[i] != int8_values[i];
        if (!nans && std::memcmp(&values[i], &int8_values[i], sizeof(float)) != 0) __builtin_trap();
      }
    }
  }
  auto tokenizer = coalesce::engine::LoadGgufTokenizer(path);
  if (tokenizer.ok()) {
    const auto ids = (*tokenizer)->Encode("ab a\n<user> 12 caf\xc3\xa9</s><|im_end|>", true);
    for (const int32_t id : ids) {
      if (id < 0 || id >= (*tokenizer)->vocab_size()) __builtin_trap();
    }
    sink = sink + coalesce::engine::Decode(**tokenizer, ids).size();
  } else if (tokenizer.status().message().empty()) {
    __builtin_trap();
  }
  return 0;
}
