#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

namespace coalesce::engine {
namespace {

TEST(RngTest, SameSeedSameSequenceOtherSeedOther) {
  Rng a(42), b(42), c(43);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.NextU64();
    ASSERT_EQ(x, b.NextU64());
    differs |= x != c.NextU64();
  }
  EXPECT_TRUE(differs);
}

TEST(RngTest, KnownFirstValue) {
  // xoshiro256** seeded through splitmix64(0): pins the algorithm, so seeds
  // give the same tokens on every build.
  Rng rng(0);
  EXPECT_EQ(rng.NextU64(), 0x99EC5F36CB75F2B4ull);
}

TEST(RngTest, FloatsAreInUnitInterval) {
  Rng rng(1);
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    const float f = rng.NextFloat();
    ASSERT_GE(f, 0.0f);
    ASSERT_LT(f, 1.0f);
    sum += f;
  }
  EXPECT_NEAR(sum / 100000, 0.5, 0.01);
}

TEST(SampleTest, GreedyTakesArgmaxLowestIdOnTiesAndDrawsNothing) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  Rng rng(5), untouched(5);
  EXPECT_EQ(Sample(logits, {}, rng), 1);
  EXPECT_EQ(rng.NextU64(), untouched.NextU64());  // greedy consumed no randomness
  // top_k / top_p are ignored at temperature 0.
  EXPECT_EQ(Sample(logits, {.temperature = 0.0f, .top_k = 3, .top_p = 0.5f}, rng), 1);
}

TEST(SampleTest, TopKOneAndTinyTopPEqualGreedy) {
  Rng rng(9);
  std::vector<float> logits(1000);
  for (int trial = 0; trial < 50; ++trial) {
    for (float& l : logits) l = static_cast<float>(rng.NextFloat() * 4.0);
    logits[trial * 7] = 10.0f;      // a clear winner...
    logits[trial * 7 + 3] = 10.0f;  // ...tied with a later id
    const int32_t greedy = Sample(logits, {}, rng);
    EXPECT_EQ(greedy, trial * 7);
    EXPECT_EQ(Sample(logits, {.temperature = 1.0f, .top_k = 1}, rng), greedy);
    EXPECT_EQ(Sample(logits, {.temperature = 0.7f, .top_p = 1e-6f}, rng), greedy);
    EXPECT_EQ(Sample(logits, {.temperature = 2.0f, .top_k = 50, .top_p = 1e-6f}, rng), greedy);
  }
}

TEST(SampleTest, SameSeedSameTokens) {
  std::vector<float> logits(32000);
  Rng init(1);
  for (float& l : logits) l = init.NextFloat() * 3.0f;
  const SamplingParams params{.temperature = 0.8f, .top_k = 40, .top_p = 0.9f};
  Rng a(1234), b(1234), c(99);
  std::vector<int32_t> xs, ys, zs;
  for (int i = 0; i < 50; ++i) {
    xs.push_back(Sample(logits, params, a));
    ys.push_back(Sample(logits, params, b));
    zs.push_back(Sample(logits, params, c));
  }
  EXPECT_EQ(xs, ys);
  EXPECT_NE(xs, zs);
}

TEST(SampleTest, TopKLargerThanVocabIsNoLimit) {
  const std::vector<float> logits = {1.0f, 1.0f, 1.0f};
  Rng rng(3);
  std::set<int32_t> seen;
  for (int i = 0; i < 200; ++i) {
    const int32_t id = Sample(logits, {.temperature = 1.0f, .top_k = 1000}, rng);
    ASSERT_TRUE(id >= 0 && id < 3);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 3u);
}

