// The null backend (engine/null/null_backend.h): deterministic tokens that depend
// only on each sequence's last token and position, never an id it must avoid,
// Step's logits agreeing with StepAndSample, every bad step refused as a real
// backend refuses it, and nothing read or held.
#include "engine/null/null_backend.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "engine/model/synthetic.h"
#include "engine/sampler.h"

namespace coalesce::engine {
namespace {

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

// Runs StepAndSample; the tokens, or an empty vector on error (the status in
// `status`).
std::vector<int32_t> Sample(Backend& backend, const std::vector<int32_t>& tokens,
                            const std::vector<SequenceStep>& seqs, absl::Status* status,
                            const std::vector<SampleSpec>& sampling = {}) {
  std::vector<SampleSpec> specs = sampling;
  if (specs.empty()) specs.resize(seqs.size());
  std::vector<int32_t> next(seqs.size(), -1);
  *status = backend.StepAndSample({tokens, seqs}, specs, std::span<int32_t>(next));
  return status->ok() ? next : std::vector<int32_t>();
}

TEST(NullBackendTest, DescribesItselfAndReadsNothing) {
  std::unique_ptr<Backend> b = Make(Config());
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->name(), "null");
  EXPECT_NE(b->Describe().find("NO ARITHMETIC"), std::string::npos) << b->Describe();
  EXPECT_NE(b->Describe().find("meaningless"), std::string::npos) << b->Describe();
  EXPECT_EQ(b->weight_bytes(), 0);
  EXPECT_EQ(b->kv_bytes_per_token(), 0);
  EXPECT_EQ(b->config().vocab_size, 512);
  EXPECT_EQ(b->kv_cache().block_size, 4);
  EXPECT_EQ(b->kv_cache().num_blocks, 32);
  // What the server asks instead of its name: no model run, nothing read
  // from host memory, and steps too short for a step thread to pay.
  const BackendCapabilities caps = b->capabilities();
  EXPECT_FALSE(caps.runs_model);
  EXPECT_FALSE(caps.weights_in_host_memory);
  EXPECT_FALSE(caps.overlap_pays);
}

TEST(NullBackendTest, RejectsBadOptions) {
  const ModelConfig c = Config(/*vocab_size=*/3);
  EXPECT_FALSE(CreateNullBackend(c, {.kv_cache = {.block_size = 0, .num_blocks = 4}}).ok());
  EXPECT_FALSE(CreateNullBackend(c, {.kv_cache = {.block_size = 4, .num_blocks = -1}}).ok());
  EXPECT_FALSE(CreateNullBackend(Config(0), {.kv_cache = {.block_size = 4, .num_blocks = 4}}).ok());
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
      EXPECT_EQ(Sample(*one, {last}, {{1, pos, table}}, &status), std::vector<int32_t>{1})
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
    const std::vector<int32_t> next = Sample(*b, {token}, {{1, pos, table}}, &status);
    ASSERT_TRUE(status.ok()) << status;
    token = next[0];
    ASSERT_NE(token, 2);
    ASSERT_NE(token, 7);
    seen.insert(token);
  }
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1, 3, 4, 5, 6}));
}

TEST(NullBackendTest, BatchMatesSamplingAndChunkingDoNotChangeTheTokens) {
  std::unique_ptr<Backend> b = Make(Config());
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> t0 = {0, 1}, t1 = {2, 3}, t2 = {4, 5, 6, 7};
  // Three sequences: a decode at position 5, a prompt of 3 tokens, a decode.
  const std::vector<int32_t> tokens = {17, 1, 40, 41, 300};
  const std::vector<SequenceStep> seqs = {{1, 5, t0}, {3, 0, t1}, {1, 9, t2}};
  absl::Status status;
  const std::vector<int32_t> next = Sample(*b, tokens, seqs, &status);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(next, (std::vector<int32_t>{NullBackendToken(17, 6, 512, {2}),
                                        NullBackendToken(41, 3, 512, {2}),
                                        NullBackendToken(300, 10, 512, {2})}));
  // Alone, or sampled at a temperature with any draw: the same tokens.
  EXPECT_EQ(Sample(*b, {40, 41}, {{2, 1, t1}}, &status), std::vector<int32_t>{next[1]}) << status;
  std::vector<SampleSpec> hot(3);
  for (SampleSpec& s : hot) s = {.params = {.temperature = 1.5f, .top_k = 5}, .uniform = 0.99f};
  EXPECT_EQ(Sample(*b, tokens, seqs, &status, hot), next) << status;
}

