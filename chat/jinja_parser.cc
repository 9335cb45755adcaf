// The lexer and parser of jinja2 templates, following jinja2 3.1's lexer
// (whitespace control, trim_blocks, lstrip_blocks, raw blocks) and its
// recursive-descent grammar (operator precedence, tuples, filters, tests).
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
namespace {

// Expressions and statements nested deeper than this do not parse (the
// parser and the evaluator recurse once per level).
constexpr int kMaxParseNesting = 100;
constexpr int kMaxExprHeight = 256;

[[noreturn]] void SyntaxError(int line, std::string message) {
  throw Error{Error::Kind::kSyntax, std::move(message), line};
}

// ---------------------------------------------------------------------------
// Lexer

enum class Tok : uint8_t {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof,
};

struct Token {
  Tok type;
  std::string value;  // data, name, the decoded string, the operator
  int64_t ival = 0;
  double fval = 0;
  int line = 1;
};

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

// ---------------------------------------------------------------------------
// Parser

std::string Describe(const Token& t) {
  switch (t.type) {
    case Tok::kName:
    case Tok::kOp:
      return t.value;
    case Tok::kString:
      return "string";
    case Tok::kInt:
      return "integer";
    case Tok::kFloat:
      return "float";
    case Tok::kData:
      return "template data / text";
    case Tok::kVarBegin:
      return "begin of print statement";
    case Tok::kVarEnd:
      return "end of print statement";
    case Tok::kBlockBegin:
      return "begin of statement block";
    case Tok::kBlockEnd:
      return "end of statement block";
    case Tok::kEof:
      return "end of template";
  }
  return "?";
}

std::string DescribeType(Tok type) {
  Token t;
  t.type = type;
  return Describe(t);
}

ExprPtr MakeExpr(ExprKind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Template Parse() {
    Template t;
    t.body = Subparse(nullptr);
    return t;
  }

 private:
  using EndTokens = std::vector<std::string_view>;

  struct NestingGuard {
    explicit NestingGuard(Parser* p) : p(p) {
      if (++p->nesting_ > kMaxParseNesting) {
        p->Fail(Cat("the template nests expressions or statements deeper than ", kMaxParseNesting,
                    " levels"));
      }
    }
    ~NestingGuard() { --p->nesting_; }
    Parser* p;
  };

  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  void Next() {
    if (i_ + 1 < toks_.size()) ++i_;
  }
  bool IsName(std::string_view v) const { return cur().type == Tok::kName && cur().value == v; }
  bool IsOp(std::string_view v) const { return cur().type == Tok::kOp && cur().value == v; }
  bool SkipName(std::string_view v) {
    if (!IsName(v)) return false;
    Next();
    return true;
  }
  bool SkipOp(std::string_view v) {
    if (!IsOp(v)) return false;
    Next();
    return true;
  }

  [[noreturn]] void Fail(std::string message, int line = 0) {
    SyntaxError(line > 0 ? line : cur().line, std::move(message));
  }

  void FailExpected(const std::string& what) {
    if (cur().type == Tok::kEof) {
      Fail(Cat("unexpected end of template, expected '", what, "'."));
    }
    Fail(Cat("expected token '", what, "', got '", Describe(cur()), "'"));
  }

  void ExpectOp(std::string_view op) {
    if (!SkipOp(op)) FailExpected(std::string(op));
  }
  void ExpectName(std::string_view name) {
    if (!SkipName(name)) FailExpected(std::string(name));
  }
  void Expect(Tok type) {
    if (cur().type != type) FailExpected(DescribeType(type));
    Next();
  }
  std::string ExpectAnyName() {
    if (cur().type != Tok::kName) FailExpected("name");
    std::string v = cur().value;
    Next();
    return v;
  }

  static std::string Quoted(const EndTokens& tokens) {
    std::vector<std::string> q;
    for (auto t : tokens) q.push_back(Cat("'", t, "'"));
    return absl::StrJoin(q, " or ");
  }

  [[noreturn]] void FailUnknownTag(const std::string* name, const std::vector<EndTokens>& stack,
                                   int line) {
    std::string message = name == nullptr ? "Unexpected end of template."
                                          : Cat("Encountered unknown tag ", ReprString(*name), ".");
    if (!stack.empty()) {
      bool expected = false;
      for (const auto& tokens : stack) {
        for (auto t : tokens) expected |= name != nullptr && t == *name;
      }
      if (expected) {
        CatAppend(&message,
                  " You probably made a nesting mistake. Jinja is expecting this tag, but "
                  "currently looking for ",
                  Quoted(stack.back()), ".");
      } else {
        CatAppend(&message, " Jinja was looking for the following tags: ", Quoted(stack.back()),
                  ".");
      }
    }
    if (!tag_stack_.empty()) {
      CatAppend(&message, " The innermost block that needs to be closed is ",
                ReprString(tag_stack_.back()), ".");
    }
    Fail(std::move(message), line);
  }

  bool IsTupleEnd(const EndTokens* extra) const {
    if (cur().type == Tok::kVarEnd || cur().type == Tok::kBlockEnd || IsOp(")")) return true;
    if (extra != nullptr) {
      for (auto t : *extra) {
        if (IsName(t)) return true;
      }
    }
    return false;
  }

  void Finish(Expr* e) {
    int h = 0;
    auto visit = [&](const ExprPtr& c) {
      if (c) h = std::max(h, c->height);
    };
    for (const auto& c : e->operands) visit(c);
    for (const auto& c : e->call.args) visit(c);
    for (const auto& [k, c] : e->call.kwargs) visit(c);
    visit(e->call.dyn_args);
    visit(e->call.dyn_kwargs);
    e->height = h + 1;
    e->is_const = ComputeIsConst(*e);
    if (e->height > kMaxExprHeight) {
      Fail(Cat("an expression nests deeper than ", kMaxExprHeight, " levels"), e->line);
    }
  }

  ExprPtr Unary(ExprKind kind, int line, ExprPtr operand) {
    auto e = MakeExpr(kind, line);
    e->operands.push_back(std::move(operand));
    Finish(e.get());
    return e;
  }

  ExprPtr Binary(ExprKind kind, int line, ExprPtr a, ExprPtr b) {
    auto e = MakeExpr(kind, line);
    e->operands.push_back(std::move(a));
    e->operands.push_back(std::move(b));
    Finish(e.get());
    return e;
  }

  // --- statements --------------------------------------------------------

  Body Subparse(const EndTokens* end_tokens) {
    Body body;
    if (end_tokens != nullptr) end_stack_.push_back(*end_tokens);
    while (cur().type != Tok::kEof) {
      const Token& t = cur();
      if (t.type == Tok::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kData;
        s->line = t.line;
        s->text = t.value;
        body.push_back(std::move(s));
        Next();
      } else if (t.type == Tok::kVarBegin) {
        Next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kPrint;
        s->line = cur().line;
        s->expr = ParseTuple(false, true, nullptr, false);
        Expect(Tok::kVarEnd);
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        Next();
        if (end_tokens != nullptr && cur().type == Tok::kName) {
          for (auto e : *end_tokens) {
            if (cur().value == e) {
              end_stack_.pop_back();
              return body;
            }
          }
        }
        body.push_back(ParseStatement());
        Expect(Tok::kBlockEnd);
      } else {
        Fail(Cat("unexpected '", Describe(t), "'"));
      }
    }
    if (end_tokens != nullptr) end_stack_.pop_back();
    return body;
  }

  Body ParseStatements(const EndTokens& end_tokens, bool drop_needle) {
    SkipOp(":");
    Expect(Tok::kBlockEnd);
    Body body = Subparse(&end_tokens);
    if (cur().type == Tok::kEof) {
      std::vector<EndTokens> stack = end_stack_;
      stack.push_back(end_tokens);
      FailUnknownTag(nullptr, stack, cur().line);
    }
    if (drop_needle) Next();
    return body;
  }

  StmtPtr NewStmt(StmtKind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  StmtPtr ParseStatement() {
    NestingGuard guard(this);
    if (cur().type != Tok::kName) Fail("tag name expected");
    const std::string tag = cur().value;
    const int line = cur().line;
    tag_stack_.push_back(tag);
    StmtPtr s;
    if (tag == "for") {
      s = ParseFor();
    } else if (tag == "if") {
      s = ParseIf();
    } else if (tag == "set") {
      s = ParseSet();
    } else if (tag == "macro") {
      s = ParseMacro();
    } else if (tag == "with") {
      s = ParseWith();
    } else if (tag == "filter") {
      Next();
      s = NewStmt(StmtKind::kFilterBlock, line);
      s->expr = ParseFilter(nullptr, /*start_inline=*/true);
      s->body = ParseStatements({"endfilter"}, true);
    } else if (tag == "print") {
      Next();
      s = NewStmt(StmtKind::kPrint, line);
      std::vector<ExprPtr> items;
      while (cur().type != Tok::kBlockEnd) {
        if (!items.empty()) ExpectOp(",");
        items.push_back(ParseExpression());
      }
      if (items.size() == 1) {
        s->expr = std::move(items[0]);
      } else {
        // Printed one after the other, as jinja2's Output node does.
        auto t = MakeExpr(ExprKind::kConcat, line);
        t->operands = std::move(items);
        Finish(t.get());
        s->expr = std::move(t);
      }
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) Fail(Cat("'", tag, "' outside loop"));
      Next();
      s = NewStmt(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue, line);
    } else if (tag == "generation") {
      // transformers' AssistantTracker: the body renders as it is.
      Next();
      s = NewStmt(StmtKind::kScope, line);
      s->body = ParseStatements({"endgeneration"}, true);
    } else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
               tag == "from" || tag == "autoescape" || tag == "call") {
      Fail(Cat("the '", tag, "' tag is not supported in chat templates"));
    } else {
      tag_stack_.pop_back();
      FailUnknownTag(&tag, end_stack_, line);
    }
    tag_stack_.pop_back();
    return s;
  }

