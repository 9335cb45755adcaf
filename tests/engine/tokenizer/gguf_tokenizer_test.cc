// BuildGgufTokenizer (engine/tokenizer/gguf_tokenizer.h) on hand-built
// vocabularies (SentencePiece merges by score, byte fallback, token types,
// the template, every error), on hostile ones (no crash), and on llama.cpp's
// vocab-only GGUF files read with ReadGgufVocab (engine/model/gguf_vocab.h):
// each of the 46 test strings must encode to llama.cpp's ids (which are HF's),
// and the GGUF tokenizers must agree with the tokenizer.json ones of the same
// vocabularies. tests/engine/tokenizer/test_gguf_tokenizer_parity.py compares
// a real model's GGUF tokenizer with transformers'.
#include "engine/tokenizer/gguf_tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/model/gguf_file.h"
#include "engine/model/gguf_vocab.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/text_stream.h"
#include "tests/engine/tokenizer/llamacpp_vocab_cases.h"

namespace coalesce::engine {
namespace {

const std::string kModels = COALESCE_MODELS_DIR;
const std::string kVocabDir = kModels + "/llamacpp-vocab-tests";

constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kByte = 6;

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

std::vector<int32_t> Ids(std::initializer_list<int32_t> ids) { return ids; }

// ---------------------------------------------------------------------------
// Hand-built vocabularies
// ---------------------------------------------------------------------------

// Appends a token and returns its id.
int32_t Add(GgufVocab& v, const std::string& text, int32_t type = kNormal, float score = 0) {
  v.tokens.push_back(text);
  v.token_types.push_back(type);
  v.scores.push_back(score);
  return static_cast<int32_t>(v.tokens.size() - 1);
}

// A small SentencePiece vocabulary: <unk> <s> </s>, the byte tokens of "é"
// (C3 A9) and of "ü"'s first byte only (C3), and pieces with scores.
struct Spm {
  GgufVocab v;
  int32_t unk, bos, eos, c3, a9, space, a, b, c, ab, bc, abc, space_a, tool, im_end;
};

Spm MakeSpm() {
  Spm s;
  GgufVocab& v = s.v;
  v.source = "spm.gguf";
  v.model = "llama";
  v.pre = "default";
  s.unk = Add(v, "<unk>", kUnknown);
  s.bos = Add(v, "<s>", kControl);
  s.eos = Add(v, "</s>", kControl);
  s.c3 = Add(v, "<0xC3>", kByte);
  s.a9 = Add(v, "<0xA9>", kByte);
  s.space = Add(v, "\xE2\x96\x81", kNormal, -10);  // ▁
  s.a = Add(v, "a", kNormal, -11);
  s.b = Add(v, "b", kNormal, -12);
  s.c = Add(v, "c", kNormal, -13);
  s.ab = Add(v, "ab", kNormal, -2);
  s.bc = Add(v, "bc", kNormal, -3);
  s.abc = Add(v, "abc", kNormal, -4);
  s.space_a = Add(v,
                  "\xE2\x96\x81"
                  "a",
                  kNormal, -1);
  s.tool = Add(v, "<tool>", kUserDefined);
  s.im_end = Add(v, "<|im_end|>", kControl);
  v.bos_id = s.bos;
  v.eos_id = s.eos;
  v.unk_id = s.unk;
  return s;
}

std::unique_ptr<HfTokenizer> Build(const GgufVocab& v) {
  auto tok = BuildGgufTokenizer(v);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

TEST(GgufTokenizerTest, SentencePieceMergesByScoreLeftmostOnTies) {
  Spm s = MakeSpm();
  s.v.add_space_prefix = false;
  // "ab" (-2) beats "bc" (-3), then (ab, c) makes "abc".
  auto tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("abc", false), Ids({s.abc}));
  EXPECT_EQ(tok->Encode("bcab", false), Ids({s.bc, s.ab}));

  // "bc" scoring above "ab": "abc" is still reached through (a, bc).
  s.v.scores[s.bc] = -1.5f;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("abc", false), Ids({s.abc}));

  // Without "abc" the higher score decides: (a, bc) here...
  s.v.token_types[s.abc] = kControl;  // control tokens are never made by merges
  s.v.tokens[s.abc] = "<abc>";
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("abc", false), Ids({s.a, s.bc}));
  // ... (ab, c) when "ab" scores higher ...
  s.v.scores[s.bc] = -3;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("abc", false), Ids({s.ab, s.c}));
  // ... and the leftmost pair on equal scores, whichever pieces they make.
  s.v.scores[s.bc] = -2;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("abc", false), Ids({s.ab, s.c}));
  EXPECT_EQ(tok->Encode("bcab", false), Ids({s.bc, s.ab}));
  EXPECT_EQ(tok->Encode("bab", false), Ids({s.b, s.ab}));
  EXPECT_EQ(tok->Encode("abcbc", false), Ids({s.ab, s.c, s.bc}));
}

TEST(GgufTokenizerTest, SpacePrefixAndDecoding) {
  Spm s = MakeSpm();
  auto tok = Build(s.v);
  ASSERT_TRUE(tok);
  // Prepend("▁") + Replace(" ", "▁"): "a" is "▁a", whose score beats "▁"+"ab".
  EXPECT_EQ(tok->Encode("a", false), Ids({s.space_a}));
  EXPECT_EQ(tok->Encode("ab a", false), Ids({s.space_a, s.b, s.space_a}));
  EXPECT_EQ(Decode(*tok, tok->Encode("ab a", false)), "ab a");
  // Strip(" ", 1, 0) removes only the one space the prefix added.
  EXPECT_EQ(Decode(*tok, tok->Encode("  a", false)), "  a");
  EXPECT_EQ(Decode(*tok, Ids({s.space_a, s.space_a})), "a a");

  s.v.add_space_prefix = false;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("a", false), Ids({s.a}));
  EXPECT_EQ(tok->Encode(" a", false), Ids({s.space_a}));
  EXPECT_EQ(Decode(*tok, Ids({s.space_a})), " a");
}

