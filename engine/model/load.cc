#include "engine/model/load.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/model/gguf_model.h"
#include "engine/model/llama2c.h"
#include "engine/model/quantize.h"
#include "engine/model/synthetic.h"
#include "engine/tokenizer/llama2c_tokenizer.h"
#if COALESCE_HF_FORMATS
#include "engine/model/gguf_vocab.h"
#include "engine/model/hf_model.h"
#include "engine/model/hf_tokenizer_config.h"
#include "engine/tokenizer/hf_tokenizer.h"
#endif

namespace coalesce::engine {
namespace {

absl::StatusOr<LoadedModel> LoadSynthetic(const std::string& name) {
  LoadedModel out;
  ASSIGN_OR_RETURN(Model model, BuildSyntheticModel(name));
  out.tokenizer = BuildSyntheticTokenizer(model.config.vocab_size);
  out.model = std::make_shared<const Model>(std::move(model));
  return out;
}

#if COALESCE_HF_FORMATS
// Weights and config, then tokenizer.json with the end-of-sequence ids the
// model's config names.
absl::StatusOr<LoadedModel> LoadHfFolder(const std::string& dir,
                                         const std::string& tokenizer_path) {
  HfLoadOptions load;
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
  ASSIGN_OR_RETURN(Model model, LoadHfModel(dir, load));
  HfTokenizerOptions tokenizer_options;
  if (!model.config.eos_token_ids.empty()) tokenizer_options.eos_ids = model.config.eos_token_ids;
  const std::string path = tokenizer_path.empty() ? dir + "/tokenizer.json" : tokenizer_path;
  ASSIGN_OR_RETURN(out.tokenizer, LoadHfTokenizer(path, tokenizer_options));
  if (out.tokenizer->vocab_size() > model.config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, " has ", out.tokenizer->vocab_size(),
                                                   " tokens but the model's vocab_size is ",
                                                   model.config.vocab_size));
  }
  ASSIGN_OR_RETURN(HfChatTemplate chat, ReadHfChatTemplate(dir));
  out.chat_template = std::move(chat.text);
  out.bos_token = std::move(chat.bos_token);
  out.eos_token = std::move(chat.eos_token);
  out.model = std::make_shared<const Model>(std::move(model));
  return out;
}
#else
absl::StatusOr<LoadedModel> LoadHfFolder(const std::string& dir, const std::string&) {
  return absl::UnimplementedError(absl::StrCat(
      dir,
      " is a folder (a Hugging Face model?), but this build has no Hugging Face formats "
      "(-DCOALESCE_HF_FORMATS=OFF)"));
}
#endif

// "210 Q4_1, 61 F32, 1 Q8_0": the tensor types, most common first.
std::string DescribeTensorTypes(const std::map<std::string, int>& counts) {
  std::vector<std::pair<int, std::string>> sorted;
  for (const auto& [type, n] : counts) sorted.emplace_back(-n, type);
  std::sort(sorted.begin(), sorted.end());
  std::string out;
  for (const auto& [n, type] : sorted)
    absl::StrAppend(&out, out.empty() ? "" : ", ", -n, " ", type);
  return out;
}

