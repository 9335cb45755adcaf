#include "engine/tokenizer/hf_tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace coalesce::engine::hf {
namespace {

// Oniguruma's \s with Unicode: the White_Space property. PCRE2 10.42's \s
// (UCP) also matches U+180E, which Unicode 6.3 took out of White_Space.
constexpr std::string_view kSpaceRanges =
    "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}"
    "\\x{3000}";

// HF tokenizers 0.23's Oniguruma has Unicode 16 tables; Debian 12's PCRE2
// (10.42) has Unicode 14. These are the code points that became letters (L)
// or numbers (N, and their decimal digits Nd) in Unicode 15 and 16, found by
// classifying every code point with both libraries. Unicode 15 and 16
// changed no category inside L or N, so adding them makes the classes equal.
constexpr std::string_view kLetterAdditions =
    "\\x{1c89}-\\x{1c8a}\\x{a7cb}-\\x{a7cd}\\x{a7da}-\\x{a7dc}\\x{105c0}-\\x{105f3}"
    "\\x{10d4a}-\\x{10d65}\\x{10d6f}-\\x{10d85}\\x{10ec2}-\\x{10ec4}\\x{1123f}-\\x{11240}"
    "\\x{11380}-\\x{11389}\\x{1138b}\\x{1138e}\\x{11390}-\\x{113b5}\\x{113b7}\\x{113d1}"
    "\\x{113d3}\\x{11bc0}-\\x{11be0}\\x{11f02}\\x{11f04}-\\x{11f10}\\x{11f12}-\\x{11f33}"
    "\\x{1342f}\\x{13441}-\\x{13446}\\x{13460}-\\x{143fa}\\x{16100}-\\x{1611d}"
    "\\x{16d40}-\\x{16d6c}\\x{18cff}\\x{1b132}\\x{1b155}\\x{1df25}-\\x{1df2a}"
    "\\x{1e030}-\\x{1e06d}\\x{1e4d0}-\\x{1e4eb}\\x{1e5d0}-\\x{1e5ed}\\x{1e5f0}\\x{2b739}"
    "\\x{2ebf0}-\\x{2ee5d}\\x{31350}-\\x{323af}";
constexpr std::string_view kDigitAdditions =
    "\\x{10d40}-\\x{10d49}\\x{116d0}-\\x{116e3}\\x{11bf0}-\\x{11bf9}\\x{11f50}-\\x{11f59}"
    "\\x{16130}-\\x{16139}\\x{16d70}-\\x{16d79}\\x{1ccf0}-\\x{1ccf9}\\x{1e4f0}-\\x{1e4f9}"
    "\\x{1e5f1}-\\x{1e5fa}";
// Kaktovik numerals: No, not Nd.
constexpr std::string_view kOtherNumberAdditions = "\\x{1d2c0}-\\x{1d2d3}";

absl::Status Unsupported(std::string_view pattern, std::string_view what) {
  return absl::UnimplementedError(
      Cat("regex \"", pattern, "\": ", what,
          " is not supported (its Oniguruma meaning differs from PCRE2's)"));
}

}  // namespace

