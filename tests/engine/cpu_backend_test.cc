// CpuBackend: batch validation, and the equivalences a paged, batched forward
// pass must keep (prefill in one step == one token per step; results
// independent of block size, thread count and batch-mates).
#include "engine/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/model/llama2c.h"
#include "engine/model/synthetic.h"

namespace coalesce::engine {
namespace {

const std::string kModels = COALESCE_MODELS_DIR;

std::shared_ptr<const Model> Stories() {
  static const std::shared_ptr<const Model> model = [] {
    auto m = LoadLlama2cModel(kModels + "/stories260K/stories260K.bin");
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::make_shared<const Model>(*std::move(m)) : nullptr;
  }();
  return model;
}

std::unique_ptr<Backend> MakeBackend(std::shared_ptr<const Model> model, int block_size,
                                     int num_blocks, int threads = 0) {
  auto backend = CreateCpuBackend(
      std::move(model),
      {.kv_cache = {.block_size = block_size, .num_blocks = num_blocks}, .threads = threads});
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

std::vector<int32_t> Iota(int n, int start = 0) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// A few ids of a prompt: BOS then a fixed spread of the vocabulary.
std::vector<int32_t> Prompt(int n, int vocab) {
  std::vector<int32_t> ids = {1};
  for (int i = 1; i < n; ++i) ids.push_back((i * 97 + 13) % vocab);
  return ids;
}

// Runs `tokens` one per step from position 0; returns the logits of each step.
std::vector<std::vector<float>> OneByOne(Backend& backend, const std::vector<int32_t>& tokens,
                                         const std::vector<int32_t>& table) {
  const int vocab = backend.config().vocab_size;
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const SequenceStep seq{
        .num_tokens = 1, .start_pos = static_cast<int32_t>(i), .block_table = table};
    std::vector<float> logits(vocab);
    EXPECT_TRUE(backend.Step({.tokens = {&tokens[i], 1}, .seqs = {&seq, 1}}, logits).ok());
    out.push_back(std::move(logits));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Creation and validation
// ---------------------------------------------------------------------------

TEST(CpuBackendTest, RejectsBadOptions) {
  EXPECT_FALSE(CreateCpuBackend(nullptr, {.kv_cache = {.block_size = 16, .num_blocks = 4}}).ok());
  EXPECT_FALSE(CreateCpuBackend(Stories(), {.kv_cache = {.block_size = 0, .num_blocks = 4}}).ok());
  EXPECT_FALSE(
      CreateCpuBackend(Stories(), {.kv_cache = {.block_size = 16, .num_blocks = -1}}).ok());
  // A model whose weights do not match its config.
  auto broken = std::make_shared<Model>(*Stories());
  broken->weights.layers.pop_back();
  EXPECT_FALSE(CreateCpuBackend(broken, {.kv_cache = {.block_size = 16, .num_blocks = 4}}).ok());
}

TEST(CpuBackendTest, DescribesItself) {
  auto backend = MakeBackend(Stories(), 16, 8);
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), "cpu");
  const BackendCapabilities caps = backend->capabilities();
  EXPECT_TRUE(caps.runs_model);
  EXPECT_TRUE(caps.weights_in_host_memory);
  EXPECT_TRUE(caps.overlap_pays);
  EXPECT_EQ(backend->config().vocab_size, 512);
  EXPECT_EQ(backend->kv_cache().block_size, 16);
  EXPECT_EQ(backend->kv_cache().num_blocks, 8);
  // 5 layers x (K + V) x 16 positions x kv_dim 32 x 4 bytes.
  EXPECT_EQ(KvBlockBytes(backend->config(), 16), 5 * 2 * 16 * 32 * 4);
}

TEST(CpuBackendTest, InvalidBatchesReturnErrors) {
  auto backend = MakeBackend(Stories(), 4, 8);
  ASSERT_NE(backend, nullptr);
  std::vector<float> logits(2 * 512);
  const std::vector<int32_t> table = {0, 1, 2};
  const std::vector<int32_t> tokens = {1, 5, 7};
  auto step = [&](std::vector<int32_t> toks, std::vector<SequenceStep> seqs, std::span<float> out) {
    return backend->Step({toks, seqs}, out);
  };
  auto seq = [&](int n, int start, std::span<const int32_t> t) {
    return SequenceStep{.num_tokens = n, .start_pos = start, .block_table = t};
  };
  // The valid version of the batch works.
  ASSERT_TRUE(step(tokens, {seq(3, 0, table)}, logits).ok());

  struct Case {
    std::string what;
    absl::Status status;
  };
  const std::vector<int32_t> bad_ids = {0, 8};
  const std::vector<int32_t> negative_id = {-1};
  const std::vector<int32_t> other = {3, 4, 5};
  const Case cases[] = {
      {"logits too small", step(tokens, {seq(3, 0, table)}, {logits.data(), 511})},
      {"zero tokens in a sequence", step({}, {seq(0, 0, table)}, logits)},
      {"negative start", step({1}, {seq(1, -1, table)}, logits)},
      {"token count mismatch", step(tokens, {seq(2, 0, table)}, logits)},
      {"token id too large", step({1, 512}, {seq(2, 0, table)}, logits)},
      {"negative token id", step({-3}, {seq(1, 0, table)}, logits)},
      {"past the context", step({1}, {seq(1, 512, Iota(129))}, logits)},
      {"block table too short", step({1}, {seq(1, 12, table)}, logits)},
      {"block id out of range", step({1}, {seq(1, 4, bad_ids)}, logits)},
      {"negative block id", step({1}, {seq(1, 0, negative_id)}, logits)},
      {"two sequences write one block", step({1, 2}, {seq(1, 1, table), seq(1, 2, table)}, logits)},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << c.status;
  }
  // Sharing a block only for reading (a common prefix) is allowed.
  const std::vector<int32_t> shares_first = {0, 3};
  EXPECT_TRUE(step({9, 9}, {seq(1, 2, table), seq(1, 5, shares_first)}, logits).ok());
  // And the backend still works after all the rejected batches.
  EXPECT_TRUE(step(tokens, {seq(3, 0, other)}, logits).ok());
}

// ---------------------------------------------------------------------------
// Equivalences
// ---------------------------------------------------------------------------

// Prefilling N tokens in one step computes what N single-token steps compute.
// Both run each row through the same per-row arithmetic (kernels.h), so the
// match is in fact exact; 1e-4 is the contract.
TEST(CpuBackendTest, PrefillEqualsSingleSteps) {
  for (const bool synthetic : {false, true}) {
    std::shared_ptr<const Model> model = Stories();
    if (synthetic) {
      auto m = BuildSyntheticModel("synthetic:tiny");
      ASSERT_TRUE(m.ok());
      model = std::make_shared<const Model>(*std::move(m));
    }
    const int vocab = model->config.vocab_size;
    const std::vector<int32_t> prompt = Prompt(23, vocab);
    const std::vector<int32_t> table = {5, 2, 7, 0, 3, 1};  // scattered blocks of 4

    auto single = MakeBackend(model, 4, 8);
    const auto expected = OneByOne(*single, prompt, table);

    // The whole prompt in one step, and in uneven chunks of 7, 1 and 15.
    for (const std::vector<int>& chunks : std::vector<std::vector<int>>{{23}, {7, 1, 15}}) {
      auto backend = MakeBackend(model, 4, 8);
      int start = 0;
      for (const int n : chunks) {
        const SequenceStep seq{.num_tokens = n, .start_pos = start, .block_table = table};
        std::vector<float> logits(vocab);
        ASSERT_TRUE(
            backend
                ->Step({.tokens = {&prompt[start], static_cast<size_t>(n)}, .seqs = {&seq, 1}},
                       logits)
                .ok());
        start += n;
        const std::vector<float>& want = expected[start - 1];
        for (int i = 0; i < vocab; ++i) {
          ASSERT_NEAR(logits[i], want[i], 1e-4) << "synthetic=" << synthetic << " i=" << i;
        }
      }
    }
  }
}

// Block size changes only where K and V live, not what attention computes;
// the thread count changes only who computes which rows.
TEST(CpuBackendTest, BlockSizeAndThreadsDoNotChangeResults) {
  const std::vector<int32_t> prompt = Prompt(20, 512);
  auto reference_backend = MakeBackend(Stories(), 16, 2, 1);
  const auto reference = OneByOne(*reference_backend, prompt, {0, 1});
  for (const int block_size : {1, 3, 16}) {
    for (const int threads : {1, 2, 3}) {
      const int blocks = (20 + block_size - 1) / block_size;
      auto backend = MakeBackend(Stories(), block_size, blocks, threads);
      std::vector<int32_t> table = Iota(blocks);
      std::reverse(table.begin(), table.end());
      const auto got = OneByOne(*backend, prompt, table);
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], reference[i])
            << "block_size " << block_size << " threads " << threads << " step " << i;
      }
    }
  }
}

