// The names of jinja2's filters and tests (an unknown one is a syntax error
// where jinja2 reports it at compile time).
#pragma once

#include <string_view>

namespace coalesce::chat::jinja {

bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);

}  // namespace coalesce::chat::jinja
