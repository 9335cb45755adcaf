// Hugging Face model folders: stories260K-hf against run.c's goldens (which
// proves the q/k permutation), the llama2.c weights it was converted from,
// dtype conversion, config handling, and corrupt folders written here, each
// of which must fail with a message naming the file and the problem.
#include "engine/model/hf_model.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/cpu/cpu_backend.h"
#include "engine/model/llama2c.h"
#include "engine/model/safetensors.h"
#include "engine/sampler.h"

namespace coalesce::engine {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kModels = COALESCE_MODELS_DIR;
const std::string kHfDir = kModels + "/stories260K-hf";

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int32_t Argmax(std::span<const float> logits) {
  Rng unused(0);
  return Sample(logits, {}, unused);
}

std::shared_ptr<const Model> StoriesHf() {
  static const std::shared_ptr<const Model> model = [] {
    auto m = LoadHfModel(kHfDir);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::make_shared<const Model>(*std::move(m)) : nullptr;
  }();
  return model;
}

Json Golden() {
  std::ifstream in(kModels + "/stories260K/golden.json");
  return Json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// ---------------------------------------------------------------------------
// stories260K-hf
// ---------------------------------------------------------------------------

TEST(HfModelTest, Stories260kConfig) {
  const auto model = StoriesHf();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.name, "stories260K-hf");
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.source, kHfDir);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_TRUE(c.tied_classifier);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c.num_parameters(), 264128 - 2 * 512 * 4);  // as the llama2.c file
}

// The HF file is a conversion of stories260K.bin: after undoing the q/k
// permutation every weight must equal the original bit for bit.
TEST(HfModelTest, Stories260kEqualsLlama2cWeights) {
  const auto hf = StoriesHf();
  ASSERT_NE(hf, nullptr);
  auto l2c = LoadLlama2cModel(kModels + "/stories260K/stories260K.bin");
  ASSERT_TRUE(l2c.ok()) << l2c.status();
  auto same = [](std::span<const float> a, std::span<const float> b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
  };
  const ModelWeights &a = hf->weights, &b = l2c->weights;
  EXPECT_TRUE(same(a.token_embedding, b.token_embedding));
  EXPECT_TRUE(same(a.classifier, b.classifier));
  EXPECT_TRUE(same(a.final_norm, b.final_norm));
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerWeights &x = a.layers[l], &y = b.layers[l];
    EXPECT_TRUE(same(x.wq, y.wq)) << l;
    EXPECT_TRUE(same(x.wk, y.wk)) << l;
    EXPECT_TRUE(same(x.wv, y.wv) && same(x.wo, y.wo) && same(x.attn_norm, y.attn_norm) &&
                same(x.ffn_norm, y.ffn_norm) && same(x.w1, y.w1) && same(x.w2, y.w2) &&
                same(x.w3, y.w3))
        << l;
  }
}

TEST(HfModelTest, Stories260kFirstStepLogits) {
  const auto model = StoriesHf();
  ASSERT_NE(model, nullptr);
  const Json golden = Golden();
  ASSERT_FALSE(golden.is_discarded());
  const auto expected = golden["first_step_logits"]["all"].get<std::vector<float>>();
  auto backend = CreateCpuBackend(model, {.kv_cache = {.block_size = 16, .num_blocks = 1}});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const int32_t bos = 1;
  const std::vector<int32_t> table = {0};
  const SequenceStep seq{.num_tokens = 1, .start_pos = 0, .block_table = table};
  std::vector<float> logits(512);
  ASSERT_TRUE((*backend)->Step({.tokens = {&bos, 1}, .seqs = {&seq, 1}}, logits).ok());
  ASSERT_EQ(expected.size(), 512u);
  // As golden_test: run.c's float32 vs our 8-lane summation order.
  for (int i = 0; i < 512; ++i) EXPECT_NEAR(logits[i], expected[i], 1e-4) << i;
}

