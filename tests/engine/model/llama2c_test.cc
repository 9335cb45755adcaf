// LoadLlama2cModel on small checkpoints written by the test: where each tensor
// starts (run.c's memory_map_weights order), tied and untied classifiers, and
// the errors for inconsistent or truncated files.
#include "engine/model/llama2c.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace coalesce::engine {
namespace {

struct Header {
  int32_t dim = 8, hidden_dim = 12, n_layers = 2, n_heads = 2, n_kv_heads = 1, vocab_size = 10,
          seq_len = 6;
};

// Floats run.c reads for `h`: weights, the legacy RoPE tables, and an untied
// classifier when vocab_size < 0.
int64_t NumFloats(const Header& h) {
  const int64_t d = h.dim, hd = h.hidden_dim, l = h.n_layers, v = std::abs(h.vocab_size);
  const int64_t kv = d / h.n_heads * h.n_kv_heads, head = d / h.n_heads;
  return v * d + l * (2 * d + 2 * d * d + 2 * kv * d + 3 * hd * d) + d + h.seq_len * head +
         (h.vocab_size < 0 ? v * d : 0);
}

// Writes a checkpoint whose i-th float is i, so a span's first value is its
// offset in the file. `drop` leaves off that many trailing bytes.
std::string WriteCheckpoint(const std::string& name, const Header& h, int64_t floats,
                            int drop = 0) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::string bytes(reinterpret_cast<const char*>(&h), sizeof(h));
  for (int64_t i = 0; i < floats; ++i) {
    const float f = static_cast<float>(i);
    bytes.append(reinterpret_cast<const char*>(&f), sizeof(f));
  }
  bytes.resize(bytes.size() - drop);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

TEST(LoadLlama2cModelTest, MapsTensorsInRunCOrder) {
  const Header h;
  const std::string path = WriteCheckpoint("tied.bin", h, NumFloats(h));
  auto model = LoadLlama2cModel(path);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.name, "tied");
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.max_seq_len, 6);
  EXPECT_EQ(c.kv_dim(), 4);
  EXPECT_TRUE(model->config.tied_classifier);
  const ModelWeights& w = model->weights;
  EXPECT_EQ(w.classifier.data(), w.token_embedding.data());
  // Offsets: embedding 80, rms_att 2x8, wq 2x64, wk 2x32, wv 2x32, wo 2x64,
  // rms_ffn 2x8, w1 2x96, w2 2x96, w3 2x96, rms_final 8.
  EXPECT_EQ(w.token_embedding.front(), 0);
  EXPECT_EQ(w.layers[0].attn_norm.front(), 80);
  EXPECT_EQ(w.layers[1].attn_norm.front(), 88);
  EXPECT_EQ(w.layers[0].wq.front(), 96);
  EXPECT_EQ(w.layers[1].wq.front(), 160);
  EXPECT_EQ(w.layers[1].wk.front(), 224 + 32);
  EXPECT_EQ(w.layers[1].wv.front(), 288 + 32);
  EXPECT_EQ(w.layers[1].wo.front(), 352 + 64);
  EXPECT_EQ(w.layers[1].ffn_norm.front(), 480 + 8);
  EXPECT_EQ(w.layers[1].w1.front(), 496 + 96);
  EXPECT_EQ(w.layers[1].w2.front(), 688 + 96);
  EXPECT_EQ(w.layers[1].w3.front(), 880 + 96);
  EXPECT_EQ(w.final_norm.front(), 1072);
  EXPECT_EQ(w.layers[1].w3.size(), 96u);
}

TEST(LoadLlama2cModelTest, NegativeVocabMeansClassifierAfterRopeTables) {
  Header h;
  h.vocab_size = -10;
  auto model = LoadLlama2cModel(WriteCheckpoint("untied.bin", h, NumFloats(h)));
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_FALSE(model->config.tied_classifier);
  EXPECT_EQ(model->config.vocab_size, 10);
  // After rms_final (1072 + 8) come 6 positions x 4 / 2 x 2 RoPE floats.
  EXPECT_EQ(model->weights.classifier.front(), 1080 + 24);
  EXPECT_EQ(model->weights.classifier.size(), 80u);
}

TEST(LoadLlama2cModelTest, TruncatedFilesAreErrorsNamingTheFile) {
  for (const bool tied : {true, false}) {
    Header h;
    if (!tied) h.vocab_size = -10;
    const std::string path = WriteCheckpoint("short.bin", h, NumFloats(h), /*drop=*/1);
    auto model = LoadLlama2cModel(path);
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(model.status().message().find(path), std::string::npos) << model.status();
  }
  // Shorter than the header itself.
  const std::string tiny = ::testing::TempDir() + "/tiny.bin";
  std::ofstream(tiny, std::ios::binary) << "abc";
  EXPECT_EQ(LoadLlama2cModel(tiny).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LoadLlama2cModelTest, InconsistentHeadersAreErrors) {
  struct Case {
    const char* what;
    Header h;
  };
  std::vector<Case> cases;
  Header h;
  h.dim = 0;
  cases.push_back({"zero dim", h});
  h = {};
  h.n_layers = -1;
  cases.push_back({"negative layers", h});
  h = {};
  h.vocab_size = 0;
  cases.push_back({"zero vocab", h});
  h = {};
  h.n_heads = 3;
  cases.push_back({"dim % n_heads", h});
  h = {};
  h.n_heads = 4;
  h.n_kv_heads = 3;
  cases.push_back({"n_heads % n_kv_heads", h});
  h = {};
  h.dim = 6;
  h.n_heads = 2;
  cases.push_back({"odd head size", h});
  h = {};
  h.dim = 1 << 30;
  h.hidden_dim = 1 << 30;
  cases.push_back({"sizes past 2^63 bytes must not wrap", h});
  for (const Case& c : cases) {
    const std::string path = WriteCheckpoint("bad.bin", c.h, 2000);
    auto model = LoadLlama2cModel(path);
    ASSERT_FALSE(model.ok()) << c.what;
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(model.status().message().find(path), std::string::npos) << model.status();
  }
}

TEST(LoadLlama2cModelTest, MissingFileOrDirectoryIsAnError) {
  auto model = LoadLlama2cModel(::testing::TempDir() + "/does-not-exist.bin");
  EXPECT_EQ(model.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadLlama2cModel(::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace coalesce::engine
