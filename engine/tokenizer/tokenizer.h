// Text <-> token ids. Generate, Tokenize and Detokenize all go through one
// Tokenizer, so a prompt is encoded exactly as Tokenize(add_special_tokens =
// true) encodes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/byte_range.h"

namespace coalesce::engine {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual int vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  // Tokens that end generation with finish_reason end-of-sequence.
  virtual std::span<const int32_t> eos_ids() const = 0;

  // Encodes `text`; with `add_special_tokens` the BOS token comes first.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const = 0;

  // Encode, for a caller that can use at most `max_tokens` tokens: nothing
  // when the result would be longer, given up as soon as that is certain, so
  // that a prompt that cannot fit the context is refused without being
  // tokenized in full. The default encodes in full, then compares.
  virtual std::optional<std::vector<int32_t>> EncodeAtMost(std::string_view text,
                                                           bool add_special_tokens,
                                                           size_t max_tokens) const;

  // Encoding as transformers' split_special_tokens=True encodes (HF
  // `tokenizers`' encode_special_tokens): special tokens written in the text
  // ("<|im_end|>", "</s>") are the ordinary text they spell, not the tokens,
  // except inside `special_ranges` (sorted, disjoint byte ranges of `text`:
  // the text a chat template wrote itself), where a special token whose
  // text lies wholly inside one range is the token, as Encode makes it.
  // Nothing else changes: text without special tokens encodes as Encode
  // encodes it, and the text between the special tokens kept is tokenized
  // whole, across the ranges' edges. Nothing when the result would have more
  // than `max_tokens` tokens, as EncodeAtMost. The default is EncodeAtMost,
  // right for a tokenizer that matches no special token in the text (llama2.c's);
  // one that does overrides it.
  virtual std::optional<std::vector<int32_t>> EncodeSplitAtMost(
      std::string_view text, bool add_special_tokens, std::span<const ByteRange> special_ranges,
      size_t max_tokens) const;
  std::vector<int32_t> EncodeSplit(std::string_view text, bool add_special_tokens,
                                   std::span<const ByteRange> special_ranges = {}) const;

  // The text of the first special token Encode(text, false) gives, or
  // nullopt when it gives none (the default: a tokenizer that matches no
  // special token in the text).
  virtual std::optional<std::string> FindSpecialToken(std::string_view text) const;

  // The raw bytes `token` stands for when it follows `prev` (-1: none). May be
  // part of a UTF-8 character (byte-fallback tokens). Control tokens (BOS,
  // EOS, unknown) give "".
  virtual std::string TokenBytes(int32_t prev, int32_t token) const = 0;

  // Whether the text of a run of ids is the concatenation of TokenBytes (then
  // made valid UTF-8), so that it can be decoded and streamed token by token.
  // Otherwise only DecodeRun gives it (a decoder that looks at several tokens
  // at once).
  virtual bool DecodesPerToken() const { return true; }

  // The text of `ids` as valid UTF-8, `prev` being the token before ids[0]
  // (-1: none). The default is SanitizeUtf8 of the concatenated TokenBytes.
  // If `open_end` is not null, it is set to whether ids after the run may
  // still change the run's text other than by completing a trailing
  // incomplete character (which shows as U+FFFD): TextStream holds such text
  // back. Always false when DecodesPerToken().
  virtual std::string DecodeRun(std::span<const int32_t> ids, int32_t prev,
                                bool* open_end = nullptr) const;
};

// Decodes `ids` to valid UTF-8 (invalid or incomplete byte sequences become
// U+FFFD): tokenizer.DecodeRun(ids, prev). `prev` is the token before
// ids[0], or -1.
std::string Decode(const Tokenizer& tokenizer, std::span<const int32_t> ids, int32_t prev = -1);

// Turns a stream of bytes into a stream of valid UTF-8: Push returns the
// longest complete prefix of what it has seen and keeps an incomplete
// character for later; bytes that can never form a character become U+FFFD.
// The concatenation of all pieces equals Decode of the whole byte string.
class Utf8StreamDecoder {
 public:
  std::string Push(std::string_view bytes);
  // Everything still held, with an incomplete trailing character as U+FFFD.
  std::string Flush();

 private:
  std::string pending_;
};

// Replaces each invalid or incomplete UTF-8 sequence in `bytes` with U+FFFD.
std::string SanitizeUtf8(std::string_view bytes);

}  // namespace coalesce::engine
