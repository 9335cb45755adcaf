// Python's str semantics on UTF-8 text, for the chat template interpreter
// (jinja_*.cc): code points, whitespace, case mapping and the character
// classes str.isprintable/isalpha/... use, from the Unicode tables of the
// Python that transformers runs under (jinja_unicode_tables.inc).
//
// Bytes that are not valid UTF-8 decode to U+DC80..U+DCFF (Python's
// "surrogateescape") and encode back to the same byte, so text passes
// through every operation unchanged except where the operation itself
// changes it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace coalesce::chat::jinja {

// Decodes the code point at `pos` and advances `pos` past it.
char32_t DecodeUtf8At(std::string_view s, size_t* pos);
// The start of the code point that ends at `end` (exclusive).
size_t PrevCodePointStart(std::string_view s, size_t end);
std::u32string DecodeUtf8(std::string_view s);
void AppendUtf8(std::string* out, char32_t c);
std::string EncodeUtf8(std::u32string_view s);
// Number of code points (Python's len()).
size_t CodePointCount(std::string_view s);
bool IsAscii(std::string_view s);

// str.isspace() of one code point (also what Python's re `\s` matches).
bool IsPySpace(char32_t c);
// str.splitlines() line boundaries.
bool IsLineBreak(char32_t c);
bool IsPrintable(char32_t c);
bool IsAlpha(char32_t c);
bool IsDecimal(char32_t c);
bool IsDigit(char32_t c);
bool IsNumeric(char32_t c);
bool IsUpperChar(char32_t c);
bool IsLowerChar(char32_t c);
bool IsCased(char32_t c);

// Full case mappings of one code point (one to three code points).
void AppendUpper(std::u32string* out, char32_t c);
void AppendLower(std::u32string* out, char32_t c);
void AppendTitle(std::u32string* out, char32_t c);

// str.upper(), lower(), title(), capitalize(), swapcase() on UTF-8.
std::string PyUpper(std::string_view s);
std::string PyLower(std::string_view s);
std::string PyTitle(std::string_view s);
std::string PyCapitalize(std::string_view s);
std::string PySwapcase(std::string_view s);

}  // namespace coalesce::chat::jinja
