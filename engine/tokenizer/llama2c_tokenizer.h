// llama2.c's tokenizer.bin: max_token_length, then score/length/bytes per
// token. See karpathy/llama2.c run.c.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace coalesce::engine {

// A SentencePiece-style BPE vocabulary in llama2.c's layout: id 0 <unk>,
// 1 BOS, 2 EOS, 3..258 the byte-fallback tokens <0x00>..<0xFF>, then pieces.
// Encoding follows run.c's encode(): dummy-prefix space, longest-match of
// UTF-8 characters with byte fallback, then repeatedly merge the adjacent
// pair whose concatenation has the highest score. No special token is
// matched in the text, so split_special_tokens changes nothing (the base
// class's EncodeSplitAtMost and FindSpecialToken).
class Llama2cTokenizer : public Tokenizer {
 public:
  Llama2cTokenizer(std::vector<std::string> pieces, std::vector<float> scores);

  int vocab_size() const override;
  int32_t bos_id() const override { return 1; }
  // run.c stops on BOS; </s> (2) ends a sequence too.
  std::span<const int32_t> eos_ids() const override;
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override;
  // Refuses at once when the text has more bytes than max_tokens tokens of
  // the longest piece could hold.
  std::optional<std::vector<int32_t>> EncodeAtMost(std::string_view text, bool add_special_tokens,
                                                   size_t max_tokens) const override;
  std::string TokenBytes(int32_t prev, int32_t token) const override;

  const std::string& piece(int32_t id) const;

 private:
  // implementation-defined lookup structures
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// Reads tokenizer.bin; `vocab_size` comes from the model header.
absl::StatusOr<std::unique_ptr<Llama2cTokenizer>> LoadLlama2cTokenizer(const std::string& path,
                                                                       int vocab_size);

}  // namespace coalesce::engine
