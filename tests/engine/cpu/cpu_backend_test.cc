// CpuBackend: what only the CPU backend has, its options. Results are
// independent of the KV block size and of the thread count, with every KV
// cache type; the quantized KV caches (bf16, fp16, int8) stay within stated
// bounds of the float32 one, on stories260K and on a synthetic model; fp8 and
// unknown types are refused. The contract every backend keeps (validation,
// prefill == single steps, batch mates, copied blocks, describing itself,
// sampling) is in backend_contract_test.cc, run there with every KV cache type.
#include "engine/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/quant_int8.h"
#include "engine/cpu/quant_matmul.h"
#include "engine/model/llama2c.h"
#include "engine/model/quantize.h"
#include "engine/tokenizer/llama2c_tokenizer.h"
#include "tests/engine/backend_test_support.h"

namespace coalesce::engine {
namespace {

using testing::Generate;
using testing::GoldenRequests;
using testing::Iota;
using testing::ModelsDir;
using testing::OneByOne;
using testing::Prompt;
using testing::ReadGoldens;
using testing::RelativeError;
using testing::Request;
using testing::Stories;
using testing::Synthetic;

constexpr KvDtype kAllTypes[] = {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kFp16, KvDtype::kInt8};
constexpr KvDtype kQuantizedTypes[] = {KvDtype::kBf16, KvDtype::kFp16, KvDtype::kInt8};

std::unique_ptr<Backend> MakeBackend(std::shared_ptr<const Model> model, int block_size,
                                     int num_blocks, int threads = 0,
                                     KvDtype dtype = KvDtype::kFp32) {
  auto backend = CreateCpuBackend(
      std::move(model),
      {.kv_cache = {.block_size = block_size, .num_blocks = num_blocks, .dtype = dtype},
       .threads = threads});
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

// Block size changes only where K and V live, not what attention computes;
// the thread count changes only who computes which rows. With every KV cache
// type (an int8 token's scale is its own, whatever block it lands in).
TEST(CpuBackendTest, BlockSizeAndThreadsDoNotChangeResults) {
  ASSERT_NE(Stories(), nullptr);
  const std::vector<int32_t> prompt = Prompt(20, 512);
  for (const KvDtype dtype : kAllTypes) {
    SCOPED_TRACE(KvDtypeName(dtype));
    auto reference_backend = MakeBackend(Stories(), 16, 2, 1, dtype);
    ASSERT_NE(reference_backend, nullptr);
    const auto reference = OneByOne(*reference_backend, prompt, {0, 1});
    for (const int block_size : {1, 3, 16}) {
      for (const int threads : {1, 2, 3}) {
        const int blocks = (20 + block_size - 1) / block_size;
        auto backend = MakeBackend(Stories(), block_size, blocks, threads, dtype);
        ASSERT_NE(backend, nullptr);
        std::vector<int32_t> table = Iota(blocks);
        std::reverse(table.begin(), table.end());
        const auto got = OneByOne(*backend, prompt, table);
        ASSERT_EQ(got.size(), reference.size());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], reference[i])
              << "block_size " << block_size << " threads " << threads << " step " << i;
        }
      }
    }
  }
}

