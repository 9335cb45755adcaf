#include "engine/tokenizer/text_stream.h"

#include <algorithm>
#include <string_view>
#include <utility>

namespace coalesce::engine {

TextStream::TextStream(const Tokenizer& tokenizer, int32_t last_prompt_token,
                       std::vector<std::string> stop_sequences)
    : tokenizer_(tokenizer), prev_(last_prompt_token) {
  // An empty stop sequence would match before any text, and one that is not
  // valid UTF-8 could only match inside a character of the (always valid)
  // output and cut it in half: ignore both.
  for (std::string& s : stop_sequences) {
    if (!s.empty() && SanitizeUtf8(s) == s) stops_.push_back(std::move(s));
  }
}

TextStream::Piece TextStream::Push(int32_t token) {
  held_ += utf8_.Push(tokenizer_.TokenBytes(prev_, token));
  prev_ = token;

  // A stop sequence anywhere in the held text ends the stream at its earliest
  // occurrence. Everything before held_ was already checked together with
  // its own tail, so searching held_ alone misses nothing.
  size_t first = std::string_view::npos;
  for (const std::string& stop : stops_) first = std::min(first, held_.find(stop));
  if (first != std::string_view::npos) {
    Piece piece{held_.substr(0, first), true};
    held_.clear();
    return piece;
  }

  // Hold back the longest tail of held_ that is a proper prefix of a stop
  // sequence: the next token may complete it.
  const std::string_view held = held_;
  size_t keep = 0;
  for (const std::string_view stop : stops_) {
    for (size_t len = std::min(held.size(), stop.size() - 1); len > keep; --len) {
      if (held.substr(held.size() - len) == stop.substr(0, len)) {
        keep = len;
        break;
      }
    }
  }
  Piece piece{held_.substr(0, held_.size() - keep), false};
  held_.erase(0, held_.size() - keep);
  return piece;
}

std::string TextStream::Finish() {
  std::string out = std::move(held_);
  held_.clear();
  out += utf8_.Flush();
  return out;
}

}  // namespace coalesce::engine