// Greedy decoding of `prompts` together in one step sequence, each with its
// own 9 blocks of 16 positions (a golden's prompt and outputs are 129 ids):
// `steps` argmax ids per prompt.
std::vector<std::vector<int32_t>> GreedyDecode(std::shared_ptr<const Model> model,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               size_t steps) {
  const int n = static_cast<int>(prompts.size()), vocab = model->config.vocab_size;
  auto backend = CreateCpuBackend(model, {.kv_cache = {.block_size = 16, .num_blocks = 9 * n}});
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return {};
  std::vector<std::vector<int32_t>> tables(n), out(n);
  std::vector<SequenceStep> seqs(n);
  std::vector<int32_t> tokens;
  for (int s = 0; s < n; ++s) {
    for (int b = 0; b < 9; ++b) tables[s].push_back(9 * s + b);
    seqs[s] = {.num_tokens = static_cast<int32_t>(prompts[s].size()), .block_table = tables[s]};
    tokens.insert(tokens.end(), prompts[s].begin(), prompts[s].end());
  }
  std::vector<float> logits(static_cast<size_t>(n) * vocab);
  for (size_t step = 0; step < steps; ++step) {
    const absl::Status status = (*backend)->Step({.tokens = tokens, .seqs = seqs}, logits);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) return {};
    tokens.clear();
    for (int s = 0; s < n; ++s) {
      out[s].push_back(Argmax(std::span<const float>(logits).subspan(s * vocab, vocab)));
      seqs[s].start_pos += seqs[s].num_tokens;
      seqs[s].num_tokens = 1;
      tokens.push_back(out[s].back());
    }
  }
  return out;
}

// Each golden case alone, then both in one batch: run.c's greedy ids exactly.
TEST(HfModelTest, Stories260kGreedyGoldens) {
  const auto model = StoriesHf();
  ASSERT_NE(model, nullptr);
  const Json golden = Golden();
  ASSERT_FALSE(golden.is_discarded());
  ASSERT_EQ(golden["cases"].size(), 2u);
  std::vector<std::vector<int32_t>> prompts, expected;
  for (const Json& c : golden["cases"]) {
    prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
    expected.push_back(c["output_ids"].get<std::vector<int32_t>>());
  }
  for (int s = 0; s < 2; ++s) {
    const auto alone = GreedyDecode(model, {prompts[s]}, expected[s].size());
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(alone[0], expected[s]) << "alone: " << golden["cases"][s]["prompt"];
  }
  auto together = GreedyDecode(model, prompts, std::max(expected[0].size(), expected[1].size()));
  ASSERT_EQ(together.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    together[s].resize(expected[s].size());
    EXPECT_EQ(together[s], expected[s]) << "batched: " << golden["cases"][s]["prompt"];
  }
}

// ---------------------------------------------------------------------------
// RoPE scaling
// ---------------------------------------------------------------------------

TEST(HfModelTest, Llama3InverseFrequenciesMatchTransformers) {
  ModelConfig c;
  c.dim = 64;
  c.n_heads = 4;  // head_dim 16
  c.rope_theta = 10000.0f;
  c.rope_scaling = {.type = RopeScaling::Type::kLlama3,
                    .factor = 8.0f,
                    .low_freq_factor = 1.0f,
                    .high_freq_factor = 4.0f,
                    .original_max_position_embeddings = 32};
  // transformers 4.47.1 _compute_llama3_parameters for this config: pair 0
  // is high-frequency (kept), pair 1 interpolated, the rest divided by 8.
  const std::vector<float> expected = {
      1.0f,           0.0958399773f,   0.0125000002f,   0.00395284733f,
      0.00124999997f, 0.000395284733f, 0.000125000006f, 3.95284733e-05f};
  const std::vector<float> got = RopeInverseFrequencies(c);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_FLOAT_EQ(got[i], expected[i]) << i;
}

// ---------------------------------------------------------------------------
// Folders written by the tests
// ---------------------------------------------------------------------------

struct TestTensor {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", "I32", ...
  std::vector<int64_t> shape;
  std::string bytes;
};

TestTensor F32(const std::string& name, std::vector<int64_t> shape, float base) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = base + 0.001f * static_cast<float>(i % 97);
  return {name, "F32", shape, std::string(reinterpret_cast<const char*>(v.data()), n * 4)};
}

// A safetensors file: tensors laid out back to back in order; `edit` may
// change the header before it is written (to make it lie).
std::string Safetensors(const std::vector<TestTensor>& tensors,
                        const std::function<void(Json&)>& edit = nullptr) {
  Json header = Json::object();
  std::string data;
  for (const TestTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  if (edit) edit(header);
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + text + data;
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// hidden 8, 2 heads of 4, 1 KV head, 2 layers, vocab 16, intermediate 12.
Json TinyConfig() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 8},
          {"intermediate_size", 12},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 1},
          {"vocab_size", 16},
          {"max_position_embeddings", 64},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},
          {"rope_scaling", nullptr},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false},
          {"bos_token_id", 1},
          {"eos_token_id", 2}};
}

