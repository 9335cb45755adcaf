// The contract every Backend keeps (engine/backend.h), one suite run against
// each backend: the CPU backend (with each of its KV cache types), the null
// backend and, in a CUDA build, the CUDA backend in FP32 and in BF16 (without a usable GPU each
// CUDA test skips itself and says why). A backend is a "kind" below: how to create one, and the
// traits where the contract reads differently for it, each with its reason. What only one backend
// promises stays in its own file: cpu_backend_test.cc (block size and thread count),
// null_backend_test.cc (its token function, the ids it avoids), cuda_backend_test.cc (logits
// against the CPU backend, goldens, graph replay, KV sizing from free memory);
// how close the CPU's quantized KV caches stay to float32 is in
// cpu_backend_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model.h"
#include "engine/null/null_backend.h"
#include "engine/precision.h"
#include "engine/sampler.h"
#include "tests/engine/backend_test_support.h"

namespace coalesce::engine {
namespace {

using testing::Generate;
using testing::GoldenRequests;
using testing::Goldens;
using testing::Iota;
using testing::OneByOne;
using testing::Prompt;
using testing::ReadGoldens;
using testing::RelativeError;
using testing::Request;
using testing::SampleStep;
using testing::Stories;
using testing::Synthetic;

// How closely two computations of the same logits must agree. LogitsAgree
// fails an Agreement that bounds nothing, so no check can pass vacuously.
struct Agreement {
  bool bit_identical = false;  // every float equal (==; a NaN fails)
  double max_abs = -1;         // when >= 0: bound on |got - want| of every logit
  double max_relative = -1;    // when >= 0: bound on RelativeError(got, want)
};

::testing::AssertionResult LogitsAgree(std::span<const float> got, std::span<const float> want,
                                       const Agreement& a) {
  if (!a.bit_identical && a.max_abs < 0 && a.max_relative < 0) {
    return ::testing::AssertionFailure() << "the Agreement bounds nothing";
  }
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " logits, want " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (a.bit_identical && !(got[i] == want[i])) {
      return ::testing::AssertionFailure() << std::setprecision(9) << "logit " << i << " is "
                                           << got[i] << ", want " << want[i] << " bit for bit";
    }
    if (a.max_abs >= 0 && !(std::abs(static_cast<double>(got[i]) - want[i]) <= a.max_abs)) {
      return ::testing::AssertionFailure()
             << std::setprecision(9) << "logit " << i << " is " << got[i] << ", want " << want[i]
             << " within " << a.max_abs;
    }
  }
  if (a.max_relative >= 0) {
    const double err = RelativeError(got, want);
    if (!(err <= a.max_relative)) {
      return ::testing::AssertionFailure()
             << "relative error " << err << ", want at most " << a.max_relative;
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// The backends and their traits
// ---------------------------------------------------------------------------
//
// Each kind has:
//   kLabel, kName              its label in messages; what name() returns
//   kNeedsGpu                  skip (saying why) without a usable CUDA device
//   Create(model, kv)          a backend of this kind
//   CreateReference(model, kv) the backend whose logits it must reproduce,
//                              within kReferenceAgreement
//   kCapabilities, DescribeWords(), KvBytesPerToken(config),
//   WeightBytesPerParameter(), kWeightBytesExact    what it says of itself
//   kTakesAModel, kReadsWeights, kRefusesNegativeBlockCount    what it refuses
//   kChunkingAgreement         prefill in one step or in chunks against single
//                              steps
//   kBatchMatesAgreement       a sequence's logits beside other sequences
//                              against alone
//   kShareDecodingAsAlone      the share of requests a batch must decode
//                              exactly as each alone
//   kSamplingFollowsTheDraws   sampled tokens depend on the parameters and
//                              draws (else they are the greedy ones)
//   kSamplesStepLogitsOnTheHost StepAndSample picks exactly what
//                              SampleWithUniform picks from Step's logits

// The CPU backend: float32 on the host, each weight matrix applied by a
// batch-invariant product of our own (cpu_backend.h), so a sequence's logits
// are the same bit for bit whatever shares its step. Its KV cache holds D:
// float32, or bf16, fp16 or int8 dequantized as attention reads it, which
// changes what the logits are (cpu_backend_test.cc bounds how much) but not
// that they are a pure function of the sequence: every contract below holds
// bit for bit with every type.
template <KvDtype D>
struct CpuKind {
  static constexpr const char* kLabel = D == KvDtype::kFp32   ? "Cpu"
                                        : D == KvDtype::kBf16 ? "CpuKvBf16"
                                        : D == KvDtype::kFp16 ? "CpuKvFp16"
                                                              : "CpuKvInt8";
  static constexpr std::string_view kName = "cpu";
  static constexpr bool kNeedsGpu = false;

  static absl::StatusOr<std::unique_ptr<Backend>> Create(std::shared_ptr<const Model> model,
                                                         KvCacheConfig kv) {
    kv.dtype = D;
    return CreateCpuBackend(std::move(model), {.kv_cache = kv});  // a thread per core
  }
  // Another CPU backend with the same KV cache type, fresh: the same
  // arithmetic gives the same bits.
  static absl::StatusOr<std::unique_ptr<Backend>> CreateReference(
      std::shared_ptr<const Model> model, const KvCacheConfig& kv) {
    return Create(std::move(model), kv);
  }
  static constexpr Agreement kReferenceAgreement = {.bit_identical = true};

  static constexpr BackendCapabilities kCapabilities = {.runs_model = true,
                                                        .weights_in_host_memory = true,
                                                        .overlap_pays = true,
                                                        .copies_blocks = true,
                                                        .all_logits = true,
                                                        .samples_on_host = true};
  // "cpu" alone with a float32 cache, as ever; the type otherwise.
  static std::vector<std::string> DescribeWords() {
    if (D == KvDtype::kFp32) return {};
    return {"fp32 weights", std::string("KV cache ") + KvDtypeName(D)};
  }
  // float32 weights; K and V of every layer at D's bytes, and for int8 a
  // float scale per token and KV head.
  static int64_t KvBytesPerToken(const ModelConfig& c) {
    const int element = D == KvDtype::kFp32 ? 4 : D == KvDtype::kInt8 ? 1 : 2;
    const int scale = D == KvDtype::kInt8 ? 4 : 0;
    return int64_t{2} * c.n_layers * (c.kv_dim() * element + c.n_kv_heads * scale);
  }
  static int WeightBytesPerParameter() { return 4; }
  static constexpr bool kWeightBytesExact = true;

  static constexpr bool kTakesAModel = true;
  static constexpr bool kReadsWeights = true;
  static constexpr bool kRefusesNegativeBlockCount = true;

  // 1e-4 is the contract. Both run each row through the same per-row
  // arithmetic (kernels.h), and a prompt's K and V are written to the cache
  // before attention reads them, so the match is in fact exact, whatever the
  // KV cache type.
  static constexpr Agreement kChunkingAgreement = {.max_abs = 1e-4};
  static constexpr Agreement kBatchMatesAgreement = {.bit_identical = true};
  static constexpr double kShareDecodingAsAlone = 1.0;
  static constexpr bool kSamplingFollowsTheDraws = true;
  // Backend's default StepAndSample: Step, then SampleWithUniform.
  static constexpr bool kSamplesStepLogitsOnTheHost = true;
};

// The null backend: no arithmetic. Its "logits" are not a model's: 0 for the
// null token (a function of each sequence's last token and position only)
// and -1e9 for every other id. So they agree bit for bit however a sequence is
// batched or chunked, and every sampler picks the null token whatever its
// parameters and draw.
struct NullKind {
  static constexpr char kLabel[] = "Null";
  static constexpr std::string_view kName = "null";
  static constexpr bool kNeedsGpu = false;

  // Avoiding id 2, stories260K's end of sequence, as the server asks it to.
  static absl::StatusOr<std::unique_ptr<Backend>> Create(std::shared_ptr<const Model> model,
                                                         const KvCacheConfig& kv) {
    return CreateNullBackend(model->config, {.kv_cache = kv, .never_emit = {2}});
  }
  static absl::StatusOr<std::unique_ptr<Backend>> CreateReference(
      std::shared_ptr<const Model> model, const KvCacheConfig& kv) {
    return Create(std::move(model), kv);
  }
  static constexpr Agreement kReferenceAgreement = {.bit_identical = true};

  // No model run, nothing read from host memory, and steps too short for a
  // step thread to pay: what the server asks instead of its name.
  static constexpr BackendCapabilities kCapabilities = {.runs_model = false,
                                                        .weights_in_host_memory = false,
                                                        .overlap_pays = false,
                                                        .copies_blocks = true,
                                                        .all_logits = true,
                                                        .samples_on_host = true};
  static std::vector<std::string> DescribeWords() { return {"NO ARITHMETIC", "meaningless"}; }
  // It holds no KV memory and reads no weights.
  static int64_t KvBytesPerToken(const ModelConfig&) { return 0; }
  static int WeightBytesPerParameter() { return 0; }
  static constexpr bool kWeightBytesExact = true;

  // It is created from a ModelConfig: there is no model to be missing.
  static constexpr bool kTakesAModel = false;
  // It never looks at the weights, so weights that do not match the shape are
  // no reason to refuse: the contract checks that it accepts them and runs.
  static constexpr bool kReadsWeights = false;
  static constexpr bool kRefusesNegativeBlockCount = true;

  static constexpr Agreement kChunkingAgreement = {.bit_identical = true};
  static constexpr Agreement kBatchMatesAgreement = {.bit_identical = true};
  static constexpr double kShareDecodingAsAlone = 1.0;
  // Its tokens ignore the sampling parameters and the draws: the contract
  // checks that sampled tokens are the greedy ones.
  static constexpr bool kSamplingFollowsTheDraws = false;
  // Its StepAndSample samples nothing, but Step's logits make any sampler
  // pick the token it returns.
  static constexpr bool kSamplesStepLogitsOnTheHost = true;
};

#if COALESCE_HAVE_CUDA
// The CUDA backend on device 0, weights and KV cache at precision P. cuBLAS
// picks its kernels by the number of rows in a step (and our skinny product
// takes steps of a few rows), so the order of the sums, and with it the last
// bits of the logits, change with how a sequence is batched and chunked: its
// agreements are relative bounds, not bit-identity. FP32's 1e-4 is the bound
// it keeps against the CPU backend (Fp32LogitsMatchTheCpuBackend); half
// precision is not bit-exact even against itself, and BF16's 5e-2 is the
// bound it keeps against the CPU's float32
// (HalfPrecisionLogitsStayCloseToTheCpuBackend).
template <Precision P>
struct CudaKind {
  static constexpr const char* kLabel = P == Precision::kFp32 ? "CudaFp32" : "CudaBf16";
  static constexpr std::string_view kName = "cuda";
  static constexpr bool kNeedsGpu = true;

  static absl::StatusOr<std::unique_ptr<Backend>> Create(std::shared_ptr<const Model> model,
                                                         const KvCacheConfig& kv) {
    CudaBackendOptions options;
    options.precision = P;
    options.block_size = kv.block_size;
    options.num_blocks = kv.num_blocks;
    options.max_batch_tokens = 512;
    options.max_seqs = 16;
    options.cuda_graphs = true;
    return CreateCudaBackend(std::move(model), options);
  }
  // The CPU backend: what the CUDA backend must compute.
  static absl::StatusOr<std::unique_ptr<Backend>> CreateReference(
      std::shared_ptr<const Model> model, const KvCacheConfig& kv) {
    return CreateCpuBackend(std::move(model), {.kv_cache = kv, .threads = 2});
  }
  static constexpr Agreement kReferenceAgreement =
      P == Precision::kFp32 ? Agreement{.max_relative = 1e-5} : Agreement{.max_relative = 5e-2};

  // Weights in device memory; KV blocks copied on the device.
  static constexpr BackendCapabilities kCapabilities = {.runs_model = true,
                                                        .weights_in_host_memory = false,
                                                        .overlap_pays = true,
                                                        .copies_blocks = true};
  static std::vector<std::string> DescribeWords() {
    return {"cuda: ", std::string(PrecisionName(P)) + " weights"};
  }
  static int64_t KvBytesPerToken(const ModelConfig& c) {
    return int64_t{2} * c.n_layers * c.kv_dim() * PrecisionBytes(P);
  }
  static int WeightBytesPerParameter() { return PrecisionBytes(P); }
  // It counts the matrices a step reads, at P: not the float32 norms, and not
  // an untied embedding, of which a step reads a few rows. So at most the
  // parameters at P.
  static constexpr bool kWeightBytesExact = false;

  static constexpr bool kTakesAModel = true;
  static constexpr bool kReadsWeights = true;
  // num_blocks <= 0 asks it to size the cache from free device memory
  // (KvCacheSizedFromFreeMemoryAndDescribed in cuda_backend_test.cc).
  static constexpr bool kRefusesNegativeBlockCount = false;

  static constexpr Agreement kChunkingAgreement =
      P == Precision::kFp32 ? Agreement{.max_relative = 1e-4} : Agreement{.max_relative = 5e-2};
  static constexpr Agreement kBatchMatesAgreement = kChunkingAgreement;
  // In BF16 a last-bit difference can flip a greedy pick between two
  // near-equal tokens, and the sequences part from there: at least half of
  // the requests must still decode as alone. FP32: all of them.
  static constexpr double kShareDecodingAsAlone = P == Precision::kFp32 ? 1.0 : 0.5;
  static constexpr bool kSamplingFollowsTheDraws = true;
  // It samples on the device (sampling.cu) with its own arithmetic: only the
  // greedy pick is compared with Step's logits.
  static constexpr bool kSamplesStepLogitsOnTheHost = false;
};
#endif  // COALESCE_HAVE_CUDA

template <typename Kind>
class BackendContractTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if constexpr (Kind::kNeedsGpu) {
      COALESCE_REQUIRE_GPU();
    }
  }

  // A backend of this kind for `model`, with num_blocks KV blocks of
  // block_size positions; nullptr (and a failure) when it cannot be made.
  static std::unique_ptr<Backend> Make(std::shared_ptr<const Model> model, int block_size,
                                       int num_blocks) {
    if (model == nullptr) {
      ADD_FAILURE() << "no model";
      return nullptr;
    }
    auto backend =
        Kind::Create(std::move(model), {.block_size = block_size, .num_blocks = num_blocks});
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? *std::move(backend) : nullptr;
  }

  static std::unique_ptr<Backend> MakeReference(std::shared_ptr<const Model> model, int block_size,
                                                int num_blocks) {
    auto backend = Kind::CreateReference(std::move(model),
                                         {.block_size = block_size, .num_blocks = num_blocks});
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? *std::move(backend) : nullptr;
  }
};

}  // namespace
}  // namespace coalesce::engine

