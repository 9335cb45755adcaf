// Llama2cTokenizer (run.c's encode/decode rules) and the UTF-8 helpers every
// tokenizer's output goes through.
#include "engine/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/tokenizer/llama2c_tokenizer.h"

namespace coalesce::engine {
namespace {

const std::string kModels = COALESCE_MODELS_DIR;
const std::string kFffd = "\xEF\xBF\xBD";

std::unique_ptr<Llama2cTokenizer> LoadTok512() {
  auto tok = LoadLlama2cTokenizer(kModels + "/stories260K/tok512.bin", 512);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// Feeds `bytes` to a stream decoder in pieces cut at `cuts` and returns the
// concatenated output, flush included.
std::string StreamDecode(std::string_view bytes, const std::vector<size_t>& cuts) {
  Utf8StreamDecoder decoder;
  std::string out;
  size_t start = 0;
  for (size_t cut : cuts) {
    out += decoder.Push(bytes.substr(start, cut - start));
    start = cut;
  }
  out += decoder.Push(bytes.substr(start));
  return out + decoder.Flush();
}

// ---------------------------------------------------------------------------
// SanitizeUtf8
// ---------------------------------------------------------------------------

TEST(SanitizeUtf8Test, KeepsValidText) {
  const std::string text = "plain, caf\xC3\xA9, \xE2\x82\xAC, \xF0\x9F\x98\x80, \xF4\x8F\xBF\xBF";
  EXPECT_EQ(SanitizeUtf8(text), text);
}

TEST(SanitizeUtf8Test, ReplacesEachMaximalInvalidSubpart) {
  // Lone continuation, byte never valid, truncated 3-byte char before ASCII.
  EXPECT_EQ(SanitizeUtf8("a\x80z"), "a" + kFffd + "z");
  EXPECT_EQ(SanitizeUtf8("\xFF\xFE"), kFffd + kFffd);
  EXPECT_EQ(SanitizeUtf8("\xE2\x82z"), kFffd + "z");
  // Overlongs, surrogates and > U+10FFFF are rejected at the second byte, so
  // each byte of them becomes its own U+FFFD (Unicode's recommended practice).
  EXPECT_EQ(SanitizeUtf8("\xC0\xAF"), kFffd + kFffd);
  EXPECT_EQ(SanitizeUtf8("\xE0\x80\xAF"), kFffd + kFffd + kFffd);
  EXPECT_EQ(SanitizeUtf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);
  EXPECT_EQ(SanitizeUtf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);
  EXPECT_EQ(SanitizeUtf8("\xF0\x8F\xBF\xBF"), kFffd + kFffd + kFffd + kFffd);
  // An incomplete character at the end is one U+FFFD.
  EXPECT_EQ(SanitizeUtf8("ok\xF0\x9F\x98"), "ok" + kFffd);
}

// ---------------------------------------------------------------------------
// Utf8StreamDecoder
// ---------------------------------------------------------------------------

TEST(Utf8StreamDecoderTest, HoldsASplitCharacterUntilComplete) {
  Utf8StreamDecoder decoder;
  EXPECT_EQ(decoder.Push("a\xF0\x9F"), "a");
  EXPECT_EQ(decoder.Push("\x98"), "");
  EXPECT_EQ(decoder.Push("\x80!"), "\xF0\x9F\x98\x80!");
  EXPECT_EQ(decoder.Flush(), "");
}

TEST(Utf8StreamDecoderTest, EmitsInvalidBytesAtOnce) {
  Utf8StreamDecoder decoder;
  // \x80 can never start a character: no reason to hold it.
  EXPECT_EQ(decoder.Push("\x80"), kFffd);
  // A pending lead byte followed by ASCII is invalid as soon as ASCII comes.
  EXPECT_EQ(decoder.Push("\xC3"), "");
  EXPECT_EQ(decoder.Push("x"), kFffd + "x");
}

TEST(Utf8StreamDecoderTest, FlushReplacesAnIncompleteTail) {
  Utf8StreamDecoder decoder;
  EXPECT_EQ(decoder.Push("\xE2\x82"), "");
  EXPECT_EQ(decoder.Flush(), kFffd);
  EXPECT_EQ(decoder.Flush(), "");  // nothing left after a flush
}

TEST(Utf8StreamDecoderTest, AnySplitEqualsSanitizingTheWhole) {
  std::mt19937 rng(7);
  const std::string alphabet[] = {"a",    "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\x80",
                                  "\xFF", "\xE0\x80", "\xED\xA0\x80", "\xF4\x90",         "\xC3"};
  for (int trial = 0; trial < 500; ++trial) {
    std::string bytes;
    for (int i = 0; i < 12; ++i) bytes += alphabet[rng() % std::size(alphabet)];
    std::vector<size_t> cuts;
    for (size_t i = 1; i < bytes.size(); ++i) {
      if (rng() % 3 == 0) cuts.push_back(i);
    }
    ASSERT_EQ(StreamDecode(bytes, cuts), SanitizeUtf8(bytes)) << "trial " << trial;
  }
}

// ---------------------------------------------------------------------------
// Llama2cTokenizer with tok512.bin
// ---------------------------------------------------------------------------

TEST(Llama2cTokenizerTest, EncodesLikeRunC) {
  auto tok = LoadTok512();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->Encode("Once upon a time", true), (std::vector<int32_t>{1, 403, 407, 261, 378}));
  EXPECT_EQ(tok->Encode("The little dog", true), (std::vector<int32_t>{1, 291, 376, 400, 428}));
  // No BOS; an empty text gets no dummy prefix either.
  EXPECT_EQ(tok->Encode("Once upon a time", false), (std::vector<int32_t>{403, 407, 261, 378}));
  EXPECT_EQ(tok->Encode("", true), (std::vector<int32_t>{1}));
  EXPECT_TRUE(tok->Encode("", false).empty());
}

// run.c's encode matches no special token in the text: it looks characters
// up and merges pieces, and no merge of tok512 gives <unk>, <s> or </s>
// (their pieces are "<unk>", "\n<s>\n" and "\n</s>\n", none the join of two
// others). split_special_tokens has nothing to split.
TEST(Llama2cTokenizerTest, SplittingSpecialTokensChangesNothing) {
  auto tok = LoadTok512();
  ASSERT_NE(tok, nullptr);
  for (const char* text : {"<s>Once</s>", "\n<s>\n", "\n</s>\n<unk>", "Once upon a time"}) {
    const std::vector<int32_t> ids = tok->Encode(text, true);
    EXPECT_EQ(tok->EncodeSplit(text, true), ids) << text;
    EXPECT_EQ(std::count_if(ids.begin() + 1, ids.end(), [](int32_t id) { return id <= 2; }), 0)
        << text;
    EXPECT_EQ(tok->FindSpecialToken(text), std::nullopt) << text;
  }
}

TEST(Llama2cTokenizerTest, LooksUpWholeCharactersThenFallsBackToBytes) {
  auto tok = LoadTok512();
  ASSERT_NE(tok, nullptr);
  // "\xC3\xA9" (e acute) is piece 485 of tok512: one token for the character.
  EXPECT_EQ(tok->Encode("\xC3\xA9", false), (std::vector<int32_t>{410, 485}));
  // U+4E2D is not in tok512: its three bytes become <0xE4> <0xB8> <0xAD>,
  // i.e. byte + 3.
  EXPECT_EQ(tok->Encode("\xE4\xB8\xAD", false),
            (std::vector<int32_t>{410, 0xE4 + 3, 0xB8 + 3, 0xAD + 3}));
}

TEST(Llama2cTokenizerTest, TokenBytesFollowsRunCDecode) {
  auto tok = LoadTok512();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->piece(403), " Once");
  EXPECT_EQ(tok->piece(512), "");              // out of range: empty, no exception
  EXPECT_EQ(tok->TokenBytes(1, 403), "Once");  // after BOS: leading space dropped
  EXPECT_EQ(tok->TokenBytes(-1, 403), " Once");
  EXPECT_EQ(tok->TokenBytes(403, 407), tok->piece(407));
  EXPECT_EQ(tok->TokenBytes(-1, 0x0A + 3), "\n");  // <0x0A>
  EXPECT_EQ(tok->TokenBytes(-1, 0xC3 + 3), "\xC3");
  for (int32_t control : {0, 1, 2}) EXPECT_EQ(tok->TokenBytes(-1, control), "");
  EXPECT_EQ(tok->TokenBytes(-1, 512), "");  // out of range: nothing, no crash
  EXPECT_EQ(tok->TokenBytes(-1, -5), "");
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(std::vector<int32_t>(tok->eos_ids().begin(), tok->eos_ids().end()),
            (std::vector<int32_t>{1, 2}));
}

TEST(Llama2cTokenizerTest, RoundTripsArbitraryBytes) {
  auto tok = LoadTok512();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    const int len = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) {
      // Mostly ASCII words, sometimes any byte at all (NUL and invalid UTF-8).
      text += rng() % 4 == 0 ? static_cast<char>(rng() % 256) : "abcde fghij."[rng() % 12];
    }
    const std::vector<int32_t> ids = tok->Encode(text, true);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 512);
    // Decode sanitises; the raw bytes must come back exactly.
    std::string bytes;
    for (size_t i = 0; i < ids.size(); ++i) bytes += tok->TokenBytes(i ? ids[i - 1] : -1, ids[i]);
    ASSERT_EQ(bytes, text) << "trial " << trial;
    ASSERT_EQ(Decode(*tok, ids), SanitizeUtf8(text));
  }
}

