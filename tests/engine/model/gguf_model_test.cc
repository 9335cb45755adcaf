// The GGUF model loader on small files written here (gguf_test_writer.h):
// the metadata -> ModelConfig mapping, every tensor landing where the engine
// reads it (tied and untied classifiers, Qwen2's biases and its q/k rows
// permuted from rotate-half to interleaved order, tensors of nine types
// dequantized as DequantizeToFloat does), the forward pass of a loaded file
// against the same weights put in a Model directly, Llama 3.1's RoPE
// frequency factors, and one error per way a file can be wrong or
// unsupported, each naming the file and the key or tensor.
// tests/engine/model/test_gguf_model_parity.py holds real and random files to
// transformers.
#include "engine/model/gguf_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/quant_int8.h"
#include "engine/model.h"
#include "engine/model/gguf_quant.h"
#include "tests/engine/backend_test_support.h"
#include "tests/engine/model/gguf_test_writer.h"

namespace coalesce::engine {
namespace {

// Bytes, Write and the value type ids kU8 ... kF64.
using namespace gguf_test;  // NOLINT(build/namespaces)

::testing::AssertionResult Contains(absl::string_view text, absl::string_view part) {
  if (text.find(part) != absl::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

// ---------------------------------------------------------------------------
// Building files
// ---------------------------------------------------------------------------

// A metadata value: its type id and its bytes.
struct Value {
  uint32_t type;
  std::string bytes;
};
Value Str(std::string_view s) { return {kString, Bytes().Str(s).str()}; }
Value U32(uint32_t v) { return {kU32, Bytes().U32(v).str()}; }
Value F32(float f) { return {kF32, Bytes().F32(f).str()}; }
// An array of n distinct strings (a token list).
Value Tokens(int n) {
  Bytes b;
  b.Array(kString, n);
  for (int i = 0; i < n; ++i) b.Str(absl::StrCat("t", i));
  return {kArray, b.str()};
}

struct TensorSpec {
  std::vector<uint64_t> dims;  // ggml order: innermost first
  GgmlType type;
  std::string data;
};

std::string FloatBytes(const std::vector<float>& values) {
  std::string out(values.size() * sizeof(float), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// A GGUF file being put together: metadata and tensors, each in the order it
// was first set.
class GgufSpec {
 public:
  GgufSpec& Set(const std::string& key, Value v) {
    for (auto& [k, value] : meta_) {
      if (k == key) {
        value = std::move(v);
        return *this;
      }
    }
    meta_.emplace_back(key, std::move(v));
    return *this;
  }
  GgufSpec& Erase(const std::string& key) {
    std::erase_if(meta_, [&](const auto& kv) { return kv.first == key; });
    return *this;
  }
  GgufSpec& SetTensor(const std::string& name, std::vector<uint64_t> dims, GgmlType type,
                      std::string data) {
    for (auto& [n, t] : tensors_) {
      if (n == name) {
        t = {std::move(dims), type, std::move(data)};
        return *this;
      }
    }
    tensors_.emplace_back(name, TensorSpec{std::move(dims), type, std::move(data)});
    return *this;
  }
  GgufSpec& SetF32(const std::string& name, std::vector<uint64_t> dims,
                   const std::vector<float>& values) {
    return SetTensor(name, std::move(dims), GgmlType::kF32, FloatBytes(values));
  }
  GgufSpec& EraseTensor(const std::string& name) {
    std::erase_if(tensors_, [&](const auto& t) { return t.first == name; });
    return *this;
  }
  const TensorSpec& tensor(const std::string& name) const {
    for (const auto& [n, t] : tensors_) {
      if (n == name) return t;
    }
    ADD_FAILURE() << "no tensor " << name;
    static const TensorSpec none{};
    return none;
  }

  // The file's bytes, with the default alignment (32).
  std::string Serialize() const {
    Bytes b;
    b.Header(tensors_.size(), meta_.size());
    for (const auto& [key, v] : meta_) b.Key(key, v.type).Raw(v.bytes);
    uint64_t offset = 0;
    for (const auto& [name, t] : tensors_) {
      b.TensorInfo(name, t.dims, static_cast<uint32_t>(t.type), offset);
      offset += (t.data.size() + 31) / 32 * 32;
    }
    b.PadTo(32);
    for (const auto& [name, t] : tensors_) b.Raw(t.data).PadTo(32);
    return b.str();
  }
  std::string WriteFile() const { return Write(Serialize()); }

 private:
  std::vector<std::pair<std::string, Value>> meta_;
  std::vector<std::pair<std::string, TensorSpec>> tensors_;
};

// The shape of the test models: 4 query heads of 16, 2 KV heads (GQA).
constexpr int kDim = 64, kHidden = 256, kLayers = 2, kHeads = 4, kKvHeads = 2, kVocab = 40;
constexpr int kHeadDim = kDim / kHeads, kKvDim = kKvHeads * kHeadDim, kContext = 64;

struct Tensor {
  std::vector<uint64_t> dims;  // ggml order
  std::vector<float> values;   // row-major: a matrix [out][in] has dims {in, out}
};
// Tensor name -> values, in the order the engine reads them (q/k rows
// interleaved).
using Weights = std::map<std::string, Tensor>;

enum class Arch { kLlama, kQwen2 };

// Random weights that give peaked logits: what a Model built directly holds.
Weights RandomWeights(Arch arch, bool untied, uint32_t seed) {
  std::mt19937 rng(seed);
  auto normal = [&](float mean, float std, std::vector<uint64_t> dims) {
    std::normal_distribution<float> dist(mean, std);
    uint64_t n = 1;
    for (const uint64_t d : dims) n *= d;
    Tensor t{std::move(dims), std::vector<float>(n)};
    for (float& v : t.values) v = dist(rng);
    return t;
  };
  Weights w;
  w["token_embd.weight"] = normal(0, 0.5f, {kDim, kVocab});
  w["output_norm.weight"] = normal(1, 0.2f, {kDim});
  if (untied) w["output.weight"] = normal(0, 0.5f, {kDim, kVocab});
  for (int l = 0; l < kLayers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    w[b + "attn_norm.weight"] = normal(1, 0.2f, {kDim});
    w[b + "attn_q.weight"] = normal(0, 0.15f, {kDim, kDim});
    w[b + "attn_k.weight"] = normal(0, 0.15f, {kDim, kKvDim});
    w[b + "attn_v.weight"] = normal(0, 0.08f, {kDim, kKvDim});
    w[b + "attn_output.weight"] = normal(0, 0.08f, {kDim, kDim});
    if (arch == Arch::kQwen2) {
      w[b + "attn_q.bias"] = normal(0, 0.5f, {kDim});
      w[b + "attn_k.bias"] = normal(0, 0.5f, {kKvDim});
      w[b + "attn_v.bias"] = normal(0, 0.5f, {kKvDim});
    }
    w[b + "ffn_norm.weight"] = normal(1, 0.2f, {kDim});
    w[b + "ffn_gate.weight"] = normal(0, 0.08f, {kDim, kHidden});
    w[b + "ffn_up.weight"] = normal(0, 0.08f, {kDim, kHidden});
    w[b + "ffn_down.weight"] = normal(0, 0.08f, {kHidden, kDim});
  }
  return w;
}

bool IsRopeRows(const std::string& name) {
  return name.find(".attn_q.") != std::string::npos || name.find(".attn_k.") != std::string::npos;
}

// Rows (of `cols` elements) in interleaved RoPE order -> rotate-half order:
// row h*head_dim + a*half + i of the result is row h*head_dim + 2i + a of
// `rows`. What Hugging Face (and a qwen2 GGUF file) stores.
std::vector<float> ToRotateHalf(const std::vector<float>& rows, size_t cols) {
  std::vector<float> out(rows.size());
  const size_t n = rows.size() / cols, half = kHeadDim / 2;
  for (size_t r = 0; r < n; ++r) {
    const size_t head = r / kHeadDim * kHeadDim, within = r % kHeadDim;
    const size_t a = within / half, i = within % half;
    std::copy_n(&rows[(head + 2 * i + a) * cols], cols, &out[r * cols]);
  }
  return out;
}

// A file holding `w` as F32 tensors, with metadata for the test shape.
// For qwen2 the q/k rows (and biases) are written in rotate-half order, as
// llama.cpp's converter leaves them.
GgufSpec ModelFile(Arch arch, const Weights& w) {
  const std::string a = arch == Arch::kLlama ? "llama" : "qwen2";
  GgufSpec spec;
  spec.Set("general.architecture", Str(a))
      .Set("general.name", Str("tiny " + a))
      .Set(a + ".block_count", U32(kLayers))
      .Set(a + ".context_length", U32(kContext))
      .Set(a + ".embedding_length", U32(kDim))
      .Set(a + ".feed_forward_length", U32(kHidden))
      .Set(a + ".attention.head_count", U32(kHeads))
      .Set(a + ".attention.head_count_kv", U32(kKvHeads))
      .Set(a + ".attention.layer_norm_rms_epsilon", F32(1e-5f))
      .Set(a + ".rope.freq_base", F32(50000.0f))
      .Set(a + ".rope.dimension_count", U32(kHeadDim))
      .Set(a + ".vocab_size", U32(kVocab))
      .Set("tokenizer.ggml.bos_token_id", U32(1))
      .Set("tokenizer.ggml.eos_token_id", U32(2))
      .Set("tokenizer.ggml.eot_token_id", U32(3))
      .Set("tokenizer.chat_template", Str("{{ messages }}"));
  for (const auto& [name, t] : w) {
    const bool permute = arch == Arch::kQwen2 && IsRopeRows(name);
    spec.SetF32(name, t.dims,
                permute ? ToRotateHalf(t.values, t.dims.size() == 1 ? 1 : t.dims[0]) : t.values);
  }
  return spec;
}

absl::StatusOr<Model> Load(const GgufSpec& spec, GgufLoadReport* report = nullptr) {
  return LoadGgufModel(spec.WriteFile(), report);
}

std::vector<float> ToVector(std::span<const float> s) { return {s.begin(), s.end()}; }

// Loading must fail with INVALID_ARGUMENT, one line naming the file and each
// of `parts`.
void ExpectError(const GgufSpec& spec, const std::vector<std::string>& parts) {
  const std::string path = spec.WriteFile();
  const auto model = LoadGgufModel(path);
  ASSERT_FALSE(model.ok()) << "loaded; expected an error with " << parts.front();
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << model.status();
  EXPECT_TRUE(Contains(model.status().message(), path));
  for (const std::string& part : parts) EXPECT_TRUE(Contains(model.status().message(), part));
  EXPECT_EQ(std::string(model.status().message()).find('\n'), std::string::npos);
}

// The logits of `tokens` fed one per step on the CPU backend.
std::vector<std::vector<float>> Forward(const std::shared_ptr<const Model>& model,
                                        const std::vector<int32_t>& tokens) {
  auto backend =
      CreateCpuBackend(model, {.kv_cache = {.block_size = 16, .num_blocks = 1}, .threads = 1});
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return {};
  return testing::OneByOne(**backend, tokens, {0});
}

const std::vector<int32_t> kPrompt = {1, 7, 30, 12, 12, 5, 39, 21, 3, 17, 8, 26};

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

TEST(GgufModelTest, MapsTheMetadataToTheConfig) {
  const GgufSpec spec = ModelFile(Arch::kLlama, RandomWeights(Arch::kLlama, false, 1));
  const std::string path = spec.WriteFile();
  GgufLoadReport report;
  const auto model = LoadGgufModel(path, &report);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.name, "tiny llama");
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.source, path);
  EXPECT_FALSE(c.synthetic);
  EXPECT_EQ(c.dim, kDim);
  EXPECT_EQ(c.hidden_dim, kHidden);
  EXPECT_EQ(c.n_layers, kLayers);
  EXPECT_EQ(c.n_heads, kHeads);
  EXPECT_EQ(c.n_kv_heads, kKvHeads);
  EXPECT_EQ(c.vocab_size, kVocab);
  EXPECT_EQ(c.max_seq_len, kContext);
  EXPECT_EQ(c.rope_theta, 50000.0f);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_TRUE(c.rope_scaling.freq_factors.empty());
  EXPECT_TRUE(c.tied_classifier);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{2, 3}));  // eos, then eot

  EXPECT_EQ(report.file_bytes, static_cast<int64_t>(std::filesystem::file_size(path)));
  EXPECT_EQ(report.weight_bytes, c.num_parameters() * 4);
  EXPECT_EQ(report.tensors_by_type, (std::map<std::string, int>{{"F32", 2 + kLayers * 9}}));
  EXPECT_EQ(report.chat_template, "{{ messages }}");
}

TEST(GgufModelTest, LlamaTensorsLandAsStoredWithATiedClassifier) {
  const Weights w = RandomWeights(Arch::kLlama, false, 2);
  const auto model = Load(ModelFile(Arch::kLlama, w));
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelWeights& m = model->weights;
  // llama.cpp's converter already wrote Llama's q/k rows interleaved: they
  // are used as they are.
  EXPECT_EQ(ToVector(m.token_embedding), w.at("token_embd.weight").values);
  EXPECT_EQ(m.classifier.data(), m.token_embedding.data());
  EXPECT_EQ(m.classifier.size(), m.token_embedding.size());
  EXPECT_EQ(ToVector(m.final_norm), w.at("output_norm.weight").values);
  ASSERT_EQ(m.layers.size(), static_cast<size_t>(kLayers));
  for (int l = 0; l < kLayers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const std::string b = "blk." + std::to_string(l) + ".";
    const LayerWeights& lw = m.layers[l];
    EXPECT_EQ(ToVector(lw.attn_norm), w.at(b + "attn_norm.weight").values);
    EXPECT_EQ(ToVector(lw.wq), w.at(b + "attn_q.weight").values);
    EXPECT_EQ(ToVector(lw.wk), w.at(b + "attn_k.weight").values);
    EXPECT_EQ(ToVector(lw.wv), w.at(b + "attn_v.weight").values);
    EXPECT_EQ(ToVector(lw.wo), w.at(b + "attn_output.weight").values);
    EXPECT_EQ(ToVector(lw.ffn_norm), w.at(b + "ffn_norm.weight").values);
    EXPECT_EQ(ToVector(lw.w1), w.at(b + "ffn_gate.weight").values);
    EXPECT_EQ(ToVector(lw.w3), w.at(b + "ffn_up.weight").values);
    EXPECT_EQ(ToVector(lw.w2), w.at(b + "ffn_down.weight").values);
    EXPECT_TRUE(lw.bq.empty() && lw.bk.empty() && lw.bv.empty() && lw.bo.empty());
  }
}

TEST(GgufModelTest, UntiedClassifierIsOutputWeight) {
  const Weights w = RandomWeights(Arch::kLlama, true, 3);
  GgufLoadReport report;
  const auto model = Load(ModelFile(Arch::kLlama, w), &report);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_FALSE(model->config.tied_classifier);
  EXPECT_EQ(ToVector(model->weights.classifier), w.at("output.weight").values);
  EXPECT_EQ(ToVector(model->weights.token_embedding), w.at("token_embd.weight").values);
  EXPECT_EQ(report.weight_bytes, model->config.num_parameters() * 4);
}

TEST(GgufModelTest, DefaultsAndFallbacks) {
  // No general.name: the file's stem. No head_count_kv: as many KV heads as
  // query heads. No freq_base: 10000. No vocab_size: the token list's length.
  Weights w = RandomWeights(Arch::kLlama, false, 4);
  for (int l = 0; l < kLayers; ++l) {
    for (const char* t : {"attn_k.weight", "attn_v.weight"}) {
      Tensor& k = w["blk." + std::to_string(l) + "." + t];
      k = {{kDim, kDim}, std::vector<float>(kDim * kDim, 0.01f)};
    }
  }
  GgufSpec spec = ModelFile(Arch::kLlama, w);
  spec.Erase("general.name")
      .Erase("llama.attention.head_count_kv")
      .Erase("llama.rope.freq_base")
      .Erase("llama.vocab_size")
      .Erase("llama.rope.dimension_count")
      .Erase("tokenizer.ggml.eot_token_id")
      .Erase("tokenizer.chat_template")
      .Set("tokenizer.ggml.tokens", Tokens(kVocab));
  const std::string path = spec.WriteFile();
  GgufLoadReport report;
  report.chat_template = "stale";
  const auto model = LoadGgufModel(path, &report);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.name, std::filesystem::path(path).stem().string());
  EXPECT_EQ(c.n_kv_heads, kHeads);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.vocab_size, kVocab);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(report.chat_template, "");