// The kinds under short names in the global namespace: gtest prints a
// TypeParam by its qualified name, and gtest_discover_tests names each ctest
// case after it, e.g. "BackendContractTest.RefusesBadStepsAndKeepsWorking<Cpu>".
// (A name generator would rename the gtest cases, "BackendContractTest/Cpu",
// but CMake's discovery reads only numbered typed cases.)
struct Cpu : coalesce::engine::CpuKind<coalesce::engine::KvDtype::kFp32> {};
struct CpuKvBf16 : coalesce::engine::CpuKind<coalesce::engine::KvDtype::kBf16> {};
struct CpuKvFp16 : coalesce::engine::CpuKind<coalesce::engine::KvDtype::kFp16> {};
struct CpuKvInt8 : coalesce::engine::CpuKind<coalesce::engine::KvDtype::kInt8> {};
struct Null : coalesce::engine::NullKind {};
#if COALESCE_HAVE_CUDA
struct CudaFp32 : coalesce::engine::CudaKind<coalesce::engine::Precision::kFp32> {};
struct CudaBf16 : coalesce::engine::CudaKind<coalesce::engine::Precision::kBf16> {};
#endif

namespace coalesce::engine {
namespace {

#if COALESCE_HAVE_CUDA
using BackendKinds =
    ::testing::Types<::Cpu, ::CpuKvBf16, ::CpuKvFp16, ::CpuKvInt8, ::Null, ::CudaFp32, ::CudaBf16>;
#else
using BackendKinds = ::testing::Types<::Cpu, ::CpuKvBf16, ::CpuKvFp16, ::CpuKvInt8, ::Null>;
#endif
TYPED_TEST_SUITE(BackendContractTest, BackendKinds);

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

SequenceStep Seq(int num_tokens, int start_pos, std::span<const int32_t> table) {
  return {.num_tokens = num_tokens, .start_pos = start_pos, .block_table = table};
}

// ---------------------------------------------------------------------------
// What it says of itself, and what it refuses to be created from
// ---------------------------------------------------------------------------

TYPED_TEST(BackendContractTest, DescribesItselfItsCapabilitiesAndItsKvCache) {
  using Kind = TypeParam;
  const std::shared_ptr<const Model> model = Stories();
  auto backend = this->Make(model, 16, 8);
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), Kind::kName);
  // One line for the start-up log, led by the name.
  const std::string text = backend->Describe();
  EXPECT_EQ(text.rfind(backend->name(), 0), 0u) << text;
  for (const std::string& word : Kind::DescribeWords()) {
    EXPECT_NE(text.find(word), std::string::npos) << "\"" << word << "\" not in: " << text;
  }
  const BackendCapabilities caps = backend->capabilities();
  EXPECT_EQ(caps.runs_model, Kind::kCapabilities.runs_model);
  EXPECT_EQ(caps.weights_in_host_memory, Kind::kCapabilities.weights_in_host_memory);
  EXPECT_EQ(caps.overlap_pays, Kind::kCapabilities.overlap_pays);
  EXPECT_EQ(caps.copies_blocks, Kind::kCapabilities.copies_blocks);
  EXPECT_EQ(caps.all_logits, Kind::kCapabilities.all_logits);
  EXPECT_EQ(caps.samples_on_host, Kind::kCapabilities.samples_on_host);

