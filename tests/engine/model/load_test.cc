// LoadModel(spec): every format through the one entry, with the tokenizer
// that goes with it, and errors that name the file.
#include "engine/model/load.h"

#include <gtest/gtest.h>

#include <filesystem>
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

}  // namespace
}  // namespace coalesce::engine