std::vector<TestTensor> TinyTensors() {
  std::vector<TestTensor> t = {F32("model.embed_tokens.weight", {16, 8}, 0.1f),
                               F32("model.norm.weight", {8}, 1.0f),
                               F32("lm_head.weight", {16, 8}, -0.1f)};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (auto [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"input_layernorm.weight", {8}},
             {"post_attention_layernorm.weight", {8}},
             {"self_attn.q_proj.weight", {8, 8}},
             {"self_attn.k_proj.weight", {4, 8}},
             {"self_attn.v_proj.weight", {4, 8}},
             {"self_attn.o_proj.weight", {8, 8}},
             {"mlp.gate_proj.weight", {12, 8}},
             {"mlp.up_proj.weight", {12, 8}},
             {"mlp.down_proj.weight", {8, 12}}}) {
      t.push_back(F32(p + name, shape, 0.01f * static_cast<float>(t.size())));
    }
  }
  return t;
}

class HfFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / (std::string("hf_model_test_") + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const Json& config, const std::vector<TestTensor>& tensors,
             const std::function<void(Json&)>& edit = nullptr) {
    WriteFile(dir_ / "config.json", config.dump(2));
    WriteFile(dir_ / "model.safetensors", Safetensors(tensors, edit));
  }
  std::string Path(const std::string& file) const { return (dir_ / file).string(); }

  // Loading must fail, and the message must name `file` and contain each of
  // `parts`.
  void ExpectError(const std::string& file, const std::vector<std::string>& parts) {
    auto model = LoadHfModel(dir_.string());
    ASSERT_FALSE(model.ok()) << "loaded a corrupt folder";
    const std::string message(model.status().message());
    EXPECT_TRUE(Contains(message, Path(file))) << message;
    for (const std::string& part : parts) EXPECT_TRUE(Contains(message, part)) << message;
  }

  fs::path dir_;
};

TEST_F(HfFolderTest, TinyModelLoadsAndRuns) {
  Write(TinyConfig(), TinyTensors());
  std::vector<std::pair<int64_t, int64_t>> progress;
  auto model = LoadHfModel(dir_.string(), {.progress = [&](int64_t done, int64_t total) {
                             progress.emplace_back(done, total);
                           }});
  ASSERT_TRUE(model.ok()) << model.status();
  // One call per tensor, ending with everything done.
  int64_t total_bytes = 0;
  for (const TestTensor& t : TinyTensors()) total_bytes += static_cast<int64_t>(t.bytes.size());
  ASSERT_EQ(progress.size(), TinyTensors().size());
  EXPECT_EQ(progress.back(), std::make_pair(total_bytes, total_bytes));
  EXPECT_FALSE(model->config.tied_classifier);
  EXPECT_EQ(model->config.eos_token_ids, std::vector<int32_t>{2});
  // lm_head is F32 and unpermuted: used in place, bit for bit.
  EXPECT_FLOAT_EQ(model->weights.classifier[0], -0.1f);
  auto backend = CreateCpuBackend(std::make_shared<const Model>(*std::move(model)),
                                  {.kv_cache = {.block_size = 16, .num_blocks = 1}});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::vector<int32_t> tokens = {1, 5, 7}, table = {0};
  const SequenceStep seq{.num_tokens = 3, .start_pos = 0, .block_table = table};
  std::vector<float> logits(16);
  EXPECT_TRUE((*backend)->Step({.tokens = tokens, .seqs = {&seq, 1}}, logits).ok());
}

TEST_F(HfFolderTest, GenerationConfigEosListWins) {
  Write(TinyConfig(), TinyTensors());
  WriteFile(dir_ / "generation_config.json", R"({"bos_token_id": 3, "eos_token_id": [2, 9]})");
  auto model = LoadHfModel(dir_.string());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->config.bos_token_id, 3);
  EXPECT_EQ(model->config.eos_token_ids, (std::vector<int32_t>{2, 9}));
}

