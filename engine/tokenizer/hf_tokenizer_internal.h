// The parsed form of a tokenizer.json, shared by the parser
// (hf_tokenizer_json.cc) and the tokenizer (hf_tokenizer.cc). Each struct is
// one HF `tokenizers` component, with only the options that change ids or
// decoded text; the parser rejects every other component and option value.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/hf_tokenizer_regex.h"
#include "engine/tokenizer/string_to_id.h"

namespace coalesce::engine::hf {

using engine::StringToId;  // engine/tokenizer/string_to_id.h

// A literal or regex pattern, as HF's Replace and Split take them.
struct Pattern {
  std::string literal;                 // used when regex is null; never empty
  std::shared_ptr<const Regex> regex;  // {"Regex": ...}
};

// ---------------------------------------------------------------------------
// Normalizers (applied to each piece of text between added tokens)
// ---------------------------------------------------------------------------

// The Unicode normalization forms of HF's NFC, NFD, NFKC and NFKD normalizers.
enum class UnicodeForm { kNfc, kNfd, kNfkc, kNfkd };

struct NormalizerStep {
  enum class Kind { kPrepend, kReplace, kUnicode };
  Kind kind;
  std::string text;                      // kPrepend: what to prepend; kReplace: the replacement
  Pattern pattern;                       // kReplace
  UnicodeForm form = UnicodeForm::kNfc;  // kUnicode
};

// ---------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------

// HF's SplitDelimiterBehavior: what happens to a match when splitting.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class PrependScheme { kAlways, kFirst, kNever };

struct PreTokenizerStep {
  enum class Kind { kByteLevel, kMetaspace, kSplit };
  Kind kind;
  // kByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // kMetaspace
  std::string replacement;  // one character
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
  // kSplit
  Pattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

// ---------------------------------------------------------------------------
// Model: BPE
// ---------------------------------------------------------------------------

struct BpeModel {
  std::vector<std::string> pieces;  // [vocab_size]: id -> piece ("" for ids without one)
  StringToId ids;                   // piece -> id
  struct Merge {
    uint32_t rank;
    int32_t merged;
  };
  // (left id << 32 | right id) -> the merge of that pair.
  std::unordered_map<uint64_t, Merge> merges;
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<int32_t, 256> byte_ids;  // the id of "<0xXX>", or -1
  std::optional<std::string> continuing_subword_prefix;
  std::optional<std::string> end_of_word_suffix;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
};

// ---------------------------------------------------------------------------
// Added tokens
// ---------------------------------------------------------------------------

struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// ---------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------

// One step of HF's decoder chain (decode_chain: a list of token strings in,
// a list out; a Sequence is flattened into its steps). The tokens the chain
// gives are joined.
struct DecoderStep {
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kByteLevel };
  Kind kind;
  Pattern pattern;      // kReplace: a literal or a regex
  std::string content;  // kReplace: the replacement; kStrip: the character stripped
  int start = 0;        // kStrip: characters stripped at the start
  int stop = 0;         // kStrip: characters stripped at the end
  // kMetaspace
  std::string replacement;
  bool prepend = true;  // prepend_scheme != never: the first token loses its ▁
};

// ---------------------------------------------------------------------------
// The whole file
// ---------------------------------------------------------------------------

struct TokenizerSpec {
  std::string source;  // the file, for messages
  BpeModel model;
  std::vector<AddedToken> added;  // in file order
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  // What the post-processor puts around the ids of the text when
  // add_special_tokens is set.
  std::vector<int32_t> prefix, suffix;
  bool has_decoder = false;  // without one HF joins tokens with " "
  std::vector<DecoderStep> decoders;
  // The decoder's text is the concatenation of each token's own text (given
  // whether it starts the text): TokenBytes decodes it (see hf_tokenizer.h).
  // Otherwise the whole run goes through the chain (HfTokenizer::DecodeRun).
  bool per_token_decode = true;
  // Whether text decoded so far only ever grows at its end as ids are added
  // (once it no longer ends in an open byte-fallback run or an incomplete
  // character), so that it can be streamed; false for chains whose steps
  // after fusing can rewrite text already decoded (a Replace of more than one
  // character or a regex, ByteFallback, ByteLevel).
  bool streamable_decode = true;
  int vocab_size = 0;  // 1 + the largest id of the model or an added token
};

// Parses tokenizer.json text. Errors name `source` and the component.
// `notes` receives what options.repair_merges changed.
absl::StatusOr<TokenizerSpec> ParseTokenizerJson(std::string_view json, const std::string& source,
                                                 const HfTokenizerOptions& options,
                                                 std::vector<std::string>* notes);

// Sets spec.per_token_decode and spec.streamable_decode from spec.decoders
// (hf_tokenizer_json.cc).
void ClassifyDecoder(TokenizerSpec& spec);

// The tokenizer of a finished spec: ClassifyDecoder applied, vocab_size above
// every id of the model, the added tokens, the template and byte_ids, and the
// merges naming ids of the model (ParseTokenizerJson's result is such a spec;
// so is BuildGgufTokenizer's). `notes` become load_notes(); options.eos_ids,
// when set, must lie inside the vocabulary (else an error naming spec.source).
// May throw std::bad_alloc (hf_tokenizer.cc).
absl::StatusOr<std::unique_ptr<HfTokenizer>> MakeTokenizer(TokenizerSpec spec,
                                                           std::vector<std::string> notes,
                                                           const HfTokenizerOptions& options);

// ---------------------------------------------------------------------------
// Text helpers (hf_tokenizer_text.cc)
// ---------------------------------------------------------------------------

// Length of the UTF-8 character starting with `lead` (input is valid UTF-8).
size_t CharLength(char lead);
// The code point of the UTF-8 character at `at`.
uint32_t DecodeChar(std::string_view s, size_t at);
// Unicode White_Space: Rust's char::is_whitespace and regex \s, which HF's
// lstrip/rstrip use.
bool IsWhiteSpace(uint32_t c);

// GPT-2's pre-tokenization regex, which HF's ByteLevel pre-tokenizer uses.
inline constexpr std::string_view kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Rust regex's Unicode \w, which single_word tests on the neighbours of an
// added token.
inline constexpr std::string_view kWordCharPattern =
    R"([\p{L}\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
// others for U+0100 onwards, in byte order.
struct ByteLevelMap {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the character for each byte
  std::array<int16_t, 0x144> char_to_byte;    // code point -> byte, or -1
  ByteLevelMap();
};
const ByteLevelMap& ByteLevel();

std::string ReplaceAll(std::string_view text, std::string_view pattern, std::string_view with);
// Each non-overlapping match of `pattern` in `text` replaced by `with`.
std::string ReplacePattern(const Pattern& pattern, std::string_view text, std::string_view with);
// Non-overlapping matches of `pattern` in `text`, left to right.
void FindPattern(const Pattern& pattern, std::string_view text,
                 std::vector<std::pair<size_t, size_t>>& out);

struct Piece {
  std::string text;
  // The piece starts at byte 0 of the input (HF: offsets_original().0 == 0);
  // Metaspace's prepend_scheme "first" prepends only there.
  bool at_input_start = false;
};

// HF's NormalizedString::split: `matches` cover parts of `piece.text`; the
// text is cut at match boundaries and the parts regrouped by `behavior`.
// Empty parts are dropped, as PreTokenizedString::split drops them.
void SplitPiece(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                SplitBehavior behavior, bool invert, std::vector<Piece>& out);

// Leftmost-longest search over the added tokens' strings (HF uses
// Aho-Corasick with MatchKind::LeftmostLongest). A byte trie: added tokens are
// few and short, so trying each start position is fast enough.
class TokenMatcher {
 public:
  // Adds `pattern`, found as `index`. Of two equal patterns the first wins.
  void Add(std::string_view pattern, int index);
  bool empty() const { return nodes_.size() == 1; }

  struct Match {
    size_t start, end;
    int index;
  };
  // The leftmost match starting at or after `from`, longest among those.
  bool Find(std::string_view text, size_t from, Match& match) const;

 private:
  struct Node {
    std::unordered_map<uint8_t, int> children;
    int index = -1;  // as given to Add
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_bytes_{};  // bytes a pattern starts with
};

// `text` (valid UTF-8) in normalization form `form`, as HF's normalizer of
// that name gives it: utf8proc's normalization, except that characters newer
// than the Unicode version of HF's tables are left alone (see
// hf_tokenizer_text.cc).
std::string NormalizeUnicode(std::string_view text, UnicodeForm form);

// Applies the normalizer steps to `text`.
std::string Normalize(const std::vector<NormalizerStep>& steps, std::string_view text);

}  // namespace coalesce::engine::hf
