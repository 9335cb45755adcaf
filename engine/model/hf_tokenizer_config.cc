#include "engine/model/hf_tokenizer_config.h"

#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/model/json_file.h"

namespace coalesce::engine {
namespace {

using Json = nlohmann::json;

// bos_token / eos_token: a string, {"content": "...", ...} (an AddedToken as
// transformers saves it), or null.
absl::StatusOr<std::string> TokenString(const Json& config, const char* key,
                                        const std::string& path) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": ", key, " must be a string or an object with a string \"content\""));
}

}  // namespace

absl::StatusOr<HfChatTemplate> ReadHfChatTemplate(const std::string& dir) {
  const std::string path = dir + "/tokenizer_config.json";
  HfChatTemplate out;
  if (!std::filesystem::exists(path)) return out;
  ASSIGN_OR_RETURN(Json config, ReadJsonFile(path));
  if (!config.is_object()) return absl::InvalidArgumentError(path + ": not a JSON object");
  ASSIGN_OR_RETURN(out.bos_token, TokenString(config, "bos_token", path));
  ASSIGN_OR_RETURN(out.eos_token, TokenString(config, "eos_token", path));
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return out;
  if (it->is_string()) {
    out.text = it->get<std::string>();
    return out;
  }
  if (it->is_array()) {
    for (const Json& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
          !entry.contains("template") || !entry["template"].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path,
                         ": chat_template: each entry of the list must be {\"name\": ..., "
                         "\"template\": ...}"));
      }
      if (entry["name"] == "default") {
        out.text = entry["template"].get<std::string>();
        return out;
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": chat_template is a list of named templates with none named \"default\"; give "
        "one with --chat_template"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": chat_template must be a string or a list of named templates"));
}

}  // namespace coalesce::engine