TEST(SampleTest, TopKAndTopPRestrictTheChoice) {
  // Probabilities at T=1 are proportional to 8:4:2:1:1.
  const std::vector<float> logits = {std::log(8.f), std::log(4.f), std::log(2.f), 0.f, 0.f};
  Rng rng(17);
  std::set<int32_t> top_k, top_p;
  for (int i = 0; i < 2000; ++i) {
    top_k.insert(Sample(logits, {.temperature = 1.0f, .top_k = 2}, rng));
    // Mass 8/16 = 0.5 after the first, 12/16 = 0.75 after two: top_p 0.7
    // keeps exactly two.
    top_p.insert(Sample(logits, {.temperature = 1.0f, .top_p = 0.7f}, rng));
  }
  EXPECT_EQ(top_k, (std::set<int32_t>{0, 1}));
  EXPECT_EQ(top_p, (std::set<int32_t>{0, 1}));
}

TEST(SampleTest, TemperatureOneFollowsSoftmax) {
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f, 0.5f};
  std::vector<double> expected(logits.size());
  double z = 0;
  for (size_t i = 0; i < logits.size(); ++i) z += expected[i] = std::exp(logits[i]);
  for (double& p : expected) p /= z;
  Rng rng(2024);
  const int n = 100000;
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[Sample(logits, {.temperature = 1.0f}, rng)];
  for (size_t i = 0; i < logits.size(); ++i) {
    // Binomial standard deviation is at most 0.0016 here; 0.01 is > 6 sigma.
    EXPECT_NEAR(counts[i] / static_cast<double>(n), expected[i], 0.01) << "token " << i;
  }
  // A high temperature flattens the distribution: the least likely token
  // gets clearly more than its T=1 share.
  int rare = 0;
  for (int i = 0; i < n; ++i) rare += Sample(logits, {.temperature = 5.0f}, rng) == 3;
  EXPECT_GT(rare / static_cast<double>(n), expected[3] + 0.05);
}

TEST(SampleTest, TopPRenormalisesTheNucleus) {
  // Within top_p 0.7 only tokens 0 and 1 remain, in proportion 8:4.
  const std::vector<float> logits = {std::log(8.f), std::log(4.f), std::log(2.f), 0.f, 0.f};
  Rng rng(8);
  const int n = 60000;
  int zeros = 0;
  for (int i = 0; i < n; ++i)
    zeros += Sample(logits, {.temperature = 1.0f, .top_p = 0.7f}, rng) == 0;
  EXPECT_NEAR(zeros / static_cast<double>(n), 2.0 / 3.0, 0.01);
}

// min_p keeps the tokens at least min_p times as likely as the most likely
// (after temperature), after top_k and top_p, and renormalises them; every
// draw then lands on one of them in proportion.
TEST(SampleTest, MinPKeepsTokensNearTheMostLikely) {
  // At T=1 proportional to 8:4:2:1:1.
  const std::vector<float> logits = {std::log(8.f), std::log(4.f), std::log(2.f), 0.f, 0.f};
  auto kept = [&](SamplingParams p) {
    std::vector<int> counts(logits.size(), 0);
    const int n = 4000;
    for (int i = 0; i < n; ++i) ++counts[SampleWithUniform(logits, p, (i + 0.5f) / n)];
    return counts;
  };
  // 0.25 of the top (8) is 2: tokens 0, 1, 2 stay, in proportion 8:4:2.
  std::vector<int> c = kept({.temperature = 1.0f, .min_p = 0.25f});
  EXPECT_EQ(c[3] + c[4], 0);
  EXPECT_NEAR(c[0] / 4000.0, 8.0 / 14, 0.002);
  EXPECT_NEAR(c[2] / 4000.0, 2.0 / 14, 0.002);
  // Just above 0.25: token 2 goes too.
  c = kept({.temperature = 1.0f, .min_p = 0.26f});
  EXPECT_EQ(c[2] + c[3] + c[4], 0);
  EXPECT_GT(c[1], 0);
  // min_p looks after temperature: at T=2 the proportions are the square
  // roots, 2.83:2:1.41:1:1, and 0.34 * 2.83 = 0.96 keeps every token.
  c = kept({.temperature = 2.0f, .min_p = 0.34f});
  EXPECT_GT(c[3], 0);
  EXPECT_GT(c[4], 0);
  // After top_k: top_k 4 drops token 4 (the later of the two equal ones),
  // min_p 0.1 keeps the rest.
  c = kept({.temperature = 1.0f, .top_k = 4, .min_p = 0.1f});
  EXPECT_EQ(c[4], 0);
  EXPECT_GT(c[3], 0);
  // With top_p: the nucleus of 0.9 is tokens 0-3 (15/16 >= 0.9 > 14/16),
  // min_p 0.2 then drops token 3 (1 < 1.6).
  c = kept({.temperature = 1.0f, .top_p = 0.9f, .min_p = 0.2f});
  EXPECT_EQ(c[3] + c[4], 0);
  EXPECT_NEAR(c[2] / 4000.0, 2.0 / 14, 0.002);
  // min_p 1 leaves the most likely alone; greedy ignores min_p.
  c = kept({.temperature = 1.0f, .min_p = 1.0f});
  EXPECT_EQ(c[0], 4000);
  EXPECT_EQ(SampleWithUniform(logits, {.temperature = 0.0f, .min_p = 0.9f}, 0.5f), 0);
}

