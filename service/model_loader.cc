#include "service/model_loader.h"

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/hf_model.h"
#include "engine/hf_tokenizer.h"
#include "engine/llama2c.h"
#include "engine/synthetic.h"

namespace coalesce::service {
namespace {

absl::StatusOr<LoadedModel> LoadSynthetic(const std::string& name) {
  LoadedModel out;
  ASSIGN_OR_RETURN(engine::Model model, engine::BuildSyntheticModel(name));
  out.tokenizer = engine::BuildSyntheticTokenizer(model.config.vocab_size);
  out.model = std::make_shared<const engine::Model>(std::move(model));
  return out;
}

// Weights and config, then tokenizer.json with the end-of-sequence ids the
// model's config names.
absl::StatusOr<LoadedModel> LoadHfFolder(const std::string& dir,
                                         const std::string& tokenizer_path) {
  engine::HfLoadOptions load;
  int last_decile = 0;
  load.progress = [&last_decile](int64_t done, int64_t total) {
    if (total < (int64_t{256} << 20)) return;  // small models load at once
    const int decile = static_cast<int>(done * 10 / total);
    if (decile > last_decile) {
      last_decile = decile;
      LogF(LogLevel::kInfo, "loading weights: %d%% of %.1f MB", decile * 10, total / 1e6);
    }
  };
  LoadedModel out;
  ASSIGN_OR_RETURN(engine::Model model, engine::LoadHfModel(dir, load));
  engine::HfTokenizerOptions tokenizer_options;
  if (!model.config.eos_token_ids.empty()) tokenizer_options.eos_ids = model.config.eos_token_ids;
  const std::string path = tokenizer_path.empty() ? dir + "/tokenizer.json" : tokenizer_path;
  ASSIGN_OR_RETURN(out.tokenizer, engine::LoadHfTokenizer(path, tokenizer_options));
  if (out.tokenizer->vocab_size() > model.config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, " has ", out.tokenizer->vocab_size(),
                                                   " tokens but the model's vocab_size is ",
                                                   model.config.vocab_size));
  }
  out.model = std::make_shared<const engine::Model>(std::move(model));
  return out;
}

absl::StatusOr<LoadedModel> LoadLlama2c(const std::string& checkpoint,
                                        const std::string& tokenizer_path) {
  LoadedModel out;
  ASSIGN_OR_RETURN(engine::Model model, engine::LoadLlama2cModel(checkpoint));
  std::string path = tokenizer_path;
  if (path.empty()) {
    path = (std::filesystem::path(checkpoint).parent_path() / "tokenizer.bin").string();
  }
  ASSIGN_OR_RETURN(out.tokenizer, engine::LoadLlama2cTokenizer(path, model.config.vocab_size));
  out.model = std::make_shared<const engine::Model>(std::move(model));
  return out;
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const std::string& model_path,
                                      const std::string& tokenizer_path) {
  if (absl::StartsWith(model_path, "synthetic:")) return LoadSynthetic(model_path);
  if (std::filesystem::is_directory(model_path)) return LoadHfFolder(model_path, tokenizer_path);
  return LoadLlama2c(model_path, tokenizer_path);
}

}  // namespace coalesce::service