TEST(NullBackendTest, StepLogitsPickTheSameTokenUnderAnySampling) {
  std::unique_ptr<Backend> b = Make(Config());
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> t0 = {3}, t1 = {4, 5};
  const std::vector<int32_t> tokens = {9, 1, 2, 3, 4, 5};
  const std::vector<SequenceStep> seqs = {{1, 2, t0}, {5, 0, t1}};
  absl::Status status;
  const std::vector<int32_t> next = Sample(*b, tokens, seqs, &status);
  ASSERT_TRUE(status.ok()) << status;
  std::vector<float> logits(2 * 512, 123.0f);
  ASSERT_TRUE(b->Step({tokens, seqs}, logits).ok());
  for (int s = 0; s < 2; ++s) {
    const std::span<const float> row = std::span<const float>(logits).subspan(s * 512, 512);
    for (const SamplingParams& p : {SamplingParams{}, SamplingParams{.temperature = 1.0f},
                                    SamplingParams{.temperature = 0.7f, .top_p = 0.9f}}) {
      // (A draw of exactly 0 may take id 0: see null_backend.cc.)
      for (float u : {1e-6f, 0.5f, 0.999f}) {
        EXPECT_EQ(SampleWithUniform(row, p, u), next[s])
            << "temperature " << p.temperature << ", top_p " << p.top_p << ", draw " << u;
      }
    }
  }
}

TEST(NullBackendTest, RefusesBadStepsAsARealBackendDoes) {
  std::unique_ptr<Backend> b = Make(Config(512, 64), {2}, /*num_blocks=*/8);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> t0 = {0, 1}, t1 = {2, 3}, shared = {5, 1}, out_of_range = {8};
  absl::Status status;
  auto code = [&](const std::vector<int32_t>& tokens, const std::vector<SequenceStep>& seqs) {
    Sample(*b, tokens, seqs, &status);
    return status.code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code({512}, {{1, 0, t0}}), kInvalid);          // token outside the vocabulary
  EXPECT_EQ(code({-1}, {{1, 0, t0}}), kInvalid);           // negative token
  EXPECT_EQ(code({1}, {{1, 64, t0}}), kInvalid);           // position beyond the context
  EXPECT_EQ(code({1}, {{1, 8, t0}}), kInvalid);            // block table too short
  EXPECT_EQ(code({1}, {{1, 0, out_of_range}}), kInvalid);  // block id out of range
  EXPECT_EQ(code({1, 2}, {{1, 0, t0}}), kInvalid);         // tokens and sequences disagree
  EXPECT_EQ(code({1}, {{0, 0, t0}}), kInvalid);            // a sequence of no tokens
  // Two sequences writing one block.
  EXPECT_EQ(code({1, 2}, {{1, 4, t0}, {1, 4, shared}}), kInvalid);
  // Wrong number of sampling specs or outputs; logits too small for Step.
  const std::vector<int32_t> tokens = {1};
  const std::vector<SequenceStep> seqs = {{1, 0, t0}};
  std::vector<SampleSpec> specs(2);
  std::vector<int32_t> next(1);
  EXPECT_EQ(b->StepAndSample({tokens, seqs}, specs, std::span<int32_t>(next)).code(), kInvalid);
  std::vector<float> small(511);
  EXPECT_EQ(b->Step({tokens, seqs}, small).code(), kInvalid);
  // And a good step still runs after all of those.
  EXPECT_EQ(code({1, 2}, {{1, 4, t0}, {1, 4, t1}}), absl::StatusCode::kOk);
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