  const ModelConfig& c = backend->config();
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, model->config.max_seq_len);
  EXPECT_EQ(backend->kv_cache().block_size, 16);
  EXPECT_EQ(backend->kv_cache().num_blocks, 8);
  // 5 layers x (K + V) x 16 positions x kv_dim 32 x 4 bytes.
  EXPECT_EQ(KvBlockBytes(c, 16), 5 * 2 * 16 * 32 * 4);
  EXPECT_EQ(backend->kv_bytes_per_token(), Kind::KvBytesPerToken(c));
  const int64_t parameter_bytes = c.num_parameters() * Kind::WeightBytesPerParameter();
  if constexpr (Kind::kWeightBytesExact) {
    EXPECT_EQ(backend->weight_bytes(), parameter_bytes);
  } else {
    EXPECT_GT(backend->weight_bytes(), 0);
    EXPECT_LE(backend->weight_bytes(), parameter_bytes);
  }
}

TYPED_TEST(BackendContractTest, RefusesBadKvCachesAndModels) {
  using Kind = TypeParam;
  const std::shared_ptr<const Model> model = Stories();
  ASSERT_NE(model, nullptr);
  auto code = [](std::shared_ptr<const Model> m, KvCacheConfig kv) {
    return Kind::Create(std::move(m), kv).status().code();
  };
  EXPECT_EQ(code(model, {.block_size = 0, .num_blocks = 4}), kInvalid);
  if constexpr (Kind::kRefusesNegativeBlockCount) {
    EXPECT_EQ(code(model, {.block_size = 16, .num_blocks = -1}), kInvalid);
  }
  if constexpr (Kind::kTakesAModel) {
    EXPECT_EQ(code(nullptr, {.block_size = 16, .num_blocks = 4}), kInvalid);
  }
  // A model of no vocabulary.
  auto no_vocabulary = std::make_shared<Model>(*model);
  no_vocabulary->config.vocab_size = 0;
  EXPECT_EQ(code(no_vocabulary, {.block_size = 16, .num_blocks = 4}), kInvalid);
  // A model whose weights do not match its config.
  auto broken = std::make_shared<Model>(*model);
  broken->weights.layers.pop_back();
  absl::StatusOr<std::unique_ptr<Backend>> from_broken =
      Kind::Create(broken, {.block_size = 16, .num_blocks = 4});
  if constexpr (Kind::kReadsWeights) {
    EXPECT_EQ(from_broken.status().code(), kInvalid);
  } else {
    ASSERT_TRUE(from_broken.ok()) << from_broken.status();
    const std::vector<int32_t> table = {0};
    absl::Status status;
    SampleStep(**from_broken, {1, 403}, {Seq(2, 0, table)}, &status);
    EXPECT_TRUE(status.ok()) << status;
  }
  // And the good version of all that is accepted.
  EXPECT_TRUE(Kind::Create(model, {.block_size = 16, .num_blocks = 4}).ok());
}

