// Hugging Face tokenizer.json, tokenized as HF `tokenizers` (the Rust
// library, Python package `tokenizers`) does, for the BPE tokenizers of LLMs:
//  - SentencePiece-style BPE (Llama 2, TinyLlama, Mistral): normalizer
//    Sequence[Prepend("▁"), Replace(" ", "▁")] or a Metaspace pre-tokenizer,
//    byte_fallback, unk_token, fuse_unk; decoder Sequence[Replace("▁", " "),
//    ByteFallback, Fuse, Strip(" ", 1, 0)] or Metaspace.
//  - the decoder steps ByteFallback, Fuse, Replace (literal or regex), Strip,
//    ByteLevel and Metaspace in any order and nesting, composed as HF's
//    decode_chain composes them (e.g. [ByteFallback, Fuse, Replace("▁", " "),
//    Strip], which transformers writes for GGUF conversions).
//  - byte-level BPE (GPT-2, Llama 3, Qwen2): ByteLevel pre-tokenizer
//    (add_prefix_space, use_regex), Split pre-tokenizers with Oniguruma
//    regexes (run with PCRE2), ignore_merges, ByteLevel decoder.
//  - the Unicode normalizers NFC (Qwen2), NFD, NFKC and NFKD, alone or in a
//    Sequence, run with utf8proc. HF's tables are Unicode 9.0's, utf8proc's
//    newer: the characters assigned since that utf8proc would normalize are
//    left as they are, as HF leaves them (hf_tokenizer_text.cc lists them).
//  - added tokens (single_word, lstrip, rstrip, normalized, special) and the
//    TemplateProcessing / ByteLevel post-processors.
// A file that asks for anything else (another model type, normalizer,
// pre-tokenizer, post-processor or decoder, or an option value that changes
// ids or text in a way not implemented) fails to load with an error naming
// the file and the component: never a silently different tokenization. So
// does a file no tokenizer would have but that would exhaust the loader: JSON
// nested more than 64 levels deep, or ids spread over more than twice the
// tokens it defines (plus 1024).
//
// Encode(text, add_special_tokens) == HF encode(text, add_special_tokens).ids.
// As in HF, added special tokens written in the text ("</s>") are matched
// whether or not add_special_tokens is set; add_special_tokens only controls
// the post-processor's template (the BOS of Llama). Invalid UTF-8 in `text`
// (which HF cannot be given) is first replaced by U+FFFD per maximal subpart.
//
// Decoding: when the decoder chain is not per token (DecodesPerToken()
// false: a step that needs several tokens at once, such as Replace or Strip
// of the end after fusing, or a step after ByteFallback other than fusing),
// Decode(tokenizer, ids) runs HF's whole chain over the run and equals HF
// decode(ids, skip_special_tokens=True) for every id sequence (tokens 0.21
// panics where Strip would cut one character twice; we cut it once, as
// later releases do). Otherwise, the fast path used by today's files:
// concatenating TokenBytes(ids[i-1], ids[i]) (ids[-1] = -1) and then
// SanitizeUtf8 (that is, Decode(tokenizer, ids)) gives HF
// decode(ids, skip_special_tokens=True) for every id sequence when the
// decoder is ByteLevel (GPT-2, Llama 3, Qwen2), and otherwise for every id
// sequence in which
//  (a) the first text token (not special, inside the vocabulary) is ids[0]
//      or directly follows bos_id(), and no later text token directly
//      follows bos_id(). Decoders that treat the first token differently
//      (Strip after Fuse, as in Llama 2; Metaspace) apply to the first text
//      token in HF; TokenBytes only sees its predecessor, so it applies them
//      when prev is -1 or bos_id(). Encode's output satisfies (a) unless the
//      text spells the BOS token ("...</s><s>[INST]"): there HF keeps the
//      space of the token after the second <s> and we drop it. A prompt that
//      satisfies (a) still does with its generation appended (streamed with
//      the prompt's last token as prev) unless the model generates BOS.
//  (b) every run of adjacent byte-fallback tokens (<0xXX>) is valid UTF-8:
//      HF's ByteFallback turns each byte of an invalid run into U+FFFD, which
//      needs the whole run; we pass the bytes on and SanitizeUtf8 replaces
//      each maximal invalid subpart, so "<0xE4><0xB8>" decodes to one U+FFFD
//      here and two in HF. Encode never produces an invalid run.
// Special added tokens (BOS, EOS, <unk> when it is one) give "", as HF's
// skip_special_tokens; ids outside the vocabulary give "".
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