  StmtPtr ParseFor() {
    auto s = NewStmt(StmtKind::kFor, cur().line);
    Next();
    const EndTokens in = {"in"};
    s->target = ParseTargetTuple(&in, /*with_namespace=*/false, /*explicit_parens=*/false);
    ExpectName("in");
    const EndTokens recursive = {"recursive"};
    s->expr = ParseTuple(false, false, &recursive, false);
    if (SkipName("if")) s->cond = ParseExpression();
    if (IsName("recursive")) Fail("recursive for loops are not supported in chat templates");
    ++loop_depth_;
    s->body = ParseStatements({"endfor", "else"}, false);
    --loop_depth_;
    const bool has_else = cur().value == "else";
    Next();
    if (has_else) s->else_body = ParseStatements({"endfor"}, true);
    return s;
  }

  StmtPtr ParseIf() {
    auto s = NewStmt(StmtKind::kIf, cur().line);
    Next();
    while (true) {
      ExprPtr test = ParseTuple(false, false, nullptr, false);
      Body body = ParseStatements({"elif", "else", "endif"}, false);
      s->branches.emplace_back(std::move(test), std::move(body));
      const std::string which = cur().value;
      Next();
      if (which == "elif") continue;
      if (which == "else") s->branches.emplace_back(nullptr, ParseStatements({"endif"}, true));
      break;
    }
    return s;
  }