// ---------------------------------------------------------------------------
// Bad steps
// ---------------------------------------------------------------------------

// Every bad step is refused with INVALID_ARGUMENT (engine::ValidateStep's
// checks, and the sizes of the outputs) by Step and by StepAndSample alike,
// a block shared only for reading is allowed, and after all that the backend
// still computes what a backend that saw none of it computes.
TYPED_TEST(BackendContractTest, RefusesBadStepsAndKeepsWorking) {
  using Kind = TypeParam;
  const std::shared_ptr<const Model> model = Stories();
  auto backend = this->Make(model, 4, 8);
  ASSERT_NE(backend, nullptr);
  Backend& b = *backend;
  const int vocab = b.config().vocab_size;     // 512
  const int context = b.config().max_seq_len;  // 512
  const int context_blocks = context / 4 + 1;  // more than the context needs
  std::vector<float> logits(2 * vocab);
  const std::vector<int32_t> table = {0, 1, 2};  // positions 0..11
  const std::vector<int32_t> tokens = {1, 5, 7};
  // The valid version of the batch works.
  ASSERT_TRUE(b.Step({tokens, std::vector<SequenceStep>{Seq(3, 0, table)}}, logits).ok());

  const std::vector<int32_t> out_of_range = {0, 8}, negative_block = {-1};
  const std::vector<int32_t> whole_context = Iota(context_blocks);
  const std::vector<int32_t> block_zero(context_blocks, 0);
  struct Case {
    std::string what;
    std::vector<int32_t> tokens;
    std::vector<SequenceStep> seqs;
  };
  const std::vector<Case> cases = {
      {"zero tokens in a sequence", {}, {Seq(0, 0, table)}},
      {"negative start", {1}, {Seq(1, -1, table)}},
      {"more tokens than the sequences hold", tokens, {Seq(2, 0, table)}},
      {"fewer tokens than the sequences hold", {1}, {Seq(2, 0, table)}},
      {"token id == vocabulary size", {1, vocab}, {Seq(2, 0, table)}},
      {"token id far outside the vocabulary", {vocab + 88}, {Seq(1, 0, table)}},
      {"negative token id", {-3}, {Seq(1, 0, table)}},
      {"token id -1", {-1}, {Seq(1, 0, table)}},
      {"position past the context", {1}, {Seq(1, context, whole_context)}},
      {"more tokens than the context (and than a CUDA step may hold)",
       std::vector<int32_t>(context + 1, 1),
       {Seq(context + 1, 0, block_zero)}},
      {"block table too short", {1}, {Seq(1, 12, table)}},
      {"block id == number of blocks", {1}, {Seq(1, 4, out_of_range)}},
      {"negative block id", {1}, {Seq(1, 0, negative_block)}},
      {"two sequences write one block", {1, 2}, {Seq(1, 1, table), Seq(1, 2, table)}},
  };
  for (const Case& c : cases) {
    std::vector<float> out(std::max<size_t>(c.seqs.size(), 1) * vocab);
    const absl::Status step = b.Step({c.tokens, c.seqs}, out);
    EXPECT_EQ(step.code(), kInvalid) << "Step, " << c.what << ": " << step;
    absl::Status sample;
    SampleStep(b, c.tokens, c.seqs, &sample);
    EXPECT_EQ(sample.code(), kInvalid) << "StepAndSample, " << c.what << ": " << sample;
  }
  // Outputs of the wrong size: logits too small for Step; for StepAndSample,
  // not one sampling spec and one output per sequence.
  const std::vector<SequenceStep> one = {Seq(3, 0, table)};
  std::vector<float> small(vocab - 1);
  EXPECT_EQ(b.Step({tokens, one}, small).code(), kInvalid) << "logits too small";
  std::vector<SampleSpec> one_spec(1), two_specs(2);
  std::vector<int32_t> one_out(1), two_out(2);
  EXPECT_EQ(b.StepAndSample({tokens, one}, two_specs, std::span<int32_t>(one_out)).code(), kInvalid)
      << "two sampling specs for one sequence";
  EXPECT_EQ(b.StepAndSample({tokens, one}, one_spec, std::span<int32_t>(two_out)).code(), kInvalid)
      << "two outputs for one sequence";

  // Sharing a block only for reading (a common prefix) is allowed: sequence 1
  // reads block 0, which only sequence 0 writes. (Every position read has
  // been written: a CUDA cache starts uninitialised.)
  const std::vector<int32_t> shares_first = {0, 3}, nines = {9, 9};
  const std::vector<SequenceStep> sharing = {Seq(1, 3, table), Seq(1, 4, shares_first)};
  const absl::Status shared_step = b.Step({nines, sharing}, logits);
  EXPECT_TRUE(shared_step.ok()) << shared_step;
  absl::Status shared_sample;
  SampleStep(b, nines, sharing, &shared_sample);
  EXPECT_TRUE(shared_sample.ok()) << shared_sample;

  // And it still works after all the refused steps, computing what its
  // reference computes.
  auto reference = this->MakeReference(model, 4, 8);
  ASSERT_NE(reference, nullptr);
  const std::vector<int32_t> bos = {1}, fresh = {4, 5};
  const std::vector<SequenceStep> first = {Seq(1, 0, fresh)};
  std::vector<float> got(vocab), want(vocab);
  ASSERT_TRUE(b.Step({bos, first}, got).ok());
  ASSERT_TRUE(reference->Step({bos, first}, want).ok());
  EXPECT_TRUE(LogitsAgree(got, want, Kind::kReferenceAgreement));
  const std::vector<int32_t> other = {3, 4, 5};
  EXPECT_TRUE(b.Step({tokens, std::vector<SequenceStep>{Seq(3, 0, other)}}, logits).ok());
}

