#include "tools/bench/workload.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace coalesce::bench {
namespace {

ModelLimits Limits() {
  ModelLimits l;
  l.vocab_size = 8;
  l.context_length = 64;
  l.bos_token_id = 1;
  l.eos_token_ids = {2};
  return l;
}

TEST(IntRangeTest, ParsesOneValueOrARange) {
  IntRange r;
  std::string error;
  ASSERT_TRUE(AbslParseFlag("128", &r, &error));
  EXPECT_EQ(r.lo, 128);
  EXPECT_EQ(r.hi, 128);
  ASSERT_TRUE(AbslParseFlag("64:256", &r, &error));
  EXPECT_EQ(r.lo, 64);
  EXPECT_EQ(r.hi, 256);
  EXPECT_EQ(AbslUnparseFlag(r), "64:256");
  EXPECT_FALSE(AbslParseFlag("256:64", &r, &error));
  EXPECT_FALSE(AbslParseFlag("1:2:3", &r, &error));
  EXPECT_FALSE(AbslParseFlag("x", &r, &error));
  ASSERT_TRUE(AbslParseFlag("16:512:log", &r, &error));
  EXPECT_TRUE(r.log);
  EXPECT_EQ(AbslUnparseFlag(r), "16:512:log");
  EXPECT_FALSE(AbslParseFlag("0:512:log", &r, &error));
  EXPECT_FALSE(AbslParseFlag("16:512:exp", &r, &error));
}

// Log-uniform: each doubling of the length is about equally likely, so the
// median is near the geometric mean, far below the uniform range's middle.
TEST(WorkloadTest, LogUniformLengthsSpreadEvenlyOverDoublings) {
  ModelLimits limits = Limits();
  limits.context_length = 4096;
  WorkloadOptions options;
  options.prompt_tokens = {2, 2};
  options.max_new_tokens = {16, 511, /*log=*/true};  // five doublings: 16, 32, ..., 256
  options.seed = 3;
  Workload w = *Workload::Create(options, limits);
  int per_doubling[5] = {};
  std::vector<int> lengths;
  const int n = 5000;
  for (int i = 0; i < n; ++i) {
    const int len = w.Next().max_new_tokens;
    ASSERT_GE(len, 16);
    ASSERT_LE(len, 511);
    lengths.push_back(len);
    int d = 0;
    while ((16 << (d + 1)) <= len) ++d;
    ++per_doubling[d];
  }
  for (int d = 0; d < 5; ++d) {
    EXPECT_NEAR(per_doubling[d], n / 5, n / 25) << "lengths " << (16 << d) << ".." << (32 << d);
  }
  std::nth_element(lengths.begin(), lengths.begin() + n / 2, lengths.end());
  EXPECT_NEAR(lengths[n / 2], 90, 10);  // sqrt(16 * 512) = 90.5
}

TEST(WorkloadTest, GeneratedPromptsHaveExactLengthsAndNoSpecialIdsAfterBos) {
  WorkloadOptions options;
  options.prompt_tokens = {3, 9};
  options.max_new_tokens = {1, 5};
  options.seed = 42;
  absl::StatusOr<Workload> w = Workload::Create(options, Limits());
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < 200; ++i) {
    RequestSpec spec = w->Next();
    ASSERT_GE(spec.prompt_token_ids.size(), 3u);
    ASSERT_LE(spec.prompt_token_ids.size(), 9u);
    EXPECT_GE(spec.max_new_tokens, 1);
    EXPECT_LE(spec.max_new_tokens, 5);
    EXPECT_EQ(spec.prompt_token_ids[0], 1);  // BOS
    for (size_t j = 1; j < spec.prompt_token_ids.size(); ++j) {
      const int32_t id = spec.prompt_token_ids[j];
      EXPECT_TRUE(id >= 0 && id < 8 && id != 1 && id != 2) << id;
    }
  }
}

TEST(WorkloadTest, SameSeedSameRequests) {
  WorkloadOptions options;
  options.prompt_tokens = {3, 30};
  options.max_new_tokens = {1, 30};
  options.seed = 7;
  Workload a = *Workload::Create(options, Limits());
  Workload b = *Workload::Create(options, Limits());
  for (int i = 0; i < 20; ++i) {
    RequestSpec x = a.Next();
    RequestSpec y = b.Next();
    EXPECT_EQ(x.prompt_token_ids, y.prompt_token_ids);
    EXPECT_EQ(x.max_new_tokens, y.max_new_tokens);
  }
}

TEST(WorkloadTest, RefusesRangesBeyondTheContext) {
  WorkloadOptions options;
  options.prompt_tokens = {10, 40};
  options.max_new_tokens = {1, 25};  // 40 + 25 > 64
  EXPECT_FALSE(Workload::Create(options, Limits()).ok());
  options.max_new_tokens = {1, 24};
  EXPECT_TRUE(Workload::Create(options, Limits()).ok());
  options.prompt_tokens = {0, 4};
  EXPECT_FALSE(Workload::Create(options, Limits()).ok());
}

