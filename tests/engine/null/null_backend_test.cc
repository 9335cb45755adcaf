// The null backend (engine/null/null_backend.h), what only it promises:
// deterministic tokens that depend only on each sequence's last token and
// position, never an id it must avoid, and a shape taken from a config
// without weights. The contract every backend keeps (bad steps refused as a
// real backend refuses them, batch mates and chunking, Step's logits agreeing
// with StepAndSample, describing itself, nothing read or held) is in
// backend_contract_test.cc.
#include "engine/null/null_backend.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "engine/model/synthetic.h"
#include "engine/sampler.h"
#include "tests/engine/backend_test_support.h"

namespace coalesce::engine {
namespace {

using testing::SampleStep;

// Only the shape matters: the null backend never looks at weights.
ModelConfig Config(int vocab_size = 512, int max_seq_len = 64) {
  ModelConfig c;
  c.name = "null-test";
  c.dim = 64;
  c.hidden_dim = 128;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.vocab_size = vocab_size;
  c.max_seq_len = max_seq_len;
  return c;
}

std::unique_ptr<Backend> Make(const ModelConfig& config, std::vector<int32_t> never_emit = {2},
                              int num_blocks = 32) {
  auto backend = CreateNullBackend(
      config, {.kv_cache = {.block_size = 4, .num_blocks = num_blocks}, .never_emit = never_emit});
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

// (A bad KV cache or a vocabulary of no ids: backend_contract_test.cc.)
TEST(NullBackendTest, RefusesToAvoidEveryIdAndEmitsTheOnlyIdLeft) {
  const ModelConfig c = Config(/*vocab_size=*/3);
  // Every id avoided: nothing left to emit.
  absl::StatusOr<std::unique_ptr<Backend>> none = CreateNullBackend(
      c, {.kv_cache = {.block_size = 4, .num_blocks = 4}, .never_emit = {2, 0, 1}});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  // One id left: that one, always.
  std::unique_ptr<Backend> one = Make(c, {2, 0});
  ASSERT_NE(one, nullptr);
  const std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};  // positions 0..39
  absl::Status status;
  for (int32_t last = 0; last < 3; ++last) {
    for (int32_t pos = 0; pos < 40; ++pos) {
      EXPECT_EQ(SampleStep(*one, {last}, {{1, pos, table}}, &status), std::vector<int32_t>{1})
          << status;
    }
  }
}

TEST(NullBackendTest, TokensAreAFunctionOfLastTokenAndPosition) {
  for (int32_t last = 0; last < 512; last += 7) {
    for (int32_t pos = 0; pos < 2048; pos += 13) {
      const int32_t t = NullBackendToken(last, pos, 512, {2});
      EXPECT_EQ(t, NullBackendToken(last, pos, 512, {2}));
      EXPECT_GE(t, 0);
      EXPECT_LT(t, 512);
      EXPECT_NE(t, 2);
    }
  }
  // A spread of ids, not a constant: the detokeniser sees varied text.
  std::set<int32_t> seen;
  for (int32_t pos = 0; pos < 1000; ++pos) seen.insert(NullBackendToken(5, pos, 512, {}));
  EXPECT_GT(seen.size(), 256u);
  // The id an avoided one would have been becomes the next id up.
  for (int32_t last = 0; last < 200; ++last) {
    const int32_t free = NullBackendToken(last, 9, 512, {});
    EXPECT_EQ(NullBackendToken(last, 9, 512, {free}), (free + 1) % 512);
  }
}

TEST(NullBackendTest, NeverEmitsAnAvoidedIdSoGenerationsRunToTheirLength) {
  // A small vocabulary where EOS would come up every few tokens by chance.
  const ModelConfig c = Config(/*vocab_size=*/8, /*max_seq_len=*/4096);
  std::unique_ptr<Backend> b = Make(c, {2, 7}, /*num_blocks=*/1024);
  ASSERT_NE(b, nullptr);
  std::vector<int32_t> table(1024);
  for (int i = 0; i < 1024; ++i) table[i] = i;
  int32_t token = 1;
  std::set<int32_t> seen;
  absl::Status status;
  for (int32_t pos = 0; pos < 4000; ++pos) {
    const std::vector<int32_t> next = SampleStep(*b, {token}, {{1, pos, table}}, &status);
    ASSERT_TRUE(status.ok()) << status;
    token = next[0];
    ASSERT_NE(token, 2);
    ASSERT_NE(token, 7);
    seen.insert(token);
  }
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1, 3, 4, 5, 6}));
}

// Whatever shares the step, however the prompt is chunked and whatever the
// sampling: each sequence's null token.
TEST(NullBackendTest, EachSequenceGetsTheNullTokenOfItsLastTokenAndPosition) {
  std::unique_ptr<Backend> b = Make(Config());
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> t0 = {0, 1}, t1 = {2, 3}, t2 = {4, 5, 6, 7};
  // Three sequences: a decode at position 5, a prompt of 3 tokens, a decode.
  const std::vector<int32_t> tokens = {17, 1, 40, 41, 300};
  const std::vector<SequenceStep> seqs = {{1, 5, t0}, {3, 0, t1}, {1, 9, t2}};
  absl::Status status;
  const std::vector<int32_t> next = SampleStep(*b, tokens, seqs, &status);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(next, (std::vector<int32_t>{NullBackendToken(17, 6, 512, {2}),
                                        NullBackendToken(41, 3, 512, {2}),
                                        NullBackendToken(300, 10, 512, {2})}));
  // Alone, or sampled at a temperature with any draw: the same tokens.
  EXPECT_EQ(SampleStep(*b, {40, 41}, {{2, 1, t1}}, &status), std::vector<int32_t>{next[1]})
      << status;
  std::vector<SampleSpec> hot(3);
  for (SampleSpec& s : hot) s = {.params = {.temperature = 1.5f, .top_k = 5}, .uniform = 0.99f};
  EXPECT_EQ(SampleStep(*b, tokens, seqs, &status, hot), next) << status;
}

TEST(NullBackendTest, RunsASyntheticModelsShapeWithoutItsWeights) {
  absl::StatusOr<Model> model = BuildSyntheticModel("synthetic:15m");
  ASSERT_TRUE(model.ok()) << model.status();
  std::unique_ptr<Backend> b = Make(model->config, {2}, 2048);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->config().vocab_size, 32000);
  EXPECT_EQ(b->config().max_seq_len, 2048);
}

}  // namespace
}  // namespace coalesce::engine