// q_proj rows come in rotate-half order per head and must leave interleaved:
// destination row h*4 + 2i + a is source row h*4 + a*2 + i.
TEST_F(HfFolderTest, QueryRowsArePermutedPerHead) {
  std::vector<TestTensor> tensors = TinyTensors();
  for (TestTensor& t : tensors) {
    if (t.name != "model.layers.0.self_attn.q_proj.weight") continue;
    std::vector<float> v(64);
    for (int r = 0; r < 8; ++r) {
      for (int c = 0; c < 8; ++c) v[r * 8 + c] = static_cast<float>(r);  // row id everywhere
    }
    t.bytes.assign(reinterpret_cast<const char*>(v.data()), 64 * 4);
  }
  Write(TinyConfig(), tensors);
  auto model = LoadHfModel(dir_.string());
  ASSERT_TRUE(model.ok()) << model.status();
  const std::span<const float> wq = model->weights.layers[0].wq;
  const float expected_rows[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int r = 0; r < 8; ++r) EXPECT_EQ(wq[r * 8], expected_rows[r]) << r;
}

TEST_F(HfFolderTest, HalfAndBfloat16AreConverted) {
  std::vector<TestTensor> tensors = TinyTensors();
  auto u16 = [](std::vector<uint16_t> v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
  };
  for (TestTensor& t : tensors) {
    // 1, -2, 0.5, smallest subnormal (2^-24), 65504, -0, 3, 0.25
    if (t.name == "model.norm.weight") {
      t = {t.name,
           "F16",
           {8},
           u16({0x3c00, 0xc000, 0x3800, 0x0001, 0x7bff, 0x8000, 0x4200, 0x3400})};
    }
    // bf16 is the top half of a float32: 1, -2, 0.5, 1e-38ish, 3, ...
    if (t.name == "model.layers.1.input_layernorm.weight") {
      t = {t.name,
           "BF16",
           {8},
           u16({0x3f80, 0xc000, 0x3f00, 0x0080, 0x4040, 0x8000, 0x4040, 0x3e80})};
    }
  }
  Write(TinyConfig(), tensors);
  auto model = LoadHfModel(dir_.string());
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<float> f16(model->weights.final_norm.begin(), model->weights.final_norm.end());
  EXPECT_EQ(f16, (std::vector<float>{1.0f, -2.0f, 0.5f, 0x1p-24f, 65504.0f, -0.0f, 3.0f, 0.25f}));
  const std::span<const float> bf = model->weights.layers[1].attn_norm;
  EXPECT_EQ(std::vector<float>(bf.begin(), bf.end()),
            (std::vector<float>{1.0f, -2.0f, 0.5f, 0x1p-126f, 3.0f, -0.0f, 3.0f, 0.25f}));
}

TEST_F(HfFolderTest, MistralSlidingWindowClampsTheContext) {
  Json config = TinyConfig();
  config["architectures"] = {"MistralForCausalLM"};
  config["sliding_window"] = 32;
  Write(config, TinyTensors());
  auto model = LoadHfModel(dir_.string());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->config.architecture, "mistral");
  EXPECT_EQ(model->config.max_seq_len, 32);
}

TEST_F(HfFolderTest, ShardedCheckpointUsesTheIndex) {
  const std::vector<TestTensor> all = TinyTensors();
  const std::vector<TestTensor> a(all.begin(), all.begin() + 10), b(all.begin() + 10, all.end());
  WriteFile(dir_ / "config.json", TinyConfig().dump());
  WriteFile(dir_ / "model-00001-of-00002.safetensors", Safetensors(a));
  WriteFile(dir_ / "model-00002-of-00002.safetensors", Safetensors(b));
  Json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", Json::object()}};
  for (const TestTensor& t : a) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const TestTensor& t : b) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  WriteFile(dir_ / "model.safetensors.index.json", index.dump());
  auto model = LoadHfModel(dir_.string());
  ASSERT_TRUE(model.ok()) << model.status();

  // A shard that holds a tensor the index assigns elsewhere.
  index["weight_map"][a[0].name] = "model-00002-of-00002.safetensors";
  WriteFile(dir_ / "model.safetensors.index.json", index.dump());
  ExpectError("model-00001-of-00002.safetensors", {a[0].name, "not assigned to this shard"});

  // A shard the index names that is not there.
  index["weight_map"][a[0].name] = "model-00001-of-00002.safetensors";
  WriteFile(dir_ / "model.safetensors.index.json", index.dump());
  fs::remove(dir_ / "model-00002-of-00002.safetensors");
  ExpectError("model-00002-of-00002.safetensors", {"cannot open", "a shard listed in"});
}