// The log-softmax against a direct computation in long double, the top
// tokens in order (ties to the lower id), and logits far from 0 (where a
// naive exp overflows).
TEST(LogprobTest, IsTheLogSoftmaxAndListsTheMostLikely) {
  const std::vector<float> logits = {1.5f, -2.0f, 3.25f, 3.25f, 0.0f, -1e9f};
  for (const float shift : {0.0f, 1000.0f, -1000.0f}) {
    std::vector<float> x = logits;
    for (float& v : x) v += shift;
    long double sum = 0;
    for (float v : logits) sum += std::exp(static_cast<long double>(v));
    for (int32_t token = 0; token < static_cast<int32_t>(x.size()) - 1; ++token) {
      const TokenLogprob lp = Logprob(x, token, 3);
      EXPECT_EQ(lp.token, token);
      EXPECT_NEAR(lp.logprob, static_cast<double>(logits[token] - std::log(sum)), 1e-5) << shift;
      ASSERT_EQ(lp.top.size(), 3u);
      EXPECT_EQ(lp.top[0].first, 2);
      EXPECT_EQ(lp.top[1].first, 3);
      EXPECT_EQ(lp.top[2].first, 0);
      EXPECT_EQ(lp.top[0].second, lp.top[1].second);
      EXPECT_EQ(lp.top[2].second, Logprob(x, 0, 0).logprob);
    }
  }
  // The probabilities sum to 1; a token far below the others is very
  // unlikely but finite; no top asked, none given.
  double total = 0;
  for (int32_t t = 0; t < static_cast<int32_t>(logits.size()); ++t) {
    total += std::exp(static_cast<double>(Logprob(logits, t, 0).logprob));
  }
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_LT(Logprob(logits, 5, 0).logprob, -1e8f);
  EXPECT_TRUE(Logprob(logits, 1, 0).top.empty());
  // A NaN never ranks among the most likely.
  std::vector<float> with_nan = logits;
  with_nan[4] = std::nanf("");
  const TokenLogprob nan_case = Logprob(with_nan, 0, 6);
  EXPECT_EQ(nan_case.top.back().first, 4);
}

// The most likely tokens equal those of a full sort, on rows with many ties.
TEST(LogprobTest, TopEqualsAFullSort) {
  Rng rng(5);
  for (int round = 0; round < 50; ++round) {
    std::vector<float> logits(1000);
    for (float& x : logits) x = static_cast<float>(rng.NextU64() % 40) * 0.25f;
    const int top = 1 + static_cast<int>(rng.NextU64() % 20);
    std::vector<int32_t> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::stable_sort(ids.begin(), ids.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    const TokenLogprob lp = Logprob(logits, 0, top);
    ASSERT_EQ(lp.top.size(), static_cast<size_t>(top));
    for (int i = 0; i < top; ++i) EXPECT_EQ(lp.top[i].first, ids[i]) << round << " " << i;
  }
}

}  // namespace
}  // namespace coalesce::engine