  // Neither vocab_size nor a token list: token_embd's rows. No special
  // tokens: none declared.
  spec.Erase("tokenizer.ggml.tokens")
      .Erase("tokenizer.ggml.bos_token_id")
      .Erase("tokenizer.ggml.eos_token_id");
  const auto bare = Load(spec);
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->config.vocab_size, kVocab);
  EXPECT_EQ(bare->config.bos_token_id, -1);
  EXPECT_TRUE(bare->config.eos_token_ids.empty());
}

// llama.cpp's "none" for a special token id, 0xFFFFFFFF, is no token: the
// model loads as without the key.
TEST(GgufModelTest, LlamaCppsNoneTokenIdIsNoToken) {
  GgufSpec spec = ModelFile(Arch::kLlama, RandomWeights(Arch::kLlama, false, 6));
  spec.Set("tokenizer.ggml.bos_token_id", U32(0xFFFFFFFFu))
      .Set("tokenizer.ggml.eot_token_id", U32(0xFFFFFFFFu))
      .Set("tokenizer.ggml.padding_token_id", U32(0xFFFFFFFFu));
  const auto model = Load(spec);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->config.bos_token_id, -1);
  EXPECT_EQ(model->config.eos_token_ids, std::vector<int32_t>{2});
}

TEST(GgufModelTest, Qwen2BiasesAndRotateHalfRowsArePermutedToInterleaved) {
  const Weights w = RandomWeights(Arch::kQwen2, false, 5);
  const GgufSpec spec = ModelFile(Arch::kQwen2, w);
  const auto model = Load(spec);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->config.architecture, "qwen2");
  EXPECT_TRUE(model->config.qkv_bias);
  EXPECT_FALSE(model->config.o_bias);
  EXPECT_TRUE(model->config.tied_classifier);
  for (int l = 0; l < kLayers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const std::string b = "blk." + std::to_string(l) + ".";
    const LayerWeights& lw = model->weights.layers[l];
    EXPECT_EQ(ToVector(lw.wq), w.at(b + "attn_q.weight").values);
    EXPECT_EQ(ToVector(lw.wk), w.at(b + "attn_k.weight").values);
    EXPECT_EQ(ToVector(lw.bq), w.at(b + "attn_q.bias").values);
    EXPECT_EQ(ToVector(lw.bk), w.at(b + "attn_k.bias").values);
    EXPECT_EQ(ToVector(lw.wv), w.at(b + "attn_v.weight").values);
    EXPECT_EQ(ToVector(lw.bv), w.at(b + "attn_v.bias").values);
    EXPECT_TRUE(lw.bo.empty());
  }
  // Spelled out for head 1: the interleaved pair (2i, 2i+1) = (2, 3) is
  // rotate-half rows (i, half + i) = (1, 9) of the file.
  std::vector<float> file_bias(kDim);
  std::memcpy(file_bias.data(), spec.tensor("blk.0.attn_q.bias").data.data(), kDim * 4);
  const std::span<const float> bq = model->weights.layers[0].bq;
  EXPECT_EQ(bq[kHeadDim + 2], file_bias[kHeadDim + 1]);
  EXPECT_EQ(bq[kHeadDim + 3], file_bias[kHeadDim + 9]);
  // The file really was in another order.
  EXPECT_NE(file_bias, w.at("blk.0.attn_q.bias").values);
}

