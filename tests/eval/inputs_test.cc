#include "tools/eval/inputs.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace coalesce::eval {
namespace {

std::string TempFile(const std::string& name, const std::string& contents) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream out(path, std::ios::binary);
  out << contents;
  return path;
}

// ---------------------------------------------------------------------------
// UTF-8 and texts
// ---------------------------------------------------------------------------

TEST(Utf8Test, FindsTheFirstInvalidByte) {
  EXPECT_EQ(FirstInvalidUtf8(""), -1);
  EXPECT_EQ(FirstInvalidUtf8("plain ascii"), -1);
  EXPECT_EQ(FirstInvalidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), -1);  // é € 😀
  EXPECT_EQ(FirstInvalidUtf8("ab\xff"), 2);
  EXPECT_EQ(FirstInvalidUtf8("a\xc3"), 1);              // cut short
  EXPECT_EQ(FirstInvalidUtf8("a\xc0\xaf"), 1);          // overlong '/'
  EXPECT_EQ(FirstInvalidUtf8("a\xe0\x80\xaf"), 1);      // overlong, 3 bytes
  EXPECT_EQ(FirstInvalidUtf8("a\xed\xa0\x80"), 1);      // a surrogate
  EXPECT_EQ(FirstInvalidUtf8("a\xf4\x90\x80\x80"), 1);  // above U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("\x80"), 0);               // a lone continuation byte
}

TEST(Utf8Test, TruncatesAtACharacterBoundary) {
  const std::string text =
      "ab\xe2\x82\xac"
      "c";  // a b € c
  EXPECT_EQ(TruncateUtf8(text, 100), text);
  EXPECT_EQ(TruncateUtf8(text, 6), text);
  EXPECT_EQ(TruncateUtf8(text, 5), "ab\xe2\x82\xac");
  EXPECT_EQ(TruncateUtf8(text, 4), "ab");  // would split the €
  EXPECT_EQ(TruncateUtf8(text, 3), "ab");
  EXPECT_EQ(TruncateUtf8(text, 2), "ab");
  EXPECT_EQ(TruncateUtf8(text, 0), "");
}

TEST(ReadTextTest, ReadsAllOrTheFirstBytes) {
  const std::string path = TempFile("text.txt", "Once upon a time \xe2\x82\xac.");
  absl::StatusOr<TextInput> all = ReadText(path, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->text, "Once upon a time \xe2\x82\xac.");
  EXPECT_EQ(all->file_bytes, 21);
  absl::StatusOr<TextInput> part = ReadText(path, 19);
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(part->text, "Once upon a time ");
  EXPECT_EQ(part->file_bytes, 21);
}

TEST(ReadTextTest, RefusesMissingEmptyAndBinaryFiles) {
  EXPECT_EQ(ReadText(::testing::TempDir() + "/no-such-file", 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(ReadText(TempFile("empty.txt", ""), 0).ok());
  absl::Status binary =
      ReadText(TempFile("binary.txt", std::string("ab\0\xff\xfe", 5)), 0).status();
  EXPECT_FALSE(binary.ok());
  EXPECT_NE(binary.message().find("not valid UTF-8"), absl::string_view::npos) << binary;
}

// ---------------------------------------------------------------------------
// Task files
// ---------------------------------------------------------------------------

TEST(TaskFileTest, ParsesItems) {
  absl::StatusOr<std::vector<TaskItem>> items = ParseTaskFile(
      "{\"context\": \"The sky is\", \"choices\": [\" blue\", \" green\"], \"answer\": 0}\n"
      "\n"
      "  {\"context\": \"Fish live in\", \"choices\": [\" trees\", \" water\", \" fire\"], "
      "\"answer\": 1, \"id\": \"extra keys are ignored\"}  \n");
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0].line, 1);
  EXPECT_EQ((*items)[0].context, "The sky is");
  EXPECT_EQ((*items)[0].choices, (std::vector<std::string>{" blue", " green"}));
  EXPECT_EQ((*items)[0].answer, 0);
  EXPECT_EQ((*items)[1].line, 3);
  EXPECT_EQ((*items)[1].answer, 1);
}

