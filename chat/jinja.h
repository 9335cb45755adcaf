// An interpreter of the jinja2 template language as Hugging Face
// transformers runs chat templates: a jinja2 3.1 ImmutableSandboxedEnvironment
// with trim_blocks, lstrip_blocks, the loopcontrols extension, transformers'
// {% generation %} tag, its tojson filter and its raise_exception and
// strftime_now globals. Written from jinja2's documented and observed
// semantics; chat/chat_template.h is the interface the server uses,
// this one also lets tools and tests pass arbitrary variables (tools,
// messages with tool calls).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace coalesce::chat::jinja {

// Parses a template. A syntax error is InvalidArgument naming the line.
absl::StatusOr<std::shared_ptr<const Template>> ParseTemplate(std::string_view source);

struct RenderLimits {
  int max_depth = 64;                 // nested macro calls
  int64_t max_steps = 10'000'000;     // nodes evaluated, loop iterations, work in builtins
  size_t max_output_bytes = 8 << 20;  // the output, and any one string built
};

struct RenderEnv {
  // The template's variables (messages, add_generation_prompt, bos_token, ...),
  // in front of jinja2's globals.
  std::vector<std::pair<std::string, Value>> variables;
  // strftime_now's clock (local time, as Python's datetime.now()); unset =
  // the real time.
  std::optional<int64_t> now_unix_seconds;
  RenderLimits limits;
};

// Renders. raise_exception(msg) is InvalidArgument with exactly msg; any other
// runtime error is InvalidArgument naming the line; exceeding a limit is
// ResourceExhausted naming the limit.
absl::StatusOr<std::string> RenderTemplate(const Template& tmpl, const RenderEnv& env);
// The same, with the bytes of the text that are the template's own
// (TrackedText, jinja_value.h).
absl::StatusOr<TrackedText> RenderTemplateTracked(const Template& tmpl, const RenderEnv& env);

}  // namespace coalesce::chat::jinja