TEST(GgufTokenizerTest, ByteFallbackAndUnknown) {
  Spm s = MakeSpm();
  s.v.add_space_prefix = false;
  auto tok = Build(s.v);
  ASSERT_TRUE(tok);
  // "é" = C3 A9: both bytes are tokens.
  EXPECT_EQ(tok->Encode("a\xC3\xA9", false), Ids({s.a, s.c3, s.a9}));
  EXPECT_EQ(Decode(*tok, Ids({s.a, s.c3, s.a9})), "a\xC3\xA9");
  // "ü" = C3 BC: BC is not, so the character is <unk>; two in a row fuse.
  EXPECT_EQ(tok->Encode("a\xC3\xBC\xC3\xBC"
                        "b",
                        false),
            Ids({s.a, s.unk, s.b}));
  // The unknown token is special: decoded as nothing.
  EXPECT_TRUE(tok->is_special(s.unk));
  EXPECT_EQ(Decode(*tok, Ids({s.a, s.unk, s.b})), "ab");

  // Without unknown_token_id the token of type 2 is the unknown token.
  s.v.unk_id.reset();
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("\xC3\xBC", false), Ids({s.unk}));
}

TEST(GgufTokenizerTest, TokenTypes) {
  Spm s = MakeSpm();
  s.v.add_space_prefix = false;
  auto tok = Build(s.v);
  ASSERT_TRUE(tok);
  // Control tokens are special added tokens: matched in the text, skipped
  // when decoding.
  EXPECT_EQ(tok->Encode("a<s>b</s>", false), Ids({s.a, s.bos, s.b, s.eos}));
  EXPECT_TRUE(tok->is_special(s.bos));
  EXPECT_TRUE(tok->is_special(s.im_end));
  EXPECT_EQ(Decode(*tok, Ids({s.bos, s.a, s.eos})), "a");
  // User-defined tokens are added tokens that are not special: matched in
  // the raw text, decoded as written.
  EXPECT_FALSE(tok->is_special(s.tool));
  EXPECT_EQ(tok->Encode("a<tool>b", false), Ids({s.a, s.tool, s.b}));
  EXPECT_EQ(Decode(*tok, Ids({s.a, s.tool, s.b})), "a<tool>b");
  // Byte and normal tokens are vocabulary pieces: "<0xC3>" in the text is
  // not the byte token.
  EXPECT_FALSE(tok->is_special(s.c3));
  EXPECT_NE(tok->Encode("<0xC3>", false), Ids({s.c3}));
  EXPECT_EQ(tok->vocab_size(), static_cast<int>(s.v.tokens.size()));
  EXPECT_EQ(tok->token_text(s.ab), "ab");

  // Without token types, unknown, BOS and EOS are the special tokens.
  s.v.token_types.clear();
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_TRUE(tok->is_special(s.bos));
  EXPECT_TRUE(tok->is_special(s.eos));
  EXPECT_TRUE(tok->is_special(s.unk));
  EXPECT_FALSE(tok->is_special(s.im_end));
  EXPECT_FALSE(tok->is_special(s.tool));
}

TEST(GgufTokenizerTest, BosAndEos) {
  Spm s = MakeSpm();
  s.v.add_space_prefix = false;
  // "llama": BOS by default, no EOS.
  auto tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("a", true), Ids({s.bos, s.a}));
  EXPECT_EQ(tok->Encode("a", false), Ids({s.a}));
  EXPECT_EQ(tok->bos_id(), s.bos);

  s.v.add_eos = true;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("a", true), Ids({s.bos, s.a, s.eos}));

  s.v.add_bos = false;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("a", true), Ids({s.a, s.eos}));
  EXPECT_EQ(tok->bos_id(), -1);

  // EOS ids: eos, eot, eom, then control tokens that are end markers
  // ("</s>" again, "<|im_end|>"), each once.
  s.v.eot_id = s.im_end;
  s.v.eom_id = s.eos;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(std::vector<int32_t>(tok->eos_ids().begin(), tok->eos_ids().end()),
            Ids({s.eos, s.im_end}));
  s.v.eot_id.reset();
  s.v.eom_id.reset();
  s.v.eos_id = s.ab;  // whatever the file says comes first
  s.v.add_eos = false;
  tok = Build(s.v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(std::vector<int32_t>(tok->eos_ids().begin(), tok->eos_ids().end()),
            Ids({s.ab, s.eos, s.im_end}));
}

// A tiny byte-level vocabulary: a few characters, "Ġ" (a space) pieces, merges,
// a control and a user-defined token.
GgufVocab MakeGpt2() {
  GgufVocab v;
  v.source = "bpe.gguf";
  v.model = "gpt2";
  v.pre = "gpt-2";
  for (const char* t : {"a", "b", "c", "\xC4\xA0" /* Ġ */, "1", "2"}) {
    v.tokens.push_back(t);
    v.token_types.push_back(kNormal);
  }
  for (const char* t : {"ab",
                        "\xC4\xA0"
                        "a",
                        "\xC4\xA0"
                        "ab",
                        "12", "<|endoftext|>", "<x>"}) {
    v.tokens.push_back(t);
    v.token_types.push_back(kNormal);
  }
  v.token_types[10] = kControl;
  v.token_types[11] = kUserDefined;
  v.merges = {"\xC4\xA0 a",
              "\xC4\xA0"
              "a b",
              "a b", "1 2"};
  v.eos_id = 10;
  v.bos_id = 10;
  return v;
}

