#include "chat/jinja_unicode.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace coalesce::chat::jinja {
namespace {

struct CaseRun {
  char32_t first, last;
  int32_t delta;
  uint8_t stride;
};
struct CaseSpecial {
  char32_t cp;
  char32_t out[3];
};
struct CodeRange {
  char32_t first, last;
};

#include "chat/jinja_unicode_tables.inc"

template <size_t N>
bool InRanges(const CodeRange (&table)[N], char32_t c) {
  const auto* it = std::upper_bound(std::begin(table), std::end(table), c,
                                    [](char32_t v, const CodeRange& r) { return v < r.first; });
  if (it == std::begin(table)) return false;
  --it;
  return c <= it->last;
}

template <size_t N>
const CaseRun* FindRun(const CaseRun (&table)[N], char32_t c) {
  const auto* it = std::upper_bound(std::begin(table), std::end(table), c,
                                    [](char32_t v, const CaseRun& r) { return v < r.first; });
  if (it == std::begin(table)) return nullptr;
  --it;
  if (c > it->last || (c - it->first) % it->stride != 0) return nullptr;
  return it;
}

template <size_t N>
const CaseSpecial* FindSpecial(const CaseSpecial (&table)[N], char32_t c) {
  const auto* it = std::lower_bound(std::begin(table), std::end(table), c,
                                    [](const CaseSpecial& s, char32_t v) { return s.cp < v; });
  if (it == std::end(table) || it->cp != c) return nullptr;
  return it;
}

template <size_t NR, size_t NS>
void AppendMapped(std::u32string* out, char32_t c, const CaseRun (&runs)[NR],
                  const CaseSpecial (&specials)[NS]) {
  if (const CaseSpecial* s = FindSpecial(specials, c)) {
    for (char32_t o : s->out) {
      if (o != 0) out->push_back(o);
    }
    return;
  }
  if (const CaseRun* r = FindRun(runs, c)) {
    out->push_back(static_cast<char32_t>(static_cast<int64_t>(c) + r->delta));
    return;
  }
  out->push_back(c);
}

}  // namespace

char32_t DecodeUtf8At(std::string_view s, size_t* pos) {
  const size_t i = *pos;
  const auto b0 = static_cast<uint8_t>(s[i]);
  auto escape = [&]() -> char32_t {
    *pos = i + 1;
    return 0xDC00 + b0;
  };
  if (b0 < 0x80) {
    *pos = i + 1;
    return b0;
  }
  int len;
  char32_t cp;
  char32_t min;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return escape();
  }
  if (i + len > s.size()) return escape();
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    if ((b & 0xC0) != 0x80) return escape();
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return escape();
  *pos = i + len;
  return cp;
}

size_t PrevCodePointStart(std::string_view s, size_t end) {
  // Walk back over up to three continuation bytes, then check that the
  // sequence decodes to exactly [start, end); otherwise the last byte stands
  // alone (an escaped byte).
  size_t start = end - 1;
  int back = 0;
  while (start > 0 && back < 3 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) {
    --start;
    ++back;
  }
  size_t pos = start;
  DecodeUtf8At(s, &pos);
  if (pos == end) return start;
  return end - 1;
}

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) out.push_back(DecodeUtf8At(s, &pos));
  return out;
}

void AppendUtf8(std::string* out, char32_t c) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c >= 0xDC80 && c <= 0xDCFF) {
    out->push_back(static_cast<char>(c - 0xDC00));  // an escaped byte
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(&out, c);
  return out;
}

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

size_t CodePointCount(std::string_view s) {
  if (IsAscii(s)) return s.size();
  size_t n = 0, pos = 0;
  while (pos < s.size()) {
    DecodeUtf8At(s, &pos);
    ++n;
  }
  return n;
}

bool IsPySpace(char32_t c) {
  if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool IsLineBreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

bool IsPrintable(char32_t c) {
  if (c < 0x80) return c >= 0x20 && c < 0x7F;
  return !InRanges(kNonPrintable, c);
}
bool IsAlpha(char32_t c) { return InRanges(kAlpha, c); }
bool IsDecimal(char32_t c) { return InRanges(kDecimal, c); }
bool IsDigit(char32_t c) { return InRanges(kDigit, c); }
bool IsNumeric(char32_t c) { return InRanges(kNumeric, c); }
bool IsUpperChar(char32_t c) { return InRanges(kUpperChars, c); }
bool IsLowerChar(char32_t c) { return InRanges(kLowerChars, c); }
bool IsCased(char32_t c) { return InRanges(kCased, c); }

void AppendUpper(std::u32string* out, char32_t c) {
  if (c < 0x80) {
    out->push_back(c >= 'a' && c <= 'z' ? c - 32 : c);
    return;
  }
  AppendMapped(out, c, kUpperRuns, kUpperSpecials);
}
void AppendLower(std::u32string* out, char32_t c) {
  if (c < 0x80) {
    out->push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
    return;
  }
  AppendMapped(out, c, kLowerRuns, kLowerSpecials);
}
void AppendTitle(std::u32string* out, char32_t c) {
  if (c < 0x80) {
    out->push_back(c >= 'a' && c <= 'z' ? c - 32 : c);
    return;
  }
  AppendMapped(out, c, kTitleRuns, kTitleSpecials);
}

namespace {

template <typename F>
std::string MapChars(std::string_view s, F f) {
  std::u32string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) f(&out, DecodeUtf8At(s, &pos));
  return EncodeUtf8(out);
}

}  // namespace

std::string PyUpper(std::string_view s) {
  if (IsAscii(s)) {
    std::string out(s);
    for (char& c : out) {
      if (c >= 'a' && c <= 'z') c -= 32;
    }
    return out;
  }
  return MapChars(s, [](std::u32string* out, char32_t c) { AppendUpper(out, c); });
}

std::string PyLower(std::string_view s) {
  if (IsAscii(s)) {
    std::string out(s);
    for (char& c : out) {
      if (c >= 'A' && c <= 'Z') c += 32;
    }
    return out;
  }
  return MapChars(s, [](std::u32string* out, char32_t c) { AppendLower(out, c); });
}

std::string PyTitle(std::string_view s) {
  bool previous_cased = false;
  return MapChars(s, [&](std::u32string* out, char32_t c) {
    if (previous_cased) {
      AppendLower(out, c);
    } else {
      AppendTitle(out, c);
    }
    previous_cased = IsCased(c);
  });
}

std::string PyCapitalize(std::string_view s) {
  bool first = true;
  return MapChars(s, [&](std::u32string* out, char32_t c) {
    if (first) {
      AppendTitle(out, c);
    } else {
      AppendLower(out, c);
    }
    first = false;
  });
}

std::string PySwapcase(std::string_view s) {
  return MapChars(s, [](std::u32string* out, char32_t c) {
    if (IsUpperChar(c)) {
      AppendLower(out, c);
    } else if (IsLowerChar(c)) {
      AppendUpper(out, c);
    } else {
      out->push_back(c);
    }
  });
}

}  // namespace coalesce::chat::jinja