// The weights, dequantized (or, with keep_quantized, the matrices a backend
// can compute with kept in their blocks), and the tokenizer the metadata
// describes (or the tokenizer.json / tokenizer.bin given instead).
absl::StatusOr<LoadedModel> LoadGguf(const std::string& path, const std::string& tokenizer_path,
                                     bool keep_quantized) {
  LoadedModel out;
  GgufLoadReport report;
  ASSIGN_OR_RETURN(Model model, LoadGgufModel(path, &report, {.keep_quantized = keep_quantized}));
  if (report.quantized_bytes > 0) {
    LogF(LogLevel::kInfo,
         "%s: GGUF, %.1f MB (%s tensors): %.1f MB of weights, of which %.1f MB of matrices kept "
         "in their block types, the rest float32",
         path.c_str(), report.file_bytes / 1e6, DescribeTensorTypes(report.tensors_by_type).c_str(),
         report.weight_bytes / 1e6, report.quantized_bytes / 1e6);
  } else {
    LogF(LogLevel::kInfo,
         "%s: GGUF, %.1f MB (%s tensors), dequantized to float32 at load: %.1f MB of weights",
         path.c_str(), report.file_bytes / 1e6, DescribeTensorTypes(report.tensors_by_type).c_str(),
         report.weight_bytes / 1e6);
  }
  out.chat_template = std::move(report.chat_template);
  if (!tokenizer_path.empty() && absl::EndsWith(tokenizer_path, ".bin")) {
    ASSIGN_OR_RETURN(out.tokenizer, LoadLlama2cTokenizer(tokenizer_path, model.config.vocab_size));
  } else {
#if COALESCE_HF_FORMATS
    if (tokenizer_path.empty()) {
      ASSIGN_OR_RETURN(std::unique_ptr<HfTokenizer> tokenizer, LoadGgufTokenizer(path));
      if (model.config.bos_token_id >= 0) {
        out.bos_token = std::string(tokenizer->token_text(model.config.bos_token_id));
      }
      if (!model.config.eos_token_ids.empty()) {
        out.eos_token = std::string(tokenizer->token_text(model.config.eos_token_ids[0]));
      }
      out.tokenizer = std::move(tokenizer);
    } else {
      HfTokenizerOptions options;
      if (!model.config.eos_token_ids.empty()) options.eos_ids = model.config.eos_token_ids;
      ASSIGN_OR_RETURN(out.tokenizer, LoadHfTokenizer(tokenizer_path, options));
    }
#else
    return absl::UnimplementedError(absl::StrCat(
        path,
        ": the tokenizers of GGUF files and tokenizer.json need the Hugging Face formats, which "
        "this build does not have (-DCOALESCE_HF_FORMATS=OFF); give a llama2.c tokenizer.bin "
        "with --tokenizer"));
#endif
  }
  if (out.tokenizer->vocab_size() > model.config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        tokenizer_path.empty() ? path : tokenizer_path, " has ", out.tokenizer->vocab_size(),
        " tokens but the model's vocab_size is ", model.config.vocab_size));
  }
  out.model = std::make_shared<const Model>(std::move(model));
  return out;
}

absl::StatusOr<LoadedModel> LoadLlama2c(const std::string& checkpoint,
                                        const std::string& tokenizer_path) {
  LoadedModel out;
  ASSIGN_OR_RETURN(Model model, LoadLlama2cModel(checkpoint));
  std::string path = tokenizer_path;
  if (path.empty()) {
    path = (std::filesystem::path(checkpoint).parent_path() / "tokenizer.bin").string();
  }
  ASSIGN_OR_RETURN(out.tokenizer, LoadLlama2cTokenizer(path, model.config.vocab_size));
  out.model = std::make_shared<const Model>(std::move(model));
  return out;
}

absl::StatusOr<LoadedModel> LoadFormat(const ModelSpec& spec) {
  if (absl::StartsWith(spec.model, "synthetic:")) return LoadSynthetic(spec.model);
  if (std::filesystem::is_directory(spec.model)) return LoadHfFolder(spec.model, spec.tokenizer);
  if (IsGgufFile(spec.model)) return LoadGguf(spec.model, spec.tokenizer, spec.keep_quantized);
  return LoadLlama2c(spec.model, spec.tokenizer);
}

// Chat templates are a few kilobytes; this bounds what a wrong path reads.
constexpr int64_t kMaxChatTemplateBytes = 1 << 20;

absl::StatusOr<std::string> ReadChatTemplateFile(const std::string& path) {
  std::error_code error;
  const auto size = std::filesystem::file_size(path, error);
  if (error) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot read the chat template: ", error.message()));
  }
  if (size > static_cast<uintmax_t>(kMaxChatTemplateBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": a chat template of ", size,
                                                   " bytes; at most ", kMaxChatTemplateBytes));
  }
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot read the chat template"));
  }
  return text;
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const ModelSpec& spec) {
  ASSIGN_OR_RETURN(LoadedModel out, LoadFormat(spec));
  if (spec.quantize.has_value()) {
    QuantizeReport report;
    ASSIGN_OR_RETURN(out.model, QuantizeModel(out.model, *spec.quantize, &report));
    LogF(LogLevel::kInfo,
         "--quantize=%s: %d matrices, %.1f MB of float32 weights quantized to %.1f MB%s",
         QuantTypeName(*spec.quantize), report.matrices, report.float_bytes / 1e6,
         report.quantized_bytes / 1e6,
         report.kept_float > 0
             ? absl::StrCat(" (", report.kept_float,
                            " left float32: their rows are not whole blocks of 32)")
                   .c_str()
             : "");
  }
  if (!spec.chat_template.empty()) {
    ASSIGN_OR_RETURN(out.chat_template, ReadChatTemplateFile(spec.chat_template));
  }
  return out;
}

}  // namespace coalesce::engine