// Float32 matrices laid out as the product's panels (CpuBackendOptions::
// float_panels) give the logits the model's rows give, bit for bit: one
// token at a time and a whole prompt in one step, on one thread and three,
// with a classifier tied to the embedding (stories260K, synthetic:15m) and
// one of its own.
TEST(CpuBackendTest, FloatPanelsGiveTheSameBits) {
  const std::shared_ptr<const Model> synthetic = Synthetic("synthetic:15m");
  ASSERT_NE(synthetic, nullptr);
  ASSERT_NE(Stories(), nullptr);
  // synthetic:15m with an untied classifier of its own values.
  auto untied = std::make_shared<Model>(*synthetic);
  const auto classifier =
      std::make_shared<std::vector<float>>(synthetic->weights.classifier.size());
  for (size_t i = 0; i < classifier->size(); ++i) {
    (*classifier)[i] = 0.02f * static_cast<float>(static_cast<int>((i * 7919) % 101) - 50) / 50.0f;
  }
  untied->config.tied_classifier = false;
  untied->weights.classifier = *classifier;
  untied->storage = std::make_shared<std::pair<std::shared_ptr<const void>, decltype(classifier)>>(
      synthetic->storage, classifier);
  const std::pair<const char*, std::shared_ptr<const Model>> models[] = {
      {"stories260K", Stories()}, {"synthetic:15m", synthetic}, {"untied", untied}};
  for (const auto& [name, model] : models) {
    SCOPED_TRACE(name);
    const std::vector<int32_t> prompt = Prompt(7, model->config.vocab_size);
    for (const int threads : {1, 3}) {
      std::vector<std::vector<float>> results[2];
      for (const bool panels : {false, true}) {
        auto backend = CreateCpuBackend(model, {.kv_cache = {.block_size = 16, .num_blocks = 1},
                                                .threads = threads,
                                                .float_panels = panels});
        ASSERT_TRUE(backend.ok()) << backend.status();
        // The start-up log says which, and the panels' bytes.
        EXPECT_EQ((*backend)->Describe().find("as panels (") != std::string::npos, panels)
            << (*backend)->Describe();
        std::vector<std::vector<float>> got = OneByOne(**backend, prompt, {0});
        const std::vector<int32_t> table = {0};
        const SequenceStep seq{.num_tokens = static_cast<int32_t>(prompt.size()),
                               .start_pos = 0,
                               .block_table = table,
                               .all_logits = true};
        std::vector<float> logits(prompt.size() * model->config.vocab_size);
        const absl::Status status = (*backend)->Step({.tokens = prompt, .seqs = {&seq, 1}}, logits);
        ASSERT_TRUE(status.ok()) << status;
        got.push_back(std::move(logits));
        results[panels] = std::move(got);
      }
      ASSERT_EQ(results[0].size(), results[1].size());
      for (size_t i = 0; i < results[0].size(); ++i) {
        ASSERT_EQ(results[0][i], results[1][i]) << "threads " << threads << " step " << i;
      }
    }
  }
}

// With every matrix laid out (float32 as panels; quantized too), the backend
// keeps none of the Model it was given, so its rows can be freed: the Model
// expires once the caller lets go of it, and the logits are the model's.
// Reading the model's rows, the backend holds it.
TEST(CpuBackendTest, LaidOutBackendLetsGoOfTheModel) {
  ASSERT_NE(Stories(), nullptr);
  const std::vector<int32_t> prompt = Prompt(5, 512);
  auto reference = MakeBackend(Stories(), 16, 1, 2);
  ASSERT_NE(reference, nullptr);
  const auto want = OneByOne(*reference, prompt, {0});
  for (const bool quantized : {false, true}) {
    for (const bool panels : {false, true}) {
      SCOPED_TRACE(std::string(quantized ? "q8_0" : "fp32") + (panels ? " panels" : " rows"));
      auto loaded = LoadLlama2cModel(ModelsDir() + "/stories260K/stories260K.bin");
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      std::shared_ptr<const Model> model = std::make_shared<const Model>(*std::move(loaded));
      if (quantized) {
        // stories260K's w2 (172 columns) stays float32: panels or rows.
        auto q = QuantizeModel(model, QuantType::kQ8_0);
        ASSERT_TRUE(q.ok()) << q.status();
        model = *std::move(q);
      }
      const std::weak_ptr<const Model> weak = model;
      auto backend = CreateCpuBackend(
          std::move(model),
          {.kv_cache = {.block_size = 16, .num_blocks = 1}, .threads = 2, .float_panels = panels});
      ASSERT_TRUE(backend.ok()) << backend.status();
      EXPECT_EQ(weak.expired(), panels);
      const auto got = OneByOne(**backend, prompt, {0});
      if (!quantized) {
        ASSERT_EQ(got, want);
      } else {
        ASSERT_EQ(got.size(), want.size());
        EXPECT_NE(got, want) << "the quantized weights were not used";
      }
    }
  }
}

