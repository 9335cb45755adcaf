// Encoding follows HF `tokenizers` TokenizerImpl::encode step by step:
//  1. split the text on added tokens that match the raw text
//     (AddedVocabulary::extract_and_normalize, first pass);
//  2. normalize each remaining piece and split it on added tokens that match
//     normalized text (second pass);
//  3. run the pre-tokenizers over the pieces;
//  4. run BPE on each piece (BPE::merge_word + Word::merge_all);
//  5. wrap the ids in the post-processor's template.
// Decoding: when the decoder chain allows (TokenizerSpec::per_token_decode),
// it runs on each token alone at load, once as the first token of the text
// and once as a later one, and TokenBytes looks the result up (see
// hf_tokenizer.h for what that guarantees); otherwise DecodeRun runs the
// whole chain over the run of tokens, as HF's decode does.
#include "engine/tokenizer/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <exception>
#include <fstream>
#include <iterator>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "engine/tokenizer/hf_tokenizer_internal.h"

namespace coalesce::engine {
namespace hf {
namespace {

// An item of encoding: an added token's id, or text still to tokenize.
struct Item {
  int32_t id = -1;  // >= 0: an added token
  Piece piece;
  size_t origin = 0;  // where piece.text starts in the text encoded
};

// Which special added tokens a pass over the text matches. Without split,
// all of them (HF's default); with split, only those whose match lies wholly
// inside one of `keep` (byte ranges of the text encoded, sorted, disjoint);
// the others are passed over as HF's encode_special_tokens passes over them.
struct SpecialFilter {
  bool split = false;
  std::span<const ByteRange> keep;

  // Whether the special token matched at [start, end) of a piece that starts
  // at `origin` of the text (npos: somewhere unknown) counts.
  bool Keeps(size_t origin, size_t start, size_t end) const {
    if (!split) return true;
    if (origin == std::string::npos) return false;
    start += origin;
    end += origin;
    // The last range beginning at or before `start`.
    auto it = std::upper_bound(keep.begin(), keep.end(), start,
                               [](size_t at, const ByteRange& r) { return at < r.begin; });
    if (it == keep.begin()) return false;
    --it;
    return end <= it->end;
  }
};

// HF's ByteFallback: "<0xXX>" stands for the byte XX (u8::from_str_radix,
// which also takes "+X").
bool ByteToken(std::string_view s, uint8_t& byte) {
  if (s.size() != 6 || !s.starts_with("<0x") || s[5] != '>') return false;
  int value = 0, digits = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = s[i];
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    if (d < 0 && !(c == '+' && i == 3)) return false;
    if (d >= 0) {
      value = value * 16 + d;
      ++digits;
    }
  }
  if (digits == 0) return false;
  byte = static_cast<uint8_t>(value);
  return true;
}

// HF's ByteLevel decoder on one token: each character back to its byte; a
// token with any other character (an added token's content) stays as it is.
void AppendByteLevelBytes(std::string_view s, std::string& out) {
  const ByteLevelMap& map = ByteLevel();
  const size_t size = out.size();
  for (size_t at = 0; at < s.size(); at += CharLength(s[at])) {
    const uint32_t cp = DecodeChar(s, at);
    if (cp >= map.char_to_byte.size() || map.char_to_byte[cp] < 0) {
      out.resize(size);
      out.append(s);
      return;
    }
    out.push_back(static_cast<char>(map.char_to_byte[cp]));
  }
}

// HF's Strip on one token: up to `start` leading and then up to `stop`
// trailing `c` (one character), never the same character twice.
void StripToken(std::string& s, std::string_view c, int start, int stop) {
  size_t from = 0, to = s.size();
  for (int k = 0; k < start && std::string_view(s).substr(from).starts_with(c); ++k) {
    from += c.size();
  }
  for (int k = 0; k < stop && std::string_view(s).substr(from, to - from).ends_with(c); ++k) {
    to -= c.size();
  }
  s = s.substr(from, to - from);
}

// HF's Metaspace decoder on one token: each `replacement` becomes a space,
// or is dropped in the first token of the text (unless prepend_scheme is
// "never").
std::string MetaspaceToken(std::string_view s, std::string_view replacement, bool drop) {
  std::string out;
  for (size_t at = 0; at < s.size();) {
    const size_t len = CharLength(s[at]);
    if (s.substr(at, len) == replacement) {
      if (!drop) out.push_back(' ');
    } else {
      out.append(s.substr(at, len));
    }
    at += len;
  }
  return out;
}

}  // namespace
}  // namespace hf

