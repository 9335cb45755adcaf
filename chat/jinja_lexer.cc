#include "chat/jinja_lexer.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "chat/jinja.h"
#include "chat/jinja_builtins.h"
#include "chat/jinja_interp.h"
#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {

[[noreturn]] void SyntaxError(int line, std::string message) {
  throw Error{Error::Kind::kSyntax, std::move(message), line};
}

namespace {

bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }
bool IsAsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string CharRepr(std::string_view s, size_t pos) {
  size_t end = pos;
  DecodeUtf8At(s, &end);
  return ReprString(s.substr(pos, end - pos));
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Every line break becomes "\n" and one trailing newline is dropped
    // (jinja2's keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') newlines_.push_back(i);
    }
  }

  std::vector<Token> Run() {
    const size_t n = src_.size();
    size_t pos = 0;
    bool line_starting = true;
    while (pos < n) {
      const size_t p = FindTagStart(pos);
      if (p == std::string::npos) {
        Emit(Tok::kData, src_.substr(pos), pos);
        break;
      }
      const char kind = src_[p + 1];
      const size_t after = p + 2;
      const char sign = after < n && (src_[after] == '-' || src_[after] == '+') ? src_[after] : 0;
      size_t raw_end = 0;
      const bool raw = kind == '%' && MatchRawBegin(p, &raw_end);
      std::string text = src_.substr(pos, p - pos);
      Strip(&text, sign, /*lstrip=*/kind != '{', line_starting);
      if (!text.empty()) Emit(Tok::kData, std::move(text), pos);

      if (raw) {
        pos = raw_end;
        line_starting = src_[pos - 1] == '\n';
        size_t end = 0;
        char end_sign = 0;
        size_t q = pos;
        // (jinja2's lexer stops without an error when nothing follows.)
        if (pos >= n) break;
        for (;; ++q) {
          q = src_.find("{%", q);
          if (q == std::string::npos) SyntaxError(LineAt(p), "Missing end of raw directive");
          if (MatchEndRaw(q, &end, &end_sign)) break;
        }
        std::string raw_text = src_.substr(pos, q - pos);
        Strip(&raw_text, end_sign, /*lstrip=*/true, line_starting);
        if (!raw_text.empty()) Emit(Tok::kData, std::move(raw_text), pos);
        pos = end;
        line_starting = src_[pos - 1] == '\n';
        continue;
      }

      if (kind == '#') {
        const size_t start = after + (sign != 0 ? 1 : 0);
        if (start >= n) break;  // as jinja2's lexer, which then just stops
        const size_t k = src_.find("#}", start);
        if (k == std::string::npos) SyntaxError(LineAt(p), "Missing end of comment tag");
        const char end_sign =
            k > start && (src_[k - 1] == '-' || src_[k - 1] == '+') ? src_[k - 1] : 0;
        pos = k + 2;
        if (end_sign == '-') {
          pos = SkipSpace(pos);
        } else if (end_sign == 0 && pos < n && src_[pos] == '\n') {
          ++pos;  // trim_blocks
        }
        line_starting = src_[pos - 1] == '\n';
        continue;
      }

      const bool block = kind == '%';
      Emit(block ? Tok::kBlockBegin : Tok::kVarBegin, "", p);
      pos = after + (sign != 0 ? 1 : 0);
      if (!LexTag(block, &pos)) {
        // The template ended inside the tag: the parser reports it.
        break;
      }
      line_starting = src_[pos - 1] == '\n';
    }
    Emit(Tok::kEof, "", n);
    return std::move(tokens_);
  }

 private:
  int LineAt(size_t pos) const {
    return 1 + static_cast<int>(std::lower_bound(newlines_.begin(), newlines_.end(), pos) -
                                newlines_.begin());
  }

  void Emit(Tok type, std::string value, size_t pos) {
    Token t;
    t.type = type;
    t.value = std::move(value);
    t.line = LineAt(pos);
    tokens_.push_back(std::move(t));
  }

  size_t FindTagStart(size_t pos) const {
    while (true) {
      pos = src_.find('{', pos);
      if (pos == std::string::npos || pos + 1 >= src_.size()) return std::string::npos;
      const char c = src_[pos + 1];
      if (c == '{' || c == '%' || c == '#') return pos;
      ++pos;
    }
  }

  bool SpaceAt(size_t pos, size_t* next) const {
    if (pos >= src_.size()) return false;
    size_t end = pos;
    const char32_t c = DecodeUtf8At(src_, &end);
    if (!IsPySpace(c)) return false;
    *next = end;
    return true;
  }

  size_t SkipSpace(size_t pos) const {
    size_t next;
    while (SpaceAt(pos, &next)) pos = next;
    return pos;
  }

  // The whitespace control in front of a tag: "-" strips all whitespace
  // before it; otherwise, with lstrip_blocks, a block or comment tag that
  // only whitespace separates from the start of its line takes that
  // whitespace away ("+" keeps it).
  static void Strip(std::string* text, char sign, bool lstrip, bool line_starting) {
    if (sign == '-') {
      size_t end = text->size();
      while (end > 0) {
        const size_t start = PrevCodePointStart(*text, end);
        size_t p = start;
        if (!IsPySpace(DecodeUtf8At(*text, &p))) break;
        end = start;
      }
      text->resize(end);
      return;
    }
    if (sign == '+' || !lstrip) return;
    const size_t nl = text->rfind('\n');
    const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting) return;
    if (l_pos >= text->size()) return;
    size_t p = l_pos;
    while (p < text->size()) {
      if (!IsPySpace(DecodeUtf8At(*text, &p))) return;
    }
    text->resize(l_pos);
  }

  bool MatchWord(size_t* pos, std::string_view word) const {
    if (src_.compare(*pos, word.size(), word) != 0) return false;
    *pos += word.size();
    return true;
  }

  // {%[-+]?\s*raw\s*(-%}\s*|%})
  bool MatchRawBegin(size_t p, size_t* end) const {
    size_t pos = p + 2;
    if (pos < src_.size() && (src_[pos] == '-' || src_[pos] == '+')) ++pos;
    pos = SkipSpace(pos);
    if (!MatchWord(&pos, "raw")) return false;
    pos = SkipSpace(pos);
    if (MatchWord(&pos, "-%}")) {
      *end = SkipSpace(pos);
      return true;
    }
    if (MatchWord(&pos, "%}")) {
      *end = pos;
      return true;
    }
    return false;
  }

  // {%[-+]?\s*endraw\s*(\+%}|-%}\s*|%}\n?)
  bool MatchEndRaw(size_t q, size_t* end, char* sign) const {
    size_t pos = q + 2;
    *sign = 0;
    if (pos < src_.size() && (src_[pos] == '-' || src_[pos] == '+')) *sign = src_[pos++];
    pos = SkipSpace(pos);
    if (!MatchWord(&pos, "endraw")) return false;
    pos = SkipSpace(pos);
    if (MatchWord(&pos, "+%}")) {
      *end = pos;
    } else if (MatchWord(&pos, "-%}")) {
      *end = SkipSpace(pos);
    } else if (MatchWord(&pos, "%}")) {
      if (pos < src_.size() && src_[pos] == '\n') ++pos;
      *end = pos;
    } else {
      return false;
    }
    return true;
  }

  // (\d+_)*\d+ at pos: the end, or npos.
  size_t MatchDigits(size_t pos) const {
    if (pos >= src_.size() || !IsAsciiDigit(src_[pos])) return std::string::npos;
    while (true) {
      while (pos < src_.size() && IsAsciiDigit(src_[pos])) ++pos;
      if (pos + 1 < src_.size() && src_[pos] == '_' && IsAsciiDigit(src_[pos + 1])) {
        ++pos;
        continue;
      }
      return pos;
    }
  }

  size_t MatchExponent(size_t pos) const {
    if (pos >= src_.size() || (src_[pos] != 'e' && src_[pos] != 'E')) return std::string::npos;
    ++pos;
    if (pos < src_.size() && (src_[pos] == '+' || src_[pos] == '-')) ++pos;
    return MatchDigits(pos);
  }

  size_t MatchFloat(size_t pos) const {
    if (pos > 0 && src_[pos - 1] == '.') return std::string::npos;
    const size_t d = MatchDigits(pos);
    if (d == std::string::npos) return d;
    const size_t frac = d < src_.size() && src_[d] == '.' ? MatchDigits(d + 1) : std::string::npos;
    if (frac != std::string::npos) {
      const size_t e = MatchExponent(frac);
      if (e != std::string::npos) return e;
    }
    const size_t e = MatchExponent(d);
    if (e != std::string::npos) return e;
    return frac;
  }

  size_t MatchInteger(size_t pos, int* base) const {
    auto run = [&](size_t p, auto is_digit) {
      // (_?digit)+
      size_t q = p;
      while (true) {
        if (q < src_.size() && is_digit(src_[q])) {
          ++q;
        } else if (q + 1 < src_.size() && src_[q] == '_' && is_digit(src_[q + 1])) {
          q += 2;
        } else {
          break;
        }
      }
      return q == p ? std::string::npos : q;
    };
    if (src_[pos] == '0' && pos + 1 < src_.size()) {
      const char p = static_cast<char>(src_[pos + 1] | 0x20);
      size_t e = std::string::npos;
      if (p == 'b') {
        e = run(pos + 2, [](char c) { return c == '0' || c == '1'; });
        *base = 2;
      } else if (p == 'o') {
        e = run(pos + 2, [](char c) { return c >= '0' && c <= '7'; });
        *base = 8;
      } else if (p == 'x') {
        e = run(pos + 2,
                [](char c) { return IsAsciiDigit(c) || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f'); });
        *base = 16;
      }
      if (e != std::string::npos) return e;
    }
    *base = 10;
    if (src_[pos] == '0') {
      size_t e = run(pos + 1, [](char c) { return c == '0'; });
      return e == std::string::npos ? pos + 1 : e;
    }
    if (src_[pos] >= '1' && src_[pos] <= '9') {
      size_t e = run(pos + 1, IsAsciiDigit);
      return e == std::string::npos ? pos + 1 : e;
    }
    return std::string::npos;
  }

  bool IsNameChar(size_t pos, size_t* next, bool first) const {
    const char c = src_[pos];
    if (static_cast<unsigned char>(c) < 0x80) {
      if (IsAsciiAlpha(c) || c == '_' || (!first && IsAsciiDigit(c))) {
        *next = pos + 1;
        return true;
      }
      return false;
    }
    size_t end = pos;
    const char32_t cp = DecodeUtf8At(src_, &end);
    if (IsAlpha(cp) || (!first && (IsDecimal(cp) || IsDigit(cp) || IsNumeric(cp)))) {
      *next = end;
      return true;
    }
    return false;
  }

  // Python's "unicode-escape" decoding of a string literal's body (jinja2
  // encodes the body with backslashreplace first, so a non-ASCII character
  // right after a backslash stays as its \x.. / \u.... spelling).
  std::string DecodeString(std::string_view body, int line) const {
    std::string out;
    out.reserve(body.size());
    size_t i = 0;
    auto hex = [&](size_t count, const char* what) -> char32_t {
      if (i + count > body.size()) SyntaxError(line, Cat("truncated ", what, " escape"));
      uint32_t v = 0;
      for (size_t k = 0; k < count; ++k) {
        const char c = body[i + k];
        int d;
        if (IsAsciiDigit(c)) {
          d = c - '0';
        } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') {
          d = (c | 0x20) - 'a' + 10;
        } else {
          SyntaxError(line, Cat("truncated ", what, " escape"));
        }
        v = v * 16 + static_cast<uint32_t>(d);
      }
      i += count;
      return v;
    };
    while (i < body.size()) {
      const char c = body[i];
      if (c != '\\') {
        out.push_back(c);
        ++i;
        continue;
      }
      ++i;
      if (i >= body.size()) SyntaxError(line, "\\ at end of string");
      const char e = body[i];
      if (static_cast<unsigned char>(e) >= 0x80) {
        size_t end = i;
        const char32_t cp = DecodeUtf8At(body, &end);
        char buf[16];
        if (cp <= 0xFF) {
          std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(cp));
        } else if (cp <= 0xFFFF) {
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
        } else {
          std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(cp));
        }
        out += buf;
        i = end;
        continue;
      }
      ++i;
      switch (e) {
        case '\n':
          break;
        case '\\':
        case '\'':
        case '"':
          out.push_back(e);
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
          AppendUtf8(&out, hex(2, "\\xXX"));
          break;
        case 'u':
          AppendUtf8(&out, hex(4, "\\uXXXX"));
          break;
        case 'U': {
          const char32_t v = hex(8, "\\UXXXXXXXX");
          if (v > 0x10FFFF) SyntaxError(line, "illegal Unicode character");
          AppendUtf8(&out, v);
          break;
        }
        case 'N':
          SyntaxError(line, "\\N{...} escapes are not supported in chat templates");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < body.size() && body[i] >= '0' && body[i] <= '7'; ++k) {
              v = v * 8 + static_cast<uint32_t>(body[i++] - '0');
            }
            AppendUtf8(&out, v);
          } else {
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    return out;
  }

  // The inside of {{ }} or {% %}; false if the template ends first.
  bool LexTag(bool block, size_t* pos_io) {
    size_t pos = *pos_io;
    const size_t n = src_.size();
    std::vector<char> balance;
    static constexpr std::string_view kOps2[] = {"//", "**", "==", "!=", ">=", "<="};
    static constexpr std::string_view kOps1 = "+-/*%~[](){}><=.:|,;";
    while (true) {
      if (pos >= n) {
        *pos_io = pos;
        return false;
      }
      if (balance.empty()) {
        size_t p = pos;
        if (block) {
          if (MatchWord(&p, "+%}")) {
          } else if (MatchWord(&p, "-%}")) {
            p = SkipSpace(p);
          } else if (MatchWord(&p, "%}")) {
            if (p < n && src_[p] == '\n') ++p;  // trim_blocks
          }
        } else {
          if (MatchWord(&p, "-}}")) {
            p = SkipSpace(p);
          } else {
            MatchWord(&p, "}}");
          }
        }
        if (p != pos) {
          Emit(block ? Tok::kBlockEnd : Tok::kVarEnd, "", pos);
          *pos_io = p;
          return true;
        }
      }
      size_t next;
      if (SpaceAt(pos, &next)) {
        pos = SkipSpace(pos);
        continue;
      }
      const char c = src_[pos];
      if (IsAsciiDigit(c)) {
        const size_t f = MatchFloat(pos);
        if (f != std::string::npos) {
          std::string text;
          for (size_t k = pos; k < f; ++k) {
            if (src_[k] != '_') text.push_back(src_[k]);
          }
          Token t;
          t.type = Tok::kFloat;
          t.fval = std::strtod(text.c_str(), nullptr);
          t.value = std::move(text);
          t.line = LineAt(pos);
          tokens_.push_back(std::move(t));
          pos = f;
          continue;
        }
        int base = 10;
        const size_t e = MatchInteger(pos, &base);
        std::string digits;
        for (size_t k = pos + (base == 10 ? 0 : 2); k < e; ++k) {
          if (src_[k] != '_') digits.push_back(src_[k]);
        }
        errno = 0;
        char* end = nullptr;
        const unsigned long long v = std::strtoull(digits.c_str(), &end, base);
        if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX)) {
          SyntaxError(LineAt(pos),
                      "integer literal too large (chat templates use 64-bit integers)");
        }
        Token t;
        t.type = Tok::kInt;
        t.ival = static_cast<int64_t>(v);
        t.value = src_.substr(pos, e - pos);
        t.line = LineAt(pos);
        tokens_.push_back(std::move(t));
        pos = e;
        continue;
      }
      if (IsNameChar(pos, &next, /*first=*/true)) {
        size_t end = next;
        while (end < n && IsNameChar(end, &next, /*first=*/false)) end = next;
        Emit(Tok::kName, src_.substr(pos, end - pos), pos);
        pos = end;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t k = pos + 1;
        bool closed = false;
        while (k < n) {
          if (src_[k] == c) {
            closed = true;
            break;
          }
          if (src_[k] == '\\') {
            ++k;
            if (k < n) DecodeUtf8At(src_, &k);
            continue;
          }
          ++k;
        }
        if (closed) {
          const int line = LineAt(pos);
          Token t;
          t.type = Tok::kString;
          t.value = DecodeString(std::string_view(src_).substr(pos + 1, k - pos - 1), line);
          t.line = line;
          tokens_.push_back(std::move(t));
          pos = k + 1;
          continue;
        }
      }
      std::string_view op;
      for (std::string_view o : kOps2) {
        if (src_.compare(pos, 2, o) == 0) op = o;
      }
      if (op.empty() && kOps1.find(c) != std::string_view::npos)
        op = std::string_view(&src_[pos], 1);
      if (op.empty()) {
        SyntaxError(LineAt(pos), Cat("unexpected char ", CharRepr(src_, pos), " at ", pos));
      }
      if (op == "{" || op == "(" || op == "[") {
        balance.push_back(op == "{" ? '}' : (op == "(" ? ')' : ']'));
      } else if (op == "}" || op == ")" || op == "]") {
        if (balance.empty()) SyntaxError(LineAt(pos), Cat("unexpected '", op, "'"));
        const char expected = balance.back();
        balance.pop_back();
        if (expected != op[0]) {
          SyntaxError(LineAt(pos),
                      Cat("unexpected '", op, "', expected '", std::string(1, expected), "'"));
        }
      }
      Emit(Tok::kOp, std::string(op), pos);
      pos += op.size();
    }
  }

  std::string src_;
  std::vector<size_t> newlines_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> Lex(std::string_view source) { return Lexer(source).Run(); }

}  // namespace coalesce::chat::jinja
