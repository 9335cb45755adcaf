// LoadModel(spec): every format through the one entry, with the tokenizer
// that goes with it, and errors that name the file.
#include "engine/model/load.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace coalesce::engine {
namespace {

const std::string kModels = COALESCE_MODELS_DIR;

TEST(LoadModelTest, SyntheticComesWithItsVocabulary) {
  absl::StatusOr<LoadedModel> loaded = LoadModel({.model = "synthetic:tiny"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->model->config.synthetic);
  EXPECT_EQ(loaded->tokenizer->vocab_size(), loaded->model->config.vocab_size);
}

TEST(LoadModelTest, UnknownSyntheticNameIsAnError) {
  EXPECT_FALSE(LoadModel({.model = "synthetic:nope"}).ok());
}

TEST(LoadModelTest, Llama2cCheckpointWithItsTokenizer) {
  const std::string dir = kModels + "/stories260K";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " not found (COALESCE_MODELS_DIR)";
  absl::StatusOr<LoadedModel> loaded =
      LoadModel({.model = dir + "/stories260K.bin", .tokenizer = dir + "/tok512.bin"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_FALSE(loaded->model->config.synthetic);
  EXPECT_EQ(loaded->model->config.vocab_size, 512);
  EXPECT_EQ(loaded->tokenizer->vocab_size(), 512);
  const Tokenizer& tokenizer = *loaded->tokenizer;
  EXPECT_EQ(Decode(tokenizer, tokenizer.Encode("Once upon a time", true)), "Once upon a time");
}

TEST(LoadModelTest, Llama2cLooksForTokenizerBinBesideTheCheckpoint) {
  const std::string dir = kModels + "/stories260K";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " not found (COALESCE_MODELS_DIR)";
  absl::StatusOr<LoadedModel> loaded = LoadModel({.model = dir + "/stories260K.bin"});
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find(dir + "/tokenizer.bin"), std::string::npos)
      << loaded.status();
}

TEST(LoadModelTest, MissingCheckpointNamesTheFile) {
  absl::StatusOr<LoadedModel> loaded = LoadModel({.model = "/nonexistent/model.bin"});
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("/nonexistent/model.bin"), std::string::npos)
      << loaded.status();
}

TEST(LoadModelTest, HuggingFaceFolder) {
  const std::string dir = kModels + "/stories260K-hf";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " not found (COALESCE_MODELS_DIR)";
  absl::StatusOr<LoadedModel> loaded = LoadModel({.model = dir});
#if COALESCE_HF_FORMATS
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model->config.vocab_size, 512);
  EXPECT_FALSE(loaded->tokenizer->eos_ids().empty());
#else
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kUnimplemented) << loaded.status();
  EXPECT_NE(loaded.status().message().find("COALESCE_HF_FORMATS"), std::string::npos);
#endif
}

#if COALESCE_HF_FORMATS
// A copy of stories260K-hf whose tokenizer_config.json is `config`.
std::string FolderWithTokenizerConfig(const std::string& name, const std::string& config) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("coalesce-load-test-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::copy(kModels + "/stories260K-hf", dir);
  std::ofstream(dir / "tokenizer_config.json", std::ios::trunc) << config;
  return dir.string();
}

// The chat template and its bos_token/eos_token come from tokenizer_config.json
// (a string, or the list entry named "default"; tokens as strings or as added
// token objects), and --chat_template's file overrides it.
TEST(LoadModelTest, ChatTemplateSources) {
  if (!std::filesystem::exists(kModels + "/stories260K-hf")) GTEST_SKIP() << "no stories260K-hf";
  std::string dir = FolderWithTokenizerConfig(
      "string",
      R"({"chat_template": "A{{ bos_token }}", "bos_token": "<s>", "eos_token": "</s>"})");
  absl::StatusOr<LoadedModel> loaded = LoadModel({.model = dir});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->chat_template, "A{{ bos_token }}");
  EXPECT_EQ(loaded->bos_token, "<s>");
  EXPECT_EQ(loaded->eos_token, "</s>");

  const std::string override_path = dir + "/override.jinja";
  std::ofstream(override_path) << "B";
  loaded = LoadModel({.model = dir, .chat_template = override_path});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->chat_template, "B");
  loaded = LoadModel({.model = dir, .chat_template = dir + "/missing.jinja"});
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("missing.jinja"), std::string::npos);
  std::filesystem::remove_all(dir);

  dir =
      FolderWithTokenizerConfig("list", R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                    {"name": "default", "template": "D"}],
                  "eos_token": {"content": "</s>", "special": true}})");
  loaded = LoadModel({.model = dir});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->chat_template, "D");
  EXPECT_EQ(loaded->eos_token, "</s>");
  EXPECT_EQ(loaded->bos_token, "");
  std::filesystem::remove_all(dir);

  dir = FolderWithTokenizerConfig("nodefault",
                                  R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  loaded = LoadModel({.model = dir});
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("none named \"default\""), std::string::npos)
      << loaded.status();
  std::filesystem::remove_all(dir);

  // Without tokenizer_config.json's chat_template: none.
  loaded = LoadModel({.model = kModels + "/stories260K-hf"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->chat_template, "");
  EXPECT_EQ(loaded->bos_token, "<s>");
}
#endif

}  // namespace
}  // namespace coalesce::engine
