// tokenizer.json -> TokenizerSpec. Every component and option HF `tokenizers`
// would honour is either turned into the spec or rejected here, so the
// tokenizer never runs a configuration it does not implement.
#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "engine/json_depth.h"
#include "engine/tokenizer/hf_tokenizer_internal.h"
#include "nlohmann/json.hpp"

namespace coalesce::engine::hf {
namespace {

using Json = nlohmann::json;

// The most ids a file with `tokens` vocabulary pieces and added tokens may
// span. HF allows gaps between ids, but every table here indexed by id is as
// long as the largest id, so four pieces with one at id 10^9 would take tens
// of gigabytes; real files have few gaps, if any.
int64_t MaxPlausibleIds(size_t tokens) { return 2 * static_cast<int64_t>(tokens) + 1024; }

// Errors carry the file and the component ("pre_tokenizer.pretokenizers[1]").
class Parser {
 public:
  Parser(const std::string& source, const HfTokenizerOptions& options)
      : source_(source), options_(options) {}

  absl::StatusOr<TokenizerSpec> Parse(const Json& root);

 private:
  absl::Status Error(std::string_view where, std::string_view what) const {
    return absl::InvalidArgumentError(Cat(source_, ": ", where, ": ", what));
  }
  absl::Status Unsupported(std::string_view where, std::string_view what) const {
    return absl::UnimplementedError(
        Cat(source_, ": ", where, ": ", what, " is not supported by coalesce's tokenizer"));
  }

  // Typed field access: a missing or null field gives the default; a field of
  // another type is an error.
  absl::StatusOr<bool> Bool(const Json& object, const char* key, bool fallback,
                            std::string_view where) const;
  absl::StatusOr<std::optional<std::string>> OptString(const Json& object, const char* key,
                                                       std::string_view where) const;
  absl::StatusOr<std::string> String(const Json& object, const char* key,
                                     std::string_view where) const;
  absl::StatusOr<std::string> Type(const Json& object, std::string_view where) const;
  absl::StatusOr<Pattern> ParsePattern(const Json& object, std::string_view where,
                                       bool allow_regex) const;

  absl::Status ParseModel(const Json& model, TokenizerSpec& spec);
  absl::Status ParseMerges(const Json& merges, BpeModel& bpe);
  absl::Status AddMerge(std::string_view left, std::string_view right, size_t index, BpeModel& bpe);
  absl::Status ParseAddedTokens(const Json& tokens, TokenizerSpec& spec);
  absl::Status ParseNormalizer(const Json& node, std::string where, TokenizerSpec& spec);
  absl::Status ParsePreTokenizer(const Json& node, std::string where, TokenizerSpec& spec);
  absl::Status ParsePostProcessor(const Json& node, std::string where, TokenizerSpec& spec);
  absl::Status ParseDecoder(const Json& node, std::string where, TokenizerSpec& spec);

  const std::string& source_;
  const HfTokenizerOptions& options_;
  uint32_t merge_rank_ = 0;

