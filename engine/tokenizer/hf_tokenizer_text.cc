// Text helpers of the tokenizer.json tokenizer: UTF-8, GPT-2's byte map,
// HF's split behaviours, the added-token matcher and the normalizers
// (Unicode normalization by utf8proc).
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "engine/tokenizer/hf_tokenizer_internal.h"

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

std::string ReplacePattern(const Pattern& pattern, std::string_view text, std::string_view with) {
  if (!pattern.regex) return ReplaceAll(text, pattern.literal, with);
  std::vector<std::pair<size_t, size_t>> matches;
  FindPattern(pattern, text, matches);
  std::string out;
  size_t at = 0;
  for (const auto& [start, end] : matches) {
    out.append(text, at, start - at);
    out.append(with);
    at = end;
  }
  out.append(text, at);
  return out;
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

namespace {

// Characters assigned after Unicode 9.0 that utf8proc 2.8 (Unicode 15.0)
// decomposes, reorders or composes. HF `tokenizers` normalizes with the crate
// unicode-normalization-alignments 0.1.12, whose tables are Unicode 9.0's: to
// it these characters are unassigned, so it leaves them as they are, with
// combining class 0, composing with nothing. (Stability keeps every older
// character's normalization fixed, so nothing else differs.) Found by running
// HF's four normalizers and utf8proc over every code point, alone, between
// U+0345 and U+0334 (combining classes 240 and 1) and as its decomposition;
// test_tokenizer_parity.py repeats that comparison, so a utf8proc with a newer
// Unicode shows which characters to add here.
constexpr std::pair<uint32_t, uint32_t> kUnknownToHf[] = {
    {0x7FD, 0x7FD},     {0x898, 0x89F},     {0x8CA, 0x8D3},     {0x9FE, 0x9FE},
    {0xC3C, 0xC3C},     {0xD3B, 0xD3C},     {0xEBA, 0xEBA},     {0x1715, 0x1715},
    {0x1ABF, 0x1ACE},   {0x1DF6, 0x1DFA},   {0x32FF, 0x32FF},   {0xA7F2, 0xA7F4},
    {0xA82C, 0xA82C},   {0xAB69, 0xAB69},   {0x10781, 0x10785}, {0x10787, 0x107B0},
    {0x107B2, 0x107BA}, {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF},
    {0x10F46, 0x10F50}, {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x1133B, 0x1133B},
    {0x1145E, 0x1145E}, {0x11839, 0x1183A}, {0x11930, 0x11930}, {0x11935, 0x11935},
    {0x11938, 0x11938}, {0x1193D, 0x1193E}, {0x11943, 0x11943}, {0x119E0, 0x119E0},
    {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99}, {0x11D42, 0x11D42},
    {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1},
    {0x1E030, 0x1E06D}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE},
    {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF}, {0x1F16C, 0x1F16C}, {0x1FBF0, 0x1FBF9},
};

bool UnknownToHf(uint32_t cp) {
  auto it = std::upper_bound(std::begin(kUnknownToHf), std::end(kUnknownToHf), cp,
                             [](uint32_t c, const auto& range) { return c < range.first; });
  return it != std::begin(kUnknownToHf) && cp <= std::prev(it)->second;
}

// utf8proc's normalization of `text` (valid UTF-8), appended to `out`.
void AppendUtf8proc(std::string_view text, utf8proc_option_t options, std::string& out) {
  if (text.empty()) return;
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &result, options);
  // Only invalid UTF-8 (which callers never pass) or a failed allocation
  // fail; leaving the text unnormalized beats failing the whole encode.
  if (n < 0) {
    out.append(text);
    return;
  }
  out.append(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
  std::free(result);
}

}  // namespace

std::string NormalizeUnicode(std::string_view text, UnicodeForm form) {
  // ASCII is the same in every form.
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; }))
    return std::string(text);
  // STABLE: no composition into composition exclusions (part of the
  // standard's NFC, optional in utf8proc).
  int options = UTF8PROC_STABLE;
  switch (form) {
    case UnicodeForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case UnicodeForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case UnicodeForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case UnicodeForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  // A character unknown to HF is a starter that composes with nothing, so
  // the text on each side of it normalizes on its own.
  std::string out;
  out.reserve(text.size());
  size_t segment = 0;
  for (size_t at = 0; at < text.size();) {
    const size_t len = CharLength(text[at]);
    if (len > 1 && at + len <= text.size() && UnknownToHf(DecodeChar(text, at))) {
      AppendUtf8proc(text.substr(segment, at - segment), static_cast<utf8proc_option_t>(options),
                     out);
      out.append(text, at, len);
      segment = at + len;
    }
    at += len;
  }
  AppendUtf8proc(text.substr(segment), static_cast<utf8proc_option_t>(options), out);
  return out;
}

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
      case NormalizerStep::Kind::kUnicode:
        s = NormalizeUnicode(s, step.form);
        break;
    }
  }
  return s;
}

}  // namespace coalesce::engine::hf
