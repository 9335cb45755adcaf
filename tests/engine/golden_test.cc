// stories260K against run.c's greedy goldens (golden.json): the loaders, the
// tokenizer, the forward pass, and batch invariance -- a sequence decodes to
// the same ids whatever shares its batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_backend.h"
#include "engine/model/llama2c.h"
#include "engine/sampler.h"
#include "engine/tokenizer/llama2c_tokenizer.h"

namespace coalesce::engine {
namespace {

const std::string kDir = std::string(COALESCE_MODELS_DIR) + "/stories260K";

struct GoldenCase {
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> output_ids;
  std::string text;
  std::string completion_text;
};

struct Golden {
  std::vector<GoldenCase> cases;
  std::vector<float> first_step_logits;  // [512] after BOS at position 0
  std::shared_ptr<const Model> model;
  std::unique_ptr<Llama2cTokenizer> tokenizer;
};

const Golden& GetGolden() {
  static const Golden* const golden = [] {
    auto* g = new Golden;
    std::ifstream in(kDir + "/golden.json");
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "cannot parse golden.json";
    if (j.is_discarded()) return g;
    for (const auto& c : j["cases"]) {
      g->cases.push_back(
          {c["prompt"], c["prompt_ids"], c["output_ids"], c["text"], c["completion_text"]});
    }
    g->first_step_logits = j["first_step_logits"]["all"].get<std::vector<float>>();
    auto model = LoadLlama2cModel(kDir + "/stories260K.bin");
    EXPECT_TRUE(model.ok()) << model.status();
    if (model.ok()) g->model = std::make_shared<const Model>(*std::move(model));
    auto tok = LoadLlama2cTokenizer(kDir + "/tok512.bin", 512);
    EXPECT_TRUE(tok.ok()) << tok.status();
    if (tok.ok()) g->tokenizer = *std::move(tok);
    return g;
  }();
  return *golden;
}

int32_t Argmax(std::span<const float> logits) {
  Rng unused(0);
  return Sample(logits, {}, unused);
}

class GoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Golden& g = GetGolden();
    ASSERT_EQ(g.cases.size(), 2u);
    ASSERT_NE(g.model, nullptr);
    ASSERT_NE(g.tokenizer, nullptr);
  }
  const Golden& g = GetGolden();
};

TEST_F(GoldenTest, ModelHeader) {
  const ModelConfig& c = g.model->config;
  EXPECT_EQ(c.name, "stories260K");
  EXPECT_EQ(c.source, kDir + "/stories260K.bin");
  EXPECT_FALSE(c.synthetic);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_TRUE(g.model->config.tied_classifier);
  // README: 264,128 floats in the file, of which 2 x 512 x 4 are the legacy
  // RoPE tables.
  EXPECT_EQ(c.num_parameters(), 264128 - 2 * 512 * 4);
}

TEST_F(GoldenTest, TokenizerEncodesPrompts) {
  for (const GoldenCase& c : g.cases) {
    EXPECT_EQ(g.tokenizer->Encode(c.prompt, true), c.prompt_ids) << c.prompt;
  }
}

TEST_F(GoldenTest, DecodeReproducesText) {
  for (const GoldenCase& c : g.cases) {
    std::vector<int32_t> all = c.prompt_ids;
    all.insert(all.end(), c.output_ids.begin(), c.output_ids.end());
    EXPECT_EQ(Decode(*g.tokenizer, all), c.text);
    EXPECT_EQ(Decode(*g.tokenizer, c.output_ids, c.prompt_ids.back()), c.completion_text);
  }
}

TEST_F(GoldenTest, FirstStepLogits) {
  auto backend = CreateCpuBackend(g.model, {.kv_cache = {.block_size = 16, .num_blocks = 1}});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const int32_t bos = 1;
  const std::vector<int32_t> table = {0};
  const SequenceStep seq{.num_tokens = 1, .start_pos = 0, .block_table = table};
  std::vector<float> logits(512);
  ASSERT_TRUE((*backend)->Step({.tokens = {&bos, 1}, .seqs = {&seq, 1}}, logits).ok());
  ASSERT_EQ(g.first_step_logits.size(), 512u);
  // run.c's float32 logits differ from a float64 reference by <= 1e-5; ours
  // sum in another order (8 FMA lanes), which costs about as much.
  for (int i = 0; i < 512; ++i) EXPECT_NEAR(logits[i], g.first_step_logits[i], 1e-4) << i;
  EXPECT_EQ(Argmax(logits), 403);
}

// The golden's steps semantics: prefill the prompt, then each generated token
// is fed back; output_ids[i] is the argmax after the prompt and i fed tokens.
TEST_F(GoldenTest, GreedyDecodingAlone) {
  for (const GoldenCase& c : g.cases) {
    auto backend = CreateCpuBackend(g.model, {.kv_cache = {.block_size = 16, .num_blocks = 8}});
    ASSERT_TRUE(backend.ok());
    const std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<float> logits(512);
    std::vector<int32_t> out;
    SequenceStep seq{.num_tokens = static_cast<int32_t>(c.prompt_ids.size()),
                     .start_pos = 0,
                     .block_table = table};
    ASSERT_TRUE((*backend)->Step({.tokens = c.prompt_ids, .seqs = {&seq, 1}}, logits).ok());
    out.push_back(Argmax(logits));
    while (out.size() < c.output_ids.size()) {
      seq = {.num_tokens = 1,
             .start_pos = static_cast<int32_t>(c.prompt_ids.size() + out.size() - 1),
             .block_table = table};
      ASSERT_TRUE((*backend)->Step({.tokens = {&out.back(), 1}, .seqs = {&seq, 1}}, logits).ok());
      out.push_back(Argmax(logits));
    }
    EXPECT_EQ(out, c.output_ids) << c.prompt;
  }
}

