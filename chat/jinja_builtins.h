// The names of jinja2's filters and tests (an unknown one is a syntax error
// where jinja2 reports it at compile time).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "chat/jinja_value.h"

namespace coalesce::chat::jinja {

bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);

// Python's errors: ValueError, and TemplateRuntimeError for what chat
// templates may not do.
[[noreturn]] void ValueError(std::string_view message);
[[noreturn]] void NotSupported(std::string_view what);
// Python's str helpers the formatting (jinja_format.cc) shares with the
// methods and filters.
// `v` as a str (TypeError naming `what` otherwise).
const std::string& RequireStr(const Value& v, std::string_view what);
// `v` as an int (TypeError naming `what` otherwise).
int64_t RequireInt(const Value& v, std::string_view what);
// str.strip(chars) family: which = -1 left, 1 right, 0 both; `begin`, when
// given, is set to the byte of `s` where the result starts.
std::string Strip(std::string_view s, const Value* chars, int which, size_t* begin = nullptr);
// `s` padded with `fill` to `width` code points, aligned '<', '>' or '^'.
std::string Pad(std::string_view s, int64_t width, char32_t fill, char align);

}  // namespace coalesce::chat::jinja