TEST(GgufTokenizerTest, ByteLevelBpe) {
  GgufVocab v = MakeGpt2();
  auto tok = Build(v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("ab ab", false), Ids({6, 8}));
  EXPECT_EQ(tok->Encode("ab ab", true), Ids({6, 8}));  // no BOS by default
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->Encode("12", false), Ids({9}));
  EXPECT_EQ(tok->Encode("a<|endoftext|>b<x>", false), Ids({0, 10, 1, 11}));
  EXPECT_EQ(Decode(*tok, Ids({6, 8, 10})), "ab ab");
  EXPECT_EQ(Decode(*tok, Ids({0, 11})), "a<x>");
  EXPECT_EQ(std::vector<int32_t>(tok->eos_ids().begin(), tok->eos_ids().end()), Ids({10}));

  v.add_bos = true;
  tok = Build(v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("ab", true), Ids({10, 6}));

  // smollm: each digit on its own.
  v.pre = "smollm";
  v.add_bos.reset();
  tok = Build(v);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->Encode("12", false), Ids({4, 5}));
  EXPECT_EQ(tok->Encode("ab ab", false), Ids({6, 8}));
}

// Control tokens split as transformers' split_special_tokens splits them:
// their text is text, except inside the ranges given; user-defined tokens
// are not special and still match.
TEST(GgufTokenizerTest, SplitSpecialTokensLeavesControlTokensAsText) {
  Spm s = MakeSpm();
  s.v.add_space_prefix = false;
  auto tok = Build(s.v);
  ASSERT_TRUE(tok);
  const std::string text = "a<s>b<tool></s>";
  // (This vocabulary has no pieces for "<", "s" or "/": the text becomes
  // unknown tokens, never <s> or </s>.)
  const std::vector<int32_t> split = tok->EncodeSplit(text, false);
  EXPECT_EQ(std::count(split.begin(), split.end(), s.bos), 0);
  EXPECT_EQ(std::count(split.begin(), split.end(), s.eos), 0);
  EXPECT_NE(std::find(split.begin(), split.end(), s.tool), split.end());
  // "</s>" at bytes 11..15 kept.
  const ByteRange keep[] = {{11, 15}};
  std::vector<int32_t> kept = tok->EncodeSplit(text, false, keep);
  ASSERT_FALSE(kept.empty());
  EXPECT_EQ(kept.back(), s.eos);
  kept.pop_back();
  EXPECT_EQ(kept, tok->EncodeSplit("a<s>b<tool>", false));
  EXPECT_EQ(tok->FindSpecialToken("a<|im_end|>"), "<|im_end|>");
  EXPECT_EQ(tok->FindSpecialToken("a<tool>"), std::nullopt);

  GgufVocab v = MakeGpt2();
  auto bpe = Build(v);
  ASSERT_TRUE(bpe);
  EXPECT_EQ(bpe->Encode("a<|endoftext|>b", false), Ids({0, 10, 1}));
  const std::vector<int32_t> bpe_split = bpe->EncodeSplit("a<|endoftext|>b", false);
  EXPECT_EQ(std::count(bpe_split.begin(), bpe_split.end(), 10), 0);
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

void ExpectError(const GgufVocab& v, const std::string& what) {
  auto tok = BuildGgufTokenizer(v);
  ASSERT_FALSE(tok.ok()) << "accepted; expected an error with: " << what;
  const std::string message(tok.status().message());
  EXPECT_TRUE(Contains(message, v.source + ": ")) << message;
  EXPECT_TRUE(Contains(message, what));
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(GgufTokenizerTest, ErrorsNameFileKeyAndValue) {
  {
    GgufVocab v = MakeGpt2();
    v.source = "x.gguf";
    v.pre = "foo";
    ExpectError(v,
                "x.gguf: tokenizer.ggml.pre = \"foo\" is not supported (supported: default, "
                "gpt-2, llama-bpe, qwen2, smollm)");
    EXPECT_EQ(BuildGgufTokenizer(v).status().code(), absl::StatusCode::kUnimplemented);
  }
  {
    GgufVocab v = MakeGpt2();
    v.model = "bert";
    ExpectError(v, "tokenizer.ggml.model = \"bert\" is not supported (supported: llama, gpt2)");
    v.model = "";
    ExpectError(v, "tokenizer.ggml.model = \"\" is not supported");
  }
  // The pre-tokenizer of "llama" files is ignored.
  {
    Spm s = MakeSpm();
    s.v.pre = "foo";
    EXPECT_TRUE(BuildGgufTokenizer(s.v).ok());
  }
  {
    GgufVocab v = MakeGpt2();
    v.tokens.clear();
    v.token_types.clear();
    ExpectError(v, "tokenizer.ggml.tokens is missing or empty");
  }
  {
    GgufVocab v = MakeGpt2();
    v.token_types.pop_back();
    ExpectError(v, "tokenizer.ggml.token_type has 11 entries but tokenizer.ggml.tokens has 12");
    v = MakeGpt2();
    v.scores = {1, 2};
    ExpectError(v, "tokenizer.ggml.scores has 2 entries but tokenizer.ggml.tokens has 12");
    v = MakeGpt2();
    v.token_types[3] = 9;
    ExpectError(v, "tokenizer.ggml.token_type[3] = 9 is not a token type");
    v = MakeGpt2();
    v.token_types[3] = -1;
    ExpectError(v, "tokenizer.ggml.token_type[3] = -1 is not a token type");
  }
  {
    GgufVocab v = MakeGpt2();
    v.bos_id = 12;
    ExpectError(v, "tokenizer.ggml.bos_token_id = 12 is outside the vocabulary");
    v = MakeGpt2();
    v.eos_id = -3;
    ExpectError(v, "tokenizer.ggml.eos_token_id = -3 is outside the vocabulary");
    v = MakeGpt2();
    v.eot_id = 1 << 30;
    ExpectError(v, "tokenizer.ggml.eot_token_id = 1073741824 is outside the vocabulary");
    v = MakeGpt2();
    v.eom_id = 99;
    ExpectError(v, "tokenizer.ggml.eom_token_id = 99");
    v = MakeGpt2();
    v.unk_id = 99;
    ExpectError(v, "tokenizer.ggml.unknown_token_id = 99");
    v = MakeGpt2();
    v.pad_id = 99;
    ExpectError(v, "tokenizer.ggml.padding_token_id = 99");
  }
  {
    GgufVocab v = MakeGpt2();
    v.merges.push_back("a zz");
    ExpectError(v, "tokenizer.ggml.merges[4] = \"a zz\": \"zz\" is not a token");
    v.merges.back() = "zz a";
    ExpectError(v, "tokenizer.ggml.merges[4] = \"zz a\": \"zz\" is not a token");
    v.merges.back() = "ab";
    ExpectError(v, "tokenizer.ggml.merges[4] = \"ab\" is not two tokens separated by a space");
    v.merges.back() = " a";  // the space is the first byte: llama.cpp looks after it
    ExpectError(v, "tokenizer.ggml.merges[4] = \" a\" is not two tokens separated by a space");
    v.merges.back() = "b a";
    ExpectError(v, "tokenizer.ggml.merges[4] = \"b a\": the merged \"ba\" is not a token");
    v.merges.back() = "a b c";
    ExpectError(v, "tokenizer.ggml.merges[4] = \"a b c\" does not split into two tokens");
  }
  {
    Spm s = MakeSpm();
    s.v.scores.clear();
    ExpectError(s.v, "tokenizer.ggml.scores is missing");
    s = MakeSpm();
    s.v.scores[7] = std::nanf("");
    ExpectError(s.v, "tokenizer.ggml.scores[7] = nan is not a number");
    s = MakeSpm();
    s.v.tokens[6] = std::string(kGgufMaxMergedPieceBytes + 1, 'a');
    ExpectError(s.v, "tokenizer.ggml.tokens[6] = \"aaaa");
    ExpectError(s.v, "is 1025 bytes long");
  }
  {
    GgufVocab v = MakeGpt2();
    v.tokens[2] = "a\xFF\"\n";
    ExpectError(v, "tokenizer.ggml.tokens[2] = \"a\\xff\\\"\\x0a\" is not valid UTF-8");
  }
  {
    GgufVocab v = MakeGpt2();
    v.add_bos = true;
    v.bos_id.reset();
    ExpectError(v,
                "tokenizer.ggml.add_bos_token = true, but there is no "
                "tokenizer.ggml.bos_token_id");
    v = MakeGpt2();
    v.add_eos = true;
    v.eos_id.reset();
    ExpectError(v,
                "tokenizer.ggml.add_eos_token = true, but there is no "
                "tokenizer.ggml.eos_token_id");
    // A default BOS without bos_token_id is no BOS.
    Spm s = MakeSpm();
    s.v.bos_id.reset();
    auto tok = Build(s.v);
    ASSERT_TRUE(tok);
    EXPECT_EQ(tok->bos_id(), -1);
  }
}

// Garbage in every field (huge and negative ids, empty and invalid tokens,
// merges without a space or naming no token, NaN and infinite scores, types
// out of range, arrays of the wrong length): an error naming the file, or a
// tokenizer, never a crash; what builds must encode and decode anything. Each
// field is garbage now and then, so that many vocabularies build.
TEST(GgufTokenizerTest, HostileVocabulariesDoNotCrash) {
  std::mt19937 rng(20260301);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  auto rarely = [&] { return pick(12) == 0; };
  static const std::vector<std::string> kParts = {
      "a",      "b",      " ",  "\xC4\xA0", "\xE2\x96\x81",     "<s>",
      "<0x41>", "<0xC3>", "1",  "\n",       "\xC3\xA9",         "",
      "<",      ">",      "ab", "a b",      "\xF0\x9F\xA6\x99", "\xEF\xBF\xBD"};
  static const std::vector<std::string> kInvalid = {"\xFF", "\xE2\x96", "\xC3", "\x80"};
  auto random_text = [&](int max_parts, bool invalid) {
    std::string s;
    const int parts = pick(max_parts + 1);
    for (int i = 0; i < parts; ++i) {
      s += invalid && pick(4) == 0 ? kInvalid[pick(static_cast<int>(kInvalid.size()))]
                                   : kParts[pick(static_cast<int>(kParts.size()))];
    }
    return s;
  };
  static const std::vector<std::string> kPre = {"",          "default", "gpt-2",
                                                "llama-bpe", "qwen2",   "smollm"};
  int built = 0, refused = 0;
  for (int round = 0; round < 4000; ++round) {
    GgufVocab v;
    v.source = "hostile.gguf";
    v.model = rarely() ? "bert" : pick(2) ? "llama" : "gpt2";
    v.pre = rarely() ? "x" : kPre[pick(static_cast<int>(kPre.size()))];
    const int n = pick(24);
    const bool invalid_tokens = rarely();
    for (int i = 0; i < n; ++i) v.tokens.push_back(random_text(3, invalid_tokens));
    auto length = [&] { return rarely() ? n + 1 - 2 * pick(2) : n; };
    if (pick(5) != 0) {
      const int types = length();
      for (int i = 0; i < types; ++i) v.token_types.push_back(pick(7));
      if (types > 0 && rarely()) v.token_types[pick(types)] = pick(2) ? -1 - pick(5) : 7 + pick(5);
    }
    if (pick(5) != 0) {
      const int scores = length();
      for (int i = 0; i < scores; ++i) {
        const int kind = pick(40);
        v.scores.push_back(kind == 0               ? std::numeric_limits<float>::infinity()
                           : kind == 1             ? -std::numeric_limits<float>::infinity()
                           : kind == 2 && rarely() ? std::nanf("")
                                                   : static_cast<float>(pick(7)) - 3);
      }
    }
    // Merges: splits of tokens into two tokens, and now and then garbage.
    const bool garbage_merges = rarely();
    for (int i = 0; i < 2 * n; ++i) {
      if (garbage_merges && pick(4) == 0) {
        v.merges.push_back(random_text(3, pick(2) == 0));
        continue;
      }
      const std::string& t = v.tokens[pick(n)];
      for (size_t at = 1; at < t.size(); ++at) {
        const std::string left = t.substr(0, at), right = t.substr(at);
        if (std::find(v.tokens.begin(), v.tokens.end(), left) != v.tokens.end() &&
            std::find(v.tokens.begin(), v.tokens.end(), right) != v.tokens.end()) {
          v.merges.push_back(left + " " + right);
          break;
        }
      }
    }
    auto random_id = [&]() -> std::optional<int32_t> {
      if (pick(2) == 0) return std::nullopt;
      if (rarely()) {
        static const int32_t kBad[] = {std::numeric_limits<int32_t>::max(),
                                       std::numeric_limits<int32_t>::min(), -1, 1 << 30};
        return pick(2) ? kBad[pick(4)] : n;
      }
      return n > 0 ? std::optional<int32_t>(pick(n)) : std::nullopt;
    };
    v.bos_id = random_id();
    v.eos_id = random_id();
    v.eot_id = random_id();
    v.eom_id = random_id();
    v.unk_id = random_id();
    v.pad_id = random_id();
    if (pick(2)) v.add_bos = pick(2) == 1;
    if (pick(2)) v.add_eos = pick(2) == 1;
    if (pick(2)) v.add_space_prefix = pick(2) == 1;
    auto tok = BuildGgufTokenizer(v);
    if (!tok.ok()) {
      ++refused;
      const std::string message(tok.status().message());
      EXPECT_TRUE(Contains(message, "hostile.gguf: "));
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
      continue;
    }
    ++built;
    const HfTokenizer& t = **tok;
    for (int k = 0; k < 5; ++k) {
      const std::string text = random_text(8, pick(4) == 0);
      const bool special = pick(2) == 1;
      const std::vector<int32_t> ids = t.Encode(text, special);
      for (const int32_t id : ids) {
        ASSERT_GE(id, 0);
        ASSERT_LT(id, t.vocab_size());
      }
      EXPECT_EQ(t.EncodeAtMost(text, special, ids.size()), ids);
      EXPECT_EQ(SanitizeUtf8(Decode(t, ids)), Decode(t, ids));
      std::vector<int32_t> garbage;
      for (int i = 0; i < 6; ++i) garbage.push_back(pick(40) - 8);
      (void)Decode(t, garbage, pick(30) - 5);
      TextStream stream(t, -1, {});
      for (const int32_t id : garbage) (void)stream.Push(id);
      (void)stream.Finish();
      for (const int32_t id : garbage) (void)t.token_text(id);
    }
  }
  // Both outcomes must be common, or the loop tests little.
  EXPECT_GT(built, 1000);
  EXPECT_GT(refused, 300);
}

// ---------------------------------------------------------------------------
// llama.cpp's vocab files
// ---------------------------------------------------------------------------

using llamacpp::VocabCase;

std::vector<VocabCase> LlamaCppCases(const std::string& name) {
  return llamacpp::LlamaCppCases(kVocabDir, name);
}

std::unique_ptr<HfTokenizer> LoadVocab(const std::string& name) {
  auto tok = LoadGgufTokenizer(kVocabDir + "/ggml-vocab-" + name + ".gguf");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

class GgufVocabFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kVocabDir)) {
      GTEST_SKIP() << kVocabDir << " not found (COALESCE_MODELS_DIR)";
    }
  }
};

