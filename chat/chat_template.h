// Chat templates: the jinja2 templates models publish (tokenizer_config.json's
// chat_template, GGUF's tokenizer.chat_template) that turn a conversation into
// the prompt text, rendered as Hugging Face transformers 4.47 renders them with
// tokenizer.apply_chat_template(messages, tokenize=False,
// add_generation_prompt=...): jinja2 3.1's ImmutableSandboxedEnvironment with
// trim_blocks, lstrip_blocks and loopcontrols, transformers' tojson filter
// (json.dumps with ensure_ascii=False) and its raise_exception and
// strftime_now globals. Our own interpreter (chat/jinja.h); no file,
// environment or import access; bounded by ChatTemplateLimits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/byte_range.h"

namespace coalesce::chat {

namespace jinja {
struct Template;
}

struct ChatMessage {
  std::string role;
  std::string content;
};

// Bounds that keep a hostile template from hanging or exhausting the server.
struct ChatTemplateLimits {
  // Nesting of macro calls. The evaluator's own recursion (statements and
  // expressions inside one another, across calls) is bounded by 16 x this.
  int max_depth = 64;
  // Loop iterations + evaluated nodes + work inside filters and operators
  // (per element compared, copied or formatted), in all.
  int64_t max_steps = 10'000'000;
  // The output, and any one string the template builds.
  size_t max_output_bytes = 8 << 20;
};

struct ChatRenderOptions {
  bool add_generation_prompt = true;
  // The tokenizer's strings, as the template variables bos_token, eos_token.
  std::string bos_token, eos_token;
  // strftime_now's clock (read as local time, as Python's datetime.now());
  // unset = the real time.
  std::optional<int64_t> now_unix_seconds;
  ChatTemplateLimits limits;
};

// A rendered conversation, and which of its bytes the template wrote itself.
struct RenderedChat {
  std::string text;
  // The template's own text, sorted, disjoint and never adjacent: its data
  // and string literals, constant expressions, bos_token and eos_token and
  // the messages' roles (the conversation's structure: Phi-3's template
  // writes '<|' + role + '|>'), as printed, concatenated, captured (set
  // blocks, macros) and trimmed. The messages' contents never are, nor is
  // anything a filter or method other than trim/strip made (uppercasing,
  // formatting, tojson, ...), whatever it was made from: a byte of a content
  // is never counted as the template's own (chat/jinja_value.h,
  // TrackedText). A tokenizer that splits special tokens keeps the special
  // tokens written in these ranges only (Tokenizer::EncodeSplitAtMost).
  std::vector<ByteRange> template_ranges;
};

class ChatTemplate {
 public:
  // Parses a template. A syntax error is InvalidArgument naming the line and
  // what was expected.
  static absl::StatusOr<ChatTemplate> Parse(std::string_view source);

  // Renders `messages` (available to the template as `messages`, a list of
  // dicts with "role" and "content"), with add_generation_prompt, bos_token
  // and eos_token defined, and tools and documents None (as transformers
  // passes them without tools or documents).
  // raise_exception(msg) -> InvalidArgument whose message is exactly msg;
  // a runtime error (e.g. calling a method on none) -> InvalidArgument naming
  // the line; exceeding a limit -> ResourceExhausted saying which limit.
  // Thread-safe: a ChatTemplate may render for many requests at once.
  absl::StatusOr<std::string> Render(std::span<const ChatMessage> messages,
                                     const ChatRenderOptions& options) const;
  // The same, with the ranges of the text the template wrote itself.
  absl::StatusOr<RenderedChat> RenderTracked(std::span<const ChatMessage> messages,
                                             const ChatRenderOptions& options) const;

 private:
  explicit ChatTemplate(std::shared_ptr<const jinja::Template> tmpl) : tmpl_(std::move(tmpl)) {}
  std::shared_ptr<const jinja::Template> tmpl_;
};

}  // namespace coalesce::chat