// ---------------------------------------------------------------------------
// The tokenizer
// ---------------------------------------------------------------------------

struct HfTokenizer::Impl {
  hf::TokenizerSpec spec;
  std::vector<std::string> notes;
  std::vector<int32_t> eos;
  int32_t bos = -1;
  std::shared_ptr<const hf::Regex> byte_level_regex;
  std::shared_ptr<const hf::Regex> word_char;
  hf::TokenMatcher raw_matcher, normalized_matcher;  // index into spec.added
  std::vector<int> added_index;                      // [vocab_size]: index into spec.added, or -1
  std::vector<std::string> bytes;                    // [vocab_size]: TokenBytes after a token
  std::unordered_map<int32_t, std::string> first_bytes;  // where the first token differs
  bool decode_normalized_added_tokens = false;
  // The most characters in one vocabulary piece (at least 1). BPE gives each
  // character of a word at most one symbol, and a token made of k symbols
  // has a piece of at least k characters (a merge concatenates its halves,
  // each keeping its character; a byte-fallback token's piece "<0xXX>" has
  // 6), so a word of n symbols needs at least n / max_piece_chars tokens.
  size_t max_piece_chars = 1;

  // --- encoding ---
  bool IsWordChar(std::string_view text, size_t at) const;
  // Appends `piece` split at the added tokens `matcher` finds; `origin` is
  // where the piece starts in the text encoded (npos: unknown), for `filter`.
  void SplitAdded(const hf::Piece& piece, size_t origin, const hf::TokenMatcher& matcher,
                  const hf::SpecialFilter& filter, std::vector<hf::Item>& out) const;
  // EncodeAtMost and EncodeSplitAtMost.
  std::optional<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens,
                                             const hf::SpecialFilter& filter,
                                             size_t max_tokens) const;
  void PreTokenize(std::vector<hf::Piece>& pieces) const;
  // Appends the tokens of `word` to `out`; false, with `out` part-way, when
  // `out` would end with more than `max_tokens`.
  bool Bpe(std::string_view word, std::vector<int32_t>& out, size_t max_tokens) const;
  // --- decoding ---
  // The string HF's decoder is given for `id`; false for ids it skips
  // (special tokens, ids without a token).
  bool TokenString(int32_t id, std::string& out) const;
  std::string DecodeToken(int32_t id, bool first) const;
  // HF's decoder chain over `tokens`, joined. `at_start`: tokens[0] starts
  // the text (else the run continues one). Sets *open when text after the
  // run could still change the run's end (an unfinished run of byte tokens
  // or character of ByteLevel bytes).
  std::string DecodeChain(std::vector<std::string> tokens, bool at_start, bool* open) const;
};

bool HfTokenizer::Impl::IsWordChar(std::string_view text, size_t at) const {
  std::vector<std::pair<size_t, size_t>> m;
  word_char->FindAll(text.substr(at, hf::CharLength(text[at])), m);
  return !m.empty();
}