// What changes from Oniguruma to PCRE2:
//  - \s, \S: the White_Space set spelled out (see kSpaceRanges).
//  - \p{L}, \p{N}, \d (and \P{..}, \D outside classes): PCRE2's class plus the
//    Unicode 15/16 additions.
//  - \v is the VT character in Oniguruma, a class in PCRE2; \uHHHH is
//    Oniguruma's spelling of \x{HHHH}.
//  - Rejected: \w \W \b \B (Oniguruma's word set differs from PCRE2's), \h \H
//    (hex digit in Oniguruma), \R \X \K \G \O \N \y \Y, nested classes, POSIX
//    brackets, class intersection (&&), the negated forms inside a class, and
//    (?m (dot-all in Ruby syntax, multi-line in PCRE2).
absl::StatusOr<std::string> TranslateOnigPattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() * 2);
  bool in_class = false;
  size_t class_start = 0;  // index in `pattern` just after the opening [ or [^
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      if (i + 1 >= pattern.size()) return Unsupported(pattern, "a trailing backslash");
      const char e = pattern[++i];
      // \p{..}, \P{..}, \p{^..}: properties.
      if (e == 'p' || e == 'P') {
        const size_t close = pattern.find('}', i);
        if (i + 1 >= pattern.size() || pattern[i + 1] != '{' || close == std::string_view::npos) {
          return Unsupported(pattern, "a \\p without {name}");
        }
        std::string_view name = pattern.substr(i + 2, close - i - 2);
        bool negated = e == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.remove_prefix(1);
        }
        i = close;
        std::string body = Cat("\\p{", name, "}");
        if (name == "L" || name == "Letter") {
          body.append(kLetterAdditions);
        } else if (name == "N" || name == "Number") {
          body += Cat(kDigitAdditions, kOtherNumberAdditions);
        } else if (name == "Nd") {
          body.append(kDigitAdditions);
        }
        if (in_class) {
          if (negated) return Unsupported(pattern, "a negated property inside a class");
          out.append(body);
        } else {
          out += Cat(negated ? "[^" : "[", body, "]");
        }
        continue;
      }
      switch (e) {
        case 's':
          out += Cat(in_class ? "" : "[", kSpaceRanges, in_class ? "" : "]");
          continue;
        case 'S':
          if (in_class) return Unsupported(pattern, "\\S inside a class");
          out += Cat("[^", kSpaceRanges, "]");
          continue;
        case 'd':
          out += Cat(in_class ? "" : "[", "\\p{Nd}", kDigitAdditions, in_class ? "" : "]");
          continue;
        case 'D':
          if (in_class) return Unsupported(pattern, "\\D inside a class");
          out += Cat("[^\\p{Nd}", kDigitAdditions, "]");
          continue;
        case 'v':
          out.append("\\x{0b}");
          continue;
        case 'u': {
          if (i + 4 >= pattern.size()) return Unsupported(pattern, "a short \\u escape");
          out += Cat("\\x{", pattern.substr(i + 1, 4), "}");
          i += 4;
          continue;
        }
        case 'w':
        case 'W':
        case 'b':
        case 'B':
        case 'h':
        case 'H':
        case 'R':
        case 'X':
        case 'K':
        case 'G':
        case 'O':
        case 'N':
        case 'y':
        case 'Y':
          return Unsupported(pattern, Cat("\\", std::string(1, e)));
        default:
          out.push_back('\\');
          out.push_back(e);
          continue;
      }
    }
    if (in_class) {
      if (c == ']' && i > class_start) {
        in_class = false;
      } else if (c == '[') {
        return Unsupported(pattern, "a nested class or POSIX bracket inside a class");
      } else if (c == '&' && i + 1 < pattern.size() && pattern[i + 1] == '&') {
        return Unsupported(pattern, "class intersection (&&)");
      }
      out.push_back(c);
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_start = i + 1;
      if (class_start < pattern.size() && pattern[class_start] == '^') {
        out.push_back('[');
        out.push_back('^');
        ++i;
        ++class_start;
        continue;
      }
    } else if (c == '(' && pattern.substr(i, 2) == "(?") {
      // Inline options: (?i), (?im-x:...). Only 'm' changes meaning.
      size_t j = i + 2;
      while (j < pattern.size() &&
             (std::isalpha(static_cast<unsigned char>(pattern[j])) || pattern[j] == '-')) {
        if (pattern[j] == 'm') return Unsupported(pattern, "the inline option m");
        ++j;
      }
    }
    out.push_back(c);
  }
  if (in_class) return Unsupported(pattern, "an unterminated class");
  return out;
}

absl::StatusOr<std::shared_ptr<const Regex>> Regex::Compile(std::string_view pattern) {
  auto translated = TranslateOnigPattern(pattern);
  if (!translated.ok()) return translated.status();
  int error = 0;
  PCRE2_SIZE offset = 0;
  // Ruby syntax (Oniguruma's default in the onig crate) has ^ and $ match at
  // line starts and ends.
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated->data()), translated->size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(Cat("regex \"", pattern,
                                          "\": ", reinterpret_cast<const char*>(message),
                                          " at offset ", offset, " of its PCRE2 form"));
  }
  std::shared_ptr<Regex> regex(new Regex());
  regex->code_ = code;
  regex->translated_ = *std::move(translated);
  // The JIT is several times faster; without it (an unsupported CPU, or a
  // build without JIT) the interpreter gives the same matches.
  regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return std::shared_ptr<const Regex>(std::move(regex));
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  // Match data is per call, so one Regex serves many threads.
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
  if (!data) return;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (start <= text.size()) {
    // The caller passes valid UTF-8 (Encode sanitizes its input).
    int rc = PCRE2_ERROR_JIT_BADOPTION;  // no JIT: use the interpreter
    if (jit_) {
      rc = pcre2_jit_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(),
                           nullptr);
    }
    // The JIT's stack is small (32 KiB); the interpreter keeps its
    // backtracking frames on the heap, so it takes over when the JIT fails.
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
      rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    }
    // No match; or the interpreter's match limit (10^7 steps), which the
    // regexes of real tokenizers do not come near.
    if (rc < 0) return;
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t s = ovector[0], e = ovector[1];
    if (s == e && have_last && last_end == e) {
      // onig's find_iter skips an empty match where the last one ended and
      // searches again one character later.
      if (start >= text.size()) return;
      size_t next = start + 1;
      while (next < text.size() && (static_cast<uint8_t>(text[next]) & 0xC0) == 0x80) ++next;
      start = next;
      continue;
    }
    out.emplace_back(s, e);
    have_last = true;
    last_end = e;
    // After an empty match the next search starts at the same place; the
    // rule above then steps past it.
    start = e;
  }
}

}  // namespace coalesce::engine::hf