TEST(WorkloadTest, ASharedPrefixStartsEveryPromptAndTheRestDiffers) {
  WorkloadOptions options;
  options.prompt_tokens = {5, 5};
  options.max_new_tokens = {3, 3};
  options.shared_prefix_tokens = 12;
  options.seed = 3;
  Workload w = *Workload::Create(options, Limits());
  RequestSpec a = w.Next(), b = w.Next();
  ASSERT_EQ(a.prompt_token_ids.size(), 17u);
  ASSERT_EQ(b.prompt_token_ids.size(), 17u);
  EXPECT_EQ(a.prompt_token_ids[0], 1);  // BOS once, at the very start
  EXPECT_TRUE(std::equal(a.prompt_token_ids.begin(), a.prompt_token_ids.begin() + 12,
                         b.prompt_token_ids.begin()));
  EXPECT_NE(a.prompt_token_ids, b.prompt_token_ids);
  for (size_t i = 1; i < a.prompt_token_ids.size(); ++i) {
    EXPECT_NE(a.prompt_token_ids[i], 1);
    EXPECT_NE(a.prompt_token_ids[i], 2);
  }
  EXPECT_EQ(w.Describe(), "shared prefix 12 tokens + prompt 5 tokens, max_new_tokens 3");
  // The prefix counts against the context.
  options.shared_prefix_tokens = 57;
  EXPECT_FALSE(Workload::Create(options, Limits()).ok());
  options.shared_prefix_tokens = 56;
  EXPECT_TRUE(Workload::Create(options, Limits()).ok());
}

TEST(WorkloadTest, ANextTurnResendsTheHistoryWithANewMessage) {
  WorkloadOptions options;
  options.prompt_tokens = {4, 4};
  options.max_new_tokens = {2, 2};
  options.turns = 3;
  Workload w = *Workload::Create(options, Limits());
  const std::vector<int32_t> history = {1, 5, 6, 7, 3, 4};
  RequestSpec next = w.NextTurn(history);
  ASSERT_EQ(next.prompt_token_ids.size(), 10u);
  EXPECT_TRUE(std::equal(history.begin(), history.end(), next.prompt_token_ids.begin()));
  EXPECT_EQ(next.max_new_tokens, 2);
  EXPECT_NE(w.Describe().find("conversations of 3 turns"), std::string::npos);
  // Every turn of a conversation must fit: 3 x (4 + 2) <= 64, 11 x 6 > 64.
  options.turns = 11;
  EXPECT_FALSE(Workload::Create(options, Limits()).ok());
  options.turns = 0;
  EXPECT_FALSE(Workload::Create(options, Limits()).ok());
}

TEST(ParseWorkloadTest, ReadsTextAndIdsWithOptionalLengths) {
  absl::StatusOr<std::vector<RequestSpec>> entries = ParseWorkload(
      "{\"prompt\": \"Once upon a time\", \"max_new_tokens\": 20}\n"
      "\n"
      "{\"prompt_token_ids\": [1, 5, 7]}\n",
      Limits());
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[0].prompt, "Once upon a time");
  EXPECT_EQ((*entries)[0].max_new_tokens, 20);
  EXPECT_EQ((*entries)[1].prompt_token_ids, (std::vector<int32_t>{1, 5, 7}));
  EXPECT_EQ((*entries)[1].max_new_tokens, 0);  // filled from --max_new_tokens
}

TEST(ParseWorkloadTest, ErrorsNameTheLine) {
  const ModelLimits limits = Limits();
  auto error = [&](const std::string& text) {
    absl::StatusOr<std::vector<RequestSpec>> r = ParseWorkload(text, limits);
    return r.ok() ? std::string("ok") : std::string(r.status().message());
  };
  EXPECT_EQ(error("{\"prompt\": \"a\"}\nnot json\n").substr(0, 7), "line 2:");
  EXPECT_NE(error("{\"prompt_token_ids\": [8]}").find("[0, 8)"), std::string::npos);
  EXPECT_NE(error("{\"prompt\": \"a\", \"prompt_token_ids\": [1]}").find("exactly one"),
            std::string::npos);
  EXPECT_NE(error("{\"prompt\": \"a\", \"max_new_tokens\": 0}").find("max_new_tokens"),
            std::string::npos);
  EXPECT_NE(error("{\"prompt\": \"\"}").find("non-empty"), std::string::npos);
  EXPECT_EQ(error("\n\n"), "no requests in the file");
}

TEST(WorkloadTest, FileEntriesCycleInOrder) {
  const std::string path = ::testing::TempDir() + "/bench_workload_test.jsonl";
  {
    std::ofstream out(path);
    out << "{\"prompt\": \"a\", \"max_new_tokens\": 3}\n{\"prompt_token_ids\": [4]}\n";
  }
  WorkloadOptions options;
  options.file = path;
  options.max_new_tokens = {9, 9};
  Workload w = *Workload::Create(options, Limits());
  for (int round = 0; round < 2; ++round) {
    RequestSpec first = w.Next();
    EXPECT_EQ(first.prompt, "a");
    EXPECT_EQ(first.max_new_tokens, 3);
    RequestSpec second = w.Next();
    EXPECT_EQ(second.prompt_token_ids, (std::vector<int32_t>{4}));
    EXPECT_EQ(second.max_new_tokens, 9);  // --max_new_tokens where the file has none
  }
  std::remove(path.c_str());
  options.file = "/nonexistent/workload.jsonl";
  EXPECT_EQ(Workload::Create(options, Limits()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace coalesce::bench
