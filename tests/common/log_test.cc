// The log: one line per event whatever the message holds, and a bounded
// number of lines from any one rate-limited call site.
#include "common/log.h"

#include <string>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST(EscapeForLogTest, EscapesControlCharactersOnly) {
  EXPECT_EQ(EscapeForLog("plain text, UTF-8 \xC3\xA9 too"), "plain text, UTF-8 \xC3\xA9 too");
  EXPECT_EQ(EscapeForLog("a\nb\rc\td"), "a\\nb\\rc\\td");
  EXPECT_EQ(EscapeForLog(std::string("\x1b[2J\x00\x7f", 6)), "\\x1b[2J\\x00\\x7f");
}

// Line breaks, terminal controls and bidirectional overrides outside ASCII:
// a log viewer or terminal would otherwise break the line there (NEL, U+2028,
// U+2029), start an escape sequence (the C1 CSI), or show the text after it
// in another order than it was written (U+202E).
TEST(EscapeForLogTest, EscapesUnicodeLineBreaksControlsAndBidiOverrides) {
  EXPECT_EQ(EscapeForLog("a\xC2\x85"
                         "b"),
            "a\\u0085b");  // NEL
  EXPECT_EQ(EscapeForLog("a\xE2\x80\xA8"
                         "b\xE2\x80\xA9"
                         "c"),
            "a\\u2028b\\u2029c");
  EXPECT_EQ(EscapeForLog("\xC2\x9B"
                         "2J"),
            "\\u009b2J");                                         // CSI
  EXPECT_EQ(EscapeForLog("\xC2\x80\xC2\x9F"), "\\u0080\\u009f");  // C1's ends
  EXPECT_EQ(EscapeForLog("user \xE2\x80\xAE"
                         "gnp.exe"),
            "user \\u202egnp.exe");  // RLO
  for (const char* bidi :
       {"\xD8\x9C", "\xE2\x80\x8E", "\xE2\x80\x8F", "\xE2\x80\xAA", "\xE2\x80\xAB", "\xE2\x80\xAC",
        "\xE2\x80\xAD", "\xE2\x81\xA6", "\xE2\x81\xA7", "\xE2\x81\xA8", "\xE2\x81\xA9"}) {
    const std::string escaped = EscapeForLog(bidi);
    EXPECT_EQ(escaped.substr(0, 2), "\\u") << bidi;
    EXPECT_EQ(escaped.size(), 6u) << bidi;
  }
  // Other characters outside ASCII stay as they are: accents, CJK, emoji,
  // and the neighbours of the escaped ranges.
  for (const char* text : {"\xC2\xA0", "\xE2\x80\xA7", "\xE2\x80\xAF", "\xE6\x97\xA5",
                           "\xF0\x9F\x98\x80", "\xE2\x80\x8D"}) {
    EXPECT_EQ(EscapeForLog(text), text);
  }
}

// Bytes that are not UTF-8 are escaped one by one, so a line is always valid
// UTF-8 and a lone 0x9B (CSI to a terminal that reads Latin-1) is not raw.
TEST(EscapeForLogTest, EscapesBytesThatAreNotUtf8) {
  EXPECT_EQ(EscapeForLog("a\x9B"
                         "2J"),
            "a\\x9b2J");
  EXPECT_EQ(EscapeForLog("\xC3"), "\\xc3");                    // truncated
  EXPECT_EQ(EscapeForLog("\xC0\xAF"), "\\xc0\\xaf");           // overlong
  EXPECT_EQ(EscapeForLog("\xED\xA0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  EXPECT_EQ(EscapeForLog("\xE2\x80"
                         "x"),
            "\\xe2\\x80x");
}

TEST(LogTest, AMessageIsOneLineWhateverItHolds) {
  SetLogLevel(LogLevel::kInfo);
  ::testing::internal::CaptureStderr();
  Log(LogLevel::kInfo, "request x\n2026-01-01T00:00:00.000Z E forged\r");
  const std::vector<std::string> lines = Lines(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr(" I request x\\n2026-01-01T00:00:00.000Z E forged\\r"));
}

TEST(LogTest, RateLimitedLinesAreBoundedPerKeyAndCountTheRest) {
  SetLogLevel(LogLevel::kInfo);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 100; ++i) LogRateLimited("test site a", LogLevel::kError, "bad request");
  for (int i = 0; i < 3; ++i) LogRateLimited("test site b", LogLevel::kError, "other");
  const std::vector<std::string> lines = Lines(::testing::internal::GetCapturedStderr());
  // Another key has a budget of its own.
  ASSERT_EQ(lines.size(), static_cast<size_t>(kLogBurst + 3));
  for (const std::string& line : lines) EXPECT_THAT(line, ::testing::Not(HasSubstr("suppressed")));
}

TEST(LogTest, BelowTheLevelNothingIsWrittenOrCounted) {
  SetLogLevel(LogLevel::kWarning);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 10; ++i) LogRateLimited("test site c", LogLevel::kInfo, "quiet");
  LogRateLimited("test site c", LogLevel::kError, "loud");
  const std::vector<std::string> lines = Lines(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("loud"));
  EXPECT_THAT(lines[0], ::testing::Not(HasSubstr("suppressed")));
  SetLogLevel(LogLevel::kInfo);
}

}  // namespace
}  // namespace coalesce
