#include "engine/tokenizer/tokenizer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace coalesce::engine {

std::optional<std::vector<int32_t>> Tokenizer::EncodeAtMost(std::string_view text,
                                                            bool add_special_tokens,
                                                            size_t max_tokens) const {
  std::vector<int32_t> ids = Encode(text, add_special_tokens);
  if (ids.size() > max_tokens) return std::nullopt;
  return ids;
}

std::optional<std::vector<int32_t>> Tokenizer::EncodeSplitAtMost(
    std::string_view text, bool add_special_tokens, std::span<const ByteRange> /*special_ranges*/,
    size_t max_tokens) const {
  return EncodeAtMost(text, add_special_tokens, max_tokens);
}

std::vector<int32_t> Tokenizer::EncodeSplit(std::string_view text, bool add_special_tokens,
                                            std::span<const ByteRange> special_ranges) const {
  return *EncodeSplitAtMost(text, add_special_tokens, special_ranges, SIZE_MAX);
}

std::optional<std::string> Tokenizer::FindSpecialToken(std::string_view /*text*/) const {
  return std::nullopt;
}

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// What the bytes at the start of `s` are, by the Unicode "maximal subpart"
// rule (Unicode 15, section 3.9, U+FFFD substitution): a well-formed character,
// an ill-formed prefix that no further byte can complete (one U+FFFD each),
// or a well-formed prefix cut off by the end of `s`. Because the decision
// needs no byte after the one that breaks a sequence, decoding in pieces and
// decoding all at once give the same text.
enum class Utf8Kind { kComplete, kInvalid, kIncomplete };
struct Utf8Scan {
  Utf8Kind kind;
  size_t length;  // bytes consumed (kComplete, kInvalid)
};

Utf8Scan ScanUtf8(std::string_view s) {
  const auto b0 = static_cast<uint8_t>(s[0]);
  if (b0 < 0x80) return {Utf8Kind::kComplete, 1};
  size_t need;
  // The allowed range of the second byte excludes overlongs (E0, F0),
  // surrogates (ED) and code points above U+10FFFF (F4).
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {Utf8Kind::kInvalid, 1};  // 80..C1 (continuation, overlong lead), F5..FF
  }
  for (size_t i = 1; i < need; ++i) {
    if (i >= s.size()) return {Utf8Kind::kIncomplete, 0};
    const auto b = static_cast<uint8_t>(s[i]);
    if (b < lo || b > hi) return {Utf8Kind::kInvalid, i};
    lo = 0x80;
    hi = 0xBF;
  }
  return {Utf8Kind::kComplete, need};
}

// Appends the valid UTF-8 for `bytes` to `out` and returns how many trailing
// bytes form an incomplete (but still completable) character; those are not
// consumed.
size_t AppendValidUtf8(std::string_view bytes, std::string& out) {
  size_t i = 0;
  while (i < bytes.size()) {
    // Copy a run of ASCII at once: the common case.
    size_t j = i;
    while (j < bytes.size() && static_cast<uint8_t>(bytes[j]) < 0x80) ++j;
    out.append(bytes.substr(i, j - i));
    i = j;
    if (i == bytes.size()) break;
    const Utf8Scan scan = ScanUtf8(bytes.substr(i));
    switch (scan.kind) {
      case Utf8Kind::kComplete:
        out.append(bytes.substr(i, scan.length));
        i += scan.length;
        break;
      case Utf8Kind::kInvalid:
        out.append(kReplacement);
        i += scan.length;
        break;
      case Utf8Kind::kIncomplete:
        return bytes.size() - i;
    }
  }
  return 0;
}

}  // namespace

std::string SanitizeUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  if (AppendValidUtf8(bytes, out) > 0) out.append(kReplacement);
  return out;
}

std::string Utf8StreamDecoder::Push(std::string_view bytes) {
  std::string out;
  if (pending_.empty()) {
    const size_t tail = AppendValidUtf8(bytes, out);
    pending_.assign(bytes.substr(bytes.size() - tail));
    return out;
  }
  // pending_ is at most 3 bytes, so copying it in front is cheap.
  std::string joined = std::move(pending_);
  joined.append(bytes);
  const size_t tail = AppendValidUtf8(joined, out);
  pending_ = joined.substr(joined.size() - tail);
  return out;
}

std::string Utf8StreamDecoder::Flush() {
  std::string out = SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

std::string Tokenizer::DecodeRun(std::span<const int32_t> ids, int32_t prev, bool* open_end) const {
  if (open_end != nullptr) *open_end = false;
  std::string bytes;
  for (const int32_t id : ids) {
    bytes += TokenBytes(prev, id);
    prev = id;
  }
  return SanitizeUtf8(bytes);
}

std::string Decode(const Tokenizer& tokenizer, std::span<const int32_t> ids, int32_t prev) {
  return tokenizer.DecodeRun(ids, prev);
}

}  // namespace coalesce::engine