// ---------------------------------------------------------------------------
// Equivalences
// ---------------------------------------------------------------------------

// Prefilling N tokens in one step, or in uneven chunks, computes what N
// single-token steps compute.
TYPED_TEST(BackendContractTest, PrefillInOneStepOrInChunksEqualsSingleSteps) {
  using Kind = TypeParam;
  for (const bool synthetic : {false, true}) {
    SCOPED_TRACE(synthetic ? "synthetic:tiny" : "stories260K");
    const std::shared_ptr<const Model> model = synthetic ? Synthetic("synthetic:tiny") : Stories();
    ASSERT_NE(model, nullptr);
    const int vocab = model->config.vocab_size;
    const std::vector<int32_t> prompt = Prompt(23, vocab);
    const std::vector<int32_t> table = {5, 2, 7, 0, 3, 1};  // scattered blocks of 4

    auto single = this->Make(model, 4, 8);
    ASSERT_NE(single, nullptr);
    const auto expected = OneByOne(*single, prompt, table);

    // The whole prompt in one step, and in uneven chunks of 7, 1 and 15.
    for (const std::vector<int>& chunks : std::vector<std::vector<int>>{{23}, {7, 1, 15}}) {
      auto backend = this->Make(model, 4, 8);
      ASSERT_NE(backend, nullptr);
      int start = 0;
      for (const int n : chunks) {
        const SequenceStep seq = Seq(n, start, table);
        std::vector<float> logits(vocab);
        ASSERT_TRUE(
            backend
                ->Step({.tokens = {&prompt[start], static_cast<size_t>(n)}, .seqs = {&seq, 1}},
                       logits)
                .ok());
        start += n;
        ASSERT_TRUE(LogitsAgree(logits, expected[start - 1], Kind::kChunkingAgreement))
            << chunks.size() << " chunks, the one ending at " << start;
      }
    }
  }
}

