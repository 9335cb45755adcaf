// libFuzzer target for the chat template interpreter (chat/).
// An input is a template (its bytes as they are): parsing must return a
// template or InvalidArgument, and rendering a fixed conversation under small
// limits must return text within max_output_bytes, InvalidArgument or
// ResourceExhausted -- never crash, hang or run past the limits. An input
// whose first byte is 0x01 is instead a conversation (messages separated by
// NUL bytes, roles cycling system/user/assistant/user) rendered through the
// real templates of $COALESCE_CHAT_TEMPLATES_DIR (default: the shared corpus
// next to the repository), read once; that half is skipped where they are
// absent.
#include <dirent.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "chat/chat_template.h"

namespace {

using coalesce::chat::ChatMessage;
using coalesce::chat::ChatRenderOptions;
using coalesce::chat::ChatTemplate;

ChatRenderOptions Options(bool generation_prompt) {
  ChatRenderOptions options;
  options.add_generation_prompt = generation_prompt;
  options.bos_token = "<s>";
  options.eos_token = "</s>";
  options.now_unix_seconds = 1733086801;
  options.limits.max_depth = 12;
  options.limits.max_steps = 200'000;
  options.limits.max_output_bytes = 64 << 10;
  return options;
}

void CheckRender(const ChatTemplate& tmpl, const std::vector<ChatMessage>& messages,
                 bool generation_prompt) {
  const ChatRenderOptions options = Options(generation_prompt);
  auto out = tmpl.RenderTracked(messages, options);
  if (out.ok()) {
    if (out->text.size() > options.limits.max_output_bytes) __builtin_trap();
    // The template's own ranges: inside the text, sorted, disjoint, never
    // empty or adjacent.
    size_t end = 0;
    for (const coalesce::ByteRange& r : out->template_ranges) {
      if (r.begin >= r.end || r.end > out->text.size()) __builtin_trap();
      if (end > 0 && r.begin <= end) __builtin_trap();
      end = r.end;
    }
    return;
  }
  const auto code = out.status().code();
  if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kResourceExhausted) {
    __builtin_trap();
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<ChatTemplate> LoadRealTemplates() {
  const char* env = std::getenv("COALESCE_CHAT_TEMPLATES_DIR");
  const std::string dir = env != nullptr ? env : COALESCE_DEFAULT_CHAT_TEMPLATES_DIR;
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() > 6 && name.substr(name.size() - 6) == ".jinja") names.push_back(name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  std::vector<ChatTemplate> out;
  for (const auto& name : names) {
    auto tmpl = ChatTemplate::Parse(ReadFile(dir + "/" + name));
    if (tmpl.ok()) out.push_back(*std::move(tmpl));
  }
  return out;
}

const std::vector<ChatMessage> kConversation = {{"system", "Be brief."},
                                                {"user", "Hi \"there\" \\ {{ x }}"},
                                                {"assistant", "Hello."},
                                                {"user", " \xE6\x97\xA5\xE6\x9C\xAC "}};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  if (!input.empty() && input[0] == '\x01') {
    static const auto* const real = new std::vector<ChatTemplate>(LoadRealTemplates());
    static const char* const kRoles[] = {"system", "user", "assistant", "user"};
    std::vector<ChatMessage> messages;
    std::string_view rest = input.substr(1);
    for (size_t i = 0;; ++i) {
      const size_t nul = rest.find('\0');
      messages.push_back({kRoles[i % 4], std::string(rest.substr(0, nul))});
      if (nul == std::string_view::npos) break;
      rest = rest.substr(nul + 1);
    }
    for (const ChatTemplate& tmpl : *real) CheckRender(tmpl, messages, true);
    return 0;
  }
  auto tmpl = ChatTemplate::Parse(input);
  if (!tmpl.ok()) {
    const auto code = tmpl.status().code();
    if (code != absl::StatusCode::kInvalidArgument &&
        code != absl::StatusCode::kResourceExhausted) {
      __builtin_trap();
    }
    return 0;
  }
  CheckRender(*tmpl, kConversation, true);
  CheckRender(*tmpl, {}, false);
  return 0;
}
