#include "tools/eval/scoring.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace coalesce::eval {
namespace {

// ---------------------------------------------------------------------------
// Windows
// ---------------------------------------------------------------------------

// The header's diagram: N = 10, W = 6, S = 3.
TEST(PlanWindowsTest, SlidesAsDrawn) {
  absl::StatusOr<std::vector<Window>> plan = PlanWindows(10, 6, 3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<Window> want = {{0, 6, 1}, {3, 9, 6}, {4, 10, 9}};
  EXPECT_EQ(*plan, want);
}

TEST(PlanWindowsTest, OneWindowWhenTheTextFits) {
  EXPECT_EQ(*PlanWindows(5, 511, 255), (std::vector<Window>{{0, 5, 1}}));
  EXPECT_EQ(*PlanWindows(2, 2, 1), (std::vector<Window>{{0, 2, 1}}));
  // Exactly the window: still one.
  EXPECT_EQ(*PlanWindows(6, 6, 3), (std::vector<Window>{{0, 6, 1}}));
}

TEST(PlanWindowsTest, LongestStrideLeavesOneTokenOfContext) {
  // W = 4, S = 3: each later window's first token is context only.
  const std::vector<Window> want = {{0, 4, 1}, {3, 7, 4}, {5, 9, 7}};
  EXPECT_EQ(*PlanWindows(9, 4, 3), want);
}

// Every token but the first is scored exactly once, each window is within
// [0, N), no longer than W, every window but the first is exactly W long,
// and every scored token has at least W - S tokens of context (or all of
// the tokens before it, in the first window).
TEST(PlanWindowsTest, ScoresEveryTokenOnceWithEnoughContext) {
  for (int64_t n = 2; n <= 60; ++n) {
    for (int64_t w = 2; w <= 12; ++w) {
      for (int64_t s = 1; s < w; ++s) {
        absl::StatusOr<std::vector<Window>> plan = PlanWindows(n, w, s);
        ASSERT_TRUE(plan.ok()) << n << " " << w << " " << s;
        std::vector<int> scored(n, 0);
        for (size_t k = 0; k < plan->size(); ++k) {
          const Window& win = (*plan)[k];
          ASSERT_GE(win.begin, 0);
          ASSERT_LE(win.end, n);
          ASSERT_LE(win.end - win.begin, w);
          ASSERT_LT(win.begin, win.score_begin);
          ASSERT_LE(win.score_begin, win.end);
          if (k > 0) {
            ASSERT_EQ(win.end - win.begin, w);
            ASSERT_GE(win.score_begin - win.begin, w - s);
            ASSERT_EQ(win.score_begin, (*plan)[k - 1].end);
          }
          for (int64_t i = win.score_begin; i < win.end; ++i) ++scored[i];
        }
        EXPECT_EQ(scored[0], 0);
        for (int64_t i = 1; i < n; ++i) ASSERT_EQ(scored[i], 1) << n << " " << w << " " << s;
        EXPECT_EQ(plan->back().end, n);
      }
    }
  }
}

TEST(PlanWindowsTest, RefusesWhatCannotBeScored) {
  EXPECT_FALSE(PlanWindows(1, 8, 4).ok());  // nothing after the first token
  EXPECT_FALSE(PlanWindows(0, 8, 4).ok());
  EXPECT_FALSE(PlanWindows(10, 1, 1).ok());  // a window of one token scores nothing
  EXPECT_FALSE(PlanWindows(10, 8, 8).ok());  // stride = window: no context
  EXPECT_FALSE(PlanWindows(10, 8, 0).ok());
  EXPECT_FALSE(PlanWindows(10, 8, -1).ok());
}

// ---------------------------------------------------------------------------
// Scored log-probabilities and perplexity
// ---------------------------------------------------------------------------

TEST(ScoredLogprobsTest, TakesTheScoredTokensOfTheWindow) {
  const std::vector<int32_t> tokens = {1, 10, 11, 12, 13, 14, 15};
  // Window [2, 6) scoring [4, 6): the prompt is tokens 2..5; its prompt
  // log-probabilities score tokens 3, 4, 5.
  const Window w{2, 6, 4};
  const std::vector<TokenLogprob> lps = {{12, -0.5}, {13, -1.5}, {14, -2.5}};
  absl::StatusOr<std::vector<double>> s = ScoredLogprobs(w, tokens, lps);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, (std::vector<double>{-1.5, -2.5}));
}

TEST(ScoredLogprobsTest, RefusesAnswersThatDoNotFit) {
  const std::vector<int32_t> tokens = {1, 10, 11, 12};
  const Window w{0, 4, 1};
  // Too few entries.
  EXPECT_FALSE(ScoredLogprobs(w, tokens, {{10, -1}, {11, -1}}).ok());
  // An entry that scores another token (an off-by-one position).
  EXPECT_FALSE(ScoredLogprobs(w, tokens, {{1, -1}, {10, -1}, {11, -1}}).ok());
  // Not a log-probability.
  EXPECT_FALSE(ScoredLogprobs(w, tokens, {{10, -1}, {11, 0.5}, {12, -1}}).ok());
  EXPECT_FALSE(ScoredLogprobs(w, tokens, {{10, -1}, {11, NAN}, {12, -1}}).ok());
  EXPECT_FALSE(ScoredLogprobs(w, tokens, {{10, -1}, {11, -INFINITY}, {12, -1}}).ok());
  // Rounding just above 0 is a certain token.
  EXPECT_TRUE(ScoredLogprobs(w, tokens, {{10, -1}, {11, 1e-6}, {12, -1}}).ok());
}

TEST(PerplexityTest, IsTheExponentOfTheMeanNegativeLogLikelihood) {
  PerplexityAccumulator p;
  EXPECT_EQ(p.tokens(), 0);
  EXPECT_EQ(p.mean_nll(), 0);
  EXPECT_EQ(p.perplexity(), 1);
  // Four tokens, each with probability 1/4: perplexity 4.
  for (int i = 0; i < 4; ++i) p.Add(std::log(0.25));
  EXPECT_EQ(p.tokens(), 4);
  EXPECT_NEAR(p.nll(), 4 * std::log(4.0), 1e-12);
  EXPECT_NEAR(p.perplexity(), 4.0, 1e-12);
  // 2 bits per token over 8 bytes: 4 tokens * 2 bits / 8 bytes.
  EXPECT_NEAR(p.bits_per_byte(8), 1.0, 1e-12);
  p.AddAll({std::log(0.5), std::log(0.125)});
  EXPECT_NEAR(p.mean_nll(), (4 * std::log(4.0) + std::log(2.0) + std::log(8.0)) / 6, 1e-12);
}

// ---------------------------------------------------------------------------
// Multiple choice
// ---------------------------------------------------------------------------

TEST(SplitContinuationTest, MovesTrailingSpacesToTheChoice) {
  EXPECT_EQ(SplitContinuation("He drank", " water"),
            (std::pair<std::string, std::string>{"He drank", " water"}));
  EXPECT_EQ(SplitContinuation("He drank ", "water"),
            (std::pair<std::string, std::string>{"He drank", " water"}));
  EXPECT_EQ(SplitContinuation("He drank  ", "water"),
            (std::pair<std::string, std::string>{"He drank", "  water"}));
  EXPECT_EQ(SplitContinuation("   ", "x"), (std::pair<std::string, std::string>{"", "   x"}));
}

TEST(MakeChoicePromptTest, ScoresTheTokensBeyondTheContext) {
  absl::StatusOr<ChoicePrompt> p = MakeChoicePrompt({1, 5, 6}, {1, 5, 6, 7, 8}, 10);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->prompt_ids, (std::vector<int32_t>{1, 5, 6, 7, 8}));
  EXPECT_EQ(p->choice_tokens, 2);
  EXPECT_EQ(p->truncated, 0);
  // The context's last token merged with the choice's first: the choice is
  // still the whole's tokens beyond the context's count, as lm-eval takes it.
  p = MakeChoicePrompt({1, 5, 6}, {1, 5, 9, 8}, 10);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->choice_tokens, 1);
}