// Random bytes for n elements of `type`, with each block's f16 scale fields
// set to finite halves (so nothing is NaN or Inf); F16 and BF16 as random
// finite values.
std::string RandomData(GgmlType type, int64_t n, std::mt19937& rng) {
  const GgmlTypeInfo& info = GetGgmlTypeInfo(type);
  std::string out(n / info.block_size * info.block_bytes, '\0');
  std::uniform_int_distribution<int> byte(0, 255);
  for (char& c : out) c = static_cast<char>(byte(rng));
  auto put16 = [&](size_t at, uint16_t v) { std::memcpy(&out[at], &v, 2); };
  std::uniform_int_distribution<int> exponent(8, 17), mantissa(0, 1023), sign(0, 1);
  auto half = [&] {
    return static_cast<uint16_t>(sign(rng) << 15 | exponent(rng) << 10 | mantissa(rng));
  };
  // Where each block's f16 fields are (gguf_quant.h's layouts).
  const std::map<GgmlType, std::vector<size_t>> f16_at = {
      {GgmlType::kQ4_0, {0}},    {GgmlType::kQ4_1, {0, 2}}, {GgmlType::kQ5_0, {0}},
      {GgmlType::kQ5_1, {0, 2}}, {GgmlType::kQ8_0, {0}},    {GgmlType::kQ8_1, {0, 2}},
      {GgmlType::kQ4_K, {0, 2}}, {GgmlType::kQ6_K, {208}}};
  const auto it = f16_at.find(type);
  const std::vector<size_t> f16_fields = it == f16_at.end() ? std::vector<size_t>{} : it->second;
  for (size_t block = 0; block < out.size(); block += info.block_bytes) {
    for (const size_t f : f16_fields) put16(block + f, half());
  }
  if (type == GgmlType::kF16) {
    for (int64_t i = 0; i < n; ++i) put16(2 * i, half());
  } else if (type == GgmlType::kBF16) {
    std::uniform_int_distribution<int> bf_exponent(120, 130), bf_mantissa(0, 127);
    for (int64_t i = 0; i < n; ++i) {
      put16(2 * i,
            static_cast<uint16_t>(sign(rng) << 15 | bf_exponent(rng) << 7 | bf_mantissa(rng)));
    }
  }
  return out;
}

