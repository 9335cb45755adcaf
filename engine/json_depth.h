// A nesting limit for the JSON files the engine reads (config.json,
// safetensors headers and indexes, tokenizer.json). nlohmann parses any depth
// without recursing, but copying or dumping a parsed value, destroying it in
// some releases, and the loaders' own readers of nested components
// (tokenizer.json's Sequence) recurse once per level: a file of a few hundred
// kilobytes of "[[[[..." would overflow the stack. No real file nests more
// than about ten levels.
#pragma once

#include <string_view>

namespace coalesce::engine {

inline constexpr int kMaxJsonDepth = 64;

// Whether `text` nests arrays and objects more than `limit` levels deep.
// Brackets inside strings do not count; malformed text is left to the parser.
inline bool JsonNestsDeeperThan(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

}  // namespace coalesce::engine