// ---------------------------------------------------------------------------
// Corrupt folders
// ---------------------------------------------------------------------------

TEST_F(HfFolderTest, TruncatedSafetensors) {
  Write(TinyConfig(), TinyTensors());
  const std::string full = Safetensors(TinyTensors());
  WriteFile(dir_ / "model.safetensors", full.substr(0, full.size() - 10));
  // The last tensor in the data section ends past the file.
  ExpectError("model.safetensors", {"model.layers.1.mlp.down_proj.weight", "truncated"});
  WriteFile(dir_ / "model.safetensors", full.substr(0, 5));
  ExpectError("model.safetensors", {"too short"});
  WriteFile(dir_ / "model.safetensors", full.substr(0, 100));  // inside the header
  ExpectError("model.safetensors", {"header length"});
}

TEST_F(HfFolderTest, HeaderOffsetsBeyondTheFile) {
  Write(TinyConfig(), TinyTensors(), [](Json& h) {
    h["model.norm.weight"]["data_offsets"] = {1000000, 1000032};
  });
  ExpectError("model.safetensors", {"model.norm.weight", "beyond the data section"});
}

TEST_F(HfFolderTest, OverlappingOffsets) {
  Write(TinyConfig(), TinyTensors(), [](Json& h) {
    // Point the final norm at the first 32 bytes, which the embedding holds.
    h["model.norm.weight"]["data_offsets"] = {0, 32};
  });
  ExpectError("model.safetensors", {"model.norm.weight", "overlap"});
}

TEST_F(HfFolderTest, ShapeDisagreesWithOffsets) {
  Write(TinyConfig(), TinyTensors(), [](Json& h) { h["model.norm.weight"]["shape"] = {9}; });
  ExpectError("model.safetensors", {"model.norm.weight", "needs 36 bytes"});
}

TEST_F(HfFolderTest, ShapeDisagreesWithConfig) {
  std::vector<TestTensor> tensors = TinyTensors();
  for (TestTensor& t : tensors) {
    if (t.name == "model.layers.1.mlp.up_proj.weight") t = F32(t.name, {8, 12}, 0.0f);
  }
  Write(TinyConfig(), tensors);
  ExpectError("model.safetensors",
              {"model.layers.1.mlp.up_proj.weight", "shape [8, 12]", "implies [12, 8]"});
}

TEST_F(HfFolderTest, MissingTensor) {
  std::vector<TestTensor> tensors = TinyTensors();
  std::erase_if(tensors, [](const TestTensor& t) { return t.name == "model.norm.weight"; });
  Write(TinyConfig(), tensors);
  ExpectError("model.safetensors", {"missing tensor model.norm.weight"});
}

TEST_F(HfFolderTest, UnexpectedTensor) {
  std::vector<TestTensor> tensors = TinyTensors();
  tensors.push_back(F32("model.layers.2.input_layernorm.weight", {8}, 1.0f));
  Write(TinyConfig(), tensors);
  ExpectError("model.safetensors", {"unexpected tensor model.layers.2.input_layernorm.weight"});
}

TEST_F(HfFolderTest, UnsupportedDtype) {
  std::vector<TestTensor> tensors = TinyTensors();
  tensors.push_back({"model.extra_ids", "I32", {4}, std::string(16, '\0')});
  Write(TinyConfig(), tensors);
  ExpectError("model.safetensors", {"model.extra_ids", "unsupported dtype I32"});
}

TEST_F(HfFolderTest, MalformedSafetensorsHeader) {
  Write(TinyConfig(), TinyTensors());
  std::string bytes = Safetensors(TinyTensors());
  bytes[8] = '[';  // the header's opening brace
  WriteFile(dir_ / "model.safetensors", bytes);
  ExpectError("model.safetensors", {"not a JSON object"});
}

TEST_F(HfFolderTest, UnsupportedArchitecture) {
  Json config = TinyConfig();
  config["architectures"] = {"GPT2LMHeadModel"};
  Write(config, TinyTensors());
  ExpectError("config.json", {"architecture GPT2LMHeadModel is not supported"});
}

TEST_F(HfFolderTest, MalformedConfig) {
  Write(TinyConfig(), TinyTensors());
  WriteFile(dir_ / "config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": )");
  ExpectError("config.json", {"malformed JSON"});
}

