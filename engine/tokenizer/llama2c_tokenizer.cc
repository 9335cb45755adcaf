#include "engine/tokenizer/llama2c_tokenizer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/string_to_id.h"

namespace coalesce::engine {
namespace {

// The byte a "<0xXX>" piece stands for, or -1.
int BytePieceValue(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int value = 0;
  for (const char ch : piece.substr(3, 2)) {
    int digit;
    if (ch >= '0' && ch <= '9') {
      digit = ch - '0';
    } else if (ch >= 'A' && ch <= 'F') {
      digit = ch - 'A' + 10;
    } else if (ch >= 'a' && ch <= 'f') {
      digit = ch - 'a' + 10;
    } else {
      return -1;
    }
    value = value * 16 + digit;
  }
  return value;
}

constexpr int32_t kUnkId = 0;
constexpr int32_t kBosId = 1;
constexpr int32_t kEosId = 2;
// run.c starts its best-merge search at -1e10: pairs scoring no higher never
// merge.
constexpr float kNoMergeScore = -1e10f;

}  // namespace

struct Llama2cTokenizer::Impl {
  std::vector<std::string> pieces;  // [vocab_size]
  std::vector<float> scores;        // [vocab_size]
  std::vector<int16_t> byte_value;  // [vocab_size]: the byte of a <0xXX> piece, or -1
  // Piece -> id. With duplicate pieces the lowest id wins.
  StringToId ids;
  int32_t space_id = -1;  // the dummy-prefix piece " "
  std::vector<int32_t> eos = {kBosId, kEosId};
  // The longest piece, in bytes (at least 1). A token of the encoding
  // stands for at most this many bytes of the text: a byte-fallback token
  // for one byte of its 6-byte piece "<0xXX>", any other for its piece, and
  // a merge for the bytes of its two halves.
  size_t max_piece_bytes = 1;

