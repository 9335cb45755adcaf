// The CUDA backend, what only it promises: logits against the CPU backend on
// random models of odd shapes (FP32 within 1e-4, half precision close),
// stories260K's greedy goldens in FP32 (exact) and BF16 (agreement reported),
// graphs against eager steps, and the KV cache sized from free memory. The
// contract every backend keeps (bad steps refused without harm, a batch
// against the same requests alone, seeded sampling, prefill == single steps,
// describing itself), in FP32 and BF16, is in backend_contract_test.cc. Skips
// without a GPU.
#include "engine/cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_backend.h"
#include "tests/engine/backend_test_support.h"
#include "tests/engine/cuda/cuda_test_support.h"

namespace coalesce::engine {
namespace {

using testing::Generate;
using testing::GoldenRequests;
using testing::Goldens;
using testing::ReadGoldens;
using testing::RelativeError;
using testing::Request;
using testing::Stories;

// A model of the given shape with random weights (1/sqrt(fan_in) scale),
// norms near 1 and, when the shape has them, biases.
std::shared_ptr<const Model> RandomModel(ModelConfig c, uint32_t seed) {
  c.name = "random";
  c.max_seq_len = 256;
  auto storage = std::make_shared<std::vector<float>>();
  std::vector<std::pair<size_t, size_t>> spans;  // offset, count
  std::vector<float> scales;
  auto add = [&](size_t count, float scale) {
    spans.push_back({storage->size(), count});
    scales.push_back(scale);
    storage->resize(storage->size() + count);
    return spans.size() - 1;
  };
  const size_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  const float sd = 1.0f / std::sqrt(static_cast<float>(d));
  const size_t emb = add(v * d, 1.0f);
  const size_t cls = c.tied_classifier ? emb : add(v * d, sd);
  const size_t fnorm = add(d, -1.0f);
  std::vector<std::vector<size_t>> layer_ids;
  for (int l = 0; l < c.n_layers; ++l) {
    layer_ids.push_back({add(d, -1.0f), add(d * d, sd), add(kv * d, sd), add(kv * d, sd),
                         add(d * d, sd), add(d, -1.0f), add(h * d, sd),
                         add(d * h, 1.0f / std::sqrt(static_cast<float>(h))), add(h * d, sd),
                         add(c.qkv_bias ? d : 0, 0.2f), add(c.qkv_bias ? kv : 0, 0.2f),
                         add(c.qkv_bias ? kv : 0, 0.2f), add(c.o_bias ? d : 0, 0.2f)});
  }
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = 0; j < spans[i].second; ++j) {
      // A negative scale marks a norm: 1 +- 0.2.
      (*storage)[spans[i].first + j] =
          scales[i] < 0 ? 1.0f + 0.2f * uniform(rng) : scales[i] * uniform(rng);
    }
  }
  auto span = [&](size_t id) {
    return std::span<const float>(storage->data() + spans[id].first, spans[id].second);
  };
  Model m;
  m.config = c;
  m.weights.token_embedding = span(emb);
  m.weights.classifier = span(cls);
  m.weights.final_norm = span(fnorm);
  for (const auto& ids : layer_ids) {
    LayerWeights lw{span(ids[0]), span(ids[1]), span(ids[2]), span(ids[3]), span(ids[4]),
                    span(ids[5]), span(ids[6]), span(ids[7]), span(ids[8])};
    lw.bq = span(ids[9]);
    lw.bk = span(ids[10]);
    lw.bv = span(ids[11]);
    lw.bo = span(ids[12]);
    m.weights.layers.push_back(lw);
  }
  m.storage = storage;
  return std::make_shared<const Model>(std::move(m));
}

ModelConfig Shape(int dim, int hidden, int layers, int heads, int kv_heads, int vocab) {
  ModelConfig c;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = vocab;
  return c;
}

