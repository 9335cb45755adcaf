#include "engine/model/gguf_vocab.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace coalesce::engine {
namespace {

constexpr std::string_view kModel = "tokenizer.ggml.model";

std::string Key(std::string_view name) { return "tokenizer.ggml." + std::string(name); }

absl::StatusOr<std::optional<std::string>> OptString(const GgufFile& file, std::string_view key) {
  if (file.Find(key) == nullptr) return std::optional<std::string>();
  ASSIGN_OR_RETURN(std::string_view value, file.GetString(key));
  return std::optional<std::string>(std::string(value));
}

absl::StatusOr<std::optional<bool>> OptBool(const GgufFile& file, std::string_view key) {
  if (file.Find(key) == nullptr) return std::optional<bool>();
  ASSIGN_OR_RETURN(bool value, file.GetBool(key));
  return std::optional<bool>(value);
}

// A token id: an integer >= 0 that fits in int32 (BuildGgufTokenizer checks
// it against the vocabulary); absent, or llama.cpp's "none"
// (kGgufNoTokenId), is nullopt.
absl::StatusOr<std::optional<int32_t>> OptId(const GgufFile& file, std::string_view key) {
  if (file.Find(key) == nullptr) return std::optional<int32_t>();
  ASSIGN_OR_RETURN(uint64_t value, file.GetUint(key));
  if (value == kGgufNoTokenId) return std::optional<int32_t>();
  if (value > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": ", std::string(key), " = ",
                                                   value, " is outside the vocabulary"));
  }
  return std::optional<int32_t>(static_cast<int32_t>(value));
}

absl::StatusOr<std::vector<std::string>> OptStrings(const GgufFile& file, std::string_view key) {
  std::vector<std::string> out;
  if (file.Find(key) == nullptr) return out;
  ASSIGN_OR_RETURN(absl::Span<const std::string_view> values, file.GetStringArray(key));
  out.reserve(values.size());
  for (const std::string_view v : values) out.emplace_back(v);
  return out;
}

}  // namespace

absl::StatusOr<GgufVocab> ReadGgufVocab(const GgufFile& file) {
  GgufVocab v;
  v.source = file.path();
  if (file.Find(kModel) == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        file.path(), ": the file has no tokenizer (its metadata has no ", std::string(kModel),
        "); give one with --tokenizer (a tokenizer.json or a llama2.c tokenizer.bin)"));
  }
  ASSIGN_OR_RETURN(std::string_view model, file.GetString(kModel));
  v.model = std::string(model);
  ASSIGN_OR_RETURN(std::optional<std::string> pre, OptString(file, Key("pre")));
  v.pre = pre.value_or("");
  ASSIGN_OR_RETURN(v.tokens, OptStrings(file, Key("tokens")));
  ASSIGN_OR_RETURN(v.merges, OptStrings(file, Key("merges")));

  if (const std::string key = Key("scores"); file.Find(key) != nullptr) {
    ASSIGN_OR_RETURN(std::vector<double> scores, file.GetFloatArray(key));
    v.scores.assign(scores.begin(), scores.end());
  }
  if (const std::string key = Key("token_type"); file.Find(key) != nullptr) {
    ASSIGN_OR_RETURN(std::vector<int64_t> types, file.GetIntArray(key));
    v.token_types.reserve(types.size());
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] < std::numeric_limits<int32_t>::min() ||
          types[i] > std::numeric_limits<int32_t>::max()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file.path(), ": ", key, "[", i, "] = ", types[i], " is not a token type"));
      }
      v.token_types.push_back(static_cast<int32_t>(types[i]));
    }
  }

  ASSIGN_OR_RETURN(v.bos_id, OptId(file, Key("bos_token_id")));
  ASSIGN_OR_RETURN(v.eos_id, OptId(file, Key("eos_token_id")));
  ASSIGN_OR_RETURN(v.eot_id, OptId(file, Key("eot_token_id")));
  ASSIGN_OR_RETURN(v.eom_id, OptId(file, Key("eom_token_id")));
  ASSIGN_OR_RETURN(v.unk_id, OptId(file, Key("unknown_token_id")));
  ASSIGN_OR_RETURN(v.pad_id, OptId(file, Key("padding_token_id")));
  ASSIGN_OR_RETURN(v.add_bos, OptBool(file, Key("add_bos_token")));
  ASSIGN_OR_RETURN(v.add_eos, OptBool(file, Key("add_eos_token")));
  ASSIGN_OR_RETURN(v.add_space_prefix, OptBool(file, Key("add_space_prefix")));
  return v;
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadGgufTokenizer(const std::string& path) {
  ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(path));
  ASSIGN_OR_RETURN(GgufVocab vocab, ReadGgufVocab(file));
  return BuildGgufTokenizer(vocab);
}

}  // namespace coalesce::engine