// A sequence's logits are bit-identical whether it runs alone or next to
// other sequences (here with the 15m shape, whose matrices are large enough
// for the multi-threaded path).
TEST(CpuBackendTest, BatchMatesDoNotChangeLogits) {
  auto m = BuildSyntheticModel("synthetic:15m");
  ASSERT_TRUE(m.ok());
  auto model = std::make_shared<const Model>(*std::move(m));
  const int vocab = model->config.vocab_size;
  const std::vector<int32_t> prompt = Prompt(9, vocab);
  auto alone_backend = MakeBackend(model, 16, 1);
  const auto alone = OneByOne(*alone_backend, prompt, {0});

  // Same prompt as sequence 1 of 3, one token per step, while sequence 0
  // prefills 13 tokens per step and sequence 2 decodes.
  auto backend = MakeBackend(model, 16, 10);
  const std::vector<int32_t> t0 = {2, 3, 4, 5, 6, 7, 8, 9}, t1 = {0}, t2 = {1};
  std::vector<float> logits(3 * vocab);
  for (int i = 0; i < 9; ++i) {
    std::vector<int32_t> tokens;
    for (int j = 0; j < 13; ++j) tokens.push_back((i * 13 + j) % vocab);
    tokens.push_back(prompt[i]);
    tokens.push_back(42);
    const SequenceStep seqs[] = {{.num_tokens = 13, .start_pos = 13 * i, .block_table = t0},
                                 {.num_tokens = 1, .start_pos = i, .block_table = t1},
                                 {.num_tokens = 1, .start_pos = i, .block_table = t2}};
    ASSERT_TRUE(backend->Step({tokens, seqs}, logits).ok());
    const std::vector<float> mine(logits.begin() + vocab, logits.begin() + 2 * vocab);
    ASSERT_EQ(mine, alone[i]) << "step " << i;
  }
}

}  // namespace
}  // namespace coalesce::engine