// ---------------------------------------------------------------------------
// Batch invariance
// ---------------------------------------------------------------------------

// A sequence in the simulated scheduler below.
struct Sim {
  std::vector<int32_t> prompt;
  int max_new = 0;  // tokens to generate
  int chunk = 0;    // prompt tokens per step while prefilling
  int cached = 0;   // positions already in the KV cache
  std::vector<int32_t> blocks;
  std::vector<int32_t> generated;
  bool golden = false;
};

// Decodes golden case `c` greedily while batch_size - 1 slots run other
// sequences: random prompts (random ids or real text), prefilled in random
// chunk sizes, generating random lengths, joining and leaving mid-way, with
// KV blocks drawn from a shuffled free list and a batch order shuffled every
// step. Returns the golden sequence's generated ids.
std::vector<int32_t> DecodeInBatch(const Golden& g, const GoldenCase& c, int batch_size,
                                   uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int block_size = std::vector<int>{1, 2, 3, 4, 5, 8, 16}[batch_size % 7];
  const int num_blocks = 16 * (200 / block_size + 1);
  auto backend =
      CreateCpuBackend(g.model, {.kv_cache = {.block_size = block_size, .num_blocks = num_blocks}});
  EXPECT_TRUE(backend.ok());
  std::vector<int32_t> free_blocks(num_blocks);
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);

  const char* texts[] = {"Lily and Ben went to the park", "Once upon a time", "The cat sat",
                         "He was sad.", "Tom had a red ball and a big dog named Max"};
  auto filler = [&]() {
    Sim s;
    if (uniform(0, 1) == 0) {
      s.prompt = g.tokenizer->Encode(texts[uniform(0, 4)], true);
    } else {
      s.prompt = {1};
      for (int i = uniform(0, 40); i > 0; --i) s.prompt.push_back(uniform(3, 511));
    }
    s.max_new = uniform(1, 60);
    s.chunk = uniform(0, 2) == 0 ? 1000 : uniform(1, 8);
    return s;
  };

  std::vector<std::unique_ptr<Sim>> slots(batch_size);
  std::vector<int> idle_until(batch_size, 0);  // filler slots rest before rejoining
  const int golden_slot = uniform(0, batch_size - 1);
  const int golden_join = uniform(0, 6);
  bool golden_started = false;
  std::vector<int32_t> result;
  std::vector<float> logits;
  for (int step = 0; step < 1000; ++step) {
    // 1. Fill empty slots: the golden one at its join step, fillers after a
    //    random rest.
    for (int s = 0; s < batch_size; ++s) {
      if (slots[s] != nullptr) continue;
      if (s == golden_slot) {
        if (!golden_started && step >= golden_join) {
          slots[s] = std::make_unique<Sim>();
          slots[s]->prompt = c.prompt_ids;
          slots[s]->max_new = static_cast<int>(c.output_ids.size());
          slots[s]->chunk = uniform(1, 6);
          slots[s]->golden = true;
          golden_started = true;
        }
      } else if (step >= idle_until[s]) {
        slots[s] = std::make_unique<Sim>(filler());
      }
    }
    // 2. Build the batch in a shuffled order.
    std::vector<int> order;
    for (int s = 0; s < batch_size; ++s) {
      if (slots[s] != nullptr) order.push_back(s);
    }
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> tokens;
    std::vector<SequenceStep> seqs;
    for (const int s : order) {
      Sim& sim = *slots[s];
      int n = 1;
      if (sim.cached < static_cast<int>(sim.prompt.size())) {
        n = std::min<int>(sim.chunk, sim.prompt.size() - sim.cached);
        tokens.insert(tokens.end(), sim.prompt.begin() + sim.cached,
                      sim.prompt.begin() + sim.cached + n);
      } else {
        tokens.push_back(sim.generated.back());
      }
      while (static_cast<int>(sim.blocks.size()) * block_size < sim.cached + n) {
        EXPECT_FALSE(free_blocks.empty());
        sim.blocks.push_back(free_blocks.back());
        free_blocks.pop_back();
      }
      seqs.push_back({.num_tokens = n, .start_pos = sim.cached, .block_table = sim.blocks});
    }
    // 3. One step; every sequence whose prompt is complete takes its argmax.
    logits.assign(seqs.size() * 512, 0.0f);
    const absl::Status status = (*backend)->Step({tokens, seqs}, logits);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) return {};
    for (size_t i = 0; i < order.size(); ++i) {
      const int s = order[i];
      Sim& sim = *slots[s];
      sim.cached += seqs[i].num_tokens;
      if (sim.cached < static_cast<int>(sim.prompt.size())) continue;
      sim.generated.push_back(Argmax({&logits[i * 512], 512}));
      if (static_cast<int>(sim.generated.size()) < sim.max_new) continue;
      if (sim.golden) return sim.generated;
      for (const int32_t b : sim.blocks) {
        free_blocks.insert(free_blocks.begin() + uniform(0, free_blocks.size()), b);
      }
      slots[s].reset();
      idle_until[s] = step + uniform(1, 10);
    }
  }
  ADD_FAILURE() << "golden sequence did not finish";
  return result;
}

TEST_F(GoldenTest, GreedyDecodingInBatchesOfOneToSixteen) {
  for (int batch_size = 1; batch_size <= 16; ++batch_size) {
    for (size_t i = 0; i < g.cases.size(); ++i) {
      const GoldenCase& c = g.cases[i];
      EXPECT_EQ(DecodeInBatch(g, c, batch_size, 1000 * batch_size + static_cast<uint32_t>(i)),
                c.output_ids)
          << "batch size " << batch_size << ", prompt \"" << c.prompt << "\"";
    }
  }
}

}  // namespace
}  // namespace coalesce::engine