TEST(Llama2cTokenizerTest, EncodeAtMostIsEncodeWhenItFitsAndNothingOtherwise) {
  auto tok = LoadTok512();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    const int len = static_cast<int>(rng() % 60);
    for (int i = 0; i < len; ++i) {
      text += rng() % 5 == 0 ? static_cast<char>(rng() % 256) : "Once upon a time."[rng() % 17];
    }
    const bool bos = rng() % 2 == 0;
    const std::vector<int32_t> full = tok->Encode(text, bos);
    for (size_t limit : {size_t{0}, full.size() - (full.empty() ? 0 : 1), full.size(),
                         full.size() + 1, full.size() * 3}) {
      const std::optional<std::vector<int32_t>> got = tok->EncodeAtMost(text, bos, limit);
      if (full.size() <= limit) {
        ASSERT_TRUE(got.has_value()) << "trial " << trial << " limit " << limit;
        ASSERT_EQ(*got, full);
      } else {
        ASSERT_FALSE(got.has_value()) << "trial " << trial << " limit " << limit;
      }
    }
  }
}

TEST(Llama2cTokenizerTest, MergesHighestScoreFirstLeftmostOnTies) {
  // A toy vocabulary: "ab" outranks "bc", so "abc" -> "ab" + "c"; two equal
  // candidates "xx" in "xxx" merge leftmost first -> "xx" + "x".
  std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    pieces.push_back(buf);
  }
  const int base = static_cast<int>(pieces.size());
  for (const char* p : {" ", "a", "b", "c", "x", "ab", "bc", "xx"}) pieces.push_back(p);
  std::vector<float> scores(pieces.size(), 0.0f);
  scores[base + 5] = 5.0f;  // ab
  scores[base + 6] = 1.0f;  // bc
  scores[base + 7] = 2.0f;  // xx
  Llama2cTokenizer tok(pieces, scores);
  EXPECT_EQ(tok.Encode("abc", false), (std::vector<int32_t>{base, base + 5, base + 3}));
  EXPECT_EQ(tok.Encode("xxx", false), (std::vector<int32_t>{base, base + 7, base + 4}));
}

TEST(LoadLlama2cTokenizerTest, ReportsBadFiles) {
  auto missing = LoadLlama2cTokenizer(kModels + "/stories260K/no-such-file.bin", 512);
  EXPECT_FALSE(missing.ok());
  // The model file is not a tokenizer: its lengths run past the end.
  auto wrong = LoadLlama2cTokenizer(kModels + "/stories260K/stories260K.bin", 512);
  EXPECT_FALSE(wrong.ok());
  // Asking for more tokens than the file holds.
  auto short_file = LoadLlama2cTokenizer(kModels + "/stories260K/tok512.bin", 513);
  ASSERT_FALSE(short_file.ok());
  EXPECT_NE(short_file.status().message().find("tok512.bin"), std::string::npos);
}

}  // namespace
}  // namespace coalesce::engine