TEST(MakeChoicePromptTest, DropsContextFromTheLeftToFit) {
  absl::StatusOr<ChoicePrompt> p = MakeChoicePrompt({1, 2, 3, 4, 5}, {1, 2, 3, 4, 5, 6, 7}, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->prompt_ids, (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(p->choice_tokens, 2);
  EXPECT_EQ(p->truncated, 3);
}

TEST(MakeChoicePromptTest, RefusesWhatCannotBeScored) {
  EXPECT_FALSE(MakeChoicePrompt({}, {5, 6}, 10).ok());           // no context token
  EXPECT_FALSE(MakeChoicePrompt({1, 5}, {1, 5}, 10).ok());       // the choice adds nothing
  EXPECT_FALSE(MakeChoicePrompt({1, 5, 6}, {1, 5}, 10).ok());    // fewer tokens than context
  EXPECT_FALSE(MakeChoicePrompt({1}, {1, 2, 3, 4, 5}, 4).ok());  // 4 choice tokens + 1 > 4
  EXPECT_TRUE(MakeChoicePrompt({1}, {1, 2, 3, 4}, 4).ok());      // 3 + 1 fits
}

TEST(PredictTest, RanksBySumPerByteAndPerToken) {
  // Choice 0: the best sum; choice 1: the best per byte; choice 2: the best
  // per token.
  const std::vector<ChoiceScore> choices = {
      {-3.0, 3, 3},   // sum -3, per byte -1, per token -1
      {-4.0, 8, 8},   // sum -4, per byte -0.5, per token -0.5
      {-3.5, 10, 2},  // sum -3.5, per byte -1.75, per token -0.35
  };
  const ItemPrediction p = Predict(choices);
  EXPECT_EQ(p.by_sum, 0);
  EXPECT_EQ(p.by_byte, 1);
  EXPECT_EQ(p.by_token, 2);
}

TEST(PredictTest, TiesGoToTheFirstChoice) {
  const ItemPrediction p = Predict({{-2, 2, 2}, {-2, 2, 2}, {-5, 1, 1}});
  EXPECT_EQ(p.by_sum, 0);
  EXPECT_EQ(p.by_byte, 0);
  EXPECT_EQ(p.by_token, 0);
  EXPECT_EQ(Predict({}).by_sum, -1);
}

TEST(AccuracyTest, CountsEachScoreAndItsStandardError) {
  AccuracyAccumulator acc;
  EXPECT_EQ(acc.acc().accuracy, 0);
  // 4 items: by_sum right in 3, by_byte in 1, by_token in 4.
  acc.Add({0, 0, 0}, 0);
  acc.Add({1, 0, 1}, 1);
  acc.Add({2, 0, 2}, 2);
  acc.Add({0, 0, 1}, 1);
  EXPECT_EQ(acc.items(), 4);
  EXPECT_EQ(acc.acc().correct, 3);
  EXPECT_DOUBLE_EQ(acc.acc().accuracy, 0.75);
  EXPECT_EQ(acc.acc_norm().correct, 1);
  EXPECT_EQ(acc.acc_per_token().correct, 4);
  // sqrt(p (1 - p) / (n - 1)) = sqrt(0.75 * 0.25 / 3) = 0.25.
  EXPECT_NEAR(acc.acc().stderr_, 0.25, 1e-12);
  EXPECT_EQ(acc.acc_per_token().stderr_, 0);  // all right: no spread
}

// ---------------------------------------------------------------------------
// Greedy agreement
// ---------------------------------------------------------------------------

TEST(AgreementTest, IdenticalGenerationsNeverPart) {
  const Agreement a = CompareGenerations({5, 6, 7}, {5, 6, 7});
  EXPECT_EQ(a.compared, 3);
  EXPECT_EQ(a.identical, 3);
  EXPECT_FALSE(a.first_parting.has_value());
  const Agreement empty = CompareGenerations({}, {});
  EXPECT_EQ(empty.compared, 0);
  EXPECT_FALSE(empty.first_parting.has_value());
}

TEST(AgreementTest, PartsAtTheFirstDifferentToken) {
  // a: 5 6 7 8 9
  // b: 5 6 3 8 9    parts at 2; positions 3 and 4 happen to agree again.
  const Agreement a = CompareGenerations({5, 6, 7, 8, 9}, {5, 6, 3, 8, 9});
  EXPECT_EQ(a.compared, 5);
  EXPECT_EQ(a.identical, 4);
  EXPECT_EQ(a.first_parting, 2);
  // Parting at the very first token.
  const Agreement b = CompareGenerations({1, 2}, {3, 2});
  EXPECT_EQ(b.first_parting, 0);
  EXPECT_EQ(b.identical, 1);
}

TEST(AgreementTest, OneStoppingEarlyPartsWhereItStopped) {
  // a: 5 6 7 2(EOS)
  // b: 5 6 7 8 9 10   parts at 3 (EOS against 8); 4 and 5 only b reached.
  const Agreement a = CompareGenerations({5, 6, 7, 2}, {5, 6, 7, 8, 9, 10});
  EXPECT_EQ(a.compared, 6);
  EXPECT_EQ(a.identical, 3);
  EXPECT_EQ(a.first_parting, 3);
  // One is a prefix of the other: parts where the shorter ends.
  const Agreement b = CompareGenerations({5, 6, 7, 8}, {5, 6});
  EXPECT_EQ(b.compared, 4);
  EXPECT_EQ(b.identical, 2);
  EXPECT_EQ(b.first_parting, 2);
  const Agreement c = CompareGenerations({}, {4});
  EXPECT_EQ(c.first_parting, 0);
  EXPECT_EQ(c.identical, 0);
}

TEST(AgreementTest, AccumulatesSharesAndPartings) {
  AgreementAccumulator acc;
  EXPECT_EQ(acc.token_share(), 1.0);
  EXPECT_FALSE(acc.earliest_parting().has_value());
  acc.Add(CompareGenerations({1, 2, 3, 4}, {1, 2, 3, 4}));              // 4 of 4, never parts
  acc.Add(CompareGenerations({1, 2, 3, 4}, {1, 2, 9, 4}));              // 3 of 4, parts at 2
  acc.Add(CompareGenerations({1, 2, 3, 4}, {1, 2, 3, 4, 5, 6, 7, 8}));  // 4 of 8, parts at 4
  EXPECT_EQ(acc.prompts(), 3);
  EXPECT_EQ(acc.compared(), 16);
  EXPECT_EQ(acc.identical(), 11);
  EXPECT_DOUBLE_EQ(acc.token_share(), 11.0 / 16.0);
  EXPECT_EQ(acc.identical_prompts(), 1);
  EXPECT_EQ(acc.parted_prompts(), 2);
  EXPECT_EQ(acc.earliest_parting(), 2);
  EXPECT_DOUBLE_EQ(*acc.mean_first_parting(), 3.0);
}

TEST(AgreementTest, TwoIdenticalServersAgreeFully) {
  AgreementAccumulator acc;
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> tokens(10 + i, i);
    acc.Add(CompareGenerations(tokens, tokens));
  }
  EXPECT_EQ(acc.token_share(), 1.0);
  EXPECT_EQ(acc.identical_prompts(), 5);
  EXPECT_FALSE(acc.earliest_parting().has_value());
  EXPECT_FALSE(acc.mean_first_parting().has_value());
}

}  // namespace
}  // namespace coalesce::eval