  int32_t Lookup(std::string_view piece) const {
    auto it = ids.find(piece);
    return it == ids.end() ? -1 : it->second;
  }
};

Llama2cTokenizer::Llama2cTokenizer(std::vector<std::string> pieces, std::vector<float> scores) {
  auto impl = std::make_shared<Impl>();
  scores.resize(pieces.size(), 0.0f);
  impl->pieces = std::move(pieces);
  impl->scores = std::move(scores);
  impl->byte_value.resize(impl->pieces.size());
  impl->ids.reserve(impl->pieces.size());
  for (size_t i = 0; i < impl->pieces.size(); ++i) {
    impl->byte_value[i] = static_cast<int16_t>(BytePieceValue(impl->pieces[i]));
    impl->ids.emplace(impl->pieces[i], static_cast<int32_t>(i));  // keeps the first id
    impl->max_piece_bytes = std::max(impl->max_piece_bytes, impl->pieces[i].size());
  }
  impl->space_id = impl->Lookup(" ");
  impl_ = std::move(impl);
}

int Llama2cTokenizer::vocab_size() const { return static_cast<int>(impl_->pieces.size()); }

std::span<const int32_t> Llama2cTokenizer::eos_ids() const { return impl_->eos; }

const std::string& Llama2cTokenizer::piece(int32_t id) const {
  static const std::string* const kNone = new std::string();
  return id >= 0 && id < vocab_size() ? impl_->pieces[id] : *kNone;  // no exceptions
}

std::string Llama2cTokenizer::TokenBytes(int32_t prev, int32_t token) const {
  const Impl& t = *impl_;
  if (token < 0 || token >= vocab_size() || token == kUnkId || token == kBosId || token == kEosId) {
    return "";
  }
  if (t.byte_value[token] >= 0) return std::string(1, static_cast<char>(t.byte_value[token]));
  std::string_view piece = t.pieces[token];
  // SentencePiece's dummy prefix: the first piece after BOS lost its space.
  if (prev == kBosId && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
  return std::string(piece);
}

std::optional<std::vector<int32_t>> Llama2cTokenizer::EncodeAtMost(std::string_view text,
                                                                   bool add_special_tokens,
                                                                   size_t max_tokens) const {
  // The text and its dummy-prefix space need at least this many tokens.
  const size_t covered = text.empty() ? 0 : text.size() + 1;
  const size_t least = (add_special_tokens ? 1 : 0) +
                       (covered + impl_->max_piece_bytes - 1) / impl_->max_piece_bytes;
  if (least > max_tokens) return std::nullopt;
  std::vector<int32_t> ids = Encode(text, add_special_tokens);
  if (ids.size() > max_tokens) return std::nullopt;
  return ids;
}

std::vector<int32_t> Llama2cTokenizer::Encode(std::string_view text,
                                              bool add_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<int32_t> tokens;
  tokens.reserve(text.size() + 2);
  if (add_special_tokens) tokens.push_back(kBosId);
  auto push_bytes = [&](std::string_view bytes) {
    for (const char ch : bytes) tokens.push_back(static_cast<uint8_t>(ch) + 3);
  };
  if (!text.empty()) {
    // run.c would push -1 for a vocabulary without " "; fall back to its byte.
    if (t.space_id >= 0) {
      tokens.push_back(t.space_id);
    } else {
      push_bytes(" ");
    }
  }

  // 1. One token per UTF-8 character as run.c splits them: a lead byte and up
  //    to three continuation bytes; characters not in the vocabulary become
  //    their byte tokens. Invalid UTF-8 splits the same way and falls back to
  //    bytes, so any input encodes.
  auto is_continuation = [](char ch) { return (static_cast<uint8_t>(ch) & 0xC0) == 0x80; };
  size_t start = 0;
  while (start < text.size()) {
    size_t end = start + 1;
    while (end < text.size() && is_continuation(text[end]) && end - start < 4) ++end;
    const std::string_view ch = text.substr(start, end - start);
    const int32_t id = t.Lookup(ch);
    if (id >= 0) {
      tokens.push_back(id);
    } else {
      push_bytes(ch);
    }
    start = end;
  }

  // 2. Merge the adjacent pair whose concatenation scores highest (leftmost
  //    on ties) until none is in the vocabulary. run.c rescans all pairs per
  //    merge (quadratic); a max-heap over candidate pairs with lazy deletion
  //    makes the same choices, because a pair's rank depends only on its score
  //    and the position of its left token, and list order is position order.
  const int n = static_cast<int>(tokens.size());
  if (n < 2) return tokens;
  std::vector<int> next(n), prev(n);
  std::vector<uint32_t> version(n, 0);  // bumps when a node changes or dies
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Candidate {
    float score;
    int left, right;
    uint32_t left_version, right_version;
    int32_t merged;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
  std::string buffer;
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    buffer.assign(t.pieces[tokens[left]]);
    buffer.append(t.pieces[tokens[right]]);
    const int32_t id = t.Lookup(buffer);
    if (id < 0 || !(t.scores[id] > kNoMergeScore)) return;
    heap.push({t.scores[id], left, right, version[left], version[right], id});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i, i + 1);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (version[c.left] != c.left_version || version[c.right] != c.right_version ||
        next[c.left] != c.right) {
      continue;  // stale: one side merged since
    }
    tokens[c.left] = c.merged;
    ++version[c.left];
    ++version[c.right];  // the right node is gone
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    next[c.right] = -1;
    consider(prev[c.left], c.left);
    consider(c.left, next[c.left]);
  }
  std::vector<int32_t> out;
  out.reserve(n);
  for (int i = 0; i >= 0; i = next[i]) out.push_back(tokens[i]);
  return out;
}

absl::StatusOr<std::unique_ptr<Llama2cTokenizer>> LoadLlama2cTokenizer(const std::string& path,
                                                                       int vocab_size) {
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": vocab_size must be positive, got ", vocab_size));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t offset = 0;
  auto read = [&](void* dst, size_t n) {
    if (data.size() - offset < n) return false;
    std::memcpy(dst, data.data() + offset, n);
    offset += n;
    return true;
  };
  int32_t max_token_length = 0;
  if (!read(&max_token_length, 4)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": file too short for a tokenizer"));
  }
  std::vector<std::string> pieces(vocab_size);
  std::vector<float> scores(vocab_size);
  for (int i = 0; i < vocab_size; ++i) {
    int32_t length = 0;
    if (!read(&scores[i], 4) || !read(&length, 4)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": file ends at token ", i, " of ",
                                                     vocab_size, " (vocab_size from the model)"));
    }
    if (length < 0 || static_cast<size_t>(length) > data.size() - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": token ", i, " has invalid length ", length));
    }
    pieces[i].assign(data.data() + offset, length);
    offset += length;
  }
  return std::make_unique<Llama2cTokenizer>(std::move(pieces), std::move(scores));
}

}  // namespace coalesce::engine