std::unique_ptr<Backend> MakeCuda(std::shared_ptr<const Model> model, Precision precision,
                                  int block_size, bool graphs = true, int num_blocks = 512) {
  CudaBackendOptions options;
  options.precision = precision;
  options.block_size = block_size;
  options.num_blocks = num_blocks;
  options.max_batch_tokens = 512;
  options.max_seqs = 16;
  options.cuda_graphs = graphs;
  auto backend = CreateCudaBackend(std::move(model), options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

std::unique_ptr<Backend> MakeCpu(std::shared_ptr<const Model> model, int block_size) {
  auto backend = CreateCpuBackend(
      std::move(model), {.kv_cache = {.block_size = block_size, .num_blocks = 512}, .threads = 2});
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

// ---------------------------------------------------------------------------
// Logits against the CPU backend
// ---------------------------------------------------------------------------

// Runs the same scripted steps on both backends (prefill chunks of two
// sequences, then a third joins, then decodes of all three, every input the
// CPU's greedy pick) and returns the worst relative error of a step's logits.
double WorstLogitError(Backend& cuda, Backend& cpu) {
  const ModelConfig& c = cpu.config();
  const int bs = cpu.kv_cache().block_size, vocab = c.vocab_size;
  const int blocks_each = (64 + bs - 1) / bs;  // the script stays within 64 positions
  std::vector<std::vector<int32_t>> tables(3, std::vector<int32_t>(blocks_each));
  for (int s = 0; s < 3; ++s) std::iota(tables[s].begin(), tables[s].end(), s * blocks_each);
  std::vector<std::vector<int32_t>> seq_tokens = {{1}, {1}, {1}};
  for (int i = 1; i < 40; ++i) {
    for (int s = 0; s < 3; ++s) seq_tokens[s].push_back((i * (31 + 7 * s) + 5 * s) % vocab);
  }
  std::vector<int> cached = {0, 0, 0};
  double worst = 0;
  // (tokens this step for seqs 0, 1, 2); 0 = not in the step.
  const std::vector<std::vector<int>> script = {{13, 3, 0}, {17, 1, 0}, {1, 1, 29}, {1, 1, 1},
                                                {1, 1, 1},  {1, 1, 1},  {1, 1, 1}};
  for (const auto& step : script) {
    std::vector<int32_t> tokens;
    std::vector<SequenceStep> seqs;
    std::vector<int> members;
    for (int s = 0; s < 3; ++s) {
      if (step[s] == 0) continue;
      while (static_cast<int>(seq_tokens[s].size()) < cached[s] + step[s])
        seq_tokens[s].push_back(7);
      tokens.insert(tokens.end(), seq_tokens[s].begin() + cached[s],
                    seq_tokens[s].begin() + cached[s] + step[s]);
      seqs.push_back({step[s], cached[s], tables[s]});
      members.push_back(s);
    }
    std::vector<float> want(seqs.size() * vocab), got(seqs.size() * vocab);
    EXPECT_TRUE(cpu.Step({tokens, seqs}, want).ok());
    const absl::Status status = cuda.Step({tokens, seqs}, got);
    EXPECT_TRUE(status.ok()) << status;
    const double err = RelativeError(got, want);
    if (err > 1e-4) {
      std::printf("  step with %zu tokens in %zu sequences: relative error %.3g\n", tokens.size(),
                  seqs.size(), err);
    }
    worst = std::max(worst, err);
    for (size_t k = 0; k < members.size(); ++k) {
      const int s = members[k];
      cached[s] += step[s];
      // The next input: the CPU's greedy choice, so both see the same tokens.
      const auto row = want.begin() + k * vocab;
      const int32_t pick = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      if (static_cast<int>(seq_tokens[s].size()) <= cached[s]) {
        seq_tokens[s].push_back(pick);
      } else {
        seq_tokens[s][cached[s]] = pick;
      }
    }
  }
  return worst;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { COALESCE_REQUIRE_GPU(); }
};

TEST_F(CudaBackendTest, Fp32LogitsMatchTheCpuBackend) {
  struct Case {
    ModelConfig shape;
    bool tied, qkv_bias, o_bias;
  };
  const Case cases[] = {
      {Shape(72, 200, 2, 6, 2, 333), false, true, true},    // odd sizes, GQA 3, biases
      {Shape(64, 172, 3, 8, 4, 512), true, false, false},   // stories260K-like
      {Shape(96, 160, 2, 3, 1, 1001), false, true, false},  // head size 32, GQA 3
  };
  for (const Case& c : cases) {
    ModelConfig shape = c.shape;
    shape.tied_classifier = c.tied;
    shape.qkv_bias = c.qkv_bias;
    shape.o_bias = c.o_bias;
    const auto model = RandomModel(shape, 7);
    for (const int bs : {1, 5, 16}) {
      SCOPED_TRACE(::testing::Message() << "dim " << shape.dim << " block size " << bs);
      auto cuda = MakeCuda(model, Precision::kFp32, bs);
      auto cpu = MakeCpu(model, bs);
      ASSERT_NE(cuda, nullptr);
      ASSERT_NE(cpu, nullptr);
      const double err = WorstLogitError(*cuda, *cpu);
      std::printf("fp32 logits vs CPU: dim %d bs %d worst relative error %.3g\n", shape.dim, bs,
                  err);
      EXPECT_LT(err, 1e-4);
    }
  }
}

// Variations of one shape, one feature at a time: which feature a mismatch
// follows says where to look.
TEST_F(CudaBackendTest, Fp32LogitsMatchOverShapeVariations) {
  struct Variant {
    const char* name;
    ModelConfig shape;
    bool qkv_bias;
  };
  const Variant variants[] = {
      {"mqa 3x32, bias", Shape(96, 160, 2, 3, 1, 1001), true},
      {"mqa 3x32", Shape(96, 160, 2, 3, 1, 1001), false},
      {"mha 3x32", Shape(96, 160, 2, 3, 3, 1001), false},
      {"gqa 6x16", Shape(96, 160, 2, 6, 2, 1001), false},
      {"mqa 3x32 vocab 333", Shape(96, 160, 2, 3, 1, 333), false},
      {"mqa 2x32", Shape(64, 160, 2, 2, 1, 333), false},
      {"mha 1x32", Shape(32, 64, 1, 1, 1, 333), false},
      {"mha 2x64", Shape(128, 64, 1, 2, 2, 333), false},
      {"mha 4x24", Shape(96, 64, 1, 4, 4, 333), false},
  };
  for (const Variant& v : variants) {
    ModelConfig shape = v.shape;
    shape.qkv_bias = v.qkv_bias;
    const auto model = RandomModel(shape, 11);
    auto cuda = MakeCuda(model, Precision::kFp32, 16);
    auto cpu = MakeCpu(model, 16);
    ASSERT_NE(cuda, nullptr);
    const double err = WorstLogitError(*cuda, *cpu);
    std::printf("fp32 logits vs CPU, %-20s worst relative error %.3g\n", v.name, err);
    EXPECT_LT(err, 1e-4) << v.name;
  }
}

TEST_F(CudaBackendTest, HalfPrecisionLogitsStayCloseToTheCpuBackend) {
  ModelConfig shape = Shape(72, 200, 2, 6, 2, 333);
  shape.qkv_bias = true;
  const auto model = RandomModel(shape, 8);
  for (const Precision p : {Precision::kBf16, Precision::kFp16}) {
    auto cuda = MakeCuda(model, p, 16);
    auto cpu = MakeCpu(model, 16);
    ASSERT_NE(cuda, nullptr);
    const double err = WorstLogitError(*cuda, *cpu);
    std::printf("%s logits vs CPU fp32: worst relative error %.3g\n", PrecisionName(p), err);
    EXPECT_LT(err, p == Precision::kBf16 ? 5e-2 : 1e-2);
  }
}

// ---------------------------------------------------------------------------
// stories260K goldens (golden.json, from llama2.c's run.c)
// ---------------------------------------------------------------------------

TEST_F(CudaBackendTest, Stories260KFp32MatchesTheGoldensExactly) {
  const Goldens g = ReadGoldens();
  ASSERT_EQ(g.prompts.size(), 2u);
  ASSERT_EQ(g.outputs.size(), 2u);
  ASSERT_NE(Stories(), nullptr);
  for (const bool graphs : {true, false}) {
    auto cuda = MakeCuda(Stories(), Precision::kFp32, 16, graphs);
    ASSERT_NE(cuda, nullptr);
    // Alone, then both together; prompts whole and in chunks of 2.
    for (const int chunk : {512, 2}) {
      for (size_t i = 0; i < g.prompts.size(); ++i) {
        const auto out = Generate(*cuda, {GoldenRequests(g)[i]}, chunk);
        EXPECT_EQ(out[0], g.outputs[i]) << "case " << i << " alone, graphs " << graphs;
      }
      const auto both = Generate(*cuda, GoldenRequests(g), chunk);
      EXPECT_EQ(both[0], g.outputs[0]) << "batched, graphs " << graphs;
      EXPECT_EQ(both[1], g.outputs[1]) << "batched, graphs " << graphs;
    }
  }
}

TEST_F(CudaBackendTest, Stories260KBf16AgreementWithTheGoldens) {
  const Goldens g = ReadGoldens();
  ASSERT_EQ(g.prompts.size(), 2u);
  for (const Precision p : {Precision::kBf16, Precision::kFp16}) {
    auto cuda = MakeCuda(Stories(), p, 16);
    ASSERT_NE(cuda, nullptr);
    const auto out = Generate(*cuda, GoldenRequests(g), 512);
    for (size_t i = 0; i < g.outputs.size(); ++i) {
      size_t prefix = 0, same = 0;
      while (prefix < out[i].size() && out[i][prefix] == g.outputs[i][prefix]) ++prefix;
      for (size_t k = 0; k < out[i].size() && k < g.outputs[i].size(); ++k) {
        same += out[i][k] == g.outputs[i][k];
      }
      std::printf(
          "%s stories260K case %zu: first %zu of %zu tokens equal the goldens, %zu "
          "positions equal in all\n",
          PrecisionName(p), i, prefix, g.outputs[i].size(), same);
      RecordProperty(std::string(PrecisionName(p)) + "_case" + std::to_string(i) + "_prefix",
                     static_cast<int>(prefix));
      EXPECT_GE(prefix, 1u) << "not even the first token agrees";
    }
  }
}

// ---------------------------------------------------------------------------
// Graphs, KV cache sizing
// ---------------------------------------------------------------------------

TEST_F(CudaBackendTest, GraphReplayEqualsEagerSteps) {
  // Four sequences decode as the bucket of 4 both ways, so the kernels and
  // cuBLAS calls are the same and the tokens must be identical.
  const Goldens g = ReadGoldens();
  std::vector<Request> requests = GoldenRequests(g);
  requests.push_back({{1, 100, 200}, 60});
  requests.push_back({{1, 300, 301, 302, 303}, 60});
  for (Request& r : requests) r.outputs = 60;
  for (const Precision p : {Precision::kFp32, Precision::kBf16}) {
    auto graphs = MakeCuda(Stories(), p, 16, true);
    auto eager = MakeCuda(Stories(), p, 16, false);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(eager, nullptr);
    EXPECT_EQ(Generate(*graphs, requests, 512), Generate(*eager, requests, 512))
        << PrecisionName(p);
  }
}

// Attention over fixed-size splits (head size 64, splits of 32 positions, so
// up to eight): logits against the CPU backend as a context grows past
// several splits, and graphs (whose split counts are rounded up: 5 to 6, 7 to
// 8) against eager steps (exact counts), token for token. The four requests
// are prefilled in one step and decode together, so both ways run the same
// batch of four.
TEST_F(CudaBackendTest, FixedSizeSplitsAtLongContexts) {
  const auto model = RandomModel(Shape(256, 128, 2, 4, 1, 333), 5);
  ASSERT_EQ(model->config.head_dim(), 64);
  auto make = [&](Precision precision, bool graphs) -> std::unique_ptr<Backend> {
    CudaBackendOptions options;
    options.precision = precision;
    options.block_size = 16;
    options.num_blocks = 128;
    options.max_batch_tokens = 512;
    options.max_seqs = 8;
    options.cuda_graphs = graphs;
    options.attention_split_size = 32;
    auto backend = CreateCudaBackend(model, options);
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? *std::move(backend) : nullptr;
  };
  auto cuda = make(Precision::kFp32, false);
  auto cpu = MakeCpu(model, 16);
  ASSERT_NE(cuda, nullptr);
  ASSERT_NE(cpu, nullptr);
  const int vocab = model->config.vocab_size;
  std::vector<int32_t> table(16);
  std::iota(table.begin(), table.end(), 3);
  std::vector<float> want(vocab), got(vocab);
  double worst = 0;
  int pos = 0, next = 17;
  // A prompt in chunks of 50 (contexts 50, 100, 150, 200), then decode
  // steps to 230.
  while (pos < 230) {
    const int n = pos < 200 ? 50 : 1;
    std::vector<int32_t> tokens(n);
    for (int i = 0; i < n; ++i) tokens[i] = n == 1 ? next : (pos + i) * 7 % vocab;
    const SequenceStep seq = {n, pos, table};
    ASSERT_TRUE(cpu->Step({tokens, {&seq, 1}}, want).ok());
    const absl::Status status = cuda->Step({tokens, {&seq, 1}}, got);
    ASSERT_TRUE(status.ok()) << status;
    worst = std::max(worst, RelativeError(got, want));
    next = static_cast<int32_t>(std::max_element(want.begin(), want.end()) - want.begin());
    pos += n;
  }
  std::printf("fp32 logits vs CPU, splits of 32 to context 230: worst relative error %.3g\n",
              worst);
  EXPECT_LT(worst, 1e-4);

  const std::vector<Request> requests = {{{1, 5, 9}, 100},
                                         {std::vector<int32_t>(150, 11), 100},
                                         {std::vector<int32_t>(60, 4), 100},
                                         {std::vector<int32_t>(100, 8), 100}};
  for (const Precision p : {Precision::kFp32, Precision::kBf16}) {
    auto graphs = make(p, true);
    auto eager = make(p, false);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(eager, nullptr);
    EXPECT_EQ(Generate(*graphs, requests, 256), Generate(*eager, requests, 256))
        << PrecisionName(p);
  }
}

TEST_F(CudaBackendTest, KvCacheSizedFromFreeMemoryAndDescribed) {
  CudaBackendOptions options;
  options.kv_memory_fraction = 0.01;
  auto backend = CreateCudaBackend(Stories(), options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const ModelConfig& c = (*backend)->config();
  EXPECT_EQ((*backend)->kv_bytes_per_token(), 2 * c.n_layers * c.kv_dim() * 2);
  EXPECT_GT((*backend)->kv_cache().num_blocks, 1000);  // 1% of a big GPU, 5 KiB per block
  const std::string text = (*backend)->Describe();
  std::printf("%s\n", text.c_str());
  EXPECT_NE(text.find("bf16"), std::string::npos);
  EXPECT_NE(text.find("tokens"), std::string::npos);
}

}  // namespace
}  // namespace coalesce::engine
