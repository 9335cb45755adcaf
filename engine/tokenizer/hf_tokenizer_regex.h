// The regular expressions of a Hugging Face tokenizer.json, run with PCRE2.
// HF `tokenizers` compiles the patterns of Split pre-tokenizers, Replace
// normalizers and the ByteLevel pre-tokenizer with Oniguruma (Ruby syntax);
// this translates the parts where PCRE2 (UTF + UCP) means something else and
// rejects the constructs it cannot translate, so a pattern either matches
// exactly what HF matches or fails to load.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace coalesce::engine::hf {

// absl::StrCat for std::string_view: Debian's Abseil (20220623) has its own
// absl::string_view, which std::string_view does not convert to.
inline void AppendPiece(std::string& out, std::string_view piece) { out.append(piece); }
template <typename Int>
requires std::is_integral_v<Int>
void AppendPiece(std::string& out, Int value) { out.append(std::to_string(value)); }
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (AppendPiece(out, args), ...);
  return out;
}

class Regex {
 public:
  // Compiles an Oniguruma pattern. The error names the pattern and the
  // construct that is not supported.
  static absl::StatusOr<std::shared_ptr<const Regex>> Compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [start, end) byte ranges of the non-overlapping matches in
  // `text` (valid UTF-8), left to right, as HF's onig find_iter reports them:
  // an empty match right where the previous match ended is skipped.
  // Thread-safe.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

  // The PCRE2 pattern this was compiled to (for tests and messages).
  const std::string& translated() const { return translated_; }

 private:
  Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
  std::string translated_;
};

// Translates an Oniguruma pattern to PCRE2 syntax; see hf_tokenizer_regex.cc
// for what changes. Exposed for tests.
absl::StatusOr<std::string> TranslateOnigPattern(std::string_view pattern);

}  // namespace coalesce::engine::hf