std::vector<float> Dequantized(const TensorSpec& t) {
  int64_t n = 1;
  for (const uint64_t d : t.dims) n *= static_cast<int64_t>(d);
  std::vector<float> out(n);
  const absl::Status st = DequantizeToFloat(t.type, t.data.data(), n, out.data());
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Nine of the thirteen types (Q2_K, Q3_K and Q5_K need more 256-wide rows
// than the test model has; the loader hands every type to DequantizeToFloat
// alike, which gguf_file_test and test_gguf_parity.py cover for all).
TEST(GgufModelTest, DequantizesTensorTypesAsDequantizeToFloat) {
  std::mt19937 rng(6);
  GgufSpec spec = ModelFile(Arch::kLlama, RandomWeights(Arch::kLlama, true, 6));
  // K-quant blocks hold 256 elements: ffn_down's rows (kHidden wide) fit.
  const std::vector<std::pair<std::string, GgmlType>> typed = {
      {"token_embd.weight", GgmlType::kQ8_0},     {"output.weight", GgmlType::kQ5_1},
      {"blk.0.attn_q.weight", GgmlType::kQ4_0},   {"blk.0.attn_k.weight", GgmlType::kQ4_1},
      {"blk.0.attn_v.weight", GgmlType::kF16},    {"blk.0.attn_output.weight", GgmlType::kBF16},
      {"blk.0.ffn_down.weight", GgmlType::kQ6_K}, {"blk.1.ffn_down.weight", GgmlType::kQ4_K},
      {"blk.1.ffn_gate.weight", GgmlType::kQ8_0}, {"blk.1.ffn_up.weight", GgmlType::kQ5_0},
      {"blk.1.attn_norm.weight", GgmlType::kF16},
  };
  for (const auto& [name, type] : typed) {
    const TensorSpec& t = spec.tensor(name);
    int64_t n = 1;
    for (const uint64_t d : t.dims) n *= static_cast<int64_t>(d);
    spec.SetTensor(name, t.dims, type, RandomData(type, n, rng));
  }
  GgufLoadReport report;
  const auto model = Load(spec, &report);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelWeights& m = model->weights;
  EXPECT_EQ(ToVector(m.token_embedding), Dequantized(spec.tensor("token_embd.weight")));
  EXPECT_EQ(ToVector(m.classifier), Dequantized(spec.tensor("output.weight")));
  EXPECT_EQ(ToVector(m.layers[0].wq), Dequantized(spec.tensor("blk.0.attn_q.weight")));
  EXPECT_EQ(ToVector(m.layers[0].wk), Dequantized(spec.tensor("blk.0.attn_k.weight")));
  EXPECT_EQ(ToVector(m.layers[0].wv), Dequantized(spec.tensor("blk.0.attn_v.weight")));
  EXPECT_EQ(ToVector(m.layers[0].wo), Dequantized(spec.tensor("blk.0.attn_output.weight")));
  EXPECT_EQ(ToVector(m.layers[0].w2), Dequantized(spec.tensor("blk.0.ffn_down.weight")));
  EXPECT_EQ(ToVector(m.layers[1].w2), Dequantized(spec.tensor("blk.1.ffn_down.weight")));
  EXPECT_EQ(ToVector(m.layers[1].w1), Dequantized(spec.tensor("blk.1.ffn_gate.weight")));
  EXPECT_EQ(ToVector(m.layers[1].w3), Dequantized(spec.tensor("blk.1.ffn_up.weight")));
  EXPECT_EQ(ToVector(m.layers[1].attn_norm), Dequantized(spec.tensor("blk.1.attn_norm.weight")));
  const std::map<std::string, int> by_type = {{"F32", 3 + kLayers * 9 - 11},
                                              {"Q8_0", 2},
                                              {"Q5_1", 1},
                                              {"Q4_0", 1},
                                              {"Q4_1", 1},
                                              {"F16", 2},
                                              {"BF16", 1},
                                              {"Q6_K", 1},
                                              {"Q4_K", 1},
                                              {"Q5_0", 1}};
  EXPECT_EQ(report.tensors_by_type, by_type);
  EXPECT_EQ(report.weight_bytes, model->config.num_parameters() * 4);
}

TEST(GgufModelTest, Qwen2QuantizedRowsAndBiasesArePermutedAfterDequantizing) {
  std::mt19937 rng(7);
  GgufSpec spec = ModelFile(Arch::kQwen2, RandomWeights(Arch::kQwen2, false, 7));
  // A bias of Q8_0 blocks: 32 of its elements per block, across heads.
  spec.SetTensor("blk.0.attn_q.weight", {kDim, kDim}, GgmlType::kQ8_0,
                 RandomData(GgmlType::kQ8_0, kDim * kDim, rng));
  spec.SetTensor("blk.0.attn_q.bias", {kDim}, GgmlType::kQ8_0,
                 RandomData(GgmlType::kQ8_0, kDim, rng));
  spec.SetTensor("blk.1.attn_k.bias", {kKvDim}, GgmlType::kF16,
                 RandomData(GgmlType::kF16, kKvDim, rng));
  const auto model = Load(spec);
  ASSERT_TRUE(model.ok()) << model.status();
  auto interleaved = [](const std::vector<float>& rotate_half, size_t cols) {
    // The inverse of ToRotateHalf: its row r is row moved[r] of the
    // interleaved rows.
    std::vector<float> index(rotate_half.size() / cols);
    for (size_t r = 0; r < index.size(); ++r) index[r] = static_cast<float>(r);
    const std::vector<float> moved = ToRotateHalf(index, 1);
    std::vector<float> out(rotate_half.size());
    for (size_t r = 0; r < index.size(); ++r) {
      std::copy_n(&rotate_half[r * cols], cols, &out[static_cast<size_t>(moved[r]) * cols]);
    }
    return out;
  };
  EXPECT_EQ(ToVector(model->weights.layers[0].wq),
            interleaved(Dequantized(spec.tensor("blk.0.attn_q.weight")), kDim));
  EXPECT_EQ(ToVector(model->weights.layers[0].bq),
            interleaved(Dequantized(spec.tensor("blk.0.attn_q.bias")), 1));
  EXPECT_EQ(ToVector(model->weights.layers[1].bk),
            interleaved(Dequantized(spec.tensor("blk.1.attn_k.bias")), 1));
}

// ---------------------------------------------------------------------------
// Forward pass
// ---------------------------------------------------------------------------

// A Model whose spans point into `w` (held by its storage), with `config`.
std::shared_ptr<const Model> Direct(const ModelConfig& config, Weights w) {
  auto held = std::make_shared<const Weights>(std::move(w));
  auto t = [&](const std::string& name) -> std::span<const float> { return held->at(name).values; };
  Model m;
  m.config = config;
  m.weights.token_embedding = t("token_embd.weight");
  m.weights.final_norm = t("output_norm.weight");
  m.weights.classifier = config.tied_classifier ? t("token_embd.weight") : t("output.weight");
  for (int l = 0; l < config.n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    LayerWeights lw{
        t(b + "attn_norm.weight"), t(b + "attn_q.weight"),      t(b + "attn_k.weight"),
        t(b + "attn_v.weight"),    t(b + "attn_output.weight"), t(b + "ffn_norm.weight"),
        t(b + "ffn_gate.weight"),  t(b + "ffn_down.weight"),    t(b + "ffn_up.weight")};
    if (config.qkv_bias) {
      lw.bq = t(b + "attn_q.bias");
      lw.bk = t(b + "attn_k.bias");
      lw.bv = t(b + "attn_v.bias");
    }
    m.weights.layers.push_back(lw);
  }
  m.storage = held;
  return std::make_shared<const Model>(std::move(m));
}

TEST(GgufModelTest, ForwardPassEqualsTheSameWeightsBuiltDirectly) {
  for (const Arch arch : {Arch::kLlama, Arch::kQwen2}) {
    for (const bool untied : {false, true}) {
      SCOPED_TRACE(std::string(arch == Arch::kLlama ? "llama" : "qwen2") +
                   (untied ? " untied" : " tied"));
      const Weights w = RandomWeights(arch, untied, 8);
      auto loaded = Load(ModelFile(arch, w));
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      const auto from_file = std::make_shared<const Model>(*std::move(loaded));
      // The config the loader read, with the weights the engine expects.
      const auto direct = Direct(from_file->config, w);
      const auto expected = Forward(direct, kPrompt);
      ASSERT_EQ(expected.size(), kPrompt.size());
      EXPECT_EQ(Forward(from_file, kPrompt), expected);
      // Peaked, varied logits: a comparison that could fail.
      EXPECT_NE(expected[3], expected[4]);
    }
  }
}

// Matrices kept in their block types (GgufLoadOptions::keep_quantized): the
// loader keeps the five types the CPU backend computes with as the file's
// blocks (rows permuted as the float ones would be), leaves every other
// tensor float32, and the CPU backend's logits stay within float32 rounding
// of the dequantized model's (the products differ only in where they round:
// quant_matmul.h).
TEST(GgufModelTest, KeptQuantizedMatricesGiveTheDequantizedModelsLogits) {
  for (const Arch arch : {Arch::kLlama, Arch::kQwen2}) {
    for (const bool untied : {false, true}) {
      SCOPED_TRACE(std::string(arch == Arch::kLlama ? "llama" : "qwen2") +
                   (untied ? " untied" : " tied"));
      std::mt19937 rng(9);
      GgufSpec spec = ModelFile(arch, RandomWeights(arch, untied, 9));
      std::vector<std::pair<std::string, GgmlType>> typed = {
          {"token_embd.weight", GgmlType::kQ8_0},        {"blk.0.attn_q.weight", GgmlType::kQ4_0},
          {"blk.0.attn_k.weight", GgmlType::kQ4_1},      {"blk.0.attn_v.weight", GgmlType::kF16},
          {"blk.0.attn_output.weight", GgmlType::kQ8_0}, {"blk.0.ffn_down.weight", GgmlType::kQ6_K},
          {"blk.1.ffn_down.weight", GgmlType::kQ4_K},    {"blk.1.ffn_gate.weight", GgmlType::kQ5_0},
          {"blk.1.attn_q.weight", GgmlType::kQ8_0},      {"blk.1.attn_k.weight", GgmlType::kQ4_0}};
      if (untied) typed.emplace_back("output.weight", GgmlType::kQ4_1);
      for (const auto& [name, type] : typed) {
        const TensorSpec& t = spec.tensor(name);
        int64_t n = 1;
        for (const uint64_t d : t.dims) n *= static_cast<int64_t>(d);
        spec.SetTensor(name, t.dims, type, RandomData(type, n, rng));
      }
      const std::string path = spec.WriteFile();
      GgufLoadReport float_report, kept_report;
      auto dequantized = LoadGgufModel(path, &float_report);
      auto kept = LoadGgufModel(path, &kept_report, {.keep_quantized = true});
      ASSERT_TRUE(dequantized.ok()) << dequantized.status();
      ASSERT_TRUE(kept.ok()) << kept.status();
      const ModelWeights& w = kept->weights;
      EXPECT_FALSE(HasQuantizedWeights(dequantized->weights));
      ASSERT_TRUE(HasQuantizedWeights(w));
      EXPECT_TRUE(w.token_embedding.empty());
      EXPECT_EQ(w.quantized_token_embedding.type, QuantType::kQ8_0);
      EXPECT_EQ(w.quantized_token_embedding.rows, kVocab);
      EXPECT_EQ(w.quantized_token_embedding.cols, kDim);
      if (untied) {
        EXPECT_EQ(w.quantized_classifier.type, QuantType::kQ4_1);
        EXPECT_NE(w.quantized_classifier.data, w.quantized_token_embedding.data);
      } else {
        EXPECT_EQ(w.quantized_classifier.data, w.quantized_token_embedding.data);
      }
      EXPECT_EQ(w.layers[0].quantized.wq.type, QuantType::kQ4_0);
      EXPECT_EQ(w.layers[0].quantized.w2.type, QuantType::kQ6_K);
      EXPECT_EQ(w.layers[1].quantized.w2.type, QuantType::kQ4_K);
      EXPECT_TRUE(w.layers[0].wq.empty());
      // F16 and Q5_0 have no kernels: float32 as before; F32 stays float32.
      EXPECT_TRUE(w.layers[0].quantized.wv.empty());
      EXPECT_EQ(w.layers[0].wv.size(), static_cast<size_t>(kKvDim) * kDim);
      EXPECT_TRUE(w.layers[1].quantized.w1.empty());
      EXPECT_TRUE(w.layers[1].quantized.w3.empty());
      // The token embedding's bytes are the file's.
      const TensorSpec& embd = spec.tensor("token_embd.weight");
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(w.quantized_token_embedding.data),
                            embd.data.size()),
                embd.data);
      EXPECT_GT(kept_report.quantized_bytes, 0);
      EXPECT_LT(kept_report.weight_bytes, float_report.weight_bytes);

      const auto float_model = std::make_shared<const Model>(*std::move(dequantized));
      const auto kept_model = std::make_shared<const Model>(*std::move(kept));
      // What a step reads: the panels of the quantized matrices, not float32.
      const CpuBackendOptions options{.kv_cache = {.block_size = 16, .num_blocks = 1}};
      auto float_backend = CreateCpuBackend(float_model, options);
      auto kept_backend = CreateCpuBackend(kept_model, options);
      ASSERT_TRUE(float_backend.ok() && kept_backend.ok());
      EXPECT_EQ((*float_backend)->weight_bytes(), float_report.weight_bytes);
      EXPECT_LT((*kept_backend)->weight_bytes(), (*float_backend)->weight_bytes());
      EXPECT_NE((*kept_backend)->Describe().find("Q4_K"), std::string::npos)
          << (*kept_backend)->Describe();

      const auto expected = Forward(float_model, kPrompt);
      ASSERT_EQ(expected.size(), kPrompt.size());
      const auto got = Forward(kept_model, kPrompt);
      ASSERT_EQ(got.size(), expected.size());
      float largest = 0.0f, off = 0.0f;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].size(), expected[i].size());
        for (size_t j = 0; j < got[i].size(); ++j) {
          largest = std::max(largest, std::fabs(expected[i][j]));
          off = std::max(off, std::fabs(got[i][j] - expected[i][j]));
        }
      }
      // A wrong scale, offset or integer moves the logits by their own size;
      // float32's roundings by millionths of it.
      EXPECT_LT(off, 1e-5f * largest) << "largest logit " << largest;
      std::cout << "kept quantized: logits off by at most " << off << " of " << largest << "\n";
      EXPECT_NE(expected[3], expected[4]);
    }
  }
}

