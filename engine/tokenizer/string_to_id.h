// A vocabulary lookup, piece -> id, that takes std::string_view keys without
// building a std::string (transparent hash and equality). Both tokenizers
// use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace coalesce::engine {

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
struct StringViewEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};
using StringToId = std::unordered_map<std::string, int32_t, StringViewHash, StringViewEq>;

}  // namespace coalesce::engine
