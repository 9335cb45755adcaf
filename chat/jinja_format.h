// Python's number parsing and formatting for templates (jinja_format.cc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "chat/jinja_interp.h"

namespace coalesce::chat::jinja {

// Python's int(str, base) and float(str): false where Python raises.
bool ParsePyInt(std::string_view s, int base, int64_t* out);
bool ParsePyFloat(std::string_view s, double* out);
// int(float), and round(x, ndigits), as Python computes them.
int64_t TruncToInt(double f);
double PyRound(double x, int64_t ndigits);
// str.format(*args, **kwargs), with jinja2's sandboxed attribute lookups.
std::string StrFormat(Interp* in, std::string_view format, const Args& args);

}  // namespace coalesce::chat::jinja