// --int8_activations (CpuBackendOptions::int8_activations) on Q4_K and Q6_K
// matrices, the only quantized ones of this file: their int8 kernels run
// (the logits move off the dequantized model's) and stay close to it.
TEST(GgufModelTest, Int8ActivationsRunTheKQuantsKernels) {
  if (!cpu::Int8DotSupported()) GTEST_SKIP() << "this processor has no AVX2: not run";
  std::mt19937 rng(11);
  GgufSpec spec = ModelFile(Arch::kLlama, RandomWeights(Arch::kLlama, false, 11));
  for (const auto& [name, type] :
       std::vector<std::pair<std::string, GgmlType>>{{"blk.0.ffn_down.weight", GgmlType::kQ6_K},
                                                     {"blk.1.ffn_down.weight", GgmlType::kQ4_K}}) {
    const TensorSpec& t = spec.tensor(name);
    spec.SetTensor(name, t.dims, type,
                   RandomData(type, static_cast<int64_t>(t.dims[0] * t.dims[1]), rng));
  }
  auto kept = LoadGgufModel(spec.WriteFile(), nullptr, {.keep_quantized = true});
  ASSERT_TRUE(kept.ok()) << kept.status();
  const auto model = std::make_shared<const Model>(*std::move(kept));
  auto exact = CreateCpuBackend(model, {.kv_cache = {.block_size = 16, .num_blocks = 1}});
  auto int8 = CreateCpuBackend(
      model, {.kv_cache = {.block_size = 16, .num_blocks = 1}, .int8_activations = true});
  ASSERT_TRUE(exact.ok() && int8.ok());
  for (const char* words : {"Q6_K", "Q4_K", "with int8 activations"}) {
    EXPECT_NE((*int8)->Describe().find(words), std::string::npos) << (*int8)->Describe();
  }
  const auto want = testing::OneByOne(**exact, kPrompt, {0});
  const auto got = testing::OneByOne(**int8, kPrompt, {0});
  ASSERT_EQ(got.size(), want.size());
  EXPECT_NE(got, want);
  float largest = 0.0f, off = 0.0f;
  for (size_t i = 0; i < want.size(); ++i) {
    for (size_t j = 0; j < want[i].size(); ++j) {
      largest = std::max(largest, std::fabs(want[i][j]));
      off = std::max(off, std::fabs(got[i][j] - want[i][j]));
    }
  }
  EXPECT_LT(off, 0.05f * largest) << "largest logit " << largest;  // 1.7% when written
  std::cout << "int8 activations on Q4_K and Q6_K: logits off by at most " << off << " of "
            << largest << "\n";
}

