// GgufVocab -> hf::TokenizerSpec -> HfTokenizer. Every value is checked
// before it is used as an index, so the spec handed to hf::MakeTokenizer
// only names ids inside the vocabulary.
#include "engine/tokenizer/gguf_tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "engine/tokenizer/hf_tokenizer_internal.h"

namespace coalesce::engine {
namespace {

using hf::Cat;

// tokenizer.ggml.token_type values (gguf-py's TokenType; 0 is llama.cpp's
// "undefined").
enum TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

constexpr std::string_view kSupportedModels = "llama, gpt2";
constexpr std::string_view kSupportedPre = "default, gpt-2, llama-bpe, qwen2, smollm";

// The pre-tokenizer regexes of llama.cpp (src/llama-vocab.cpp) for the
// tokenizer.ggml.pre values supported here. Llama 3's and Qwen2's are the
// patterns of their tokenizer.json files, which llama.cpp rewrites without
// (?i:...) for its own regex engine.
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kPunctuationRunRegex = R"([\p{P}\$\+<=>\^~\|]+)";
constexpr std::string_view kNumberRunRegex = R"(\p{N}+)";
constexpr std::string_view kThreeDigitsRegex = R"([0-9][0-9][0-9])";
constexpr std::string_view kNumberRegex = R"(\p{N})";

// SentencePiece's meta symbol for a space.
constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // ▁

// A string for messages: quoted, control characters (and every byte of
// invalid UTF-8) escaped, cut after 64 bytes.
std::string Quote(std::string_view s) {
  const bool valid = SanitizeUtf8(s) == s;
  size_t n = std::min<size_t>(s.size(), 64);
  while (valid && n < s.size() && n > 0 && (static_cast<uint8_t>(s[n]) & 0xC0) == 0x80) --n;
  std::string out = "\"";
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20 || c == 0x7F || (!valid && c >= 0x80)) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out.push_back('"');
  if (n < s.size()) out += "...";
  return out;
}

hf::DecoderStep Decoder(hf::DecoderStep::Kind kind) {
  hf::DecoderStep step;
  step.kind = kind;
  return step;
}

hf::NormalizerStep Normalizer(hf::NormalizerStep::Kind kind) {
  hf::NormalizerStep step;
  step.kind = kind;
  return step;
}

// Length of the UTF-8 character at `at` of valid UTF-8.
size_t CharAt(std::string_view s, size_t at) { return hf::CharLength(s[at]); }

class Builder {
 public:
  explicit Builder(const GgufVocab& vocab) : v_(vocab) {}
  absl::StatusOr<std::unique_ptr<HfTokenizer>> Build();

 private:
  absl::Status Invalid(std::string_view what) const {
    return absl::InvalidArgumentError(Cat(v_.source, ": ", what));
  }
  absl::Status Unsupported(std::string_view what) const {
    return absl::UnimplementedError(Cat(v_.source, ": ", what));
  }
  int32_t TypeOf(size_t id) const { return v_.token_types.empty() ? kNormal : v_.token_types[id]; }

  absl::Status CheckArrays();
  absl::Status CheckId(const char* key, const std::optional<int32_t>& id) const;
  void MakeModel();
  void AddTokens();
  absl::Status SentencePieceMerges();
  absl::Status Gpt2Merges();
  absl::Status PreTokenizer();
  absl::Status Template();
  std::vector<int32_t> EosIds() const;