// A model big enough for a step's projections to run in one parallel loop
// together (q, k and v; the feed-forward's w1 and w3: CpuBackend's
// ApplyTogether), with float32, quantized and int8-activation weights: more
// threads change nothing, for one row of activations or several, and one
// thread (each product alone, inline) is the reference.
TEST(CpuBackendTest, ProjectionsRunTogetherGiveTheSameBits) {
  const std::shared_ptr<const Model> synthetic = Synthetic("synthetic:15m");
  ASSERT_NE(synthetic, nullptr);
  const std::vector<int32_t> prompt = Prompt(6, synthetic->config.vocab_size);
  struct Case {
    std::string name;
    std::shared_ptr<const Model> model;
    bool int8 = false;
  };
  std::vector<Case> cases = {{"fp32", synthetic}};
  for (const QuantType type : {QuantType::kQ8_0, QuantType::kQ4_1}) {
    auto quantized = QuantizeModel(synthetic, type);
    ASSERT_TRUE(quantized.ok()) << quantized.status();
    cases.push_back({QuantTypeName(type), *quantized});
    if (cpu::Int8DotSupported()) {
      cases.push_back({std::string(QuantTypeName(type)) + " int8", *quantized, true});
    }
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::vector<float>> reference;
    for (const int threads : {1, 2, 3}) {
      auto backend = CreateCpuBackend(c.model, {.kv_cache = {.block_size = 16, .num_blocks = 1},
                                                .threads = threads,
                                                .int8_activations = c.int8});
      ASSERT_TRUE(backend.ok()) << backend.status();
      auto got = OneByOne(**backend, prompt, {0});
      // The whole prompt in one step (6 rows of activations), then its
      // last token's logits.
      const std::vector<int32_t> table = {0};
      const SequenceStep seq{
          .num_tokens = static_cast<int32_t>(prompt.size()), .start_pos = 0, .block_table = table};
      std::vector<float> logits(static_cast<size_t>(c.model->config.vocab_size));
      const absl::Status status = (*backend)->Step({.tokens = prompt, .seqs = {&seq, 1}}, logits);
      ASSERT_TRUE(status.ok()) << status;
      got.push_back(std::move(logits));
      if (threads == 1) {
        reference = std::move(got);
        continue;
      }
      ASSERT_EQ(got.size(), reference.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], reference[i]) << "threads " << threads << " step " << i;
      }
    }
  }
}

// Decoding a Q4_0 and a Q4_1 model one token at a time, the one-row kernels
// with converted codes and with subnormal ones (cpu/quant_matmul.h's
// CodeFloats): the same logits, bit for bit; the backend says which it uses.
TEST(CpuBackendTest, SubnormalCodesGiveTheSameLogitsAsConvertedOnes) {
  const std::shared_ptr<const Model> synthetic = Synthetic("synthetic:15m");
  ASSERT_NE(synthetic, nullptr);
  const std::vector<int32_t> prompt = Prompt(6, synthetic->config.vocab_size);
  for (const QuantType type : {QuantType::kQ4_0, QuantType::kQ4_1}) {
    SCOPED_TRACE(QuantTypeName(type));
    auto quantized = QuantizeModel(synthetic, type);
    ASSERT_TRUE(quantized.ok()) << quantized.status();
    std::vector<std::vector<float>> logits[2];
    for (const cpu::CodeFloats codes : {cpu::CodeFloats::kConverted, cpu::CodeFloats::kSubnormal}) {
      cpu::SetQuantCodeFloats(codes);
      auto backend =
          CreateCpuBackend(*quantized, {.kv_cache = {.block_size = 16, .num_blocks = 1}});
      ASSERT_TRUE(backend.ok()) << backend.status();
      const bool subnormal = codes == cpu::CodeFloats::kSubnormal;
      EXPECT_EQ((*backend)->Describe().find("subnormal") != std::string::npos, subnormal)
          << (*backend)->Describe();
      logits[subnormal] = OneByOne(**backend, prompt, {0});
    }
    cpu::SetQuantCodeFloats(std::nullopt);
    ASSERT_EQ(logits[0].size(), prompt.size());
    EXPECT_EQ(logits[0], logits[1]);
  }
}

// ---------------------------------------------------------------------------
// Quantized KV caches against the float32 one
// ---------------------------------------------------------------------------