// HF's AddedVocabulary::find_matches: non-overlapping leftmost-longest matches,
// dropped when single_word and a neighbour is a word character, widened over
// white space by lstrip/rstrip.
void HfTokenizer::Impl::SplitAdded(const hf::Piece& piece, size_t origin,
                                   const hf::TokenMatcher& matcher, const hf::SpecialFilter& filter,
                                   std::vector<hf::Item>& out) const {
  const std::string_view text = piece.text;
  size_t taken = 0;  // end of the last split made
  size_t search = 0;
  hf::TokenMatcher::Match m;
  // Where a part of the piece starts in the text encoded.
  auto at = [origin](size_t offset) {
    return origin == std::string::npos ? std::string::npos : origin + offset;
  };
  while (!matcher.empty() && matcher.Find(text, search, m)) {
    search = m.end;
    const hf::AddedToken& token = spec.added[m.index];
    // HF's encode_special_tokens: the match is passed over, its text stays.
    if (token.special && !filter.Keeps(origin, m.start, m.end)) continue;
    size_t start = m.start, stop = m.end;
    if (token.single_word) {
      // The character that ends right before the match.
      size_t prev_char = start;
      if (prev_char > 0) {
        --prev_char;
        while (prev_char > 0 && (static_cast<uint8_t>(text[prev_char]) & 0xC0) == 0x80) {
          --prev_char;
        }
      }
      const bool left_ok = start == 0 || !IsWordChar(text, prev_char);
      const bool right_ok = stop == text.size() || !IsWordChar(text, stop);
      if (!left_ok || !right_ok) continue;
    }
    if (token.lstrip) {
      size_t s = start;
      while (s > 0) {
        size_t p = s - 1;
        while (p > 0 && (static_cast<uint8_t>(text[p]) & 0xC0) == 0x80) --p;
        if (!hf::IsWhiteSpace(hf::DecodeChar(text, p))) break;
        s = p;
      }
      // Spaces a previous rstrip token took stay with it.
      start = std::max(s, taken);
    }
    if (token.rstrip) {
      while (stop < text.size() && hf::IsWhiteSpace(hf::DecodeChar(text, stop))) {
        stop += hf::CharLength(text[stop]);
      }
    }
    // A match inside the white space an rstrip token took: HF would emit
    // overlapping splits; no real tokenizer has added tokens that start with
    // white space after an rstrip token.
    if (start < taken) continue;
    if (taken < start) {
      out.push_back(
          {-1,
           {std::string(text.substr(taken, start - taken)), piece.at_input_start && taken == 0},
           at(taken)});
    }
    out.push_back({token.id, {}});
    taken = stop;
  }
  if (taken < text.size()) {
    out.push_back(
        {-1, {std::string(text.substr(taken)), piece.at_input_start && taken == 0}, at(taken)});
  }
}

void HfTokenizer::Impl::PreTokenize(std::vector<hf::Piece>& pieces) const {
  std::vector<hf::Piece> next;
  std::vector<std::pair<size_t, size_t>> matches;
  for (const hf::PreTokenizerStep& step : spec.pre_tokenizers) {
    next.clear();
    for (hf::Piece& piece : pieces) {
      switch (step.kind) {
        case hf::PreTokenizerStep::Kind::kByteLevel: {
          if (step.add_prefix_space && piece.text[0] != ' ')
            piece.text.insert(piece.text.begin(), ' ');
          const size_t first = next.size();
          if (step.use_regex) {
            matches.clear();
            byte_level_regex->FindAll(piece.text, matches);
            hf::SplitPiece(piece, matches, hf::SplitBehavior::kIsolated, false, next);
          } else {
            next.push_back(std::move(piece));
          }
          // Each byte becomes its printable stand-in character.
          const hf::ByteLevelMap& map = hf::ByteLevel();
          for (size_t i = first; i < next.size(); ++i) {
            std::string mapped;
            mapped.reserve(next[i].text.size() * 2);
            for (const char c : next[i].text)
              mapped.append(map.byte_to_char[static_cast<uint8_t>(c)]);
            next[i].text = std::move(mapped);
          }
          break;
        }
        case hf::PreTokenizerStep::Kind::kMetaspace: {
          piece.text = hf::ReplaceAll(piece.text, " ", step.replacement);
          const bool starts = piece.text.starts_with(step.replacement);
          if ((step.prepend_scheme == hf::PrependScheme::kAlways && !starts) ||
              (step.prepend_scheme == hf::PrependScheme::kFirst && !starts &&
               piece.at_input_start)) {
            piece.text.insert(0, step.replacement);
          }
          if (!step.split) {
            next.push_back(std::move(piece));
            break;
          }
          // Each replacement character is a match of its own.
          matches.clear();
          for (size_t at = piece.text.find(step.replacement); at != std::string::npos;
               at = piece.text.find(step.replacement, at + step.replacement.size())) {
            matches.emplace_back(at, at + step.replacement.size());
          }
          hf::SplitPiece(piece, matches, hf::SplitBehavior::kMergedWithNext, false, next);
          break;
        }
        case hf::PreTokenizerStep::Kind::kSplit:
          matches.clear();
          hf::FindPattern(step.pattern, piece.text, matches);
          hf::SplitPiece(piece, matches, step.behavior, step.invert, next);
          break;
      }
    }
    // A step may have emptied a piece (the ByteLevel prefix never does).
    std::erase_if(next, [](const hf::Piece& p) { return p.text.empty(); });
    pieces.swap(next);
  }
}