 public:
  std::vector<std::string> notes;
};

absl::StatusOr<bool> Parser::Bool(const Json& object, const char* key, bool fallback,
                                  std::string_view where) const {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Error(where, Cat("\"", key, "\" must be a boolean"));
  return it->get<bool>();
}

absl::StatusOr<std::optional<std::string>> Parser::OptString(const Json& object, const char* key,
                                                             std::string_view where) const {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) return Error(where, Cat("\"", key, "\" must be a string"));
  return std::optional<std::string>(it->get<std::string>());
}

absl::StatusOr<std::string> Parser::String(const Json& object, const char* key,
                                           std::string_view where) const {
  ASSIGN_OR_RETURN(auto value, OptString(object, key, where));
  if (!value) return Error(where, Cat("missing string \"", key, "\""));
  return *value;
}

absl::StatusOr<std::string> Parser::Type(const Json& object, std::string_view where) const {
  if (!object.is_object()) return Error(where, "must be an object");
  return String(object, "type", where);
}

absl::StatusOr<Pattern> Parser::ParsePattern(const Json& object, std::string_view where,
                                             bool allow_regex) const {
  auto it = object.find("pattern");
  if (it == object.end() || !it->is_object() || it->size() != 1) {
    return Error(where, "\"pattern\" must be {\"String\": ...} or {\"Regex\": ...}");
  }
  Pattern pattern;
  if (auto s = it->find("String"); s != it->end() && s->is_string()) {
    pattern.literal = s->get<std::string>();
    // HF's empty String pattern matches nothing in Split and everything
    // (between characters) in Replace; no real file has one.
    if (pattern.literal.empty()) return Unsupported(where, "an empty String pattern");
    return pattern;
  }
  if (auto r = it->find("Regex"); r != it->end() && r->is_string()) {
    if (!allow_regex) return Unsupported(where, "a Regex pattern");
    auto regex = Regex::Compile(r->get<std::string>());
    if (!regex.ok()) {
      return absl::Status(regex.status().code(),
                          Cat(source_, ": ", where, ": ", std::string(regex.status().message())));
    }
    pattern.regex = *std::move(regex);
    return pattern;
  }
  return Error(where, "\"pattern\" must be {\"String\": ...} or {\"Regex\": ...}");
}

// ---------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------

absl::Status Parser::ParseModel(const Json& model, TokenizerSpec& spec) {
  const std::string where = "model";
  if (!model.is_object()) return Error(where, "missing or not an object");
  // HF reads a model without "type" by trying each model's fields in turn;
  // GPT-2's file has none, and only BPE has "merges".
  std::string type = "BPE";
  if (auto it = model.find("type"); it != model.end()) {
    if (!it->is_string()) return Error(where, "\"type\" must be a string");
    type = it->get<std::string>();
  } else if (!model.contains("merges")) {
    return Unsupported(where, "a model without \"type\" and without \"merges\" (not BPE)");
  }
  if (type != "BPE") return Unsupported(where, Cat("model type ", type));

  BpeModel& bpe = spec.model;
  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    if (!it->is_number()) return Error(where, "\"dropout\" must be a number");
    // Dropout makes encoding random; 0 is the same as none.
    if (it->get<double>() != 0.0) return Unsupported(where, "BPE dropout");
  }
  ASSIGN_OR_RETURN(bpe.fuse_unk, Bool(model, "fuse_unk", false, where));
  ASSIGN_OR_RETURN(bpe.byte_fallback, Bool(model, "byte_fallback", false, where));
  ASSIGN_OR_RETURN(bpe.ignore_merges, Bool(model, "ignore_merges", false, where));
  ASSIGN_OR_RETURN(bpe.continuing_subword_prefix,
                   OptString(model, "continuing_subword_prefix", where));
  ASSIGN_OR_RETURN(bpe.end_of_word_suffix, OptString(model, "end_of_word_suffix", where));
  ASSIGN_OR_RETURN(auto unk, OptString(model, "unk_token", where));

  auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object()) {
    return Error(where, "\"vocab\" must be an object of piece -> id");
  }
  int64_t max_id = -1;
  bpe.ids.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() >= (1 << 30)) {
      return Error(where, Cat("vocab entry \"", it.key(), "\" has an invalid id"));
    }
    const int64_t id = it->get<int64_t>();
    bpe.ids.emplace(it.key(), static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  if (max_id >= MaxPlausibleIds(vocab->size())) {
    return Error(where, Cat("vocab ids reach ", max_id, " with only ", vocab->size(),
                            " pieces: too sparse to be a vocabulary"));
  }
  bpe.pieces.assign(max_id + 1, std::string());
  std::vector<bool> seen(max_id + 1, false);
  for (const auto& [piece, id] : bpe.ids) {
    // Two pieces with one id would decode differently depending on HF's hash
    // map order.
    if (seen[id]) return Error(where, Cat("vocab id ", id, " is given to two pieces"));
    seen[id] = true;
    bpe.pieces[id] = piece;
  }
  spec.vocab_size = static_cast<int>(max_id + 1);

  if (unk) {
    auto it = bpe.ids.find(*unk);
    // HF fails at encode time when it needs an unknown token that is not in
    // the vocabulary; failing here is the closest we can do without
    // exceptions.
    if (it == bpe.ids.end()) {
      return Error(where, Cat("unk_token \"", *unk, "\" is not in the vocabulary"));
    }
    bpe.unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    // HF looks byte-fallback pieces up as format!("<{b:#04X}>"): "<0x0A>".
    static constexpr char kHex[] = "0123456789ABCDEF";
    const std::string piece = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
    auto it = bpe.ids.find(piece);
    bpe.byte_ids[b] = it == bpe.ids.end() ? -1 : it->second;
  }

  auto merges = model.find("merges");
  if (merges == model.end() || merges->is_null()) return absl::OkStatus();
  return ParseMerges(*merges, bpe);
}

