// coalesce-chat-template: renders chat templates with coalesce's interpreter
// (chat/chat_template.h), one JSON line in, one JSON line out, for
// tests/chat/test_chat_template_parity.py to compare with Hugging Face
// transformers' apply_chat_template.
//
//   coalesce-chat-template < requests.jsonl > results.jsonl
//
// Each input line:
//   {"template": "...", "messages": [{"role": ..., "content": ...}, ...],
//    "add_generation_prompt": bool, "bos_token": "...", "eos_token": "...",
//    "now": unix_seconds,
//    "variables": {...},                                   (optional)
//    "limits": {"max_depth": n, "max_steps": n, "max_output_bytes": n}}  (optional)
// gives {"text": "...", "template_ranges": [[begin, end], ...]} (the byte ranges
// of the text the template wrote itself: RenderedChat::template_ranges) or
// {"error": "...", "code": "INVALID_ARGUMENT"}.
// Messages of only string roles and contents, without "variables", go through
// ChatTemplate::Render (what the server calls); messages with more in them
// (tool calls, non-string content) or extra variables (tools, documents, ...)
// go through the interpreter underneath (chat/jinja.h) with the same
// variables ChatTemplate::Render defines, plus those (there only bos_token and
// eos_token are the template's own text among the variables; ChatTemplate's
// roles are too).
#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "chat/chat_template.h"
#include "chat/jinja.h"

namespace coalesce::chat {
namespace {

using Json = nlohmann::ordered_json;
using jinja::Value;

Value ToValue(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return Value::None();
    case Json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case Json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case Json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::Float(static_cast<double>(u));
      return Value::Int(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float:
      return Value::Float(j.get<double>());
    case Json::value_t::string:
      return Value::Str(j.get<std::string>());
    case Json::value_t::array: {
      std::vector<Value> items;
      for (const Json& item : j) items.push_back(ToValue(item));
      return Value::List(std::move(items));
    }
    case Json::value_t::object: {
      auto dict = std::make_shared<jinja::DictObj>();
      for (const auto& [k, v] : j.items()) dict->Set(Value::Str(k), ToValue(v));
      return Value::Dict(std::move(dict));
    }
    default:
      return Value::None();
  }
}

bool PlainMessages(const Json& messages) {
  for (const Json& m : messages) {
    if (!m.is_object() || m.size() != 2 || !m.contains("role") || !m.contains("content") ||
        !m["role"].is_string() || !m["content"].is_string()) {
      return false;
    }
  }
  return true;
}

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case absl::StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    default:
      return "INTERNAL";
  }
}

Json Handle(const Json& request, std::map<std::string, std::shared_ptr<ChatTemplate>>& cache) {
  const std::string source = request.value("template", "");
  const Json messages = request.value("messages", Json::array());
  ChatRenderOptions options;
  options.add_generation_prompt = request.value("add_generation_prompt", false);
  options.bos_token = request.value("bos_token", "");
  options.eos_token = request.value("eos_token", "");
  if (request.contains("now") && request["now"].is_number()) {
    options.now_unix_seconds = request["now"].get<int64_t>();
  }
  if (request.contains("limits")) {
    const Json& l = request["limits"];
    options.limits.max_depth = l.value("max_depth", options.limits.max_depth);
    options.limits.max_steps = l.value("max_steps", options.limits.max_steps);
    options.limits.max_output_bytes = l.value("max_output_bytes", options.limits.max_output_bytes);
  }
  auto error = [](const absl::Status& status) {
    return Json{{"error", std::string(status.message())}, {"code", CodeName(status.code())}};
  };

  absl::StatusOr<RenderedChat> text;
  if (!request.contains("variables") && messages.is_array() && PlainMessages(messages)) {
    auto& tmpl = cache[source];
    if (tmpl == nullptr) {
      auto parsed = ChatTemplate::Parse(source);
      if (!parsed.ok()) return error(parsed.status());
      tmpl = std::make_shared<ChatTemplate>(*std::move(parsed));
    }
    std::vector<ChatMessage> chat;
    for (const Json& m : messages) {
      chat.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    text = tmpl->RenderTracked(chat, options);
  } else {
    auto parsed = jinja::ParseTemplate(source);
    if (!parsed.ok()) return error(parsed.status());
    jinja::RenderEnv env;
    env.variables = {
        {"messages", ToValue(messages)},
        {"tools", Value::None()},
        {"documents", Value::None()},
        {"add_generation_prompt", Value::Bool(options.add_generation_prompt)},
        {"bos_token", Value::TemplateStr(options.bos_token)},
        {"eos_token", Value::TemplateStr(options.eos_token)},
    };
    if (request.contains("variables")) {
      for (const auto& [k, v] : request["variables"].items())
        env.variables.emplace_back(k, ToValue(v));
    }
    env.now_unix_seconds = options.now_unix_seconds;
    env.limits = {options.limits.max_depth, options.limits.max_steps,
                  options.limits.max_output_bytes};
    absl::StatusOr<jinja::TrackedText> tracked = jinja::RenderTemplateTracked(**parsed, env);
    if (!tracked.ok()) return error(tracked.status());
    text = RenderedChat{std::move(tracked->text), std::move(tracked->own)};
  }
  if (!text.ok()) return error(text.status());
  Json ranges = Json::array();
  for (const ByteRange& r : text->template_ranges) ranges.push_back({r.begin, r.end});
  return Json{{"text", text->text}, {"template_ranges", std::move(ranges)}};
}

}  // namespace
}  // namespace coalesce::chat

int main() {
  std::ios::sync_with_stdio(false);
  std::map<std::string, std::shared_ptr<coalesce::chat::ChatTemplate>> cache;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    coalesce::chat::Json out;
    try {
      out = coalesce::chat::Handle(coalesce::chat::Json::parse(line), cache);
    } catch (const std::exception& e) {
      out = {{"error", std::string("bad request: ") + e.what()}, {"code", "INVALID_ARGUMENT"}};
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    std::cout.flush();
  }
  return 0;
}