  StmtPtr ParseSet() {
    const int line = cur().line;
    Next();
    Target target = ParseTargetTuple(nullptr, /*with_namespace=*/true, false);
    if (SkipOp("=")) {
      auto s = NewStmt(StmtKind::kSet, line);
      s->target = std::move(target);
      s->expr = ParseTuple(false, true, nullptr, false);
      return s;
    }
    auto s = NewStmt(StmtKind::kSetBlock, line);
    s->target = std::move(target);
    s->expr = ParseFilter(nullptr, false);
    s->body = ParseStatements({"endset"}, true);
    return s;
  }

  StmtPtr ParseMacro() {
    auto s = NewStmt(StmtKind::kMacro, cur().line);
    Next();
    auto macro = std::make_unique<MacroStmt>();
    macro->name = ExpectAnyName();
    ExpectOp("(");
    while (!IsOp(")")) {
      if (!macro->params.empty()) ExpectOp(",");
      std::string param = ExpectAnyName();
      if (SkipOp("=")) {
        macro->defaults.push_back(ParseExpression());
      } else if (!macro->defaults.empty()) {
        Fail("non-default argument follows default argument");
      }
      macro->params.push_back(std::move(param));
    }
    ExpectOp(")");
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    macros_.push_back(macro.get());
    macro->body = ParseStatements({"endmacro"}, true);
    macros_.pop_back();
    loop_depth_ = saved_loops;
    s->macro = std::move(macro);
    return s;
  }

