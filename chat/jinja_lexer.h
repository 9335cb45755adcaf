// The lexer of jinja2 templates, following jinja2 3.1's (whitespace control,
// trim_blocks, lstrip_blocks, raw blocks, comments): a template's text in,
// its tokens out, for the parser (jinja_parser.cc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace coalesce::chat::jinja {

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

// The tokens of `source`, ending with kEof. Throws Error (kSyntax) where
// jinja2's lexer fails.
std::vector<Token> Lex(std::string_view source);

// Throws Error (kSyntax) with `message` at `line`.
[[noreturn]] void SyntaxError(int line, std::string message);

}  // namespace coalesce::chat::jinja
