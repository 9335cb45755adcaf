// TextStream: UTF-8 assembly across tokens and stop sequences that may span
// tokens, checked against a whole-string reference.
#include "engine/tokenizer/text_stream.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace coalesce::engine {
namespace {

// Token i stands for pieces[i]; token 0 is a control token (no bytes).
class FakeTokenizer : public Tokenizer {
 public:
  explicit FakeTokenizer(std::vector<std::string> pieces) : pieces_(std::move(pieces)) {}
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int32_t bos_id() const override { return 0; }
  std::span<const int32_t> eos_ids() const override { return {}; }
  std::vector<int32_t> Encode(std::string_view, bool) const override { return {}; }
  std::string TokenBytes(int32_t prev, int32_t token) const override { return pieces_[token]; }

 private:
  std::vector<std::string> pieces_;
};

struct StreamRun {
  std::vector<std::string> pieces;  // what each Push returned
  bool stopped = false;
  std::string text;  // everything sent, Finish included when not stopped
};

StreamRun Feed(const Tokenizer& tok, const std::vector<int32_t>& ids,
               std::vector<std::string> stops) {
  TextStream stream(tok, -1, std::move(stops));
  StreamRun run;
  for (int32_t id : ids) {
    TextStream::Piece p = stream.Push(id);
    run.pieces.push_back(p.text);
    run.text += p.text;
    if (p.stopped) {
      run.stopped = true;
      return run;
    }
  }
  run.text += stream.Finish();
  return run;
}

// A tokenizer whose text is not per token: DecodeRun joins the pieces with
// "-" (also after a text token before the run); the text of a run ending in
// token 1 is open (later tokens may change it). TokenBytes must not be used.
class RunTokenizer : public FakeTokenizer {
 public:
  using FakeTokenizer::FakeTokenizer;
  std::string TokenBytes(int32_t, int32_t) const override { return "WRONG"; }
  bool DecodesPerToken() const override { return false; }
  std::string DecodeRun(std::span<const int32_t> ids, int32_t prev, bool* open_end) const override {
    std::string out;
    bool joined = prev > 0;
    for (const int32_t id : ids) {
      if (id == 0) continue;
      if (joined) out += "-";
      out += FakeTokenizer::TokenBytes(-1, id);
      joined = true;
    }
    if (open_end != nullptr) *open_end = !ids.empty() && ids.back() == 1;
    return out;
  }
};

TEST(TextStreamTest, RunDecoderStreamsWhatDecodeGives) {
  RunTokenizer tok({"", "x", "y", "z"});
  StreamRun run = Feed(tok, {1, 2, 1, 3, 0, 2}, {});
  EXPECT_EQ(run.pieces, (std::vector<std::string>{"", "x-y", "", "-x-z", "", "-y"}));
  EXPECT_EQ(run.text, "x-y-x-z-y");
  EXPECT_EQ(run.text, Decode(tok, std::vector<int32_t>{1, 2, 1, 3, 0, 2}));
  // An open end waits for Finish.
  run = Feed(tok, {2, 1}, {});
  EXPECT_EQ(run.pieces, (std::vector<std::string>{"y", ""}));
  EXPECT_EQ(run.text, "y-x");
  // Stop sequences across the pieces.
  run = Feed(tok, {1, 2, 3, 1, 2}, {"y-z"});
  EXPECT_TRUE(run.stopped);
  EXPECT_EQ(run.text, "x-");
  // After a prompt token, the run continues its text.
  TextStream stream(tok, 3, {});
  EXPECT_EQ(stream.Push(2).text, "-y");
  std::mt19937 rng(3);
  for (int round = 0; round < 200; ++round) {
    std::vector<int32_t> ids(1 + rng() % 10);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 4);
    const int32_t prev = static_cast<int32_t>(rng() % 5) - 1;
    TextStream s(tok, prev, {});
    std::string text;
    for (const int32_t id : ids) text += s.Push(id).text;
    text += s.Finish();
    EXPECT_EQ(text, Decode(tok, ids, prev)) << round;
  }
}

TEST(TextStreamTest, NoStopsPassesTextThrough) {
  FakeTokenizer tok({"", "Hello", " world"});
  StreamRun run = Feed(tok, {1, 0, 2}, {});
  EXPECT_EQ(run.pieces, (std::vector<std::string>{"Hello", "", " world"}));
  EXPECT_FALSE(run.stopped);
  EXPECT_EQ(run.text, "Hello world");
}

TEST(TextStreamTest, InvalidUtf8StopNeverCutsACharacter) {
  // "\xbf" is the middle byte of "\xef\xbf\xbd" (U+FFFD, what a lone
  // continuation byte decodes to). A stop made of it must not match there.
  FakeTokenizer tok({"", "a", "\xbf", "b"});
  StreamRun run = Feed(tok, {1, 2, 3}, {"\xbf"});
  EXPECT_FALSE(run.stopped);
  EXPECT_EQ(run.text,
            "a\xef\xbf\xbd"
            "b");
  EXPECT_EQ(SanitizeUtf8(run.text), run.text);
}