  StmtPtr ParseWith() {
    auto s = NewStmt(StmtKind::kWith, cur().line);
    Next();
    while (cur().type != Tok::kBlockEnd) {
      if (!s->with_targets.empty()) ExpectOp(",");
      s->with_targets.push_back(ParseTargetTuple(nullptr, false, false));
      ExpectOp("=");
      s->with_values.push_back(ParseExpression());
    }
    s->body = ParseStatements({"endwith"}, true);
    return s;
  }

  // An assignment target: names (namespace.attr with `with_namespace`), in
  // a tuple if there are commas.
  Target ParseTargetTuple(const EndTokens* extra, bool with_namespace, bool explicit_parens) {
    std::vector<Target> items;
    bool is_tuple = false;
    const int line = cur().line;
    while (true) {
      if (!items.empty()) ExpectOp(",");
      if (IsTupleEnd(extra)) break;
      items.push_back(ParseTargetPrimary(with_namespace));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Fail(Cat("Expected an expression, got '", Describe(cur()), "'"));
    }
    Target t;
    t.kind = Target::Kind::kTuple;
    t.items = std::move(items);
    t.line = line;
    return t;
  }

  Target ParseTargetPrimary(bool with_namespace) {
    const Token& t = cur();
    Target target;
    target.line = t.line;
    if (t.type == Tok::kName) {
      if (t.value == "true" || t.value == "false" || t.value == "True" || t.value == "False" ||
          t.value == "none" || t.value == "None") {
        Fail("can't assign to 'const'");
      }
      target.name = t.value;
      Next();
      if (with_namespace && IsOp(".")) {
        Next();
        target.kind = Target::Kind::kNsAttr;
        target.attr = ExpectAnyName();
      }
      return target;
    }
    if (IsOp("(")) {
      Next();
      NestingGuard guard(this);
      Target inner = ParseTargetTuple(nullptr, with_namespace, true);
      ExpectOp(")");
      return inner;
    }
    if (t.type == Tok::kEof || t.type == Tok::kBlockEnd || t.type == Tok::kVarEnd) {
      Fail(Cat("Expected an expression, got '", Describe(t), "'"));
    }
    Fail(Cat("can't assign to '", Describe(t), "'"));
  }

  // --- expressions -------------------------------------------------------

  ExprPtr ParseExpression(bool with_condexpr = true) {
    NestingGuard guard(this);
    return with_condexpr ? ParseCondExpr() : ParseOr();
  }

  ExprPtr ParseCondExpr() {
    int line = cur().line;
    ExprPtr expr1 = ParseOr();
    while (SkipName("if")) {
      ExprPtr expr2 = ParseOr();
      ExprPtr expr3 = SkipName("else") ? ParseCondExpr() : nullptr;
      auto e = MakeExpr(ExprKind::kCondExpr, line);
      e->operands.push_back(std::move(expr1));
      e->operands.push_back(std::move(expr2));
      e->operands.push_back(std::move(expr3));
      Finish(e.get());
      expr1 = std::move(e);
      line = cur().line;
    }
    return expr1;
  }