TEST_F(HfFolderTest, MissingConfig) {
  Write(TinyConfig(), TinyTensors());
  fs::remove(dir_ / "config.json");
  ExpectError("config.json", {"cannot open"});
  EXPECT_EQ(LoadHfModel(dir_.string()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(HfFolderTest, MissingWeights) {
  Write(TinyConfig(), TinyTensors());
  fs::remove(dir_ / "model.safetensors");
  auto model = LoadHfModel(dir_.string());
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(std::string(model.status().message()), "no model.safetensors"))
      << model.status();
}

TEST_F(HfFolderTest, UnsupportedSettings) {
  struct Case {
    const char* key;
    Json value;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"head_dim", 8, "head_dim is 8 but hidden_size / num_attention_heads is 4"},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}, "type \"yarn\" is not supported"},
      {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}, "type \"linear\" is not supported"},
      {"mlp_bias", true, "mlp_bias is true"},
      {"hidden_act", "gelu", "hidden_act \"gelu\" is not silu"},
      {"num_key_value_heads", 3, "num_key_value_heads (3)"},
      {"hidden_size", "eight", "hidden_size is \"eight\""},
      {"vocab_size", nullptr, "vocab_size is missing"},
  };
  for (const Case& c : cases) {
    Json config = TinyConfig();
    config[c.key] = c.value;
    Write(config, TinyTensors());
    auto model = LoadHfModel(dir_.string());
    ASSERT_FALSE(model.ok()) << c.key << " " << c.value.dump();
    const std::string message(model.status().message());
    EXPECT_TRUE(Contains(message, Path("config.json")) && Contains(message, c.expected)) << message;
  }
}

TEST_F(HfFolderTest, AttentionBiasNeedsBiasTensors) {
  Json config = TinyConfig();
  config["attention_bias"] = true;
  Write(config, TinyTensors());
  ExpectError("model.safetensors", {"missing tensor model.layers.0.self_attn.q_proj.bias"});
  // And bias tensors without attention_bias are unexpected.
  std::vector<TestTensor> tensors = TinyTensors();
  tensors.push_back(F32("model.layers.0.self_attn.q_proj.bias", {8}, 0.0f));
  Write(TinyConfig(), tensors);
  ExpectError("model.safetensors", {"unexpected tensor model.layers.0.self_attn.q_proj.bias"});
}

// Found through tests/fuzz/hf_model_fuzz: the layers were allocated for
// num_hidden_layers before any layer tensor was looked up, so a config.json
// claiming two billion layers asked for ~400 GB (std::bad_alloc) instead of
// reporting the missing layer 2.
TEST_F(HfFolderTest, ClaimedLayersBeyondTheCheckpoint) {
  Json config = TinyConfig();
  config["num_hidden_layers"] = 2000000000;
  Write(config, TinyTensors());
  ExpectError("model.safetensors", {"missing tensor model.layers.2.input_layernorm.weight"});
  EXPECT_EQ(LoadHfModel(dir_.string()).status().code(), absl::StatusCode::kInvalidArgument);
}

// Found through tests/fuzz/hf_model_fuzz: copying or printing a JSON value
// recurses once per level, so an eos_token_id of 30000 nested lists
// overflowed the stack. Files nested more than 64 levels are refused.
TEST_F(HfFolderTest, DeeplyNestedJson) {
  const std::string deep = std::string(30000, '[') + std::string(30000, ']');
  Write(TinyConfig(), TinyTensors());
  std::string config = TinyConfig().dump();
  config.insert(config.rfind('}'), ", \"eos_token_id\": " + deep);
  WriteFile(dir_ / "config.json", config);
  ExpectError("config.json", {"nested more than 64 levels"});
  // The same in the safetensors header, where 64 levels (the header, its
  // __metadata__ and 62 lists) are fine.
  for (const int lists : {62, 63, 1000}) {
    const std::string nested = std::string(lists, '[') + std::string(lists, ']');
    Write(TinyConfig(), TinyTensors(),
          [&](Json& header) { header["__metadata__"]["x"] = Json::parse(nested); });
    if (lists == 62) {
      EXPECT_TRUE(LoadHfModel(dir_.string()).ok());
    } else {
      ExpectError("model.safetensors", {"nests more than 64 levels"});
    }
  }
}

}  // namespace
}  // namespace coalesce::engine
