#include "chat/chat_template.h"

#include <utility>
#include <vector>

#include "chat/jinja.h"

namespace coalesce::chat {

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  auto tmpl = jinja::ParseTemplate(source);
  if (!tmpl.ok()) return tmpl.status();
  return ChatTemplate(*std::move(tmpl));
}

absl::StatusOr<std::string> ChatTemplate::Render(std::span<const ChatMessage> messages,
                                                 const ChatRenderOptions& options) const {
  absl::StatusOr<RenderedChat> out = RenderTracked(messages, options);
  if (!out.ok()) return out.status();
  return std::move(out->text);
}

absl::StatusOr<RenderedChat> ChatTemplate::RenderTracked(std::span<const ChatMessage> messages,
                                                         const ChatRenderOptions& options) const {
  using jinja::Value;
  std::vector<Value> list;
  list.reserve(messages.size());
  // A role is the conversation's structure, which the service sets (and in
  // which the service refuses special tokens): templates make their turns'
  // tokens from it ('<|' + role + '|>'), so it counts as the template's own
  // text. The contents are what the users wrote.
  for (const ChatMessage& m : messages) {
    auto dict = std::make_shared<jinja::DictObj>();
    dict->Set(Value::Str("role"), Value::TemplateStr(m.role));
    dict->Set(Value::Str("content"), Value::Str(m.content));
    list.push_back(Value::Dict(std::move(dict)));
  }
  jinja::RenderEnv env;
  // The tokenizer's strings are the template's own text: a template writes
  // its special tokens through them.
  env.variables = {
      {"messages", Value::List(std::move(list))},
      {"tools", Value::None()},
      {"documents", Value::None()},
      {"add_generation_prompt", Value::Bool(options.add_generation_prompt)},
      {"bos_token", Value::TemplateStr(options.bos_token)},
      {"eos_token", Value::TemplateStr(options.eos_token)},
  };
  env.now_unix_seconds = options.now_unix_seconds;
  env.limits.max_depth = options.limits.max_depth;
  env.limits.max_steps = options.limits.max_steps;
  env.limits.max_output_bytes = options.limits.max_output_bytes;
  absl::StatusOr<jinja::TrackedText> out = jinja::RenderTemplateTracked(*tmpl_, env);
  if (!out.ok()) return out.status();
  return RenderedChat{std::move(out->text), std::move(out->own)};
}

}  // namespace coalesce::chat