// HF's BPE::merge_word and Word::merge_all.
bool HfTokenizer::Impl::Bpe(std::string_view word, std::vector<int32_t>& out,
                            size_t max_tokens) const {
  const hf::BpeModel& m = spec.model;
  if (m.ignore_merges) {
    if (auto it = m.ids.find(word); it != m.ids.end()) {
      out.push_back(it->second);
      return out.size() <= max_tokens;
    }
  }
  // 1. One symbol per character, with byte fallback and unknown tokens.
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  int32_t pending_unk = -1;  // HF holds an unknown token back to fuse the next one
  std::string s;
  for (size_t i = 0; i < word.size();) {
    const size_t len = hf::CharLength(word[i]);
    const bool is_first = i == 0, is_last = i + len >= word.size();
    s.clear();
    if (!is_first && m.continuing_subword_prefix) s.append(*m.continuing_subword_prefix);
    s.append(word.substr(i, len));
    if (is_last && m.end_of_word_suffix) s.append(*m.end_of_word_suffix);
    i += len;
    if (auto it = m.ids.find(s); it != m.ids.end()) {
      if (pending_unk >= 0) symbols.push_back(pending_unk);
      pending_unk = -1;
      symbols.push_back(it->second);
      continue;
    }
    if (m.byte_fallback &&
        std::all_of(s.begin(), s.end(), [&](char c) { return m.byte_ids[uint8_t(c)] >= 0; })) {
      // As in HF, a held unknown token is not flushed first.
      for (const char c : s) symbols.push_back(m.byte_ids[static_cast<uint8_t>(c)]);
      continue;
    }
    if (m.unk_id >= 0) {
      if (pending_unk >= 0 && !m.fuse_unk) symbols.push_back(pending_unk);
      pending_unk = m.unk_id;
    }
    // Without an unknown token HF drops the character.
  }
  if (pending_unk >= 0) symbols.push_back(pending_unk);
  if (out.size() + (symbols.size() + max_piece_chars - 1) / max_piece_chars > max_tokens) {
    return false;  // too many for the tokens left, however they merge
  }

  // 2. Merge the pair of lowest rank, leftmost on ties, until none is left.
  //    Entries go stale when either side merges; HF detects that by looking
  //    the pair up again, which we do too.
  const int n = static_cast<int>(symbols.size());
  if (n < 2 || m.merges.empty()) {
    out.insert(out.end(), symbols.begin(), symbols.end());
    return out.size() <= max_tokens;
  }
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    uint32_t rank;
    int pos;
    int32_t merged;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
  auto consider = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    auto it = m.merges.find(hf::BpeModel::PairKey(symbols[left], symbols[next[left]]));
    if (it != m.merges.end()) heap.push({it->second.rank, left, it->second.merged});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    const int right = next[c.pos];
    auto it = m.merges.find(hf::BpeModel::PairKey(symbols[c.pos], symbols[right]));
    if (it == m.merges.end() || it->second.merged != c.merged) continue;  // stale
    symbols[c.pos] = c.merged;
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    consider(prev[c.pos]);
    consider(c.pos);
  }
  for (int i = 0; i >= 0; i = next[i]) out.push_back(symbols[i]);
  return out.size() <= max_tokens;
}