TEST_F(GgufVocabFileTest, ReadsTheKeys) {
  auto file = GgufFile::Open(kVocabDir + "/ggml-vocab-llama-spm.gguf");
  ASSERT_TRUE(file.ok()) << file.status();
  auto v = ReadGgufVocab(*file);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->model, "llama");
  EXPECT_EQ(v->pre, "default");
  EXPECT_EQ(v->tokens.size(), 32000u);
  EXPECT_EQ(v->scores.size(), 32000u);
  EXPECT_EQ(v->token_types.size(), 32000u);
  EXPECT_TRUE(v->merges.empty());
  EXPECT_EQ(v->bos_id, 1);
  EXPECT_EQ(v->eos_id, 2);
  EXPECT_EQ(v->unk_id, 0);
  EXPECT_EQ(v->add_bos, true);
  EXPECT_EQ(v->add_eos, false);
  EXPECT_FALSE(v->add_space_prefix.has_value());
  EXPECT_EQ(v->tokens[3], "<0x00>");
  EXPECT_EQ(v->token_types[3], kByte);

  file = GgufFile::Open(kVocabDir + "/ggml-vocab-gpt-2.gguf");
  ASSERT_TRUE(file.ok()) << file.status();
  v = ReadGgufVocab(*file);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->model, "gpt2");
  EXPECT_EQ(v->pre, "gpt-2");
  EXPECT_EQ(v->tokens.size(), 50257u);
  EXPECT_EQ(v->merges.size(), 50000u);
  EXPECT_EQ(v->merges[0], "\xC4\xA0 t");
  EXPECT_TRUE(v->scores.empty());
  EXPECT_EQ(v->token_types[50256], kControl);
}