// Each hostile line is refused with a message naming its line, never a crash.
TEST(TaskFileTest, RefusesMalformedLines) {
  const std::string good = "{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": 0}\n";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": 0", "not valid JSON"},
      {"[1, 2, 3]", "not a JSON object"},
      {"\"just a string\"", "not a JSON object"},
      {"{\"choices\": [\"a\", \"b\"], \"answer\": 0}", "\"context\""},
      {"{\"context\": \"\", \"choices\": [\"a\", \"b\"], \"answer\": 0}", "\"context\""},
      {"{\"context\": 7, \"choices\": [\"a\", \"b\"], \"answer\": 0}", "\"context\""},
      {"{\"context\": \"c\", \"choices\": \"ab\", \"answer\": 0}", "\"choices\""},
      {"{\"context\": \"c\", \"choices\": [\"a\"], \"answer\": 0}", "\"choices\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", 2], \"answer\": 0}", "every choice"},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"\"], \"answer\": 0}", "every choice"},
      {"{\"context\": \"c\", \"choices\": [\"a\", null], \"answer\": 0}", "every choice"},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"]}", "\"answer\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": 2}", "\"answer\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": -1}", "\"answer\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": 1.0}", "\"answer\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": \"0\"}", "\"answer\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": 18446744073709551615}",
       "\"answer\""},
      {"{\"context\": \"c\", \"choices\": [\"a\", \"b\"], \"answer\": 1e400}", ""},
      {"{\"context\": \"\xff\xfe\", \"choices\": [\"a\", \"b\"], \"answer\": 0}", "not valid JSON"},
      {"{\"context\": \"\\ud800\", \"choices\": [\"a\", \"b\"], \"answer\": 0}", "not valid JSON"},
  };
  for (const auto& [line, why] : bad) {
    absl::StatusOr<std::vector<TaskItem>> items = ParseTaskFile(good + line + "\n" + good);
    ASSERT_FALSE(items.ok()) << line;
    EXPECT_NE(items.status().message().find("line 2: "), absl::string_view::npos) << items.status();
    EXPECT_NE(items.status().message().find(why), absl::string_view::npos) << items.status();
  }
}

TEST(TaskFileTest, RefusesTooManyChoicesHugeLinesAndDeepNesting) {
  std::string many = "{\"context\": \"c\", \"choices\": [";
  for (int i = 0; i < kMaxChoices + 1; ++i) many += std::string(i ? "," : "") + "\"x\"";
  many += "], \"answer\": 0}";
  EXPECT_FALSE(ParseTaskFile(many).ok());

  const std::string huge = "{\"context\": \"" + std::string(kMaxLineBytes, 'a') +
                           "\", \"choices\": [\"a\", \"b\"], "
                           "\"answer\": 0}";
  absl::Status s = ParseTaskFile(huge).status();
  EXPECT_NE(s.message().find("longer than"), absl::string_view::npos) << s;

  // A million nested lists: the parser must refuse it without overflowing
  // the stack (it is iterative), within the line limit.
  const std::string deep = std::string(500000, '[') + std::string(500000, ']');
  s = ParseTaskFile(deep).status();
  EXPECT_NE(s.message().find("not a JSON object"), absl::string_view::npos)
      << s.message().substr(0, 80);
  const std::string deep_object =
      "{\"context\": " + std::string(400000, '[') + std::string(400000, ']') + "}";
  EXPECT_FALSE(ParseTaskFile(deep_object).ok());
}

TEST(TaskFileTest, RefusesAFileWithNoItems) {
  EXPECT_FALSE(ParseTaskFile("").ok());
  EXPECT_FALSE(ParseTaskFile("\n  \n").ok());
}

// ---------------------------------------------------------------------------
// Prompt files and reading files
// ---------------------------------------------------------------------------

TEST(PromptFileTest, ParsesPromptsAndRefusesTheRest) {
  absl::StatusOr<std::vector<PromptItem>> prompts =
      ParsePromptFile("{\"prompt\": \"Once upon a time\"}\n{\"prompt\": \"Line\\nbreak\"}\n");
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 2u);
  EXPECT_EQ((*prompts)[1].prompt, "Line\nbreak");
  EXPECT_EQ((*prompts)[1].line, 2);
  EXPECT_FALSE(ParsePromptFile("{\"prompt\": \"\"}").ok());
  EXPECT_FALSE(ParsePromptFile("{\"text\": \"x\"}").ok());
  EXPECT_FALSE(ParsePromptFile("not json").ok());
  EXPECT_FALSE(ParsePromptFile("").ok());
}

TEST(ReadFileTest, ReadsAndRefusesOversizedFiles) {
  const std::string path = TempFile("small.jsonl", "0123456789");
  EXPECT_EQ(*ReadFile(path), "0123456789");
  EXPECT_FALSE(ReadFile(path, 5).ok());
  EXPECT_EQ(ReadFile(::testing::TempDir() + "/missing").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace coalesce::eval