// One token through the decoder chain, as HF's decoders treat it when it is
// the first token of the text (`first`) or a later one.
bool HfTokenizer::Impl::TokenString(int32_t id, std::string& out) const {
  if (id < 0 || id >= spec.vocab_size) return false;
  if (added_index[id] >= 0) {
    const hf::AddedToken& token = spec.added[added_index[id]];
    if (token.special) return false;  // skip_special_tokens
    // See HfTokenizerOptions::decode_normalized_added_tokens.
    out = token.normalized && decode_normalized_added_tokens
              ? hf::Normalize(spec.normalizers, token.content)
              : token.content;
    return true;
  }
  if (id < static_cast<int32_t>(spec.model.pieces.size()) && !spec.model.pieces[id].empty()) {
    out = spec.model.pieces[id];
    return true;
  }
  return false;  // HF drops ids it has no token for
}

std::string HfTokenizer::Impl::DecodeToken(int32_t id, bool first) const {
  std::string s;
  if (!TokenString(id, s)) return "";
  if (!spec.has_decoder) return first ? s : " " + s;  // HF joins tokens with " "
  bool fused = false;
  for (const hf::DecoderStep& step : spec.decoders) {
    switch (step.kind) {
      case hf::DecoderStep::Kind::kReplace:
        s = hf::ReplacePattern(step.pattern, s, step.content);
        break;
      case hf::DecoderStep::Kind::kMetaspace:
        // The first token loses all its replacement characters.
        s = hf::MetaspaceToken(s, step.replacement, first && step.prepend);
        break;
      case hf::DecoderStep::Kind::kByteFallback: {
        uint8_t byte;
        if (hf::ByteToken(s, byte)) s = std::string(1, static_cast<char>(byte));
        break;
      }
      case hf::DecoderStep::Kind::kFuse:
        fused = true;
        break;
      case hf::DecoderStep::Kind::kByteLevel: {
        std::string out;
        hf::AppendByteLevelBytes(s, out);
        s = std::move(out);
        fused = true;
        break;
      }
      case hf::DecoderStep::Kind::kStrip:
        // Before fusing, HF strips every token; after, only the text's start.
        if (fused && !first) break;
        hf::StripToken(s, step.content, step.start, step.stop);
        break;
    }
  }
  return s;
}