TEST_F(GgufVocabFileTest, LlamaSpmVectors) {
  auto tok = LoadVocab("llama-spm");
  ASSERT_TRUE(tok);
  const auto cases = LlamaCppCases("llama-spm");
  ASSERT_EQ(cases.size(), 46u);
  int passed = 0;
  for (const VocabCase& c : cases) {
    const std::vector<int32_t> ids = tok->Encode(c.text, false);
    EXPECT_EQ(ids, c.ids) << c.text;
    passed += ids == c.ids;
    // SentencePiece's only normalization is the space prefix, which the
    // decoder strips: every text comes back.
    EXPECT_EQ(Decode(*tok, ids), c.text);
    EXPECT_EQ(tok->Encode(c.text, true), [&] {
      std::vector<int32_t> with = {1};
      with.insert(with.end(), c.ids.begin(), c.ids.end());
      return with;
    }());
  }
  EXPECT_EQ(passed, 46);
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(std::vector<int32_t>(tok->eos_ids().begin(), tok->eos_ids().end()), Ids({2}));
}

TEST_F(GgufVocabFileTest, Gpt2Vectors) {
  auto tok = LoadVocab("gpt-2");
  ASSERT_TRUE(tok);
  const auto cases = LlamaCppCases("gpt-2");
  ASSERT_EQ(cases.size(), 46u);
  int passed = 0;
  for (const VocabCase& c : cases) {
    const std::vector<int32_t> ids = tok->Encode(c.text, false);
    EXPECT_EQ(ids, c.ids) << c.text;
    passed += ids == c.ids;
    EXPECT_EQ(Decode(*tok, ids), c.text);
    EXPECT_EQ(tok->Encode(c.text, true), c.ids);  // no BOS
  }
  EXPECT_EQ(passed, 46);
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(std::vector<int32_t>(tok->eos_ids().begin(), tok->eos_ids().end()), Ids({50256}));
}