TEST(TextStreamTest, StopSequenceAcrossTokensIsCutOff) {
  FakeTokenizer tok({"", "The end", ". ST", "OP", " more"});
  StreamRun run = Feed(tok, {1, 2, 3, 4}, {"STOP"});
  EXPECT_TRUE(run.stopped);
  // ". " goes out with the second token; "ST" waits; "OP" completes the stop.
  EXPECT_EQ(run.pieces, (std::vector<std::string>{"The end", ". ", ""}));
  EXPECT_EQ(run.text, "The end. ");
}

TEST(TextStreamTest, HeldPrefixIsReleasedWhenItStopsMatching) {
  FakeTokenizer tok({"", "ab", "c", "x"});
  TextStream stream(tok, -1, {"abcd"});
  EXPECT_EQ(stream.Push(1).text, "");    // "ab" may start "abcd"
  EXPECT_EQ(stream.Push(2).text, "");    // "abc" still may
  TextStream::Piece p = stream.Push(3);  // "abcx" cannot
  EXPECT_EQ(p.text, "abcx");
  EXPECT_FALSE(p.stopped);
  EXPECT_EQ(stream.Finish(), "");
}

TEST(TextStreamTest, FinishReturnsHeldText) {
  FakeTokenizer tok({"", "so S", "T"});
  TextStream stream(tok, -1, {"STOP"});
  EXPECT_EQ(stream.Push(1).text, "so ");
  EXPECT_EQ(stream.Push(2).text, "");
  EXPECT_EQ(stream.Finish(), "ST");
}

TEST(TextStreamTest, EarliestOfSeveralStopsWins) {
  FakeTokenizer tok({"", "one two three"});
  StreamRun run = Feed(tok, {1}, {"three", "two", "wo t"});
  EXPECT_TRUE(run.stopped);
  EXPECT_EQ(run.text, "one ");
}

TEST(TextStreamTest, SplitCharacterGoesOutWhole) {
  // U+20AC EURO SIGN split over three byte tokens, then an invalid byte.
  FakeTokenizer tok({"", "\xE2", "\x82", "\xAC", "\xFF"});
  StreamRun run = Feed(tok, {1, 2, 3, 4}, {});
  EXPECT_EQ(run.pieces, (std::vector<std::string>{"", "", "\xE2\x82\xAC", "\xEF\xBF\xBD"}));
  // An unfinished character at the end becomes U+FFFD in Finish.
  StreamRun cut = Feed(tok, {1, 2}, {});
  EXPECT_EQ(cut.text, "\xEF\xBF\xBD");
}

TEST(TextStreamTest, StopSequenceOfMultiByteCharacters) {
  FakeTokenizer tok({"", "a\xE2", "\x82\xAC", "b"});
  StreamRun run = Feed(tok, {1, 2, 3}, {"\xE2\x82\xAC"});  // stop on "€"
  EXPECT_TRUE(run.stopped);
  EXPECT_EQ(run.text, "a");
}

// Random token streams over a small alphabet: the text sent must be exactly
// the whole text up to the first stop occurrence, must never contain a stop
// sequence, and must be sent no later than needed (at most a stop's length
// minus one byte is ever held).
TEST(TextStreamTest, MatchesWholeStringReference) {
  FakeTokenizer tok({"", "a", "b", "ab", "ba", "bb", "aab", "c"});
  const std::vector<std::string> stops = {"abba", "cab", "bbb"};
  std::mt19937 rng(3);
  int stopped_runs = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids;
    std::string full;
    for (int i = 0; i < 12; ++i) {
      ids.push_back(1 + static_cast<int32_t>(rng() % 7));
      full += tok.TokenBytes(-1, ids.back());
    }
    size_t first = std::string::npos;
    for (const std::string& s : stops) first = std::min(first, full.find(s));
    StreamRun run = Feed(tok, ids, stops);
    ASSERT_EQ(run.stopped, first != std::string::npos) << full;
    ASSERT_EQ(run.text, first == std::string::npos ? full : full.substr(0, first)) << full;
    for (const std::string& s : stops) ASSERT_EQ(run.text.find(s), std::string::npos);
    // After each push, what was sent so far lags the bytes seen by < 4.
    std::string sent, seen;
    for (size_t i = 0; i < run.pieces.size(); ++i) {
      sent += run.pieces[i];
      seen += tok.TokenBytes(-1, ids[i]);
      if (!(run.stopped && i + 1 == run.pieces.size())) {
        ASSERT_LT(seen.size() - sent.size(), 4u);
      }
    }
    stopped_runs += run.stopped;
  }
  EXPECT_GT(stopped_runs, 100);  // the stops were actually exercised
}

}  // namespace
}  // namespace coalesce::engine
