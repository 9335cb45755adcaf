#include "engine/tokenizer/text_stream.h"

#include <algorithm>
#include <string_view>
#include <utility>

namespace coalesce::engine {

TextStream::TextStream(const Tokenizer& tokenizer, int32_t last_prompt_token,
                       std::vector<std::string> stop_sequences)
    : tokenizer_(tokenizer),
      prev_(last_prompt_token),
      per_token_(tokenizer.DecodesPerToken()),
      window_prev_(last_prompt_token) {
  // An empty stop sequence would match before any text, and one that is not
  // valid UTF-8 could only match inside a character of the (always valid)
  // output and cut it in half: ignore both.
  for (std::string& s : stop_sequences) {
    if (!s.empty() && SanitizeUtf8(s) == s) stops_.push_back(std::move(s));
  }
  if (!per_token_) {
    // Ids that give no text at all and yet leave it open: every run does.
    tokenizer_.DecodeRun({}, window_prev_, &hold_all_);
  }
}

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

void TextStream::DecodeWindow(int32_t token, bool finish) {
  if (!finish) window_.push_back(token);
  if (hold_all_ && !finish) return;
  bool open = false;
  std::string text = tokenizer_.DecodeRun(window_, window_prev_, &open);
  // Text that later ids may still change (an unfinished run of byte tokens,
  // a character not yet complete) waits, as does text that does not extend
  // the context's (it would mean the decoder rewrote released text).
  if (text.size() <= window_text_.size() || !text.starts_with(window_text_)) return;
  if (!finish && (open || text.ends_with(kReplacement))) return;
  held_.append(text, window_text_.size());
  if (finish) return;
  // The ids since the last release become the context. Their text is decoded
  // as continuing the text before them, which a BOS before them would deny:
  // then the window keeps its start.
  const size_t start = context_;
  const int32_t before = start == 0 ? window_prev_ : window_[start - 1];
  if (start > 0 && before == tokenizer_.bos_id()) {
    context_ = window_.size();
    window_text_ = std::move(text);
    return;
  }
  window_.erase(window_.begin(), window_.begin() + static_cast<ptrdiff_t>(start));
  window_prev_ = before;
  context_ = window_.size();
  window_text_ = tokenizer_.DecodeRun(window_, window_prev_);
}

TextStream::Piece TextStream::Push(int32_t token) {
  if (per_token_) {
    held_ += utf8_.Push(tokenizer_.TokenBytes(prev_, token));
    prev_ = token;
  } else {
    DecodeWindow(token, /*finish=*/false);
  }
  return Release();
}

TextStream::Piece TextStream::Release() {
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
  if (!per_token_) DecodeWindow(-1, /*finish=*/true);
  std::string out = std::move(held_);
  held_.clear();
  out += utf8_.Flush();
  return out;
}

}  // namespace coalesce::engine