// The GGUF files hold the vocabularies of the shared tokenizer.json files
// (Llama 2's in tinyllama-tokenizer, GPT-2's): both tokenizers must give the
// same ids and text on more than the 46 strings.
TEST_F(GgufVocabFileTest, AgreesWithTheTokenizerJsonOfTheSameVocabulary) {
  for (const auto& [gguf, json] :
       {std::pair<std::string, std::string>{"llama-spm", "tinyllama-tokenizer"},
        {"gpt-2", "gpt2-tokenizer"}}) {
    auto ours = LoadVocab(gguf);
    auto ref = LoadHfTokenizer(kModels + "/" + json + "/tokenizer.json");
    ASSERT_TRUE(ours && ref.ok()) << ref.status();
    EXPECT_EQ(ours->vocab_size(), (*ref)->vocab_size());
    std::vector<std::string> texts;
    for (const VocabCase& c : LlamaCppCases(gguf)) texts.push_back(c.text);
    // Concatenations and pieces of them, and special tokens in the text.
    for (size_t i = 0; i + 1 < texts.size(); i += 3) {
      texts.push_back(texts[i] + " " + texts[i + 1]);
      texts.push_back(texts[i].substr(texts[i].size() / 3));
    }
    texts.push_back("Hello</s> world<s>!<unk>");
    texts.push_back("<|endoftext|>Hi<|endoftext|>");
    texts.push_back(
        "\xE2\x96\x81"
        "already metaspaced \xE2\x96\x81\xE2\x96\x81 text");
    texts.push_back("ĠHello Ġworld \xF0\x9F\xA6\x99\xF0\x9F\xA6\x99 \xE6\x9D\xB1\xE4\xBA\xAC");
    for (const std::string& t : texts) {
      for (const bool special : {false, true}) {
        EXPECT_EQ(ours->Encode(t, special), (*ref)->Encode(t, special)) << gguf << ": " << t;
      }
    }
    // Decoding any ids, special and out-of-range ones included.
    std::mt19937 rng(7);
    for (int round = 0; round < 300; ++round) {
      std::vector<int32_t> ids;
      const int n = 1 + static_cast<int>(rng() % 12);
      for (int i = 0; i < n; ++i) {
        ids.push_back(rng() % 8 == 0 ? static_cast<int32_t>(rng() % 4)
                                     : static_cast<int32_t>(rng() % ours->vocab_size()));
      }
      EXPECT_EQ(Decode(*ours, ids), Decode(**ref, ids)) << gguf << " round " << round;
    }
    // Streaming: the decoder of each is per token.
    EXPECT_EQ(ours->DecodesPerToken(), (*ref)->DecodesPerToken());
  }
}