absl::Status Parser::AddMerge(std::string_view left, std::string_view right, size_t index,
                              BpeModel& bpe) {
  const size_t prefix_len =
      bpe.continuing_subword_prefix ? bpe.continuing_subword_prefix->size() : 0;
  auto l = bpe.ids.find(left);
  auto r = bpe.ids.find(right);
  std::string merged;
  if (right.size() >= prefix_len) merged = Cat(left, right.substr(prefix_len));
  auto m = bpe.ids.find(merged);
  if (l == bpe.ids.end() || r == bpe.ids.end() || m == bpe.ids.end() || right.size() < prefix_len) {
    const std::string missing = l == bpe.ids.end()   ? std::string(left)
                                : r == bpe.ids.end() ? std::string(right)
                                                     : merged;
    if (!options_.repair_merges) {
      return Error("model.merges",
                   Cat("merge ", index, " (\"", left, "\", \"", right, "\"): \"", missing,
                       "\" is not in the vocabulary (HF rejects this "
                       "file too; repair_merges drops such merges)"));
    }
    notes.push_back(Cat("dropped merge ", index, " (\"", left, "\", \"", right, "\"): \"", missing,
                        "\" is not in the vocabulary"));
    ++merge_rank_;
    return absl::OkStatus();
  }
  // HF collects the merges into a map, so a repeated pair keeps its last rank.
  bpe.merges[BpeModel::PairKey(l->second, r->second)] = {merge_rank_++, m->second};
  return absl::OkStatus();
}