  const GgufVocab& v_;
  bool spm_ = false;  // "llama"
  hf::TokenizerSpec spec_;
};

absl::Status Builder::CheckArrays() {
  const size_t n = v_.tokens.size();
  if (n == 0) return Invalid("tokenizer.ggml.tokens is missing or empty");
  if (n > kGgufMaxTokens) {
    return Invalid(Cat("tokenizer.ggml.tokens has ", n, " tokens, more than the ", kGgufMaxTokens,
                       " coalesce accepts"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (SanitizeUtf8(v_.tokens[i]) != v_.tokens[i]) {
      return Invalid(
          Cat("tokenizer.ggml.tokens[", i, "] = ", Quote(v_.tokens[i]), " is not valid UTF-8"));
    }
  }
  auto same_length = [&](const char* key, size_t size) -> absl::Status {
    if (size == 0 || size == n) return absl::OkStatus();
    return Invalid(Cat(key, " has ", size, " entries but tokenizer.ggml.tokens has ", n,
                       ": there must be one per token"));
  };
  RETURN_IF_ERROR(same_length("tokenizer.ggml.scores", v_.scores.size()));
  RETURN_IF_ERROR(same_length("tokenizer.ggml.token_type", v_.token_types.size()));
  for (size_t i = 0; i < v_.token_types.size(); ++i) {
    const int32_t t = v_.token_types[i];
    if (t < kUndefined || t > kByte) {
      return Invalid(Cat("tokenizer.ggml.token_type[", i, "] = ", t,
                         " is not a token type (0 to 6: undefined, normal, unknown, control, "
                         "user-defined, unused, byte)"));
    }
  }
  if (spm_) {
    if (v_.scores.empty()) {
      return Invalid(
          "tokenizer.ggml.scores is missing: a \"llama\" (SentencePiece) tokenizer merges by "
          "them");
    }
    for (size_t i = 0; i < n; ++i) {
      if (std::isnan(v_.scores[i])) {
        return Invalid(Cat("tokenizer.ggml.scores[", i, "] = nan is not a number"));
      }
    }
  }
  RETURN_IF_ERROR(CheckId("tokenizer.ggml.bos_token_id", v_.bos_id));
  RETURN_IF_ERROR(CheckId("tokenizer.ggml.eos_token_id", v_.eos_id));
  RETURN_IF_ERROR(CheckId("tokenizer.ggml.eot_token_id", v_.eot_id));
  RETURN_IF_ERROR(CheckId("tokenizer.ggml.eom_token_id", v_.eom_id));
  RETURN_IF_ERROR(CheckId("tokenizer.ggml.unknown_token_id", v_.unk_id));
  RETURN_IF_ERROR(CheckId("tokenizer.ggml.padding_token_id", v_.pad_id));
  return absl::OkStatus();
}

absl::Status Builder::CheckId(const char* key, const std::optional<int32_t>& id) const {
  if (!id || (*id >= 0 && static_cast<size_t>(*id) < v_.tokens.size())) return absl::OkStatus();
  return Invalid(Cat(key, " = ", *id, " is outside the vocabulary (tokenizer.ggml.tokens has ",
                     v_.tokens.size(), " tokens)"));
}

// The BPE vocabulary: every token, as HF's converters put every token in the
// model's vocab. A text given to two ids looks up the last (llama.cpp's
// token_to_id); empty tokens are never looked up.
void Builder::MakeModel() {
  hf::BpeModel& m = spec_.model;
  const size_t n = v_.tokens.size();
  m.pieces = v_.tokens;
  m.ids.reserve(n);
  for (size_t id = 0; id < n; ++id) {
    if (!v_.tokens[id].empty()) m.ids[v_.tokens[id]] = static_cast<int32_t>(id);
  }
  m.byte_ids.fill(-1);
  if (spm_) {
    m.byte_fallback = true;
    m.fuse_unk = true;
    if (v_.unk_id) {
      m.unk_id = *v_.unk_id;
    } else {
      for (size_t id = 0; id < n && m.unk_id < 0; ++id) {
        if (TypeOf(id) == kUnknown) m.unk_id = static_cast<int32_t>(id);
      }
    }
    // HF looks byte-fallback pieces up as "<0x0A>".
    static constexpr char kHex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      const std::string piece = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
      if (auto it = m.ids.find(piece); it != m.ids.end()) m.byte_ids[b] = it->second;
    }
  }
  spec_.vocab_size = static_cast<int>(n);
}

// Unknown and control tokens: special; user-defined ones: plain added
// tokens. Both matched in the raw text.
void Builder::AddTokens() {
  auto add = [&](size_t id, bool special) {
    if (v_.tokens[id].empty()) return;  // HF ignores empty added tokens
    hf::AddedToken token;
    token.id = static_cast<int32_t>(id);
    token.content = v_.tokens[id];
    token.special = special;
    token.normalized = false;
    spec_.added.push_back(std::move(token));
  };
  if (v_.token_types.empty()) {
    // As transformers' GGUF converter does without types.
    std::vector<int32_t> ids;
    for (const auto& id : {v_.unk_id, v_.bos_id, v_.eos_id}) {
      if (id && std::find(ids.begin(), ids.end(), *id) == ids.end()) ids.push_back(*id);
    }
    std::sort(ids.begin(), ids.end());
    for (const int32_t id : ids) add(id, true);
    return;
  }
  for (size_t id = 0; id < v_.tokens.size(); ++id) {
    const int32_t type = v_.token_types[id];
    if (type == kUnknown || type == kControl) add(id, true);
    if (type == kUserDefined) add(id, false);
  }
}

// SentencePiece BPE: the pair whose concatenation has the highest score
// merges first, leftmost on ties (bpe_model.cc's agenda, llama.cpp's
// llm_tokenizer_spm). HF's BPE takes the pair of lowest rank, leftmost on
// ties: ranking each split of a token by that token's score alone, equal
// scores sharing a rank, makes the two the same.
absl::Status Builder::SentencePieceMerges() {
  hf::BpeModel& m = spec_.model;
  struct Split {
    int32_t left, right, merged;
  };
  std::vector<Split> splits;
  for (size_t id = 0; id < v_.tokens.size(); ++id) {
    const int32_t type = TypeOf(id);
    // SentencePiece keeps these out of the pieces merges may make.
    if (type == kUnknown || type == kControl || type == kByte) continue;
    const std::string_view t = v_.tokens[id];
    if (t.empty()) continue;
    auto self = m.ids.find(t);
    if (self->second != static_cast<int32_t>(id)) continue;  // a repeated text: the last counts
    if (t.size() > kGgufMaxMergedPieceBytes) {
      return Unsupported(Cat("tokenizer.ggml.tokens[", id, "] = ", Quote(t), " is ", t.size(),
                             " bytes long: \"llama\" (SentencePiece) tokens of more than ",
                             kGgufMaxMergedPieceBytes, " bytes are not supported"));
    }
    for (size_t at = CharAt(t, 0); at < t.size(); at += CharAt(t, at)) {
      auto left = m.ids.find(t.substr(0, at));
      if (left == m.ids.end()) continue;
      auto right = m.ids.find(t.substr(at));
      if (right == m.ids.end()) continue;
      splits.push_back({left->second, right->second, static_cast<int32_t>(id)});
    }
  }
  std::vector<float> scores;
  scores.reserve(splits.size());
  for (const Split& s : splits) scores.push_back(v_.scores[s.merged]);
  std::sort(scores.begin(), scores.end(), std::greater<float>());
  scores.erase(std::unique(scores.begin(), scores.end()), scores.end());
  m.merges.reserve(splits.size());
  for (const Split& s : splits) {
    const auto rank =
        std::lower_bound(scores.begin(), scores.end(), v_.scores[s.merged], std::greater<float>()) -
        scores.begin();
    m.merges[hf::BpeModel::PairKey(s.left, s.right)] = {static_cast<uint32_t>(rank), s.merged};
  }
  return absl::OkStatus();
}

// "left right": split at the first space (after the first byte, as llama.cpp
// looks for it) that leaves two tokens.
absl::Status Builder::Gpt2Merges() {
  hf::BpeModel& m = spec_.model;
  m.merges.reserve(v_.merges.size());
  for (size_t i = 0; i < v_.merges.size(); ++i) {
    const std::string_view text = v_.merges[i];
    auto left = m.ids.end(), right = m.ids.end();
    size_t spaces = 0, last_space = 0;
    for (size_t at = text.find(' ', 1); at != std::string_view::npos; at = text.find(' ', at + 1)) {
      ++spaces;
      last_space = at;
      auto l = m.ids.find(text.substr(0, at));
      auto r = m.ids.find(text.substr(at + 1));
      if (l != m.ids.end() && r != m.ids.end()) {
        left = l;
        right = r;
        break;
      }
    }
    const std::string where = Cat("tokenizer.ggml.merges[", i, "] = ", Quote(text));
    if (left == m.ids.end()) {
      if (spaces == 0) return Invalid(Cat(where, " is not two tokens separated by a space"));
      if (spaces == 1) {
        const std::string_view l = text.substr(0, last_space), r = text.substr(last_space + 1);
        return Invalid(Cat(where, ": ", Quote(m.ids.contains(l) ? r : l), " is not a token"));
      }
      return Invalid(Cat(where, " does not split into two tokens at any of its spaces"));
    }
    const std::string merged = Cat(left->first, right->first);
    auto result = m.ids.find(merged);
    if (result == m.ids.end()) {
      return Invalid(Cat(where, ": the merged ", Quote(merged), " is not a token"));
    }
    // A pair given twice keeps its first rank (llama.cpp's bpe_ranks).
    m.merges.try_emplace(hf::BpeModel::PairKey(left->second, right->second),
                         hf::BpeModel::Merge{static_cast<uint32_t>(i), result->second});
  }
  return absl::OkStatus();
}

absl::Status Builder::PreTokenizer() {
  auto split = [&](std::string_view regex) -> absl::Status {
    auto compiled = hf::Regex::Compile(regex);
    if (!compiled.ok()) {
      return absl::Status(compiled.status().code(),
                          Cat(v_.source, ": ", std::string(compiled.status().message())));
    }
    hf::PreTokenizerStep step;
    step.kind = hf::PreTokenizerStep::Kind::kSplit;
    step.pattern.regex = *std::move(compiled);
    step.behavior = hf::SplitBehavior::kIsolated;
    spec_.pre_tokenizers.push_back(std::move(step));
    return absl::OkStatus();
  };
  auto byte_level = [&](bool use_regex) {
    hf::PreTokenizerStep step;
    step.kind = hf::PreTokenizerStep::Kind::kByteLevel;
    step.add_prefix_space = false;
    step.use_regex = use_regex;
    spec_.pre_tokenizers.push_back(std::move(step));
  };
  const std::string& pre = v_.pre;
  if (pre.empty() || pre == "default") {
    RETURN_IF_ERROR(split(kPunctuationRunRegex));
    RETURN_IF_ERROR(split(kGpt2Regex));
    RETURN_IF_ERROR(split(kNumberRunRegex));
    RETURN_IF_ERROR(split(kThreeDigitsRegex));
    byte_level(false);
  } else if (pre == "gpt-2") {
    byte_level(true);
  } else if (pre == "llama-bpe") {
    RETURN_IF_ERROR(split(kLlama3Regex));
    byte_level(false);
    spec_.model.ignore_merges = true;
  } else if (pre == "qwen2") {
    hf::NormalizerStep nfc = Normalizer(hf::NormalizerStep::Kind::kUnicode);
    nfc.form = hf::UnicodeForm::kNfc;
    spec_.normalizers.push_back(std::move(nfc));
    RETURN_IF_ERROR(split(kQwen2Regex));
    byte_level(false);
  } else if (pre == "smollm") {
    RETURN_IF_ERROR(split(kNumberRegex));
    byte_level(true);
  } else {
    return Unsupported(Cat("tokenizer.ggml.pre = ", Quote(pre),
                           " is not supported (supported: ", kSupportedPre, ")"));
  }
  return absl::OkStatus();
}

absl::Status Builder::Template() {
  // llama.cpp's defaults: BOS for SentencePiece and Llama 3.
  const bool bos_by_default = spm_ || v_.pre == "llama-bpe";
  if (v_.add_bos.value_or(bos_by_default)) {
    if (v_.bos_id) {
      spec_.prefix.push_back(*v_.bos_id);
    } else if (v_.add_bos) {
      return Invalid(
          "tokenizer.ggml.add_bos_token = true, but there is no tokenizer.ggml.bos_token_id");
    }
  }
  if (v_.add_eos.value_or(false)) {
    if (!v_.eos_id) {
      return Invalid(
          "tokenizer.ggml.add_eos_token = true, but there is no tokenizer.ggml.eos_token_id");
    }
    spec_.suffix.push_back(*v_.eos_id);
  }
  return absl::OkStatus();
}

std::vector<int32_t> Builder::EosIds() const {
  static const std::vector<std::string_view> kEndMarkers = {
      "</s>",       "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>",
      "<|eom_id|>", "<eos>",         "<|end|>",    "<end_of_turn>"};
  std::vector<int32_t> eos;
  auto add = [&](int32_t id) {
    if (std::find(eos.begin(), eos.end(), id) == eos.end()) eos.push_back(id);
  };
  for (const auto& id : {v_.eos_id, v_.eot_id, v_.eom_id}) {
    if (id) add(*id);
  }
  for (const hf::AddedToken& token : spec_.added) {
    if (token.special &&
        std::find(kEndMarkers.begin(), kEndMarkers.end(), token.content) != kEndMarkers.end()) {
      add(token.id);
    }
  }
  return eos;
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> Builder::Build() {
  spec_.source = v_.source;
  if (v_.model == "llama") {
    spm_ = true;
  } else if (v_.model != "gpt2") {
    return Unsupported(Cat("tokenizer.ggml.model = ", Quote(v_.model),
                           " is not supported (supported: ", kSupportedModels, ")"));
  }
  RETURN_IF_ERROR(CheckArrays());
  MakeModel();
  AddTokens();
  if (spm_) {
    RETURN_IF_ERROR(SentencePieceMerges());
    const bool space_prefix = v_.add_space_prefix.value_or(true);
    if (space_prefix) {
      hf::NormalizerStep prepend = Normalizer(hf::NormalizerStep::Kind::kPrepend);
      prepend.text = kSpaceSymbol;
      spec_.normalizers.push_back(std::move(prepend));
    }
    hf::NormalizerStep replace = Normalizer(hf::NormalizerStep::Kind::kReplace);
    replace.text = kSpaceSymbol;
    replace.pattern.literal.assign(1, ' ');
    spec_.normalizers.push_back(std::move(replace));

    hf::DecoderStep to_space = Decoder(hf::DecoderStep::Kind::kReplace);
    to_space.pattern.literal = std::string(kSpaceSymbol);
    to_space.content = " ";
    spec_.decoders.push_back(std::move(to_space));
    spec_.decoders.push_back(Decoder(hf::DecoderStep::Kind::kByteFallback));
    spec_.decoders.push_back(Decoder(hf::DecoderStep::Kind::kFuse));
    if (space_prefix) {
      hf::DecoderStep strip = Decoder(hf::DecoderStep::Kind::kStrip);
      strip.content = " ";
      strip.start = 1;
      strip.stop = 0;
      spec_.decoders.push_back(std::move(strip));
    }
  } else {
    RETURN_IF_ERROR(Gpt2Merges());
    RETURN_IF_ERROR(PreTokenizer());
    spec_.decoders.push_back(Decoder(hf::DecoderStep::Kind::kByteLevel));
  }
  spec_.has_decoder = true;
  hf::ClassifyDecoder(spec_);
  RETURN_IF_ERROR(Template());

  HfTokenizerOptions options;
  options.eos_ids = EosIds();
  return hf::MakeTokenizer(std::move(spec_), {}, options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HfTokenizer>> BuildGgufTokenizer(const GgufVocab& vocab) {
  // The tables are proportional to the vocabulary, which the limits bound;
  // this only turns running out of memory into a status.
  try {
    return Builder(vocab).Build();
  } catch (const std::exception& e) {
    return absl::InternalError(Cat(vocab.source, ": building the tokenizer failed: ", e.what()));
  }
}

}  // namespace coalesce::engine