// A block copied with CopyBlocks continues exactly as the original: two
// sequences that share a prompt's full block, each with its own copy of the
// partly filled last one, then diverge, and each computes the logits it
// computes alone. A backend that cannot copy says so (UNIMPLEMENTED).
TYPED_TEST(BackendContractTest, CopiedBlocksContinueAsTheOriginal) {
  using Kind = TypeParam;
  const std::shared_ptr<const Model> model = Stories();
  ASSERT_NE(model, nullptr);
  const int vocab = model->config.vocab_size;
  auto backend = this->Make(model, 4, 8);
  ASSERT_NE(backend, nullptr);
  const std::vector<BlockCopy> copy = {{.from = 2, .to = 7}};
  if (!backend->capabilities().copies_blocks) {
    EXPECT_EQ(backend->CopyBlocks(copy).code(), absl::StatusCode::kUnimplemented);
    return;
  }
  for (const std::vector<BlockCopy>& bad :
       std::vector<std::vector<BlockCopy>>{{{.from = 8, .to = 1}},
                                           {{.from = 1, .to = -1}},
                                           {{.from = 2, .to = 2}},
                                           {{.from = 2, .to = 7}, {.from = 7, .to = 3}},
                                           {{.from = 2, .to = 7}, {.from = 3, .to = 7}}}) {
    EXPECT_EQ(backend->CopyBlocks(bad).code(), kInvalid) << bad.size() << " copies";
  }
  // Block 7 first holds something else, which the copy must replace.
  const std::vector<int32_t> other = {1, 300, 301, 302};
  const std::vector<int32_t> other_table = {7};
  const SequenceStep other_seq = Seq(4, 0, other_table);
  std::vector<float> logits(vocab);
  ASSERT_TRUE(backend->Step({other, {&other_seq, 1}}, logits).ok());
  // The prompt's six positions: block 5 full, block 2 half.
  const std::vector<int32_t> prompt = Prompt(6, vocab);
  const std::vector<int32_t> table = {5, 2};
  const SequenceStep prefill = Seq(6, 0, table);
  ASSERT_TRUE(backend->Step({prompt, {&prefill, 1}}, logits).ok());
  ASSERT_TRUE(backend->CopyBlocks(copy).ok());

  // Each continues with its own token: the copy first (so a copy that
  // shared memory with its original would spoil the original's positions).
  const std::vector<int32_t> copy_table = {5, 7};
  const int32_t next[] = {77, 123};
  const std::vector<int32_t>* tables[] = {&copy_table, &table};
  auto reference = this->MakeReference(model, 4, 8);
  ASSERT_NE(reference, nullptr);
  for (int i = 0; i < 2; ++i) {
    std::vector<int32_t> tokens = prompt;
    tokens.push_back(next[i]);
    const auto expected = OneByOne(*reference, tokens, {0, 1});
    const SequenceStep decode = Seq(1, 6, *tables[i]);
    ASSERT_TRUE(backend->Step({{&next[i], 1}, {&decode, 1}}, logits).ok());
    EXPECT_TRUE(LogitsAgree(logits, expected[6], Kind::kReferenceAgreement))
        << (i == 0 ? "the copy" : "the original");
  }
}