// The logits after every token of `tokens`, from position 0 (one step with
// all_logits; the cache is written before attention reads it, so this is
// what single steps compute). [tokens.size()][vocab]
std::vector<std::vector<float>> AllLogits(std::shared_ptr<const Model> model, KvDtype dtype,
                                          const std::vector<int32_t>& tokens) {
  const int bs = 16, blocks = (static_cast<int>(tokens.size()) + bs - 1) / bs;
  auto backend = MakeBackend(std::move(model), bs, blocks, 0, dtype);
  if (backend == nullptr) return {};
  const int vocab = backend->config().vocab_size;
  const std::vector<int32_t> table = Iota(blocks);
  SequenceStep seq{.num_tokens = static_cast<int32_t>(tokens.size()),
                   .start_pos = 0,
                   .block_table = table,
                   .all_logits = true};
  std::vector<float> flat(tokens.size() * vocab);
  const absl::Status status = backend->Step({tokens, {&seq, 1}}, flat);
  EXPECT_TRUE(status.ok()) << status;
  std::vector<std::vector<float>> rows;
  for (size_t t = 0; t < tokens.size(); ++t) {
    rows.emplace_back(flat.begin() + t * vocab, flat.begin() + (t + 1) * vocab);
  }
  return rows;
}

int Argmax(const std::vector<float>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

// -log p(next) under softmax(logits), in double.
double NegativeLogLikelihood(const std::vector<float>& logits, int32_t next) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - max);
  return std::log(sum) - (logits[next] - max);
}

struct Comparison {
  double worst_relative = 0;  // max over positions of RelativeError(logits, fp32's)
  double mean_relative = 0;
  double top1_agreement = 0;  // share of positions whose argmax is fp32's
  double perplexity = 0;      // of tokens[1..] given what precedes
};

Comparison Compare(const std::vector<std::vector<float>>& got,
                   const std::vector<std::vector<float>>& want,
                   const std::vector<int32_t>& tokens) {
  Comparison c;
  double nll = 0.0;
  int agree = 0;
  for (size_t t = 0; t < got.size(); ++t) {
    const double err = RelativeError(got[t], want[t]);
    c.worst_relative = std::max(c.worst_relative, std::isnan(err) ? INFINITY : err);
    c.mean_relative += err / got.size();
    agree += Argmax(got[t]) == Argmax(want[t]);
    if (t + 1 < tokens.size()) nll += NegativeLogLikelihood(got[t], tokens[t + 1]);
  }
  c.top1_agreement = static_cast<double>(agree) / got.size();
  c.perplexity = std::exp(nll / (tokens.size() - 1));
  return c;
}

// How far each type may move the logits from float32's, as ||got - fp32|| /
// ||fp32|| at any position: about twice the worst these tests measure (the
// test output prints it: bf16 1.5e-2, fp16 1.9e-3, int8 7.8e-2 on
// stories260K, whose head size of 8 makes int8's per-head step coarse), so that
// a lost or doubled scale, or a conversion that reads the wrong bits, fails
// while the rounding each type must do passes. (The conversions themselves
// are checked exactly in cpu_kernels_test.) bf16 keeps 8 significant bits
// (rounding error up to 2^-9 of a value), fp16 11 (2^-12), int8 a step of
// max|x|/127 per token and head; errors in K and V reach the logits through
// every later layer.
double LogitBound(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kBf16:
      return 3e-2;
    case KvDtype::kFp16:
      return 4e-3;
    case KvDtype::kInt8:
      return 1.5e-1;
    default:
      return 0.0;
  }
}

// A short story of our own, in the style stories260K was trained on.
constexpr char kStory[] =
    "Once upon a time, there was a little girl named Mia. She lived in a small house near the "
    "woods with her mom and her dog, Max. Every morning, Mia and Max went outside to play in the "
    "green grass. One day, Mia saw a big red ball under a tree. She ran to the ball and picked it "
    "up. \"Look, Max! A ball!\" she said. Max wagged his tail and barked. They played with the "
    "ball all day. They threw it high and ran after it. When the sun went down, Mia felt tired. "
    "She went home and told her mom about the red ball. Her mom smiled and gave her a warm hug. "
    "\"You had a fun day,\" her mom said. Mia went to bed with a big smile on her face. Max "
    "slept next to her bed. The next day, they went back to the tree to play again. They were "
    "very happy.";

