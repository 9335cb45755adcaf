// coalesce-eval's input files, read and checked before any request is sent:
// a text (perplexity), a multiple-choice task file and a prompt file (greedy
// agreement), both JSON lines. Anything malformed is refused with a message
// that names the line and the problem; nothing in a file can crash the tool
// (every JSON value is checked for its type and range before it is used).
//
// Task file, one item a line (blank lines are skipped; other keys ignored):
//   {"context": "Tom was thirsty, so he drank a glass of",
//    "choices": [" water", " sand", " paper"], "answer": 0}
// context a non-empty string; choices 2 to 64 non-empty strings; answer the
// index of the right choice. Prompt file, one a line: {"prompt": "Once upon"}.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace coalesce::eval {

// Limits on what a file may hold (beyond them: InvalidArgument).
inline constexpr int64_t kMaxFileBytes = int64_t{256} << 20;  // any input file
inline constexpr int64_t kMaxLineBytes = int64_t{1} << 20;    // one JSON line
inline constexpr int kMinChoices = 2;
inline constexpr int kMaxChoices = 64;

// The whole file, or NotFound / InvalidArgument (over max_bytes) naming it.
absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes = kMaxFileBytes);

// The byte offset of the first byte of `text` that is not part of valid
// UTF-8 (overlong forms, surrogates and code points above U+10FFFF are
// invalid), or -1 when all of it is valid.
int64_t FirstInvalidUtf8(absl::string_view text);

// The longest prefix of `text` of at most max_bytes bytes that does not end
// inside a multi-byte character.
absl::string_view TruncateUtf8(absl::string_view text, int64_t max_bytes);

// A text to score: the file, or its first max_bytes bytes (0: all of it).
struct TextInput {
  std::string text;
  int64_t file_bytes = 0;  // the whole file's size
};
// InvalidArgument when the text (as cut) is empty or not valid UTF-8.
absl::StatusOr<TextInput> ReadText(const std::string& path, int64_t max_bytes);

// One multiple-choice item.
struct TaskItem {
  int line = 0;  // in the file, from 1
  std::string context;
  std::vector<std::string> choices;  // [2, 64]
  int answer = 0;                    // index into choices
};
// InvalidArgument "line N: ..." for the first malformed line, or for a file
// with no items.
absl::StatusOr<std::vector<TaskItem>> ParseTaskFile(absl::string_view contents);

// One prompt of a greedy-agreement run.
struct PromptItem {
  int line = 0;
  std::string prompt;  // non-empty
};
absl::StatusOr<std::vector<PromptItem>> ParsePromptFile(absl::string_view contents);

}  // namespace coalesce::eval