// With all_logits a sequence gets a row of logits after each of its tokens,
// each what single steps compute there, while a sequence beside it gets its
// one row; StepAndSample still samples from each sequence's last row.
TYPED_TEST(BackendContractTest, AllLogitsGivesARowAfterEveryToken) {
  using Kind = TypeParam;
  const std::shared_ptr<const Model> model = Stories();
  ASSERT_NE(model, nullptr);
  const int vocab = model->config.vocab_size;
  auto backend = this->Make(model, 4, 8);
  ASSERT_NE(backend, nullptr);
  if (!backend->capabilities().all_logits)
    GTEST_SKIP() << "no all_logits: prompt log-probabilities are refused";
  const std::vector<int32_t> a = Prompt(9, vocab), b = {1, 300, 301};
  auto single = this->MakeReference(model, 4, 8);
  ASSERT_NE(single, nullptr);
  const auto a_alone = OneByOne(*single, a, {0, 1, 2});
  const auto b_alone = OneByOne(*single, b, {3});

  std::vector<int32_t> tokens = a;
  tokens.insert(tokens.end(), b.begin(), b.end());
  const std::vector<int32_t> a_table = {5, 2, 7}, b_table = {0};
  std::vector<SequenceStep> seqs = {Seq(9, 0, a_table), Seq(3, 0, b_table)};
  seqs[0].all_logits = true;
  const StepBatch batch{tokens, seqs};
  EXPECT_EQ(LogitRows(batch), 10u);
  std::vector<float> logits(10 * vocab);
  EXPECT_EQ(backend->Step(batch, std::span<float>(logits).first(9 * vocab)).code(), kInvalid);
  ASSERT_TRUE(backend->Step(batch, logits).ok());
  auto row = [&](int r) { return std::span<const float>(logits).subspan(r * vocab, vocab); };
  for (int t = 0; t < 9; ++t) {
    EXPECT_TRUE(LogitsAgree(row(t), a_alone[t], Kind::kReferenceAgreement)) << "row " << t;
  }
  EXPECT_TRUE(LogitsAgree(row(9), b_alone[2], Kind::kReferenceAgreement));

  auto again = this->Make(model, 4, 8);
  ASSERT_NE(again, nullptr);
  absl::Status status;
  const std::vector<int32_t> sampled = SampleStep(*again, tokens, seqs, &status);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(sampled[0], SampleWithUniform(row(8), {}, 0.0f));
  EXPECT_EQ(sampled[1], SampleWithUniform(row(9), {}, 0.0f));
}

// A sequence's logits are the same whether it runs alone or next to other
// sequences (here with the 15m shape, whose matrices are large enough for the
// CPU backend's multi-threaded path).
TYPED_TEST(BackendContractTest, BatchMatesDoNotChangeLogits) {
  using Kind = TypeParam;
  const std::shared_ptr<const Model> model = Synthetic("synthetic:15m");
  ASSERT_NE(model, nullptr);
  const int vocab = model->config.vocab_size;
  const std::vector<int32_t> prompt = Prompt(9, vocab);
  auto alone_backend = this->Make(model, 16, 1);
  ASSERT_NE(alone_backend, nullptr);
  const auto alone = OneByOne(*alone_backend, prompt, {0});

  // Same prompt as sequence 1 of 3, one token per step, while sequence 0
  // prefills 13 tokens per step and sequence 2 decodes.
  auto backend = this->Make(model, 16, 10);
  ASSERT_NE(backend, nullptr);
  const std::vector<int32_t> t0 = {2, 3, 4, 5, 6, 7, 8, 9}, t1 = {0}, t2 = {1};
  std::vector<float> logits(3 * vocab);
  for (int i = 0; i < 9; ++i) {
    std::vector<int32_t> tokens;
    for (int j = 0; j < 13; ++j) tokens.push_back((i * 13 + j) % vocab);
    tokens.push_back(prompt[i]);
    tokens.push_back(42);
    const SequenceStep seqs[] = {Seq(13, 13 * i, t0), Seq(1, i, t1), Seq(1, i, t2)};
    ASSERT_TRUE(backend->Step({tokens, seqs}, logits).ok());
    const std::span<const float> mine = std::span<const float>(logits).subspan(vocab, vocab);
    ASSERT_TRUE(LogitsAgree(mine, alone[i], Kind::kBatchMatesAgreement)) << "step " << i;
  }
}

// The goldens' prompts decoding 40 tokens each, and five more requests that
// join while the others decode.
std::vector<Request> MixedRequests(const Goldens& g) {
  std::vector<Request> requests = GoldenRequests(g);
  for (Request& r : requests) r.outputs = 40;
  for (int i = 0; i < 5; ++i) {
    Request r;
    r.prompt = {1};
    for (int k = 0; k < 3 + 4 * i; ++k) r.prompt.push_back(50 + (k * 37 + i * 11) % 400);
    r.outputs = 20 + 7 * i;
    r.start_step = 2 * i + 1;  // joins while others decode
    requests.push_back(r);
  }
  return requests;
}

// Requests decoded together, prompts in chunks of 6 and joining at different
// steps, produce the tokens each produces alone with its prompt whole.
TYPED_TEST(BackendContractTest, ABatchDecodesEachRequestAsItWouldAlone) {
  using Kind = TypeParam;
  const Goldens g = ReadGoldens();
  ASSERT_EQ(g.prompts.size(), 2u);
  ASSERT_EQ(g.outputs.size(), 2u);
  const std::vector<Request> requests = MixedRequests(g);
  auto backend = this->Make(Stories(), 16, 512);
  ASSERT_NE(backend, nullptr);
  const auto together = Generate(*backend, requests, 6);
  ASSERT_EQ(together.size(), requests.size());
  int equal = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(together[i].size(), static_cast<size_t>(requests[i].outputs)) << "request " << i;
    Request alone = requests[i];
    alone.start_step = 0;
    const auto out = Generate(*backend, {alone}, 512);
    equal += out[0] == together[i];
    if constexpr (Kind::kShareDecodingAsAlone == 1.0) {
      EXPECT_EQ(out[0], together[i]) << "request " << i;
    }
  }
  std::printf("%s: %d of %zu requests decode the same in a batch as alone\n", Kind::kLabel, equal,
              requests.size());
  EXPECT_GE(equal, static_cast<int>(std::ceil(Kind::kShareDecodingAsAlone * requests.size())));
}