// ---------------------------------------------------------------------------
// RoPE frequency factors (Llama 3.1's rope_freqs.weight)
// ---------------------------------------------------------------------------

TEST(RopeFrequencyFactorsTest, DivideEachPairsInverseFrequency) {
  ModelConfig c;
  c.dim = 64;
  c.n_heads = 4;  // head_dim 16: 8 pairs
  c.rope_theta = 500000.0f;
  for (const RopeScaling::Type type : {RopeScaling::Type::kNone, RopeScaling::Type::kLlama3}) {
    c.rope_scaling = {.type = type,
                      .factor = 8.0f,
                      .low_freq_factor = 1.0f,
                      .high_freq_factor = 4.0f,
                      .original_max_position_embeddings = 64};
    const std::vector<float> base = RopeInverseFrequencies(c);
    c.rope_scaling.freq_factors = {1.0f, 1.0f, 1.5f, 2.0f, 3.0f, 8.0f, 8.0f, 0.5f};
    const std::vector<float> scaled = RopeInverseFrequencies(c);
    ASSERT_EQ(scaled.size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(scaled[i], base[i] / c.rope_scaling.freq_factors[i]) << "pair " << i;
    }
    EXPECT_NE(scaled[7], base[7]);
  }
}

TEST(RopeFrequencyFactorsTest, RopeFreqsTensorScalesTheForwardPass) {
  const Weights w = RandomWeights(Arch::kLlama, false, 9);
  const std::vector<float> factors = {1.0f, 1.0f, 1.0f, 2.0f, 4.0f, 8.0f, 8.0f, 8.0f};
  GgufSpec spec = ModelFile(Arch::kLlama, w);
  const auto plain = Load(spec);
  ASSERT_TRUE(plain.ok()) << plain.status();
  spec.SetF32("rope_freqs.weight", {kHeadDim / 2}, factors);
  auto loaded = Load(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->config.rope_scaling.freq_factors, factors);
  EXPECT_EQ(loaded->config.rope_scaling.type, RopeScaling::Type::kNone);
  const auto scaled = std::make_shared<const Model>(*std::move(loaded));

  // The engine computes what the factors say: the same as a Model built
  // directly with them, and not what it computes without them.
  const auto with = Forward(scaled, kPrompt);
  EXPECT_EQ(with, Forward(Direct(scaled->config, w), kPrompt));
  const auto without = Forward(std::make_shared<const Model>(*plain), kPrompt);
  EXPECT_EQ(with[0], without[0]);  // position 0 does not rotate
  EXPECT_NE(with.back(), without.back());

  // Factors of 1 change nothing.
  spec.SetF32("rope_freqs.weight", {kHeadDim / 2}, std::vector<float>(kHeadDim / 2, 1.0f));
  auto ones = Load(spec);
  ASSERT_TRUE(ones.ok()) << ones.status();
  EXPECT_EQ(Forward(std::make_shared<const Model>(*std::move(ones)), kPrompt), without);
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

struct ErrorCase {
  std::string what;
  Arch arch;
  std::function<void(GgufSpec&)> change;
  std::vector<std::string> expect;
};

TEST(GgufModelErrorTest, EachNamesTheFileAndTheKeyOrTensor) {
  std::mt19937 rng(10);
  const std::string q8_1 =
      RandomData(GgmlType::kQ8_1, kDim * kDim, rng);  // layout only: 36-byte blocks
  const std::vector<ErrorCase> cases = {
      {"unsupported architecture",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("general.architecture", Str("gpt2")); },
       {"general.architecture", "\"gpt2\"", "not supported", "llama, qwen2"}},
      {"no architecture",
       Arch::kLlama,
       [](GgufSpec& s) { s.Erase("general.architecture"); },
       {"general.architecture is missing"}},
      {"architecture not a string",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("general.architecture", U32(7)); },
       {"general.architecture", "uint32 7"}},
      {"unsupported tensor type",
       Arch::kLlama,
       [&](GgufSpec& s) {
         s.SetTensor("blk.1.attn_q.weight", {kDim, kDim}, GgmlType::kQ8_1, q8_1);
       },
       {"tensor blk.1.attn_q.weight", "Q8_1", "not supported"}},
      {"missing tensor",
       Arch::kLlama,
       [](GgufSpec& s) { s.EraseTensor("blk.1.ffn_up.weight"); },
       {"missing tensor blk.1.ffn_up.weight"}},
      {"missing embedding",
       Arch::kLlama,
       [](GgufSpec& s) { s.EraseTensor("token_embd.weight"); },
       {"missing tensor token_embd.weight"}},
      {"missing qwen2 bias",
       Arch::kQwen2,
       [](GgufSpec& s) { s.EraseTensor("blk.0.attn_k.bias"); },
       {"missing tensor blk.0.attn_k.bias"}},
      {"unexpected block",
       Arch::kLlama,
       [](GgufSpec& s) { s.SetF32("blk.2.attn_norm.weight", {kDim}, std::vector<float>(kDim)); },
       {"unexpected tensor blk.2.attn_norm.weight", "2 blocks"}},
      {"llama with a bias",
       Arch::kLlama,
       [](GgufSpec& s) { s.SetF32("blk.0.attn_q.bias", {kDim}, std::vector<float>(kDim)); },
       {"unexpected tensor blk.0.attn_q.bias"}},
      {"rope_freqs in qwen2",
       Arch::kQwen2,
       [](GgufSpec& s) {
         s.SetF32("rope_freqs.weight", {kHeadDim / 2}, std::vector<float>(kHeadDim / 2, 1));
       },
       {"unexpected tensor rope_freqs.weight"}},
      {"k of the wrong shape",
       Arch::kLlama,
       [](GgufSpec& s) {
         s.SetF32("blk.0.attn_k.weight", {kDim, kDim}, std::vector<float>(kDim * kDim));
       },
       {"tensor blk.0.attn_k.weight", "[64, 64]", "[64, 32]"}},
      {"transposed down projection",
       Arch::kLlama,
       [](GgufSpec& s) {
         s.SetF32("blk.1.ffn_down.weight", {kDim, kHidden}, std::vector<float>(kDim * kHidden));
       },
       {"tensor blk.1.ffn_down.weight", "[64, 256]", "[256, 64]"}},
      {"embedding of another vocabulary",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.vocab_size", U32(kVocab + 1)); },
       {"tensor token_embd.weight", "[64, 40]", "[64, 41]"}},
      {"qwen2 bias of the wrong size",
       Arch::kQwen2,
       [](GgufSpec& s) { s.SetF32("blk.1.attn_v.bias", {kDim}, std::vector<float>(kDim)); },
       {"tensor blk.1.attn_v.bias", "[64]", "[32]"}},
      {"partial rotary",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.rope.dimension_count", U32(8)); },
       {"llama.rope.dimension_count", "uint32 8", "16"}},
      {"separate key length",
       Arch::kQwen2,
       [](GgufSpec& s) { s.Set("qwen2.attention.key_length", U32(32)); },
       {"qwen2.attention.key_length", "uint32 32"}},
      {"separate value length",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.attention.value_length", U32(8)); },
       {"llama.attention.value_length", "uint32 8"}},
      {"linear RoPE scaling",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.rope.scaling.type", Str("linear")); },
       {"llama.rope.scaling.type", "\"linear\"", "not supported"}},
      {"YaRN",
       Arch::kQwen2,
       [](GgufSpec& s) { s.Set("qwen2.rope.scaling.type", Str("yarn")); },
       {"qwen2.rope.scaling.type", "\"yarn\""}},
      {"a scaling factor",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.rope.scaling.factor", F32(4.0f)); },
       {"llama.rope.scaling.factor", "float32 4"}},
      {"an old linear scale",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.rope.scale_linear", F32(2.0f)); },
       {"llama.rope.scale_linear", "float32 2"}},
      {"missing block count",
       Arch::kLlama,
       [](GgufSpec& s) { s.Erase("llama.block_count"); },
       {"llama.block_count is missing"}},
      {"missing epsilon",
       Arch::kQwen2,
       [](GgufSpec& s) { s.Erase("qwen2.attention.layer_norm_rms_epsilon"); },
       {"qwen2.attention.layer_norm_rms_epsilon is missing"}},
      {"missing context length",
       Arch::kLlama,
       [](GgufSpec& s) { s.Erase("llama.context_length"); },
       {"llama.context_length is missing"}},
      {"width as a string",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.embedding_length", Str("64")); },
       {"llama.embedding_length", "string \"64\"", "positive 32-bit integer"}},
      {"zero heads",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.attention.head_count", U32(0)); },
       {"llama.attention.head_count", "uint32 0"}},
      {"heads not dividing the width",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.attention.head_count", U32(5)); },
       {"llama.embedding_length (64)", "llama.attention.head_count (5)"}},
      {"KV heads not dividing the heads",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.attention.head_count_kv", U32(3)); },
       {"llama.attention.head_count_kv (3)"}},
      {"negative theta",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.rope.freq_base", F32(-1.0f)); },
       {"llama.rope.freq_base", "float32 -1", "finite positive"}},
      {"NaN epsilon",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.attention.layer_norm_rms_epsilon", F32(NAN)); },
       {"llama.attention.layer_norm_rms_epsilon", "nan"}},
      {"mixture of experts",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.expert_count", U32(8)); },
       {"llama.expert_count", "uint32 8", "mixture-of-experts"}},
      {"BOS beyond the vocabulary",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("tokenizer.ggml.bos_token_id", U32(kVocab)); },
       {"tokenizer.ggml.bos_token_id", "uint32 40", "below the vocabulary size 40"}},
      {"EOT beyond the vocabulary",
       Arch::kQwen2,
       [](GgufSpec& s) { s.Set("tokenizer.ggml.eot_token_id", U32(1000)); },
       {"tokenizer.ggml.eot_token_id", "uint32 1000"}},
      {"name not a string",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("general.name", U32(3)); },
       {"general.name", "uint32 3", "need a string"}},
      {"chat template not a string",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("tokenizer.chat_template", U32(3)); },
       {"tokenizer.chat_template", "uint32 3"}},
      {"token list not an array",
       Arch::kLlama,
       [](GgufSpec& s) { s.Erase("llama.vocab_size").Set("tokenizer.ggml.tokens", U32(3)); },
       {"tokenizer.ggml.tokens", "uint32 3"}},
      {"one more block than the file has",
       Arch::kLlama,
       [](GgufSpec& s) { s.Set("llama.block_count", U32(kLayers + 1)); },
       {"missing tensor blk.2.attn_norm.weight"}},
      // Refused at the first missing block, before anything is allocated
      // for two billion of them.
      {"two billion blocks",
       Arch::kQwen2,
       [](GgufSpec& s) { s.Set("qwen2.block_count", U32(0x7fffffff)); },
       {"missing tensor blk.2.attn_norm.weight"}},
      {"rope_freqs of the wrong size",
       Arch::kLlama,
       [](GgufSpec& s) { s.SetF32("rope_freqs.weight", {kHeadDim}, std::vector<float>(kHeadDim)); },
       {"tensor rope_freqs.weight", "[16]", "[8]"}},
      {"a zero RoPE factor",
       Arch::kLlama,
       [](GgufSpec& s) {
         s.SetF32("rope_freqs.weight", {kHeadDim / 2}, {1, 1, 1, 1, 0, 1, 1, 1});
       },
       {"tensor rope_freqs.weight", "factor 4 is 0"}},
  };
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.what);
    GgufSpec spec = ModelFile(c.arch, RandomWeights(c.arch, false, 11));
    c.change(spec);
    ExpectError(spec, c.expect);
  }
}

TEST(GgufModelErrorTest, NotAGgufFileOrNoFile) {
  const std::string path = Write("GGUF but then nothing");
  const auto model = LoadGgufModel(path);
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(model.status().message(), path)) << model.status();
  const auto missing = LoadGgufModel(path + ".absent");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(Contains(missing.status().message(), path + ".absent")) << missing.status();
}

TEST(GgufModelTest, IsGgufFileChecksTheMagic) {
  EXPECT_TRUE(IsGgufFile(Write("GGUF")));
  EXPECT_FALSE(IsGgufFile(Write("GGU")));
  EXPECT_FALSE(IsGgufFile(Write("ggjt....")));
  EXPECT_FALSE(IsGgufFile(::testing::TempDir() + "/no_such_file.gguf"));
}

}  // namespace
}  // namespace coalesce::engine
