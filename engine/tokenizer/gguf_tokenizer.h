// Tokenizers described by GGUF metadata (the tokenizer.ggml.* keys llama.cpp
// writes), built on the tokenizer.json implementation (hf_tokenizer.h): the
// metadata is turned into the components Hugging Face `tokenizers` would run
// for the same vocabulary, and from there on it is that tokenizer.
//
// tokenizer.ggml.model "llama" (SentencePiece BPE, e.g. Llama 2, TinyLlama,
// Mistral):
//  - BPE with byte_fallback and fuse_unk; the unknown token is
//    unknown_token_id, else the token of type 2 (unknown).
//  - The merges come from the scores, as SentencePiece's BPE merges: the
//    adjacent pair whose concatenation is the token of highest score merges
//    first, the leftmost on ties. Every split of a token into two tokens is a
//    merge ranked by the token's score alone, equal scores sharing a rank
//    (HF's converters instead order the splits of one token by their ids;
//    the two differ only where one piece can be reached by several splits at
//    once). Tokens of type unknown, control and byte are never the result of
//    a merge. Normal tokens longer than kGgufMaxMergedPieceBytes are refused.
//  - Normalizer Prepend("▁") (when add_space_prefix, default true) and
//    Replace(" ", "▁"); decoder Replace("▁", " "), ByteFallback, Fuse and,
//    with add_space_prefix, Strip(" ", 1, 0): the tokenizer.json of Llama 2.
//  - tokenizer.ggml.pre is ignored (the files say "default").
// tokenizer.ggml.model "gpt2" (byte-level BPE, e.g. GPT-2, Llama 3, Qwen2,
// SmolLM):
//  - BPE over the merges "left right" of tokenizer.ggml.merges, ranked by
//    their order (a pair given twice keeps its first rank, as in llama.cpp);
//    the merge is split at the first space after its first byte at which both
//    halves are tokens, and the concatenation must be a token too.
//  - The pre-tokenizer llama.cpp runs for tokenizer.ggml.pre, written as HF
//    components (each llama.cpp regex a Split(Isolated), then ByteLevel):
//      "default" (or no key): llama.cpp's default regexes (punctuation runs,
//        GPT-2's regex, number runs, then groups of three ASCII digits);
//      "gpt-2": GPT-2's ByteLevel pre-tokenizer;
//      "llama-bpe": Llama 3's Split regex, with ignore_merges, as its
//        tokenizer.json has;
//      "qwen2": NFC, then Qwen2's Split regex;
//      "smollm": each digit split off (\p{N}), then GPT-2's ByteLevel: HF's
//        Sequence[Digits(individual_digits), ByteLevel].
//    Any other value is refused.
//  - Decoder ByteLevel. No unknown token (every byte is a token).
// Both:
//  - Token types (tokenizer.ggml.token_type): 1 normal, 2 unknown, 3 control,
//    4 user-defined, 5 unused, 6 byte (0, llama.cpp's "undefined", is taken as
//    normal). Unknown and control tokens are special added tokens (matched in
//    the raw text, skipped when decoding), user-defined ones non-special
//    added tokens matched in the raw text (normalized: false). Without
//    token types, the unknown, BOS and EOS tokens are the special ones.
//  - The template: BOS before the text when add_bos_token (default: true for
//    "llama" and "llama-bpe", false otherwise; a default true needs
//    bos_token_id, an explicit true is an error without it), EOS after it
//    when add_eos_token (default false).
//  - The ids that end generation: eos_token_id, eot_token_id, eom_token_id,
//    then every control token whose text is one of the end markers
//    HfTokenizerOptions lists, without repeats.
//  - Tokens must be valid UTF-8 (the tokenizer.json path cannot express
//    anything else), at most kGgufMaxTokens of them.
//
// This room knows nothing of the GGUF container: engine/model/gguf_vocab.h
// reads the keys into a GgufVocab.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/hf_tokenizer.h"

namespace coalesce::engine {

// Limits that keep a hostile vocabulary from exhausting memory or time;
// real vocabularies stay far below them.
inline constexpr size_t kGgufMaxTokens = size_t{1} << 22;
inline constexpr size_t kGgufMaxMergedPieceBytes = 1024;

// The tokenizer.ggml.* metadata of one file, as written (absent keys empty or
// nullopt).
struct GgufVocab {
  std::string source;                // the file, for messages
  std::string model;                 // tokenizer.ggml.model: "llama" or "gpt2"
  std::string pre;                   // tokenizer.ggml.pre ("" when absent)
  std::vector<std::string> tokens;   // tokenizer.ggml.tokens
  std::vector<float> scores;         // tokenizer.ggml.scores
  std::vector<int32_t> token_types;  // tokenizer.ggml.token_type
  std::vector<std::string> merges;   // tokenizer.ggml.merges ("left right")
  std::optional<int32_t> bos_id, eos_id, eot_id, eom_id, unk_id, pad_id;
  std::optional<bool> add_bos, add_eos, add_space_prefix;
};

// Builds the tokenizer. Anything unsupported (a tokenizer.ggml.model other
// than "llama" and "gpt2", an unknown tokenizer.ggml.pre, inconsistent
// arrays or ids) is an error with one message naming vocab.source, the key and
// the value. Never crashes, whatever the vocabulary holds.
absl::StatusOr<std::unique_ptr<HfTokenizer>> BuildGgufTokenizer(const GgufVocab& vocab);

}  // namespace coalesce::engine