// ---------------------------------------------------------------------------
// Sampling
// ---------------------------------------------------------------------------

// The same seeds give the same tokens; another seed, another stream (or, for
// a backend whose tokens ignore the draws, the greedy tokens whatever the
// seed).
TYPED_TEST(BackendContractTest, SeededSamplingIsReproducible) {
  using Kind = TypeParam;
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.prompt = {1, 403, 407};
    r.outputs = 30;
    r.params = {.temperature = 0.9f, .top_k = i % 2 == 0 ? 40 : 0, .top_p = i < 3 ? 0.9f : 1.0f};
    r.seed = 1000 + i;
    requests.push_back(r);
  }
  auto backend = this->Make(Stories(), 16, 512);
  ASSERT_NE(backend, nullptr);
  const int vocab = backend->config().vocab_size;
  const auto a = Generate(*backend, requests, 512);
  const auto b = Generate(*backend, requests, 512);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), requests.size());
  const auto other_seed =
      Generate(*backend, {Request{{1, 403, 407}, 30, 0, requests[0].params, 7}}, 512)[0];
  if constexpr (Kind::kSamplingFollowsTheDraws) {
    EXPECT_NE(a[0], other_seed);  // different seeds give different streams
  } else {
    std::vector<Request> greedy = requests;
    for (Request& r : greedy) r.params = {};
    EXPECT_EQ(a, Generate(*backend, greedy, 512));
    EXPECT_EQ(other_seed, a[0]);
  }
  for (const auto& out : a) {
    EXPECT_EQ(out.size(), 30u);
    for (int32_t t : out) ASSERT_TRUE(t >= 0 && t < vocab) << t;
  }
}

// StepAndSample's greedy pick is the argmax of what Step returns for the same
// batch; and where the backend samples on the host, any sampled pick is what
// SampleWithUniform picks from Step's logits.
TYPED_TEST(BackendContractTest, StepAndSamplePicksWhatSamplingStepsLogitsPicks) {
  using Kind = TypeParam;
  auto backend = this->Make(Stories(), 4, 32);
  ASSERT_NE(backend, nullptr);
  Backend& b = *backend;
  const int vocab = b.config().vocab_size;
  const std::vector<int32_t> t0 = {3}, t1 = {4, 5};
  struct Batch {
    std::vector<int32_t> tokens;
    std::vector<SequenceStep> seqs;
  };
  // Every batch has a sequence of several tokens, so that the CUDA backend
  // runs StepAndSample eagerly, as it runs Step (decode graphs pad the batch).
  const Batch batches[] = {
      {{9, 1, 1, 2, 3, 4, 5}, {Seq(2, 0, t0), Seq(5, 0, t1)}},  // two prompts
      {{7, 6, 8}, {Seq(1, 2, t0), Seq(2, 5, t1)}},              // a decode and a chunk
  };
  const SamplingParams sampling[] = {{},  // greedy: the draw is unused
                                     {.temperature = 1.0f},
                                     {.temperature = 0.7f, .top_p = 0.9f},
                                     {.temperature = 1.5f, .top_k = 5}};
  // (A draw of exactly 0 may take id 0 from the null backend: see null_backend.cc.)
  const float draws[] = {1e-6f, 0.5f, 0.999f};
  for (size_t k = 0; k < std::size(batches); ++k) {
    SCOPED_TRACE(::testing::Message() << "batch " << k);
    const Batch& batch = batches[k];
    absl::Status status;
    const std::vector<int32_t> greedy = SampleStep(b, batch.tokens, batch.seqs, &status);
    ASSERT_TRUE(status.ok()) << status;
    // Running the step again writes the same K and V into the same slots.
    std::vector<float> logits(2 * vocab, 123.0f);
    ASSERT_TRUE(b.Step({batch.tokens, batch.seqs}, logits).ok());
    auto row = [&](size_t s) { return std::span<const float>(logits).subspan(s * vocab, vocab); };
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(SampleWithUniform(row(s), SamplingParams{}, 0.0f), greedy[s]) << "sequence " << s;
    }
    for (const SamplingParams& p : sampling) {
      for (const float u : draws) {
        const std::vector<SampleSpec> specs(2, SampleSpec{.params = p, .uniform = u});
        const std::vector<int32_t> sampled =
            SampleStep(b, batch.tokens, batch.seqs, &status, specs);
        ASSERT_TRUE(status.ok()) << status;
        for (size_t s = 0; s < 2; ++s) {
          SCOPED_TRACE(::testing::Message()
                       << "sequence " << s << ", temperature " << p.temperature << ", top_k "
                       << p.top_k << ", top_p " << p.top_p << ", draw " << u);
          EXPECT_TRUE(sampled[s] >= 0 && sampled[s] < vocab) << sampled[s];
          if (p.temperature == 0.0f) {
            EXPECT_EQ(sampled[s], greedy[s]) << "a greedy pick ignores the draw";
          }
          if constexpr (Kind::kSamplesStepLogitsOnTheHost) {
            EXPECT_EQ(sampled[s], SampleWithUniform(row(s), p, u));
          }
          if constexpr (!Kind::kSamplingFollowsTheDraws) {
            EXPECT_EQ(sampled[s], greedy[s]);
            EXPECT_EQ(SampleWithUniform(row(s), p, u), greedy[s]);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace coalesce::engine
