#include "tools/eval/inputs.h"

#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace coalesce::eval {

absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  if (size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", size, " bytes: more than the ", max_bytes, " read at most"));
  }
  in.seekg(0, std::ios::beg);
  std::string contents(static_cast<size_t>(size), '\0');
  in.read(contents.data(), size);
  if (in.gcount() != size) return absl::DataLossError(absl::StrCat("cannot read all of ", path));
  return contents;
}

// ---------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------

namespace {

// The length of the valid UTF-8 character at text[i], or 0 when none starts
// there (RFC 3629's well-formed sequences).
int Utf8CharLength(absl::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  int n;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (int k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

int64_t FirstInvalidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const int n = Utf8CharLength(text, i);
    if (n == 0) return static_cast<int64_t>(i);
    i += n;
  }
  return -1;
}

absl::string_view TruncateUtf8(absl::string_view text, int64_t max_bytes) {
  if (max_bytes < 0) max_bytes = 0;
  if (static_cast<int64_t>(text.size()) <= max_bytes) return text;
  size_t end = static_cast<size_t>(max_bytes);
  // Back off continuation bytes (10xxxxxx) to the start of the character
  // that the cut would split.
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end);
}

absl::StatusOr<TextInput> ReadText(const std::string& path, int64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  TextInput out;
  out.file_bytes = size;
  // Read a few bytes past the cut so that TruncateUtf8 sees the character
  // the cut lands in.
  int64_t to_read = size;
  if (max_bytes > 0) to_read = std::min<int64_t>(size, max_bytes + 4);
  if (to_read > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is ", size, " bytes: more than the ",
                                                   kMaxFileBytes,
                                                   " read at most (use --max_bytes)"));
  }
  in.seekg(0, std::ios::beg);
  out.text.resize(static_cast<size_t>(to_read));
  in.read(out.text.data(), to_read);
  if (in.gcount() != to_read) {
    return absl::DataLossError(absl::StrCat("cannot read all of ", path));
  }
  if (max_bytes > 0) out.text = std::string(TruncateUtf8(out.text, max_bytes));
  if (out.text.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no text"));
  const int64_t bad = FirstInvalidUtf8(out.text);
  if (bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not valid UTF-8 text (at byte ", bad, ")"));
  }
  return out;
}

// ---------------------------------------------------------------------------
// JSON lines
// ---------------------------------------------------------------------------

namespace {

// Calls `parse_line(json, fail)` for each non-blank line; `fail(why)` makes
// the "line N: why" error.
using LineFail = std::function<absl::Status(absl::string_view)>;

absl::Status ForEachJsonLine(
    absl::string_view contents,
    const std::function<absl::Status(int, const nlohmann::json&, const LineFail&)>& parse_line) {
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_number;
    const LineFail fail = [line_number](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": ", why));
    };
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    if (static_cast<int64_t>(line.size()) > kMaxLineBytes) {
      return fail(absl::StrCat("longer than ", kMaxLineBytes, " bytes"));
    }
    // No exceptions: a line that does not parse is discarded. nlohmann's
    // parser and destructor are iterative, so deep nesting cannot overflow
    // the stack; its lexer refuses strings that are not valid UTF-8.
    const nlohmann::json j =
        nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail("not valid JSON");
    if (!j.is_object()) return fail("not a JSON object");
    absl::Status status = parse_line(line_number, j, fail);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

bool NonEmptyString(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_string() && !it->get_ref<const std::string&>().empty();
}

}  // namespace

absl::StatusOr<std::vector<TaskItem>> ParseTaskFile(absl::string_view contents) {
  std::vector<TaskItem> items;
  absl::Status status = ForEachJsonLine(contents, [&](int line, const nlohmann::json& j,
                                                      const LineFail& fail) {
    TaskItem item;
    item.line = line;
    if (!NonEmptyString(j, "context")) return fail("\"context\" must be a non-empty string");
    item.context = j["context"].get<std::string>();
    const auto choices = j.find("choices");
    if (choices == j.end() || !choices->is_array() ||
        static_cast<int>(choices->size()) < kMinChoices ||
        static_cast<int>(choices->size()) > kMaxChoices) {
      return fail(absl::StrCat("\"choices\" must be a list of ", kMinChoices, " to ", kMaxChoices,
                               " strings"));
    }
    for (const nlohmann::json& c : *choices) {
      if (!c.is_string() || c.get_ref<const std::string&>().empty()) {
        return fail("every choice must be a non-empty string");
      }
      item.choices.push_back(c.get<std::string>());
    }
    const auto answer = j.find("answer");
    const int64_t n = static_cast<int64_t>(item.choices.size());
    // An unsigned JSON number may exceed int64's range: compare it as
    // unsigned; a float (1.0) is not an index.
    const bool in_range =
        answer != j.end() &&
        ((answer->is_number_unsigned() && answer->get<uint64_t>() < static_cast<uint64_t>(n)) ||
         (answer->is_number_integer() && !answer->is_number_unsigned() &&
          answer->get<int64_t>() >= 0 && answer->get<int64_t>() < n));
    if (!in_range) {
      return fail(absl::StrCat("\"answer\" must be an integer index into choices, 0 to ", n - 1));
    }
    item.answer = static_cast<int>(answer->get<int64_t>());
    items.push_back(std::move(item));
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  if (items.empty()) return absl::InvalidArgumentError("no items in the task file");
  return items;
}

absl::StatusOr<std::vector<PromptItem>> ParsePromptFile(absl::string_view contents) {
  std::vector<PromptItem> prompts;
  absl::Status status =
      ForEachJsonLine(contents, [&](int line, const nlohmann::json& j, const LineFail& fail) {
        if (!NonEmptyString(j, "prompt")) return fail("\"prompt\" must be a non-empty string");
        prompts.push_back({line, j["prompt"].get<std::string>()});
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  if (prompts.empty()) return absl::InvalidArgumentError("no prompts in the file");
  return prompts;
}

}  // namespace coalesce::eval
