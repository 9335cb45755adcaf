// llama2.c's formats: the checkpoint (7 int32 header fields, then float32
// weights) and tokenizer.bin (max_token_length, then score/length/bytes per
// token). See karpathy/llama2.c run.c.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

namespace coalesce::engine {

// Loads a llama2.c checkpoint. A negative vocab_size in the header means an
// untied classifier follows the weights. Every size is checked against the
// file's length: a truncated or inconsistent file is an error naming the file.
absl::StatusOr<Model> LoadLlama2cModel(const std::string& path);

// A SentencePiece-style BPE vocabulary in llama2.c's layout: id 0 <unk>,
// 1 BOS, 2 EOS, 3..258 the byte-fallback tokens <0x00>..<0xFF>, then pieces.
// Encoding follows run.c's encode(): dummy-prefix space, longest-match of
// UTF-8 characters with byte fallback, then repeatedly merge the adjacent
// pair whose concatenation has the highest score.
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