// The tokenizer.ggml.pre values on GPT-2's vocabulary.
TEST_F(GgufVocabFileTest, PreTokenizers) {
  auto file = GgufFile::Open(kVocabDir + "/ggml-vocab-gpt-2.gguf");
  ASSERT_TRUE(file.ok()) << file.status();
  auto vocab = ReadGgufVocab(*file);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  auto texts = [](const HfTokenizer& tok, const std::string& s) {
    std::vector<std::string> out;
    for (const int32_t id : tok.Encode(s, false)) out.emplace_back(tok.token_text(id));
    return out;
  };
  using Texts = std::vector<std::string>;
  GgufVocab v = *vocab;

  v.pre = "gpt-2";
  auto gpt2 = Build(v);
  ASSERT_TRUE(gpt2);
  EXPECT_EQ(texts(*gpt2, "in 2024"), (Texts{"in",
                                            "\xC4\xA0"
                                            "2024"}));

  // SmolLM: every digit alone, the rest as GPT-2.
  v.pre = "smollm";
  auto smollm = Build(v);
  ASSERT_TRUE(smollm);
  EXPECT_EQ(texts(*smollm, "in 2024"), (Texts{"in", "\xC4\xA0", "2", "0", "2", "4"}));
  EXPECT_EQ(smollm->Encode("Hello world, it's me!", false),
            gpt2->Encode("Hello world, it's me!", false));

  // Llama 3: numbers in threes, newline runs kept whole (GPT-2's regex
  // splits "\n\n" before a letter in two).
  v.pre = "llama-bpe";
  auto llama3 = Build(v);
  ASSERT_TRUE(llama3);
  EXPECT_EQ(texts(*llama3, "1234567"), (Texts{"123", "456", "7"}));
  EXPECT_EQ(texts(*gpt2, "1234567"), (Texts{"123", "45", "67"}));
  const std::string nn = "\xC4\x8A";  // Ċ, the byte-level "\n"
  EXPECT_EQ(texts(*llama3, "hello\n\nworld"), (Texts{"hello", nn + nn, "world"}));
  EXPECT_EQ(texts(*gpt2, "hello\n\nworld"), (Texts{"hello", nn, nn, "world"}));
  // llama.cpp adds BOS for Llama 3 unless add_bos_token says otherwise; this
  // file has no add_bos_token and a BOS token (50256).
  EXPECT_EQ(llama3->bos_id(), 50256);
  EXPECT_EQ(llama3->Encode("a", true).front(), 50256);

  // Qwen2: NFC first, digits one by one.
  v.pre = "qwen2";
  auto qwen2 = Build(v);
  ASSERT_TRUE(qwen2);
  EXPECT_EQ(qwen2->Encode("cafe\xCC\x81", false), qwen2->Encode("caf\xC3\xA9", false));
  EXPECT_NE(gpt2->Encode("cafe\xCC\x81", false), gpt2->Encode("caf\xC3\xA9", false));
  EXPECT_EQ(texts(*qwen2, "123"), (Texts{"1", "2", "3"}));

  // default (or no key): llama.cpp's default regexes; ASCII digits in
  // threes from the left, punctuation runs split off.
  for (const char* pre : {"default", ""}) {
    v.pre = pre;
    auto def = Build(v);
    ASSERT_TRUE(def);
    EXPECT_EQ(texts(*def, "1234567"), (Texts{"123", "456", "7"})) << pre;
    // The punctuation run is split from the space GPT-2's regex joins to it.
    EXPECT_EQ(texts(*def, "a !"), (Texts{"a", "\xC4\xA0", "!"})) << pre;
    EXPECT_EQ(texts(*gpt2, "a !"), (Texts{"a", "\xC4\xA0!"})) << pre;
    EXPECT_EQ(def->bos_id(), -1);
  }
}

// ---------------------------------------------------------------------------
// ReadGgufVocab on files written byte by byte
// ---------------------------------------------------------------------------

constexpr uint32_t kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9, kU64 = 10,
                   kI64 = 11;

// The little-endian bytes of a GGUF file without tensors.
class Writer {
 public:
  Writer& U32(uint32_t v) { return Int(v, 4); }
  Writer& U64(uint64_t v) { return Int(v, 8); }
  Writer& Str(const std::string& s) {
    U64(s.size());
    out_ += s;
    return *this;
  }
  Writer& Key(const std::string& key, uint32_t type) {
    ++kvs_;
    return Str(key).U32(type);
  }
  Writer& Strings(const std::string& key, const std::vector<std::string>& items) {
    Key(key, kArray).U32(kString).U64(items.size());
    for (const std::string& s : items) Str(s);
    return *this;
  }
  // The whole file: header, then the key/values written so far.
  std::string File() const {
    Writer header;
    header.out_ = "GGUF";
    header.U32(3).U64(0).U64(kvs_);
    return header.out_ + out_;
  }
  Writer& Int(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>(v >> (8 * i) & 0xFF));
    return *this;
  }

 private:
  std::string out_;
  uint64_t kvs_ = 0;
};

std::string WriteTemp(const std::string& bytes) {
  static int counter = 0;
  const std::string path = ::testing::TempDir() + "/gguf_tokenizer_test_" +
                           std::to_string(getpid()) + "_" + std::to_string(counter++) + ".gguf";
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// A valid "gpt2" vocabulary of three tokens and one merge.
Writer TinyGpt2() {
  Writer w;
  w.Key("tokenizer.ggml.model", kString).Str("gpt2");
  w.Strings("tokenizer.ggml.tokens", {"a", "b", "ab"});
  w.Strings("tokenizer.ggml.merges", {"a b"});
  return w;
}

TEST(GgufVocabTest, ReadsAWrittenFile) {
  Writer w = TinyGpt2();
  w.Key("tokenizer.ggml.token_type", kArray).U32(kI32).U64(3).U32(1).U32(1).U32(3);
  w.Key("tokenizer.ggml.scores", kArray).U32(kF32).U64(3).U32(0).U32(0x3F800000).U32(0);
  w.Key("tokenizer.ggml.eos_token_id", kI32).U32(2);  // any integer type
  w.Key("tokenizer.ggml.add_bos_token", kBool).Int(0, 1);
  const std::string path = WriteTemp(w.File());
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto v = ReadGgufVocab(*file);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->source, path);
  EXPECT_EQ(v->tokens, (std::vector<std::string>{"a", "b", "ab"}));
  EXPECT_EQ(v->token_types, Ids({1, 1, 3}));
  EXPECT_EQ(v->scores, (std::vector<float>{0, 1, 0}));
  EXPECT_EQ(v->eos_id, 2);
  EXPECT_EQ(v->add_bos, false);
  EXPECT_FALSE(v->bos_id.has_value());
  EXPECT_EQ(v->pre, "");
  auto tok = LoadGgufTokenizer(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("ab", false), Ids({2}));
  EXPECT_TRUE((*tok)->is_special(2));
}