absl::Status Parser::ParseMerges(const Json& merges, BpeModel& bpe) {
  if (!merges.is_array()) return Error("model.merges", "must be an array");
  bpe.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const Json& m = merges[i];
    if (m.is_array()) {
      // The [a, b] form (tokenizers >= 0.20): pieces may contain spaces.
      if (m.size() != 2 || !m[0].is_string() || !m[1].is_string()) {
        return Error("model.merges", Cat("merge ", i, " must be [left, right]"));
      }
      RETURN_IF_ERROR(AddMerge(m[0].get<std::string>(), m[1].get<std::string>(), i, bpe));
      continue;
    }
    if (!m.is_string()) {
      return Error("model.merges", Cat("merge ", i, " must be a string or a pair"));
    }
    // The "a b" form. HF splits on every space and wants exactly two parts.
    const std::string text = m.get<std::string>();
    const size_t space = text.find(' ');
    if (space != std::string::npos && text.find(' ', space + 1) == std::string::npos) {
      RETURN_IF_ERROR(AddMerge(text.substr(0, space), text.substr(space + 1), i, bpe));
      continue;
    }
    if (!options_.repair_merges) {
      return Error("model.merges",
                   Cat("merge ", i, " \"", text,
                       "\" does not have exactly one space (HF rejects this file too; "
                       "repair_merges splits such merges by the vocabulary)"));
    }
    // A legacy file whose pieces contain spaces: the separator is the space
    // that leaves two pieces whose concatenation is also a piece.
    std::vector<size_t> splits;
    for (size_t at = text.find(' '); at != std::string::npos; at = text.find(' ', at + 1)) {
      const std::string left = text.substr(0, at), right = text.substr(at + 1);
      if (bpe.ids.contains(left) && bpe.ids.contains(right) && bpe.ids.contains(left + right)) {
        splits.push_back(at);
      }
    }
    if (splits.size() != 1) {
      return Error("model.merges", Cat("merge ", i, " \"", text, "\" has ", splits.size(),
                                       " readings as two vocabulary pieces; need one"));
    }
    notes.push_back(Cat("merge ", i, " \"", text, "\" read as (\"", text.substr(0, splits[0]),
                        "\", \"", text.substr(splits[0] + 1), "\")"));
    RETURN_IF_ERROR(AddMerge(text.substr(0, splits[0]), text.substr(splits[0] + 1), i, bpe));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Added tokens
// ---------------------------------------------------------------------------

absl::Status Parser::ParseAddedTokens(const Json& tokens, TokenizerSpec& spec) {
  if (tokens.is_null()) return absl::OkStatus();
  if (!tokens.is_array()) return Error("added_tokens", "must be an array");
  // HF gives an added token its vocabulary id, or else the next id after the
  // vocabulary and the added tokens so far (AddedVocabulary::add_tokens). A
  // file whose ids disagree would make HF warn and renumber; refuse it.
  const int32_t model_size = static_cast<int32_t>(spec.model.ids.size());
  int32_t max_added = -1;
  StringToId seen;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string where = Cat("added_tokens[", i, "]");
    const Json& t = tokens[i];
    if (!t.is_object()) return Error(where, "must be an object");
    AddedToken token;
    ASSIGN_OR_RETURN(token.content, String(t, "content", where));
    auto id = t.find("id");
    if (id == t.end() || !id->is_number_integer() || id->get<int64_t>() < 0 ||
        id->get<int64_t>() >= (1 << 30)) {
      return Error(where, "\"id\" must be a non-negative integer");
    }
    token.id = static_cast<int32_t>(id->get<int64_t>());
    ASSIGN_OR_RETURN(token.single_word, Bool(t, "single_word", false, where));
    ASSIGN_OR_RETURN(token.lstrip, Bool(t, "lstrip", false, where));
    ASSIGN_OR_RETURN(token.rstrip, Bool(t, "rstrip", false, where));
    ASSIGN_OR_RETURN(token.special, Bool(t, "special", false, where));
    ASSIGN_OR_RETURN(token.normalized, Bool(t, "normalized", !token.special, where));
    if (token.content.empty()) continue;  // HF ignores these
    if (seen.contains(token.content)) {
      return Error(where, Cat("\"", token.content, "\" is added twice"));
    }
    seen.emplace(token.content, token.id);
    int32_t hf_id;
    if (auto in_vocab = spec.model.ids.find(token.content); in_vocab != spec.model.ids.end()) {
      hf_id = in_vocab->second;
    } else {
      hf_id = max_added >= model_size || model_size == 0 ? max_added + 1 : model_size;
    }
    if (hf_id != token.id) {
      return Error(where, Cat("\"", token.content, "\" has id ", token.id,
                              " but HF would give it id ", hf_id));
    }
    max_added = std::max(max_added, hf_id);
    spec.vocab_size = std::max(spec.vocab_size, token.id + 1);
    spec.added.push_back(std::move(token));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Normalizer
// ---------------------------------------------------------------------------

absl::Status Parser::ParseNormalizer(const Json& node, std::string where, TokenizerSpec& spec) {
  if (node.is_null()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string type, Type(node, where));
  if (type == "Sequence") {
    auto list = node.find("normalizers");
    if (list == node.end() || !list->is_array()) {
      return Error(where, "Sequence needs a \"normalizers\" array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(ParseNormalizer((*list)[i], Cat(where, ".normalizers[", i, "]"), spec));
    }
    return absl::OkStatus();
  }
  NormalizerStep step;
  if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::kPrepend;
    ASSIGN_OR_RETURN(step.text, String(node, "prepend", where));
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::kReplace;
    ASSIGN_OR_RETURN(step.pattern, ParsePattern(node, where, /*allow_regex=*/true));
    ASSIGN_OR_RETURN(step.text, String(node, "content", where));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    step.kind = NormalizerStep::Kind::kUnicode;
    step.form = type == "NFC"    ? UnicodeForm::kNfc
                : type == "NFD"  ? UnicodeForm::kNfd
                : type == "NFKC" ? UnicodeForm::kNfkc
                                 : UnicodeForm::kNfkd;
  } else {
    // Lowercase, Strip, BertNormalizer, Precompiled (SentencePiece's
    // charsmap)...: none is implemented.
    return Unsupported(where, Cat("normalizer ", type));
  }
  spec.normalizers.push_back(std::move(step));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Pre-tokenizer
// ---------------------------------------------------------------------------

absl::StatusOr<PrependScheme> ParsePrependScheme(const Json& node) {
  // Older files say add_prefix_space instead of prepend_scheme.
  auto scheme = node.find("prepend_scheme");
  auto add_prefix = node.find("add_prefix_space");
  const bool has_add = add_prefix != node.end() && add_prefix->is_boolean();
  if (scheme == node.end() || scheme->is_null()) {
    return has_add && !add_prefix->get<bool>() ? PrependScheme::kNever : PrependScheme::kAlways;
  }
  if (!scheme->is_string()) return absl::InvalidArgumentError("prepend_scheme must be a string");
  const std::string s = scheme->get<std::string>();
  PrependScheme result;
  if (s == "always") {
    result = PrependScheme::kAlways;
  } else if (s == "first") {
    result = PrependScheme::kFirst;
  } else if (s == "never") {
    result = PrependScheme::kNever;
  } else {
    return absl::InvalidArgumentError(Cat("unknown prepend_scheme \"", s, "\""));
  }
  if (has_add && add_prefix->get<bool>() == (result == PrependScheme::kNever)) {
    return absl::InvalidArgumentError("add_prefix_space contradicts prepend_scheme");
  }
  return result;
}

// One UTF-8 character, as HF's `char` fields require.
bool IsOneCharacter(std::string_view s) {
  if (s.empty()) return false;
  const auto b = static_cast<uint8_t>(s[0]);
  const size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  return s.size() == n;
}

absl::Status Parser::ParsePreTokenizer(const Json& node, std::string where, TokenizerSpec& spec) {
  if (node.is_null()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string type, Type(node, where));
  if (type == "Sequence") {
    auto list = node.find("pretokenizers");
    if (list == node.end() || !list->is_array()) {
      return Error(where, "Sequence needs a \"pretokenizers\" array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(ParsePreTokenizer((*list)[i], Cat(where, ".pretokenizers[", i, "]"), spec));
    }
    return absl::OkStatus();
  }
  PreTokenizerStep step;
  if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    ASSIGN_OR_RETURN(step.add_prefix_space, Bool(node, "add_prefix_space", true, where));
    ASSIGN_OR_RETURN(step.use_regex, Bool(node, "use_regex", true, where));
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, String(node, "replacement", where));
    if (!IsOneCharacter(step.replacement)) {
      return Error(where, "\"replacement\" must be one character");
    }
    auto scheme = ParsePrependScheme(node);
    if (!scheme.ok()) return Error(where, std::string(scheme.status().message()));
    step.prepend_scheme = *scheme;
    ASSIGN_OR_RETURN(step.split, Bool(node, "split", true, where));
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    ASSIGN_OR_RETURN(step.pattern, ParsePattern(node, where, /*allow_regex=*/true));
    ASSIGN_OR_RETURN(step.invert, Bool(node, "invert", false, where));
    ASSIGN_OR_RETURN(const std::string behavior, String(node, "behavior", where));
    static const std::map<std::string, SplitBehavior> kBehaviors = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    auto it = kBehaviors.find(behavior);
    if (it == kBehaviors.end()) return Error(where, Cat("unknown behavior ", behavior));
    step.behavior = it->second;
  } else {
    return Unsupported(where, Cat("pre-tokenizer ", type));
  }
  spec.pre_tokenizers.push_back(std::move(step));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Post-processor
// ---------------------------------------------------------------------------

absl::Status Parser::ParsePostProcessor(const Json& node, std::string where, TokenizerSpec& spec) {
  if (node.is_null()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string type, Type(node, where));
  if (type == "Sequence") {
    auto list = node.find("processors");
    if (list == node.end() || !list->is_array()) {
      return Error(where, "Sequence needs a \"processors\" array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(ParsePostProcessor((*list)[i], Cat(where, ".processors[", i, "]"), spec));
    }
    return absl::OkStatus();
  }
  // ByteLevel's post-processor only trims offsets.
  if (type == "ByteLevel") return absl::OkStatus();
  if (type != "TemplateProcessing") return Unsupported(where, Cat("post-processor ", type));

  auto single = node.find("single");
  if (single == node.end() || !single->is_array()) {
    return Unsupported(where, "a TemplateProcessing \"single\" that is not a list of pieces");
  }
  auto specials = node.find("special_tokens");
  // Each processor wraps what the previous ones made: its pieces before $A go
  // in front of everything so far.
  std::vector<int32_t> prefix, suffix;
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const Json& piece = (*single)[i];
    const std::string piece_where = Cat(where, ".single[", i, "]");
    if (auto seq = piece.find("Sequence"); piece.is_object() && seq != piece.end()) {
      ASSIGN_OR_RETURN(const std::string id, String(*seq, "id", piece_where));
      if (id != "A") return Unsupported(piece_where, Cat("sequence ", id, " in single"));
      if (seen_sequence) return Unsupported(piece_where, "$A twice");
      seen_sequence = true;
      continue;
    }
    auto special = piece.is_object() ? piece.find("SpecialToken") : piece.end();
    if (!piece.is_object() || special == piece.end()) {
      return Error(piece_where, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
    ASSIGN_OR_RETURN(const std::string name, String(*special, "id", piece_where));
    if (specials == node.end() || !specials->is_object() || !specials->contains(name)) {
      return Error(piece_where, Cat("special token \"", name, "\" is missing from special_tokens"));
    }
    const Json& entry = (*specials)[name];
    auto ids = entry.find("ids");
    if (ids == entry.end() || !ids->is_array()) {
      return Error(piece_where, Cat("special_tokens[\"", name, "\"] has no ids"));
    }
    for (const Json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= MaxPlausibleIds(spec.model.ids.size() + spec.added.size())) {
        return Error(piece_where, Cat("special_tokens[\"", name, "\"] has a bad id"));
      }
      (seen_sequence ? suffix : prefix).push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  if (!seen_sequence) return Unsupported(where, "a single template without $A");
  prefix.insert(prefix.end(), spec.prefix.begin(), spec.prefix.end());
  spec.prefix = std::move(prefix);
  spec.suffix.insert(spec.suffix.end(), suffix.begin(), suffix.end());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------

absl::Status Parser::ParseDecoder(const Json& node, std::string where, TokenizerSpec& spec) {
  if (node.is_null()) return absl::OkStatus();
  spec.has_decoder = true;
  ASSIGN_OR_RETURN(const std::string type, Type(node, where));
  if (type == "Sequence") {
    auto list = node.find("decoders");
    if (list == node.end() || !list->is_array()) {
      return Error(where, "Sequence needs a \"decoders\" array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(ParseDecoder((*list)[i], Cat(where, ".decoders[", i, "]"), spec));
    }
    return absl::OkStatus();
  }
  DecoderStep step;
  if (type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    ASSIGN_OR_RETURN(step.pattern, ParsePattern(node, where, /*allow_regex=*/true));
    ASSIGN_OR_RETURN(step.content, String(node, "content", where));
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    ASSIGN_OR_RETURN(step.content, String(node, "content", where));
    if (!IsOneCharacter(step.content)) return Error(where, "\"content\" must be one character");
    auto start = node.find("start");
    auto stop = node.find("stop");
    if (start == node.end() || !start->is_number_unsigned() || stop == node.end() ||
        !stop->is_number_unsigned()) {
      return Error(where, "\"start\" and \"stop\" must be non-negative integers");
    }
    if (start->get<uint64_t>() > 1000 || stop->get<uint64_t>() > 1000) {
      return Error(where, "\"start\" and \"stop\" are implausibly large");
    }
    step.start = static_cast<int>(start->get<uint64_t>());
    step.stop = static_cast<int>(stop->get<uint64_t>());
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, String(node, "replacement", where));
    if (!IsOneCharacter(step.replacement)) {
      return Error(where, "\"replacement\" must be one character");
    }
    auto scheme = ParsePrependScheme(node);
    if (!scheme.ok()) return Error(where, std::string(scheme.status().message()));
    step.prepend = *scheme != PrependScheme::kNever;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::kByteLevel;
  } else {
    return Unsupported(where, Cat("decoder ", type));
  }
  spec.decoders.push_back(std::move(step));
  return absl::OkStatus();
}

}  // namespace

// Every chain of the supported steps, in any order, decodes exactly
// (HfTokenizer::DecodeRun). Whether the fast per-token path (TokenBytes) and
// streaming apply depends on the order:
//  - per token: HF's result is the concatenation of per-token results when
//    Replace (literal), Metaspace and Strip act on each token before the
//    tokens are fused (Fuse, or ByteLevel, which joins its output into one
//    string); ByteFallback groups runs of byte tokens, so only fusing may
//    follow it; after fusing only a Strip of at most one leading character
//    (applied to the first token) and further fusing;
//  - streamable: after fusing, no step may rewrite text already decoded
//    because of text that follows it.
void ClassifyDecoder(TokenizerSpec& spec) {
  bool fused = false, after_byte_fallback = false;
  bool per_token = true, streamable = true;
  for (const DecoderStep& step : spec.decoders) {
    switch (step.kind) {
      case DecoderStep::Kind::kFuse:
        fused = true;
        break;
      case DecoderStep::Kind::kByteLevel:
        if (fused || after_byte_fallback) per_token = false;
        // A fused text maps to bytes only if all of its characters do.
        if (fused) streamable = false;
        fused = true;
        break;
      case DecoderStep::Kind::kStrip:
        if (after_byte_fallback && !fused) per_token = false;
        // Stripping the end of the whole text needs all of it, and more than
        // one leading character may reach past the first token.
        if (fused && (step.stop != 0 || step.start > 1)) per_token = false;
        break;
      case DecoderStep::Kind::kByteFallback:
        if (fused) per_token = streamable = false;  // the whole text may be "<0xXX>"
        after_byte_fallback = true;
        break;
      case DecoderStep::Kind::kReplace:
        if (fused || after_byte_fallback || step.pattern.regex) per_token = false;
        // A match may span the end of the text decoded so far.
        if (fused && (step.pattern.regex || !IsOneCharacter(step.pattern.literal))) {
          streamable = false;
        }
        break;
      case DecoderStep::Kind::kMetaspace:
        if (fused || after_byte_fallback) per_token = false;
        break;
    }
  }
  spec.per_token_decode = per_token;
  spec.streamable_decode = streamable;
}

namespace {

absl::StatusOr<TokenizerSpec> Parser::Parse(const Json& root) {
  if (!root.is_object()) return Error("top level", "must be an object");
  TokenizerSpec spec;
  spec.source = source_;
  auto get = [&](const char* key) -> const Json& {
    static const Json kNull;
    auto it = root.find(key);
    return it == root.end() ? kNull : *it;
  };
  // Truncation and padding change what encode returns; a server wants them
  // off.
  if (!get("truncation").is_null()) return Unsupported("truncation", "truncation");
  if (!get("padding").is_null()) return Unsupported("padding", "padding");
  RETURN_IF_ERROR(ParseModel(get("model"), spec));
  RETURN_IF_ERROR(ParseAddedTokens(get("added_tokens"), spec));
  RETURN_IF_ERROR(ParseNormalizer(get("normalizer"), "normalizer", spec));
  RETURN_IF_ERROR(ParsePreTokenizer(get("pre_tokenizer"), "pre_tokenizer", spec));
  RETURN_IF_ERROR(ParsePostProcessor(get("post_processor"), "post_processor", spec));
  RETURN_IF_ERROR(ParseDecoder(get("decoder"), "decoder", spec));
  ClassifyDecoder(spec);
  for (const int32_t id : spec.prefix) spec.vocab_size = std::max(spec.vocab_size, id + 1);
  for (const int32_t id : spec.suffix) spec.vocab_size = std::max(spec.vocab_size, id + 1);
  return spec;
}

}  // namespace

absl::StatusOr<TokenizerSpec> ParseTokenizerJson(std::string_view json, const std::string& source,
                                                 const HfTokenizerOptions& options,
                                                 std::vector<std::string>* notes) {
  if (JsonNestsDeeperThan(json, kMaxJsonDepth)) {
    return absl::InvalidArgumentError(
        Cat(source, ": JSON nested more than ", kMaxJsonDepth, " levels deep"));
  }
  Json root = Json::parse(json, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    // Parse again for the position of the error; nlohmann reports it only
    // through its exception, which stays inside this function.
    std::string detail = "invalid JSON";
    try {
      Json discarded = Json::parse(json);
      (void)discarded;
    } catch (const Json::exception& e) {
      detail = e.what();
    }
    return absl::InvalidArgumentError(Cat(source, ": ", detail));
  }
  Parser parser(source, options);
  // Accessors above check types before reading, so nlohmann does not throw;
  // this guards the boundary in case one was missed.
  try {
    auto spec = parser.Parse(root);
    if (notes != nullptr) *notes = std::move(parser.notes);
    return spec;
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(Cat(source, ": ", e.what()));
  }
}

}  // namespace coalesce::engine::hf