struct HfTokenizerOptions {
  // The ids that end generation (usually from the model's config.json or
  // generation_config.json). When unset: each added special token whose
  // content is a well-known end marker ("</s>", "<|endoftext|>", "<|eot_id|>",
  // "<|end_of_text|>", "<|im_end|>", "<|eom_id|>", "<eos>", "<|end|>",
  // "<end_of_turn>"), in id order; tokenizer.json itself does not say which
  // token is EOS.
  std::optional<std::vector<int32_t>> eos_ids;
  // Repairs two defects of legacy files that HF itself refuses to load
  // ("Merges text file invalid", "Token ... out of vocabulary"): a merge
  // written "a b" whose pieces contain spaces (legacy Llama conversions) is
  // split at the one space that leaves both halves and their concatenation in
  // the vocabulary, and a merge whose pieces or result are missing from the
  // vocabulary is dropped (it can never produce a token). Each repair is
  // listed in load_notes(). Files HF loads are never changed by this. When
  // false, such files fail to load, as in HF.
  bool repair_merges = true;
  // How a non-special added token with "normalized": true is decoded. HF
  // tokenizers up to 0.22 decodes its content as written ("world"); 0.23
  // decodes its normalized form, so that the decoder undoes the normalizer
  // ("world" -> "▁world" -> " world"). The default follows the release
  // tests/requirements.txt pins (0.21).
  bool decode_normalized_added_tokens = false;
};

class HfTokenizer : public Tokenizer {
 public:
  struct Impl;
  explicit HfTokenizer(std::shared_ptr<const Impl> impl);

  int vocab_size() const override;
  // The first id the post-processor puts before the text, or -1 if it puts
  // none (GPT-2).
  int32_t bos_id() const override;
  std::span<const int32_t> eos_ids() const override;
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override;
  // Gives up before merging a word whose characters are more than the
  // tokens left could hold (see Impl::max_piece_chars), or once the tokens
  // made exceed max_tokens.
  std::optional<std::vector<int32_t>> EncodeAtMost(std::string_view text, bool add_special_tokens,
                                                   size_t max_tokens) const override;
  // HF encode with encode_special_tokens (transformers' split_special_tokens):
  // the added special tokens are passed over where they match outside
  // `special_ranges`, in both passes (the raw text, and the normalized text
  // for tokens with "normalized": true); non-special added tokens match as
  // before. In the normalized pass a piece the normalizer changed keeps none
  // (its offsets are no longer the text's): a special normalized token is
  // then text even inside `special_ranges` (GPT-2's <|endoftext|> is such a
  // token, but its tokenizer has no normalizer). Text that is not valid
  // UTF-8 keeps none at all.
  std::optional<std::vector<int32_t>> EncodeSplitAtMost(std::string_view text,
                                                        bool add_special_tokens,
                                                        std::span<const ByteRange> special_ranges,
                                                        size_t max_tokens) const override;
  // The first added special token Encode(text, false) gives.
  std::optional<std::string> FindSpecialToken(std::string_view text) const override;
  // For a chain that is not per token (DecodesPerToken() false) this is the
  // token's text as if the chain ran on it alone: Decode uses DecodeRun.
  std::string TokenBytes(int32_t prev, int32_t token) const override;
  bool DecodesPerToken() const override;
  // Per-token chains: the default (concatenated TokenBytes). Others: HF's
  // decoder chain over the run's tokens (special tokens and unknown ids left
  // out), the run starting the text when prev is -1 or bos_id().
  std::string DecodeRun(std::span<const int32_t> ids, int32_t prev,
                        bool* open_end = nullptr) const override;

  // The token's string in the file (vocabulary piece or added token content),
  // or "" for an unknown id.
  std::string_view token_text(int32_t id) const;
  // Whether `id` is an added special token (skipped when decoding).
  bool is_special(int32_t id) const;
  // What repair_merges changed, one line each.
  const std::vector<std::string>& load_notes() const;

 private:
  std::shared_ptr<const Impl> impl_;
};

// Reads and parses `tokenizer_json_path`. Errors name the file.
absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadHfTokenizer(
    const std::string& tokenizer_json_path, const HfTokenizerOptions& options = {});

// The same from the file's text; `source` names it in errors.
absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadHfTokenizerFromJson(
    std::string_view json, const std::string& source, const HfTokenizerOptions& options = {});

}  // namespace coalesce::engine