// llama.cpp writes a special token id of "none" as 0xFFFFFFFF (its -1 as
// uint32; llama-convert-llama2c-to-ggml does for the padding id) and reads it
// as no such token: so do we. One below it is still outside the vocabulary.
TEST(GgufVocabTest, LlamaCppsNoneIdIsNoToken) {
  Writer w = TinyGpt2();
  w.Key("tokenizer.ggml.padding_token_id", kU32).U32(0xFFFFFFFFu);
  w.Key("tokenizer.ggml.bos_token_id", kU32).U32(0xFFFFFFFFu);
  w.Key("tokenizer.ggml.eos_token_id", kU64).U64(0xFFFFFFFFu);
  w.Key("tokenizer.ggml.unknown_token_id", kU32).U32(1);
  const std::string path = WriteTemp(w.File());
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto v = ReadGgufVocab(*file);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->pad_id.has_value());
  EXPECT_FALSE(v->bos_id.has_value());
  EXPECT_FALSE(v->eos_id.has_value());
  EXPECT_EQ(v->unk_id, 1);
  auto tok = LoadGgufTokenizer(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("ab", true), (*tok)->Encode("ab", false));  // no BOS to add
  EXPECT_EQ((*tok)->bos_id(), -1);

  Writer below = TinyGpt2();
  below.Key("tokenizer.ggml.padding_token_id", kU32).U32(0xFFFFFFFEu);
  const std::string below_path = WriteTemp(below.File());
  auto refused = LoadGgufTokenizer(below_path);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(std::string(refused.status().message()),
                       "tokenizer.ggml.padding_token_id = 4294967294 is outside the vocabulary"))
      << refused.status();
}

void ExpectReadError(Writer w, const std::string& what,
                     absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  const std::string path = WriteTemp(w.File());
  auto tok = LoadGgufTokenizer(path);
  ASSERT_FALSE(tok.ok()) << "accepted; expected an error with: " << what;
  EXPECT_EQ(tok.status().code(), code) << tok.status();
  const std::string message(tok.status().message());
  EXPECT_TRUE(Contains(message, path));
  EXPECT_TRUE(Contains(message, what));
}

TEST(GgufVocabTest, WrongTypesNameFileAndKey) {
  {
    Writer w;
    w.Key("general.architecture", kString).Str("llama");
    ExpectReadError(w, "the file has no tokenizer", absl::StatusCode::kNotFound);
    ExpectReadError(w, "--tokenizer", absl::StatusCode::kNotFound);
  }
  {
    Writer w;
    w.Key("tokenizer.ggml.model", kU32).U32(7);
    ExpectReadError(w, "\"tokenizer.ggml.model\": expected a string, found uint32 7");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.bos_token_id", kString).Str("1");
    ExpectReadError(w, "\"tokenizer.ggml.bos_token_id\": expected an integer >= 0");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.eos_token_id", kI32).U32(static_cast<uint32_t>(-1));
    ExpectReadError(w, "\"tokenizer.ggml.eos_token_id\": expected an integer >= 0, found int32 -1");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.unknown_token_id", kU32).U32(3000000000u);
    ExpectReadError(w, "tokenizer.ggml.unknown_token_id = 3000000000 is outside the vocabulary");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.bos_token_id", kU32).U32(3);
    ExpectReadError(w, "tokenizer.ggml.bos_token_id = 3 is outside the vocabulary");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.token_type", kArray).U32(kI64).U64(3).U64(1).U64(1).U64(1ull << 40);
    ExpectReadError(w, "tokenizer.ggml.token_type[2] = 1099511627776 is not a token type");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.scores", kArray).U32(kString).U64(1).Str("x");
    ExpectReadError(w, "\"tokenizer.ggml.scores\"");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.add_bos_token", kU32).U32(1);
    ExpectReadError(w, "\"tokenizer.ggml.add_bos_token\": expected a bool");
  }
  {
    Writer w;
    w.Key("tokenizer.ggml.model", kString).Str("gpt2");
    w.Key("tokenizer.ggml.tokens", kArray).U32(kU32).U64(1).U32(5);
    ExpectReadError(w, "\"tokenizer.ggml.tokens\": expected an array of string");
  }
  {
    Writer w;
    w.Key("tokenizer.ggml.model", kString).Str("gpt2");
    ExpectReadError(w, "tokenizer.ggml.tokens is missing or empty");
  }
  {
    Writer w = TinyGpt2();
    w.Key("tokenizer.ggml.pre", kString).Str("foo");
    ExpectReadError(w, "tokenizer.ggml.pre = \"foo\" is not supported",
                    absl::StatusCode::kUnimplemented);
  }
}

}  // namespace
}  // namespace coalesce::engine
