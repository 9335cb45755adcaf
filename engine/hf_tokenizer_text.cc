// Text helpers of the tokenizer.json tokenizer: UTF-8, GPT-2's byte map,
// HF's split behaviours, the added-token matcher and the normalizers.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "engine/hf_tokenizer_internal.h"

namespace coalesce::engine::hf {

// ---------------------------------------------------------------------------
// UTF-8 and character classes
// ---------------------------------------------------------------------------

size_t CharLength(char lead) {
  const auto b = static_cast<uint8_t>(lead);
  return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

uint32_t DecodeChar(std::string_view s, size_t at) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(s[at + i])); };
  switch (CharLength(s[at])) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

namespace {

void AppendChar(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace

bool IsWhiteSpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

ByteLevelMap::ByteLevelMap() {
  char_to_byte.fill(-1);
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = printable ? b : next++;
    AppendChar(cp, byte_to_char[b]);
    char_to_byte[cp] = static_cast<int16_t>(b);
  }
}

const ByteLevelMap& ByteLevel() {
  static const ByteLevelMap* const kMap = new ByteLevelMap();
  return *kMap;
}

std::string ReplaceAll(std::string_view text, std::string_view pattern, std::string_view with) {
  std::string out;
  size_t at = 0;
  for (size_t found = text.find(pattern); found != std::string_view::npos;
       found = text.find(pattern, at)) {
    out.append(text.substr(at, found - at));
    out.append(with);
    at = found + pattern.size();
  }
  out.append(text.substr(at));
  return out;
}

void FindPattern(const Pattern& pattern, std::string_view text,
                 std::vector<std::pair<size_t, size_t>>& out) {
  if (pattern.regex) {
    pattern.regex->FindAll(text, out);
    return;
  }
  for (size_t at = text.find(pattern.literal); at != std::string_view::npos;
       at = text.find(pattern.literal, at + pattern.literal.size())) {
    out.emplace_back(at, at + pattern.literal.size());
  }
}

// ---------------------------------------------------------------------------
// Splitting pieces of text
// ---------------------------------------------------------------------------

void SplitPiece(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                SplitBehavior behavior, bool invert, std::vector<Piece>& out) {
  struct Part {
    size_t start, end;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  for (const auto& [s, e] : matches) {
    if (prev != s) parts.push_back({prev, s, invert});
    parts.push_back({s, e, !invert});
    prev = e;
  }
  if (prev != piece.text.size()) parts.push_back({prev, piece.text.size(), invert});

  // (start, end, keep) after regrouping.
  struct Group {
    size_t start, end;
    bool keep;
  };
  std::vector<Group> groups;
  // MergedWithNext is MergedWithPrevious read backwards: a match joins the
  // part after it unless that part is a match too.
  const bool backwards = behavior == SplitBehavior::kMergedWithNext;
  if (backwards) std::reverse(parts.begin(), parts.end());
  bool previous_match = false;
  for (const Part& p : parts) {
    switch (behavior) {
      case SplitBehavior::kIsolated:
        groups.push_back({p.start, p.end, true});
        break;
      case SplitBehavior::kRemoved:
        groups.push_back({p.start, p.end, !p.is_match});
        break;
      case SplitBehavior::kContiguous:
        if (p.is_match == previous_match && !groups.empty()) {
          groups.back().end = p.end;
        } else {
          groups.push_back({p.start, p.end, true});
        }
        break;
      case SplitBehavior::kMergedWithPrevious:
      case SplitBehavior::kMergedWithNext:
        if (p.is_match && !previous_match && !groups.empty()) {
          if (backwards) {
            groups.back().start = p.start;
          } else {
            groups.back().end = p.end;
          }
        } else {
          groups.push_back({p.start, p.end, true});
        }
        break;
    }
    previous_match = p.is_match;
  }
  if (backwards) std::reverse(groups.begin(), groups.end());
  for (const Group& g : groups) {
    if (!g.keep || g.start == g.end) continue;
    out.push_back(
        {piece.text.substr(g.start, g.end - g.start), piece.at_input_start && g.start == 0});
  }
}

// ---------------------------------------------------------------------------
// Added-token matching
// ---------------------------------------------------------------------------

void TokenMatcher::Add(std::string_view pattern, int index) {
  if (pattern.empty()) return;
  int node = 0;
  for (const char c : pattern) {
    auto it = nodes_[node].children.find(static_cast<uint8_t>(c));
    if (it == nodes_[node].children.end()) {
      nodes_.push_back({});
      it = nodes_[node].children.emplace(static_cast<uint8_t>(c), nodes_.size() - 1).first;
    }
    node = it->second;
  }
  if (nodes_[node].index < 0) nodes_[node].index = index;
  first_bytes_[static_cast<uint8_t>(pattern[0])] = true;
}

bool TokenMatcher::Find(std::string_view text, size_t from, Match& match) const {
  for (size_t start = from; start < text.size(); ++start) {
    if (!first_bytes_[static_cast<uint8_t>(text[start])]) continue;
    int node = 0, best = -1;
    size_t best_end = 0;
    for (size_t i = start; i < text.size(); ++i) {
      auto it = nodes_[node].children.find(static_cast<uint8_t>(text[i]));
      if (it == nodes_[node].children.end()) break;
      node = it->second;
      if (nodes_[node].index >= 0) {
        best = nodes_[node].index;
        best_end = i + 1;
      }
    }
    if (best >= 0) {
      match = {start, best_end, best};
      return true;
    }
  }
  return false;
}

// ---------------------------------------------------------------------------
// Normalizers
// ---------------------------------------------------------------------------

std::string Normalize(const std::vector<NormalizerStep>& steps, std::string_view text) {
  std::string s(text);
  std::vector<std::pair<size_t, size_t>> matches;
  for (const NormalizerStep& step : steps) {
    switch (step.kind) {
      case NormalizerStep::Kind::kPrepend:
        if (!s.empty()) s.insert(0, step.text);
        break;
      case NormalizerStep::Kind::kReplace: {
        matches.clear();
        FindPattern(step.pattern, s, matches);
        if (matches.empty()) break;
        std::string out;
        size_t at = 0;
        for (const auto& [start, end] : matches) {
          out.append(s, at, start - at);
          out.append(step.text);
          at = end;
        }
        out.append(s, at);
        s = std::move(out);
        break;
      }
    }
  }
  return s;
}

}  // namespace coalesce::engine::hf
