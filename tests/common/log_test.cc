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