  ExprPtr ParseOr() {
    int line = cur().line;
    ExprPtr left = ParseAnd();
    while (SkipName("or")) {
      left = Binary(ExprKind::kOr, line, std::move(left), ParseAnd());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseAnd() {
    int line = cur().line;
    ExprPtr left = ParseNot();
    while (SkipName("and")) {
      left = Binary(ExprKind::kAnd, line, std::move(left), ParseNot());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName("not")) {
      const int line = cur().line;
      Next();
      NestingGuard guard(this);
      return Unary(ExprKind::kNot, line, ParseNot());
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    const int line = cur().line;
    ExprPtr expr = ParseMath1();
    std::vector<CmpOp> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      CmpOp op;
      if (cur().type == Tok::kOp &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
           cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        const std::string& v = cur().value;
        op = v == "=="   ? CmpOp::kEq
             : v == "!=" ? CmpOp::kNe
             : v == "<"  ? CmpOp::kLt
             : v == "<=" ? CmpOp::kLe
             : v == ">"  ? CmpOp::kGt
                         : CmpOp::kGe;
        Next();
      } else if (SkipName("in")) {
        op = CmpOp::kIn;
      } else if (IsName("not") && look().type == Tok::kName && look().value == "in") {
        Next();
        Next();
        op = CmpOp::kNotIn;
      } else {
        break;
      }
      ops.push_back(op);
      operands.push_back(ParseMath1());
    }
    if (ops.empty()) return expr;
    auto e = MakeExpr(ExprKind::kCompare, line);
    e->operands.push_back(std::move(expr));
    for (auto& o : operands) e->operands.push_back(std::move(o));
    e->cmp_ops = std::move(ops);
    Finish(e.get());
    return e;
  }

  ExprPtr BinaryOp(BinOp op, int line, ExprPtr a, ExprPtr b) {
    auto e = Binary(ExprKind::kBinary, line, std::move(a), std::move(b));
    e->bin_op = op;
    return e;
  }

  ExprPtr ParseMath1() {
    int line = cur().line;
    ExprPtr left = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const BinOp op = IsOp("+") ? BinOp::kAdd : BinOp::kSub;
      Next();
      left = BinaryOp(op, line, std::move(left), ParseConcat());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseConcat() {
    const int line = cur().line;
    ExprPtr first = ParseMath2();
    if (!IsOp("~")) return first;
    auto e = MakeExpr(ExprKind::kConcat, line);
    e->operands.push_back(std::move(first));
    while (SkipOp("~")) e->operands.push_back(ParseMath2());
    Finish(e.get());
    return e;
  }

  ExprPtr ParseMath2() {
    int line = cur().line;
    ExprPtr left = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string& v = cur().value;
      const BinOp op = v == "*"    ? BinOp::kMul
                       : v == "/"  ? BinOp::kDiv
                       : v == "//" ? BinOp::kFloorDiv
                                   : BinOp::kMod;
      Next();
      left = BinaryOp(op, line, std::move(left), ParsePow());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParsePow() {
    int line = cur().line;
    ExprPtr left = ParseUnary(true);
    while (SkipOp("**")) {
      left = BinaryOp(BinOp::kPow, line, std::move(left), ParseUnary(true));
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    const int line = cur().line;
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const ExprKind kind = IsOp("-") ? ExprKind::kNeg : ExprKind::kPos;
      Next();
      NestingGuard guard(this);
      node = Unary(kind, line, ParseUnary(false));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr Const(Value v, int line) {
    auto e = MakeExpr(ExprKind::kConst, line);
    e->value = std::move(v);
    e->is_const = true;
    return e;
  }

  ExprPtr ParsePrimary() {
    const Token& t = cur();
    const int line = t.line;
    switch (t.type) {
      case Tok::kName: {
        const std::string name = t.value;
        Next();
        if (name == "true" || name == "True") return Const(Value::Bool(true), line);
        if (name == "false" || name == "False") return Const(Value::Bool(false), line);
        if (name == "none" || name == "None") return Const(Value::None(), line);
        if (!macros_.empty()) {
          if (name == "varargs") macros_.back()->catch_varargs = true;
          if (name == "kwargs") macros_.back()->catch_kwargs = true;
        }
        auto e = MakeExpr(ExprKind::kName, line);
        e->name = name;
        return e;
      }
      case Tok::kString: {
        std::string s = t.value;
        Next();
        while (cur().type == Tok::kString) {
          s += cur().value;
          Next();
        }
        return Const(Value::TemplateStr(std::move(s)), line);
      }
      case Tok::kInt: {
        const int64_t v = t.ival;
        Next();
        return Const(Value::Int(v), line);
      }
      case Tok::kFloat: {
        const double v = t.fval;
        Next();
        return Const(Value::Float(v), line);
      }
      case Tok::kOp:
        if (t.value == "(") {
          Next();
          NestingGuard guard(this);
          ExprPtr e = ParseTuple(false, true, nullptr, /*explicit_parens=*/true);
          ExpectOp(")");
          return e;
        }
        if (t.value == "[") return ParseList();
        if (t.value == "{") return ParseDict();
        break;
      default:
        break;
    }
    Fail(Cat("unexpected '", Describe(t), "'"));
  }

  ExprPtr ParseTuple(bool simplified, bool with_condexpr, const EndTokens* extra,
                     bool explicit_parens) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) ExpectOp(",");
      if (IsTupleEnd(extra)) break;
      items.push_back(simplified ? ParsePrimary() : ParseExpression(with_condexpr));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Fail(Cat("Expected an expression, got '", Describe(cur()), "'"));
    }
    auto e = MakeExpr(ExprKind::kTuple, line);
    e->operands = std::move(items);
    Finish(e.get());
    return e;
  }

  ExprPtr ParseList() {
    const int line = cur().line;
    ExpectOp("[");
    NestingGuard guard(this);
    auto e = MakeExpr(ExprKind::kList, line);
    while (!IsOp("]")) {
      if (!e->operands.empty()) ExpectOp(",");
      if (IsOp("]")) break;
      e->operands.push_back(ParseExpression());
    }
    ExpectOp("]");
    Finish(e.get());
    return e;
  }

  ExprPtr ParseDict() {
    const int line = cur().line;
    ExpectOp("{");
    NestingGuard guard(this);
    auto e = MakeExpr(ExprKind::kDict, line);
    while (!IsOp("}")) {
      if (!e->operands.empty()) ExpectOp(",");
      if (IsOp("}")) break;
      e->operands.push_back(ParseExpression());
      ExpectOp(":");
      e->operands.push_back(ParseExpression());
    }
    ExpectOp("}");
    Finish(e.get());
    return e;
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".") || IsOp("[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        node = ParseFilter(std::move(node), false);
      } else if (IsName("is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr node) {
    const int line = cur().line;
    if (SkipOp(".")) {
      const Token& attr = cur();
      if (attr.type == Tok::kName) {
        auto e = MakeExpr(ExprKind::kGetattr, line);
        e->name = attr.value;
        Next();
        e->operands.push_back(std::move(node));
        Finish(e.get());
        return e;
      }
      if (attr.type != Tok::kInt) Fail("expected name or number", attr.line);
      ExprPtr index = Const(Value::Int(attr.ival), attr.line);
      Next();
      return Binary(ExprKind::kGetitem, line, std::move(node), std::move(index));
    }
    ExpectOp("[");
    NestingGuard guard(this);
    std::vector<ExprPtr> args;
    while (!IsOp("]")) {
      if (!args.empty()) ExpectOp(",");
      args.push_back(ParseSubscribed());
    }
    ExpectOp("]");
    ExprPtr arg;
    if (args.size() == 1) {
      arg = std::move(args[0]);
    } else {
      arg = MakeExpr(ExprKind::kTuple, line);
      arg->operands = std::move(args);
      Finish(arg.get());
    }
    return Binary(ExprKind::kGetitem, line, std::move(node), std::move(arg));
  }

  ExprPtr ParseSubscribed() {
    const int line = cur().line;
    std::vector<ExprPtr> args;
    if (IsOp(":")) {
      Next();
      args.push_back(nullptr);
    } else {
      ExprPtr node = ParseExpression();
      if (!IsOp(":")) return node;
      Next();
      args.push_back(std::move(node));
    }
    if (IsOp(":")) {
      args.push_back(nullptr);
    } else if (!IsOp("]") && !IsOp(",")) {
      args.push_back(ParseExpression());
    } else {
      args.push_back(nullptr);
    }
    if (SkipOp(":")) {
      if (!IsOp("]") && !IsOp(",")) {
        args.push_back(ParseExpression());
      } else {
        args.push_back(nullptr);
      }
    } else {
      args.push_back(nullptr);
    }
    auto e = MakeExpr(ExprKind::kSlice, line);
    e->operands = std::move(args);
    Finish(e.get());
    return e;
  }

  void ParseCallArgs(CallArgs* call) {
    const int line = cur().line;
    ExpectOp("(");
    NestingGuard guard(this);
    bool require_comma = false;
    auto ensure = [&](bool ok) {
      if (!ok) Fail("invalid syntax for function call expression", line);
    };
    while (!IsOp(")")) {
      if (require_comma) {
        ExpectOp(",");
        if (IsOp(")")) break;
      }
      if (IsOp("*")) {
        ensure(call->dyn_args == nullptr && call->dyn_kwargs == nullptr);
        Next();
        call->dyn_args = ParseExpression();
      } else if (IsOp("**")) {
        ensure(call->dyn_kwargs == nullptr);
        Next();
        call->dyn_kwargs = ParseExpression();
      } else if (cur().type == Tok::kName && look().type == Tok::kOp && look().value == "=") {
        ensure(call->dyn_kwargs == nullptr);
        std::string key = cur().value;
        Next();
        Next();
        call->kwargs.emplace_back(std::move(key), ParseExpression());
      } else {
        ensure(call->dyn_args == nullptr && call->dyn_kwargs == nullptr && call->kwargs.empty());
        call->args.push_back(ParseExpression());
      }
      require_comma = true;
    }
    ExpectOp(")");
  }

  ExprPtr ParseCall(ExprPtr node) {
    auto e = MakeExpr(ExprKind::kCall, cur().line);
    ParseCallArgs(&e->call);
    e->operands.push_back(std::move(node));
    Finish(e.get());
    return e;
  }

  ExprPtr ParseFilter(ExprPtr node, bool start_inline) {
    while (IsOp("|") || start_inline) {
      if (!start_inline) Next();
      const int line = cur().line;
      std::string name = ExpectAnyName();
      while (SkipOp(".")) {
        name += '.';
        name += ExpectAnyName();
      }
      auto e = MakeExpr(ExprKind::kFilter, line);
      e->name = std::move(name);
      if (IsOp("(")) ParseCallArgs(&e->call);
      e->operands.push_back(std::move(node));
      Finish(e.get());
      node = std::move(e);
      start_inline = false;
    }
    return node;
  }

  ExprPtr ParseTest(ExprPtr node) {
    const int line = cur().line;
    Next();  // is
    const bool negated = SkipName("not");
    std::string name = ExpectAnyName();
    while (SkipOp(".")) {
      name += '.';
      name += ExpectAnyName();
    }
    auto e = MakeExpr(ExprKind::kTest, line);
    e->name = std::move(name);
    const Token& t = cur();
    if (IsOp("(")) {
      ParseCallArgs(&e->call);
    } else if ((t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt ||
                t.type == Tok::kFloat || IsOp("[") || IsOp("{")) &&
               !(IsName("else") || IsName("or") || IsName("and"))) {
      if (IsName("is")) Fail("You cannot chain multiple tests with is");
      NestingGuard guard(this);
      e->call.args.push_back(ParsePostfix(ParsePrimary()));
    }
    e->operands.push_back(std::move(node));
    Finish(e.get());
    if (negated) return Unary(ExprKind::kNot, line, std::move(e));
    return e;
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
  std::vector<MacroStmt*> macros_;
  std::vector<EndTokens> end_stack_;
  std::vector<std::string> tag_stack_;
};

// ---------------------------------------------------------------------------
// Unknown filters and tests fail at parse time, except where jinja2 compiles
// them in a "soft" frame (the test and bodies of an if, an inline if),
// where they fail only if evaluated.

void CheckExpr(const Expr* e, bool soft) {
  if (e == nullptr) return;
  if (e->kind == ExprKind::kCondExpr) soft = true;
  if (!soft && e->kind == ExprKind::kFilter && !IsKnownFilter(e->name)) {
    SyntaxError(e->line, Cat("No filter named ", ReprString(e->name), "."));
  }
  if (!soft && e->kind == ExprKind::kTest && !IsKnownTest(e->name)) {
    SyntaxError(e->line, Cat("No test named ", ReprString(e->name), "."));
  }
  for (const auto& c : e->operands) CheckExpr(c.get(), soft);
  for (const auto& c : e->call.args) CheckExpr(c.get(), soft);
  for (const auto& [k, c] : e->call.kwargs) CheckExpr(c.get(), soft);
  CheckExpr(e->call.dyn_args.get(), soft);
  CheckExpr(e->call.dyn_kwargs.get(), soft);
}

void CheckBody(const Body& body, bool soft) {
  for (const auto& s : body) {
    switch (s->kind) {
      case StmtKind::kIf:
        for (const auto& [test, b] : s->branches) {
          CheckExpr(test.get(), true);
          CheckBody(b, true);
        }
        break;
      case StmtKind::kFor:
        CheckExpr(s->expr.get(), soft);
        CheckExpr(s->cond.get(), false);
        CheckBody(s->body, false);
        CheckBody(s->else_body, false);
        break;
      case StmtKind::kMacro:
        for (const auto& d : s->macro->defaults) CheckExpr(d.get(), false);
        CheckBody(s->macro->body, false);
        break;
      case StmtKind::kWith:
        for (const auto& v : s->with_values) CheckExpr(v.get(), soft);
        CheckBody(s->body, false);
        break;
      case StmtKind::kSetBlock:
      case StmtKind::kFilterBlock:
        CheckExpr(s->expr.get(), soft);
        CheckBody(s->body, false);
        break;
      case StmtKind::kScope:
        CheckBody(s->body, false);
        break;
      default:
        CheckExpr(s->expr.get(), soft);
        break;
    }
  }
}

}  // namespace

bool ComputeIsConst(const Expr& e) {
  if (e.kind == ExprKind::kConst) return true;
  bool is_const = e.kind != ExprKind::kName && e.kind != ExprKind::kCall;
  auto child_const = [&](const ExprPtr& c) {
    is_const = is_const && (c == nullptr || c->is_const);
  };
  for (const auto& c : e.operands) child_const(c);
  for (const auto& c : e.call.args) child_const(c);
  for (const auto& [k, c] : e.call.kwargs) child_const(c);
  child_const(e.call.dyn_args);
  child_const(e.call.dyn_kwargs);
  if (e.kind == ExprKind::kFilter) {
    // Filters that take the context (and unknown ones) are not folded.
    is_const = is_const && e.operands[0] != nullptr && IsKnownFilter(e.name) && e.name != "map" &&
               e.name != "select" && e.name != "reject" && e.name != "selectattr" &&
               e.name != "rejectattr" && e.name != "random";
  }
  if (e.kind == ExprKind::kTest) is_const = is_const && IsKnownTest(e.name);
  return is_const;
}

absl::StatusOr<std::shared_ptr<const Template>> ParseTemplate(std::string_view source) {
  try {
    Lexer lexer(source);
    Parser parser(lexer.Run());
    auto tmpl = std::make_shared<Template>(parser.Parse());
    CheckBody(tmpl->body, false);
    FoldConstants(tmpl.get());
    return std::shared_ptr<const Template>(std::move(tmpl));
  } catch (const Error& e) {
    return absl::InvalidArgumentError(
        Cat("chat template syntax error, line ", e.line, ": ", e.message));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("chat template: out of memory while parsing");
  }
}

}  // namespace coalesce::chat::jinja
