// Turns one sequence's generated tokens into the text its client receives:
// valid UTF-8 only (a character split across tokens goes out when complete),
// with stop sequences cut off. Text that might be the start of a stop
// sequence is held back until it is known not to be.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/tokenizer/tokenizer.h"

namespace coalesce::engine {

class TextStream {
 public:
  // `last_prompt_token` is the context for the first generated token's bytes.
  // Empty stop sequences and ones that are not valid UTF-8 are ignored.
  TextStream(const Tokenizer& tokenizer, int32_t last_prompt_token,
             std::vector<std::string> stop_sequences);

  struct Piece {
    std::string text;      // safe to send now
    bool stopped = false;  // a stop sequence completed; text ends before it
  };
  // Adds one generated token.
  Piece Push(int32_t token);
  // The end of the sequence (not by stop): everything held back.
  std::string Finish();

 private:
  // Appends the text `token` adds to held_ (a tokenizer that does not decode
  // per token: DecodeRun over a window of the latest ids).
  void DecodeWindow(int32_t token, bool finish);
  // The stop sequence check and hold-back on held_.
  Piece Release();

  const Tokenizer& tokenizer_;
  int32_t prev_;
  std::vector<std::string> stops_;
  Utf8StreamDecoder utf8_;
  std::string held_;  // decoded text not yet sent: may start a stop sequence
  // Decoding by window (!tokenizer_.DecodesPerToken()), as HF's DecodeStream:
  // window_ holds the ids of the last text released (context) and those
  // since; window_text_ is the text of the context alone.
  bool per_token_ = true;
  bool hold_all_ = false;  // the decoder may rewrite any text: all waits for Finish
  std::vector<int32_t> window_;
  size_t context_ = 0;        // ids of window_ that are context
  int32_t window_prev_ = -1;  // the id before window_[0]
  std::string window_text_;
};

}  // namespace coalesce::engine