std::vector<int32_t> StoryTokens() {
  auto tok = LoadLlama2cTokenizer(testing::ModelsDir() + "/stories260K/tok512.bin", 512);
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (!tok.ok()) return {};
  return (*tok)->Encode(kStory, /*add_special_tokens=*/true);
}

// stories260K (head size 8, 2 query heads per KV head) over the story:
// logits within LogitBound of float32's at every position, perplexity within
// 1% of float32's, and the share of positions whose most likely next token is
// float32's, printed.
TEST(CpuBackendTest, QuantizedKvCachesStayCloseToFp32OnStories) {
  ASSERT_NE(Stories(), nullptr);
  const std::vector<int32_t> tokens = StoryTokens();
  ASSERT_GT(tokens.size(), 200u);
  ASSERT_LE(tokens.size(), static_cast<size_t>(Stories()->config.max_seq_len));
  const auto fp32 = AllLogits(Stories(), KvDtype::kFp32, tokens);
  const Comparison base = Compare(fp32, fp32, tokens);
  std::printf("stories260K, %zu tokens: fp32 perplexity %.4f\n", tokens.size(), base.perplexity);
  for (const KvDtype dtype : kQuantizedTypes) {
    SCOPED_TRACE(KvDtypeName(dtype));
    const Comparison c = Compare(AllLogits(Stories(), dtype, tokens), fp32, tokens);
    const double change = c.perplexity / base.perplexity - 1.0;
    std::printf(
        "stories260K, %s KV cache: logits within %.2e of fp32's (mean %.2e), perplexity %.4f "
        "(%+.3f%%), top-1 agreement %.1f%%\n",
        KvDtypeName(dtype), c.worst_relative, c.mean_relative, c.perplexity, 100.0 * change,
        100.0 * c.top1_agreement);
    EXPECT_LE(c.worst_relative, LogitBound(dtype));
    EXPECT_GT(c.worst_relative, 0.0) << "the cache type changed nothing: is it in use?";
    EXPECT_LE(std::fabs(change), 0.01);
  }
}

// The same bounds on a synthetic model of another shape (synthetic:15m: head
// size 48, one query head per KV head, random weights) over a 300-token
// prompt.
TEST(CpuBackendTest, QuantizedKvCachesStayCloseToFp32OnASyntheticModel) {
  const std::shared_ptr<const Model> model = Synthetic("synthetic:15m");
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> tokens = Prompt(300, model->config.vocab_size);
  const auto fp32 = AllLogits(model, KvDtype::kFp32, tokens);
  for (const KvDtype dtype : kQuantizedTypes) {
    SCOPED_TRACE(KvDtypeName(dtype));
    const Comparison c = Compare(AllLogits(model, dtype, tokens), fp32, tokens);
    std::printf("synthetic:15m, %s KV cache: logits within %.2e of fp32's (mean %.2e)\n",
                KvDtypeName(dtype), c.worst_relative, c.mean_relative);
    EXPECT_LE(c.worst_relative, LogitBound(dtype));
    EXPECT_GT(c.worst_relative, 0.0);
  }
}