std::string HfTokenizer::Impl::DecodeChain(std::vector<std::string> tokens, bool at_start,
                                           bool* open) const {
  if (!spec.has_decoder) {
    // HF joins the tokens with " ".
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0 || !at_start) out.push_back(' ');
      out += tokens[i];
    }
    return out;
  }
  // After fusing, the one token left is the whole text: HF's first token.
  bool fused = false;
  std::vector<std::string> next;
  for (const hf::DecoderStep& step : spec.decoders) {
    switch (step.kind) {
      case hf::DecoderStep::Kind::kReplace:
        for (std::string& t : tokens) t = hf::ReplacePattern(step.pattern, t, step.content);
        break;
      case hf::DecoderStep::Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool first = fused || (i == 0 && at_start);
          tokens[i] = hf::MetaspaceToken(tokens[i], step.replacement, first && step.prepend);
        }
        break;
      case hf::DecoderStep::Kind::kByteFallback: {
        // A run of byte tokens becomes one token if its bytes are valid
        // UTF-8, else one U+FFFD per byte.
        next.clear();
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (SanitizeUtf8(run) == run) {
            next.push_back(std::move(run));
          } else {
            for (size_t k = 0; k < run_tokens; ++k) next.emplace_back("\xEF\xBF\xBD");
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : tokens) {
          uint8_t byte;
          if (hf::ByteToken(t, byte)) {
            run.push_back(static_cast<char>(byte));
            ++run_tokens;
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        if (run_tokens > 0 && open != nullptr) *open = true;
        flush();
        tokens.swap(next);
        break;
      }
      case hf::DecoderStep::Kind::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        fused = true;
        break;
      }
      case hf::DecoderStep::Kind::kByteLevel: {
        // The bytes of all tokens, joined, as UTF-8 with invalid sequences
        // replaced (String::from_utf8_lossy).
        std::string bytes;
        for (const std::string& t : tokens) hf::AppendByteLevelBytes(t, bytes);
        Utf8StreamDecoder utf8;
        std::string text = utf8.Push(bytes);
        const std::string tail = utf8.Flush();
        if (!tail.empty() && open != nullptr) *open = true;
        text += tail;
        tokens.assign(1, std::move(text));
        fused = true;
        break;
      }
      case hf::DecoderStep::Kind::kStrip:
        for (std::string& t : tokens) {
          // The start of a fused text is the text's start only at_start.
          hf::StripToken(t, step.content, fused && !at_start ? 0 : step.start, step.stop);
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

HfTokenizer::HfTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

int HfTokenizer::vocab_size() const { return impl_->spec.vocab_size; }
int32_t HfTokenizer::bos_id() const { return impl_->bos; }
std::span<const int32_t> HfTokenizer::eos_ids() const { return impl_->eos; }
const std::vector<std::string>& HfTokenizer::load_notes() const { return impl_->notes; }

std::string_view HfTokenizer::token_text(int32_t id) const {
  const Impl& t = *impl_;
  if (id < 0 || id >= t.spec.vocab_size) return "";
  if (t.added_index[id] >= 0) return t.spec.added[t.added_index[id]].content;
  if (id < static_cast<int32_t>(t.spec.model.pieces.size())) return t.spec.model.pieces[id];
  return "";
}

bool HfTokenizer::is_special(int32_t id) const {
  const Impl& t = *impl_;
  return id >= 0 && id < t.spec.vocab_size && t.added_index[id] >= 0 &&
         t.spec.added[t.added_index[id]].special;
}

std::string HfTokenizer::TokenBytes(int32_t prev, int32_t token) const {
  const Impl& t = *impl_;
  if (token < 0 || token >= t.spec.vocab_size) return "";
  if (prev < 0 || prev == t.bos) {
    if (auto it = t.first_bytes.find(token); it != t.first_bytes.end()) return it->second;
  }
  return t.bytes[token];
}

bool HfTokenizer::DecodesPerToken() const { return impl_->spec.per_token_decode; }

std::string HfTokenizer::DecodeRun(std::span<const int32_t> ids, int32_t prev,
                                   bool* open_end) const {
  const Impl& t = *impl_;
  if (open_end != nullptr) *open_end = !t.spec.streamable_decode;
  if (t.spec.per_token_decode) return Tokenizer::DecodeRun(ids, prev, nullptr);
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  std::string s;
  for (const int32_t id : ids) {
    if (t.TokenString(id, s)) tokens.push_back(std::move(s));
  }
  // ByteFallback and ByteLevel make valid UTF-8; an added token's content
  // is valid already.
  return SanitizeUtf8(t.DecodeChain(std::move(tokens), prev < 0 || prev == t.bos, open_end));
}

std::vector<int32_t> HfTokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  return *EncodeAtMost(text, add_special_tokens, SIZE_MAX);
}

std::optional<std::vector<int32_t>> HfTokenizer::EncodeAtMost(std::string_view text,
                                                              bool add_special_tokens,
                                                              size_t max_tokens) const {
  return impl_->Encode(text, add_special_tokens, {}, max_tokens);
}

std::optional<std::vector<int32_t>> HfTokenizer::EncodeSplitAtMost(
    std::string_view text, bool add_special_tokens, std::span<const ByteRange> special_ranges,
    size_t max_tokens) const {
  return impl_->Encode(text, add_special_tokens, {.split = true, .keep = special_ranges},
                       max_tokens);
}

std::optional<std::string> HfTokenizer::FindSpecialToken(std::string_view text) const {
  for (const int32_t id : Encode(text, /*add_special_tokens=*/false)) {
    if (is_special(id)) return std::string(token_text(id));
  }
  return std::nullopt;
}

std::optional<std::vector<int32_t>> HfTokenizer::Impl::Encode(std::string_view text,
                                                              bool add_special_tokens,
                                                              const hf::SpecialFilter& filter,
                                                              size_t max_tokens) const {
  const Impl& t = *this;
  // The template's tokens after the text count too.
  const size_t suffix = add_special_tokens ? t.spec.suffix.size() : 0;
  if (suffix > max_tokens) return std::nullopt;
  const size_t budget = max_tokens - suffix;
  // HF takes only valid Unicode; invalid bytes become U+FFFD first. That
  // moves the bytes after them, and with them the ranges of `filter`: no
  // special token is kept then (callers give valid UTF-8).
  std::string sanitized = SanitizeUtf8(text);
  const size_t origin = sanitized == text ? 0 : std::string::npos;

  // 1. Added tokens in the raw text.
  std::vector<hf::Item> items;
  t.SplitAdded({std::move(sanitized), true}, origin, t.raw_matcher, filter, items);

  std::vector<int32_t> ids;
  if (add_special_tokens) ids = t.spec.prefix;
  std::vector<hf::Item> sub;
  std::vector<hf::Piece> pieces;
  for (hf::Item& item : items) {
    if (item.id >= 0) {
      ids.push_back(item.id);
      continue;
    }
    // 2. Normalize, then added tokens in the normalized text.
    hf::Piece normalized{hf::Normalize(t.spec.normalizers, item.piece.text),
                         item.piece.at_input_start};
    if (normalized.text.empty()) continue;
    sub.clear();
    // Offsets in normalized text are those of the text only where the
    // normalizer changed nothing; elsewhere no special token is kept.
    t.SplitAdded(normalized, normalized.text == item.piece.text ? item.origin : std::string::npos,
                 t.normalized_matcher, filter, sub);
    for (hf::Item& s : sub) {
      if (s.id >= 0) {
        ids.push_back(s.id);
        continue;
      }
      // 3. Pre-tokenize; 4. BPE.
      pieces.clear();
      pieces.push_back(std::move(s.piece));
      t.PreTokenize(pieces);
      for (const hf::Piece& piece : pieces) {
        if (!t.Bpe(piece.text, ids, budget)) return std::nullopt;
      }
    }
    if (ids.size() > budget) return std::nullopt;
  }
  if (ids.size() > budget) return std::nullopt;
  // 5. The template.
  if (add_special_tokens) ids.insert(ids.end(), t.spec.suffix.begin(), t.spec.suffix.end());
  return ids;
}

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<HfTokenizer>> hf::MakeTokenizer(TokenizerSpec spec,
                                                               std::vector<std::string> notes,
                                                               const HfTokenizerOptions& options) {
  const std::string source = spec.source;
  auto impl = std::make_shared<HfTokenizer::Impl>();
  impl->notes = std::move(notes);
  impl->spec = std::move(spec);
  impl->decode_normalized_added_tokens = options.decode_normalized_added_tokens;
  hf::TokenizerSpec& s = impl->spec;

  auto byte_level = hf::Regex::Compile(hf::kByteLevelPattern);
  auto word_char = hf::Regex::Compile(hf::kWordCharPattern);
  if (!byte_level.ok()) return byte_level.status();
  if (!word_char.ok()) return word_char.status();
  impl->byte_level_regex = *std::move(byte_level);
  impl->word_char = *std::move(word_char);
  for (const std::string& piece : s.model.pieces) {
    size_t chars = 0;
    for (size_t i = 0; i < piece.size(); i += hf::CharLength(piece[i])) ++chars;
    impl->max_piece_chars = std::max(impl->max_piece_chars, chars);
  }

  // HF matches special tokens first, then the others, each in file order.
  impl->added_index.assign(s.vocab_size, -1);
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < s.added.size(); ++i) {
      const hf::AddedToken& token = s.added[i];
      if (token.special != (pass == 0)) continue;
      if (token.normalized) {
        impl->normalized_matcher.Add(hf::Normalize(s.normalizers, token.content),
                                     static_cast<int>(i));
      } else {
        impl->raw_matcher.Add(token.content, static_cast<int>(i));
      }
    }
  }
  for (size_t i = 0; i < s.added.size(); ++i)
    impl->added_index[s.added[i].id] = static_cast<int>(i);

  impl->bos = s.prefix.empty() ? -1 : s.prefix.front();
  if (options.eos_ids) {
    for (const int32_t id : *options.eos_ids) {
      if (id < 0 || id >= s.vocab_size) {
        return absl::InvalidArgumentError(hf::Cat(
            source, ": eos id ", id, " is outside the vocabulary (size ", s.vocab_size, ")"));
      }
    }
    impl->eos = *options.eos_ids;
  } else {
    static const std::vector<std::string_view> kEndMarkers = {
        "</s>",       "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>",
        "<|eom_id|>", "<eos>",         "<|end|>",    "<end_of_turn>"};
    for (const hf::AddedToken& token : s.added) {
      if (token.special &&
          std::find(kEndMarkers.begin(), kEndMarkers.end(), token.content) != kEndMarkers.end()) {
        impl->eos.push_back(token.id);
      }
    }
    std::sort(impl->eos.begin(), impl->eos.end());
  }

  // Also for chains that are not per token: TokenBytes is then an
  // approximation of DecodeRun, for callers that want one token's text.
  impl->bytes.resize(s.vocab_size);
  for (int32_t id = 0; id < s.vocab_size; ++id) {
    impl->bytes[id] = impl->DecodeToken(id, /*first=*/false);
    std::string first = impl->DecodeToken(id, /*first=*/true);
    if (first != impl->bytes[id]) impl->first_bytes.emplace(id, std::move(first));
  }
  return std::make_unique<HfTokenizer>(std::move(impl));
}

namespace {

absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadFromJson(std::string_view json,
                                                          const std::string& source,
                                                          const HfTokenizerOptions& options) {
  std::vector<std::string> notes;
  auto spec = hf::ParseTokenizerJson(json, source, options, &notes);
  if (!spec.ok()) return spec.status();
  return hf::MakeTokenizer(*std::move(spec), std::move(notes), options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadHfTokenizerFromJson(
    std::string_view json, const std::string& source, const HfTokenizerOptions& options) {
  // The parser keeps tables proportional to the file, so this only catches
  // running out of memory on a huge one; callers get a status, not a throw.
  try {
    return LoadFromJson(json, source, options);
  } catch (const std::exception& e) {
    return absl::InternalError(hf::Cat(source, ": loading failed: ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadHfTokenizer(const std::string& tokenizer_json_path,
                                                             const HfTokenizerOptions& options) {
  std::ifstream in(tokenizer_json_path, std::ios::binary);
  if (!in) return absl::NotFoundError(hf::Cat("cannot open ", tokenizer_json_path));
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::InternalError(hf::Cat("cannot read ", tokenizer_json_path));
  return LoadHfTokenizerFromJson(json, tokenizer_json_path, options);
}

}  // namespace coalesce::engine
