#include "tools/eval/report.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace coalesce::eval {
namespace {

EvalReport Sample() {
  EvalReport r;
  r.server = {"127.0.0.1:1", "stories260K", "cpu", 512, 512, 1};
  r.requests = 7;
  r.elapsed_s = 1.25;

  PerplexityReport p;
  p.file = "story.txt";
  p.file_bytes = 100;
  p.bytes = 40;
  p.tokens = 5;
  p.window = 4;
  p.stride = 2;
  p.windows = *PlanWindows(5, 4, 2);
  for (int i = 0; i < 4; ++i) p.result.Add(std::log(0.5));
  p.window_nll = {3 * std::log(2.0), std::log(2.0)};
  r.perplexity = p;

  MultipleChoiceReport mc;
  mc.file = "tasks.jsonl";
  ItemReport item;
  item.line = 3;
  item.answer = 1;
  item.choices = {{-4.0, 2, 4}, {-1.0, 1, 2}};
  item.prediction = Predict(item.choices);
  mc.items.push_back(item);
  mc.result.Add(item.prediction, item.answer);
  r.multiple_choice = mc;

  AgreementReport a;
  a.file = "prompts.jsonl";
  a.other = {"127.0.0.1:2", "stories260K", "cpu", 512, 512, 1};
  a.max_new_tokens = 4;
  PromptReport pr;
  pr.line = 1;
  pr.tokens = {5, 6, 7, 8};
  pr.other_tokens = {5, 6, 9, 8};
  pr.agreement = CompareGenerations(pr.tokens, pr.other_tokens);
  a.prompts.push_back(pr);
  a.result.Add(pr.agreement);
  r.agreement = a;
  return r;
}

TEST(ReportTest, JsonCarriesEveryFigure) {
  const nlohmann::json j = ToJson(Sample(), /*per_item=*/false);
  EXPECT_EQ(j["server"]["model"], "stories260K");
  EXPECT_EQ(j["requests"], 7);
  const nlohmann::json& p = j["perplexity"];
  EXPECT_EQ(p["tokens"], 5);
  EXPECT_EQ(p["scored_tokens"], 4);
  EXPECT_EQ(p["windows"], 2);
  EXPECT_NEAR(p["perplexity"].get<double>(), 2.0, 1e-12);
  EXPECT_NEAR(p["bits_per_byte"].get<double>(), 4.0 / 40, 1e-12);
  EXPECT_FALSE(p.contains("window_plan"));
  const nlohmann::json& mc = j["multiple_choice"];
  EXPECT_EQ(mc["items"], 1);
  EXPECT_EQ(mc["acc"]["correct"], 1);
  EXPECT_EQ(mc["acc_norm"]["accuracy"], 1.0);
  EXPECT_FALSE(mc.contains("per_item"));
  const nlohmann::json& a = j["agreement"];
  EXPECT_EQ(a["compared_tokens"], 4);
  EXPECT_EQ(a["identical_tokens"], 3);
  EXPECT_EQ(a["token_share"], 0.75);
  EXPECT_EQ(a["earliest_parting"], 2);
  EXPECT_EQ(a["other"]["address"], "127.0.0.1:2");
}

TEST(ReportTest, PerItemAddsThePlanScoresAndTokens) {
  const nlohmann::json j = ToJson(Sample(), /*per_item=*/true);
  EXPECT_EQ(j["perplexity"]["window_plan"], nlohmann::json::parse("[[0, 4, 1], [1, 5, 4]]"));
  EXPECT_EQ(j["perplexity"]["window_nll"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["perplexity"]["window_nll"][1].get<double>(), std::log(2.0));
  const nlohmann::json& item = j["multiple_choice"]["per_item"][0];
  EXPECT_EQ(item["line"], 3);
  EXPECT_EQ(item["prediction"], 1);
  EXPECT_EQ(item["choices"][0]["logprob"], -4.0);
  EXPECT_EQ(item["choices"][0]["tokens"], 2);
  const nlohmann::json& prompt = j["agreement"]["per_prompt"][0];
  EXPECT_EQ(prompt["other_tokens"], nlohmann::json::parse("[5, 6, 9, 8]"));
  EXPECT_EQ(prompt["first_parting"], 2);
}

TEST(ReportTest, NoPartingIsNull) {
  EvalReport r = Sample();
  r.agreement->result = AgreementAccumulator();
  r.agreement->result.Add(CompareGenerations({1, 2}, {1, 2}));
  const nlohmann::json j = ToJson(r, false);
  EXPECT_TRUE(j["agreement"]["earliest_parting"].is_null());
  EXPECT_TRUE(j["agreement"]["mean_first_parting"].is_null());
  EXPECT_EQ(j["agreement"]["token_share"], 1.0);
  EXPECT_NE(FormatTable(r).find("| 2 of 2 | 1.0000 | 1 of 1 | none | none |"), std::string::npos)
      << FormatTable(r);
}

TEST(ReportTest, TableShowsEachSection) {
  const std::string t = FormatTable(Sample());
  EXPECT_NE(t.find("stories260K at 127.0.0.1:1 (cpu backend, vocabulary 512, context 512)"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("perplexity of story.txt (40 of its 100 bytes)"), std::string::npos) << t;
  EXPECT_NE(t.find("| 5 | 4 | 2 | 4 | 2 | 0.6931 | 2.0000 | 0.1000 |"), std::string::npos) << t;
  EXPECT_NE(t.find("| acc (sum of log-probabilities) | 1 | 1.0000 | 0.0000 |"), std::string::npos)
      << t;
  EXPECT_NE(t.find("| 3 of 4 | 0.7500 | 0 of 1 | 2 | 2.0 |"), std::string::npos) << t;
  EXPECT_NE(t.find("7 requests in 1.2 s"), std::string::npos) << t;
}

TEST(ReportTest, ProgressLine) {
  EXPECT_EQ(ProgressLine("perplexity", 5, 10, 1.5, false), " 50% perplexity 5/10 1.5 s");
  EXPECT_EQ(ProgressLine("x", 10, 10, 2, true), "[########################] 100% x 10/10 2.0 s");
  EXPECT_EQ(ProgressLine("x", 0, 0, 0, false), "100% x 0/0 0.0 s");
}

}  // namespace
}  // namespace coalesce::eval