// Greedy decoding with each type against float32: stories260K's golden
// prompts, 200 tokens each. Rounding can flip a near tie and the texts then
// part, so this prints how far they agree, and asserts only that each type
// decodes the first 16 tokens of every prompt as float32 does (measured:
// bf16 and fp16 all 200 of both prompts, int8 the first 114 and 21).
TEST(CpuBackendTest, GreedyDecodingAgreementWithFp32) {
  const testing::Goldens goldens = ReadGoldens();
  ASSERT_FALSE(goldens.prompts.empty());
  std::vector<Request> requests = GoldenRequests(goldens);
  for (Request& r : requests) r.outputs = 200;
  const int blocks = static_cast<int>(requests.size()) * (Stories()->config.max_seq_len / 16);
  auto fp32_backend = MakeBackend(Stories(), 16, blocks, 0, KvDtype::kFp32);
  ASSERT_NE(fp32_backend, nullptr);
  const auto want = Generate(*fp32_backend, requests, 512);
  for (const KvDtype dtype : kQuantizedTypes) {
    auto backend = MakeBackend(Stories(), 16, blocks, 0, dtype);
    ASSERT_NE(backend, nullptr);
    const auto got = Generate(*backend, requests, 512);
    ASSERT_EQ(got.size(), want.size());
    int same = 0, total = 0;
    std::string prefixes;
    for (size_t i = 0; i < got.size(); ++i) {
      size_t prefix = 0;
      while (prefix < got[i].size() && prefix < want[i].size() && got[i][prefix] == want[i][prefix])
        ++prefix;
      for (size_t k = 0; k < got[i].size() && k < want[i].size(); ++k)
        same += got[i][k] == want[i][k];
      total += static_cast<int>(want[i].size());
      prefixes += (i ? ", " : "") + std::to_string(prefix);
      EXPECT_GE(prefix, 16u) << KvDtypeName(dtype) << " prompt " << i;
    }
    std::printf(
        "stories260K greedy, %s KV cache: the same as fp32 for the first %s of 200 tokens; "
        "%d of %d tokens equal position by position\n",
        KvDtypeName(dtype), prefixes.c_str(), same, total);
  }
}

// fp8 is a CUDA type and an unknown value is no type: both refused at
// creation, saying what the CPU holds.
TEST(CpuBackendTest, RefusesFp8AndUnknownKvCacheTypes) {
  ASSERT_NE(Stories(), nullptr);
  for (const KvDtype bad : {KvDtype::kFp8, static_cast<KvDtype>(42)}) {
    auto backend = CreateCpuBackend(
        Stories(), {.kv_cache = {.block_size = 16, .num_blocks = 4, .dtype = bad}});
    ASSERT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(backend.status().message().find("fp32, bf16, fp16 or int8"), std::string::npos)
        << backend.status();
  }
  auto fp8 = CreateCpuBackend(
      Stories(), {.kv_cache = {.block_size = 16, .num_blocks = 4, .dtype = KvDtype::kFp8}});
  EXPECT_NE(fp8.status().message().find("CUDA"), std::string::npos) << fp8.status();
  EXPECT_FALSE(ParseKvDtype("int4").ok());
  EXPECT_FALSE(ParseKvDtype("FP16").ok());
  EXPECT_EQ(*ParseKvDtype("int8"), KvDtype::kInt8);
}

// What each type takes per token, scales included, and so how many tokens a
// given memory holds: bf16 and fp16 half of fp32, int8 a quarter plus a float
// per KV head (for stories260K's head size of 8 that is 1.5 bytes a value, for
// synthetic:15m's 48 about 1.08).
TEST(CpuBackendTest, KvBytesFollowTheType) {
  for (const std::string name : {"stories260K", "synthetic:15m"}) {
    SCOPED_TRACE(name);
    const std::shared_ptr<const Model> model = name == "stories260K" ? Stories() : Synthetic(name);
    ASSERT_NE(model, nullptr);
    const ModelConfig& c = model->config;
    const int64_t values = int64_t{2} * c.n_layers * c.kv_dim();  // K and V of every layer
    const int64_t want[] = {values * 4, values * 2, values * 2,
                            values + int64_t{2} * c.n_layers * c.n_kv_heads * 4};
    for (size_t i = 0; i < std::size(kAllTypes); ++i) {
      auto backend = MakeBackend(model, 16, 4, 0, kAllTypes[i]);
      ASSERT_NE(backend, nullptr);
      EXPECT_EQ(backend->kv_cache().dtype, kAllTypes[i]);
      EXPECT_EQ(backend->kv_bytes_per_token(), want[i]) << KvDtypeName(kAllTypes[i]);
      EXPECT_EQ(KvBlockBytes(c, 16, kAllTypes[i]), 16 * want[i]) << KvDtypeName(kAllTypes[i]);
    }
  }
  EXPECT_EQ(KvBlockBytes(Stories()->config, 16, KvDtype::kFp32),
            KvBlockBytes(Stories()->config, 16));
}

}  // namespace
}  // namespace coalesce::engine
