// The chat template of a Hugging Face model folder and the strings its
// template calls bos_token and eos_token, from tokenizer_config.json as
// transformers reads them.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace coalesce::engine {

struct HfChatTemplate {
  // "" when the folder has none (no tokenizer_config.json, or no
  // chat_template in it).
  std::string text;
  // tokenizer_config.json's bos_token / eos_token: a string, or an added
  // token's {"content": ...}; "" when absent or null.
  std::string bos_token, eos_token;
};

// Reads `dir`/tokenizer_config.json. chat_template is a string, or a list of
// {"name", "template"} of which the one named "default" is used (as
// transformers does when no name is asked for; a list without one is an
// error). A malformed file is an error naming it and the field; a missing one
// gives an empty HfChatTemplate.
absl::StatusOr<HfChatTemplate> ReadHfChatTemplate(const std::string& dir);

}  // namespace coalesce::engine
