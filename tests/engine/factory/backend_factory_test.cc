// The device rule, the precision rule, the KV cache type rule and the KV
// sizing of --device, --dtype, --kv_cache_dtype and --kv_cache_memory
// (engine/factory/backend_factory.h). Runs without a GPU: the CUDA side is
// checked through the options it would be given.
#include "engine/factory/backend_factory.h"

#include <memory>
#include <vector>

#include "engine/factory/backend_options.h"
#include "engine/model/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::engine {
namespace {

using ::testing::HasSubstr;

// stories260K's end-of-sequence id, which the null backend must never emit.
const std::vector<int32_t> kEos = {2};

BackendSpec Options(Device device, std::optional<Precision> precision = std::nullopt) {
  BackendSpec o;
  o.device = device;
  o.precision = precision;
  return o;
}

std::shared_ptr<const engine::Model> TinyModel() {
  static const auto model = [] {
    absl::StatusOr<engine::Model> m = engine::BuildSyntheticModel("synthetic:tiny");
    EXPECT_TRUE(m.ok()) << m.status();
    return std::make_shared<const engine::Model>(*std::move(m));
  }();
  return model;
}

TEST(KvCacheMemoryTest, ParsesSizesFractionsAndAuto) {
  EXPECT_TRUE(ParseKvCacheMemory("auto")->automatic);
  EXPECT_EQ(ParseKvCacheMemory("512MiB")->bytes, 512LL << 20);
  EXPECT_EQ(ParseKvCacheMemory("2GB")->bytes, 2000000000LL);
  EXPECT_EQ(ParseKvCacheMemory("1048576")->bytes, 1048576);
  EXPECT_DOUBLE_EQ(ParseKvCacheMemory("0.25")->fraction, 0.25);
  for (const char* bad : {"", "lots", "-1", "12parsecs", "0"}) {
    EXPECT_FALSE(ParseKvCacheMemory(bad).ok()) << bad;
  }
}

TEST(KvCacheMemoryTest, AutoIsBoundedByBatchAndByMemory) {
  const KvCacheMemory automatic{.automatic = true};
  // 16 sequences x 128 blocks of 1 KiB = 2 MiB, well under a quarter of 1 GiB.
  EXPECT_EQ(KvCacheBlocks(automatic, 1024, 128, 16, 1LL << 30), 16 * 128);
  // The same with 4 MiB of memory: a quarter (1 MiB) is the limit.
  EXPECT_EQ(KvCacheBlocks(automatic, 1024, 128, 16, 4LL << 20), 1024);
  EXPECT_EQ(KvCacheBlocks({.bytes = 10240}, 1024, 128, 16, 1LL << 30), 10);
  EXPECT_EQ(KvCacheBlocks({.fraction = 0.5}, 1024, 128, 16, 1LL << 20), 512);
}

TEST(PlanBackendTest, AutoTakesTheGpuWhenUsableElseTheCpuAndSaysWhy) {
  absl::StatusOr<BackendPlan> gpu = PlanBackend(Options(Device::kAuto), true, "");
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(gpu->device, Device::kCuda);
  EXPECT_EQ(gpu->precision, Precision::kBf16);
  EXPECT_EQ(gpu->fallback_reason, "");

  absl::StatusOr<BackendPlan> cpu = PlanBackend(Options(Device::kAuto), false, "no CUDA device");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->device, Device::kCpu);
  EXPECT_EQ(cpu->precision, Precision::kFp32);
  EXPECT_EQ(cpu->fallback_reason, "no CUDA device");
}

TEST(PlanBackendTest, CudaWithoutADeviceFailsNamingTheReason) {
  absl::StatusOr<BackendPlan> plan =
      PlanBackend(Options(Device::kCuda), false, "built without CUDA");
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("--device=cuda"));
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("built without CUDA"));
}

TEST(PlanBackendTest, CpuIsTheCpuEvenWithAGpu) {
  absl::StatusOr<BackendPlan> plan = PlanBackend(Options(Device::kCpu), true, "");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->device, Device::kCpu);
  EXPECT_EQ(plan->fallback_reason, "");
}

TEST(PlanBackendTest, DtypeOnCudaIsAnyAndOnTheCpuOnlyFp32) {
  for (Precision p : {Precision::kBf16, Precision::kFp16, Precision::kFp32}) {
    absl::StatusOr<BackendPlan> plan = PlanBackend(Options(Device::kCuda, p), true, "");
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->precision, p);
  }
  EXPECT_TRUE(PlanBackend(Options(Device::kCpu, Precision::kFp32), false, "").ok());
  for (Precision p : {Precision::kBf16, Precision::kFp16}) {
    absl::StatusOr<BackendPlan> plan = PlanBackend(Options(Device::kCpu, p), false, "");
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("fp32 only"));
  }
  // When auto fell back to the CPU, the error says why it did.
  absl::StatusOr<BackendPlan> fallback =
      PlanBackend(Options(Device::kAuto, Precision::kBf16), false, "no CUDA device (driver)");
  EXPECT_EQ(fallback.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fallback.status().message()), HasSubstr("no CUDA device (driver)"));
}

TEST(PlanBackendTest, NullIsTheNullBackendAndTakesNoDtype) {
  for (bool cuda_usable : {false, true}) {
    absl::StatusOr<BackendPlan> plan = PlanBackend(Options(Device::kNull), cuda_usable, "none");
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->device, Device::kNull);
    EXPECT_EQ(plan->fallback_reason, "");
  }
  // It has no precision: any --dtype but auto is a flag error.
  for (Precision p : {Precision::kBf16, Precision::kFp16, Precision::kFp32}) {
    absl::StatusOr<BackendPlan> plan = PlanBackend(Options(Device::kNull, p), true, "");
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("null backend"));
  }
}

TEST(PlanBackendTest, KvCacheDtypeAutoFollowsTheBackend) {
  // auto: fp32 on the CPU (and the null backend), the weights' precision on
  // CUDA.
  EXPECT_EQ(PlanBackend(Options(Device::kCpu), false, "")->kv_dtype, KvDtype::kFp32);
  EXPECT_EQ(PlanBackend(Options(Device::kNull), false, "")->kv_dtype, KvDtype::kFp32);
  EXPECT_EQ(PlanBackend(Options(Device::kCuda), true, "")->kv_dtype, KvDtype::kBf16);
  EXPECT_EQ(PlanBackend(Options(Device::kCuda, Precision::kFp16), true, "")->kv_dtype,
            KvDtype::kFp16);
  EXPECT_EQ(PlanBackend(Options(Device::kAuto), false, "none")->kv_dtype, KvDtype::kFp32);
}

TEST(PlanBackendTest, TheCpuHoldsFp32Bf16Fp16AndInt8ButNotFp8) {
  for (const Device device : {Device::kCpu, Device::kNull, Device::kAuto}) {
    for (const KvDtype dtype : {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kFp16, KvDtype::kInt8}) {
      BackendSpec o = Options(device);
      o.kv_cache_dtype = dtype;
      absl::StatusOr<BackendPlan> plan = PlanBackend(o, false, "no CUDA device");
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->kv_dtype, dtype);
    }
    BackendSpec o = Options(device);
    o.kv_cache_dtype = KvDtype::kFp8;
    absl::StatusOr<BackendPlan> plan = PlanBackend(o, false, "no CUDA device");
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("--kv_cache_dtype=fp8"));
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("CUDA"));
    if (device == Device::kAuto) {
      EXPECT_THAT(std::string(plan.status().message()), HasSubstr("no CUDA device"));
    }
  }
}

// Until the quantized types are built and measured on a GPU, CUDA holds its
// KV cache in its weights' precision only, and says so at start-up.
TEST(PlanBackendTest, CudaHoldsOnlyItsWeightsPrecisionSoFar) {
  for (const Precision p : {Precision::kBf16, Precision::kFp16, Precision::kFp32}) {
    BackendSpec o = Options(Device::kCuda, p);
    o.kv_cache_dtype = engine::KvDtypeOf(p);
    absl::StatusOr<BackendPlan> plan = PlanBackend(o, true, "");
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kv_dtype, engine::KvDtypeOf(p));
    for (const KvDtype other :
         {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kFp16, KvDtype::kInt8, KvDtype::kFp8}) {
      if (other == engine::KvDtypeOf(p)) continue;
      o.kv_cache_dtype = other;
      for (const Device device : {Device::kCuda, Device::kAuto}) {
        o.device = device;
        plan = PlanBackend(o, true, "");
        EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
        const std::string message(plan.status().message());
        EXPECT_THAT(message, HasSubstr(std::string("--kv_cache_dtype=") + KvDtypeName(other)));
        EXPECT_THAT(message, HasSubstr("not built for CUDA yet"));
        if (device == Device::kAuto) {
          EXPECT_THAT(message, HasSubstr("--device=cpu"));
        }
      }
      o.device = Device::kCuda;
      // The backend itself refuses it too, before touching a device.
      engine::CudaBackendOptions cuda;
      cuda.precision = p;
      cuda.kv_cache_dtype = other;
      EXPECT_EQ(engine::CheckCudaKvCacheDtype(cuda).code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(KvSizingTest, BlockBytesFollowThePrecision) {
  const engine::ModelConfig& c = TinyModel()->config;  // 5 layers, kv_dim 32
  ASSERT_EQ(c.n_layers, 5);
  ASSERT_EQ(c.kv_dim(), 32);
  EXPECT_EQ(engine::KvBlockBytes(c, 16, Precision::kBf16), 2 * 5 * 16 * 32 * 2);
  EXPECT_EQ(engine::KvBlockBytes(c, 16, Precision::kFp16), 2 * 5 * 16 * 32 * 2);
  EXPECT_EQ(engine::KvBlockBytes(c, 16, Precision::kFp32), 2 * 5 * 16 * 32 * 4);
  EXPECT_EQ(engine::KvBlockBytes(c, 16), engine::KvBlockBytes(c, 16, Precision::kFp32));
}

TEST(KvSizingTest, CudaAutoAndFractionsAreLeftToTheBackendSizesAreBlocks) {
  const engine::ModelConfig& c = TinyModel()->config;
  BackendSpec o = Options(Device::kCuda);
  o.max_batch_tokens = 512;
  o.max_batch_size = 24;
  o.cuda_graphs = false;
  o.kv_block_size = 16;

  absl::StatusOr<engine::CudaBackendOptions> automatic = CudaOptions(o, c, Precision::kBf16);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ(automatic->num_blocks, 0);
  EXPECT_DOUBLE_EQ(automatic->kv_memory_fraction, 0.9);
  EXPECT_EQ(automatic->precision, Precision::kBf16);
  EXPECT_EQ(automatic->block_size, 16);
  EXPECT_EQ(automatic->max_batch_tokens, 512);
  EXPECT_EQ(automatic->max_seqs, 24);
  EXPECT_FALSE(automatic->cuda_graphs);

  o.kv_cache_memory = "0.5";
  absl::StatusOr<engine::CudaBackendOptions> fraction = CudaOptions(o, c, Precision::kFp16);
  ASSERT_TRUE(fraction.ok());
  EXPECT_EQ(fraction->num_blocks, 0);
  EXPECT_DOUBLE_EQ(fraction->kv_memory_fraction, 0.5);

  // 1 MiB of 10240-byte bf16 blocks (20480 at fp32).
  o.kv_cache_memory = "1MiB";
  EXPECT_EQ(CudaOptions(o, c, Precision::kBf16)->num_blocks, (1 << 20) / 10240);
  EXPECT_EQ(CudaOptions(o, c, Precision::kFp32)->num_blocks, (1 << 20) / 20480);

  o.kv_cache_memory = "1KiB";  // less than one block
  EXPECT_EQ(CudaOptions(o, c, Precision::kBf16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvSizingTest, CpuKeepsItsMeaning) {
  const engine::ModelConfig& c = TinyModel()->config;
  BackendSpec o = Options(Device::kCpu);
  o.threads = 3;
  o.kv_cache_memory = "1MiB";
  absl::StatusOr<engine::CpuBackendOptions> cpu = CpuOptions(o, c, int64_t{1} << 30);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->kv_cache.block_size, 16);
  EXPECT_EQ(cpu->kv_cache.num_blocks, (1 << 20) / 20480);
  EXPECT_EQ(cpu->threads, 3);
  // auto: max_batch_size (16) sequences of the full context (2048 = 128 blocks).
  o.kv_cache_memory = "auto";
  EXPECT_EQ(CpuOptions(o, c, int64_t{1} << 30)->kv_cache.num_blocks, 16 * 128);
  o.kv_cache_memory = "100";
  EXPECT_EQ(CpuOptions(o, c, int64_t{1} << 30).status().code(), absl::StatusCode::kInvalidArgument);
}

// The same memory holds 2x the blocks in bf16 or fp16, and in int8 what a
// byte per value plus a float per token and KV head allow: synthetic:tiny has
// 5 layers and kv_dim 32 in 4 KV heads, so an int8 block of 16 is
// 2 x 5 x 16 x (32 + 4 x 4) = 7680 bytes against fp32's 20480 (2.67x; the
// scales weigh more the smaller the head, 8 here).
TEST(KvSizingTest, CpuBlocksFollowTheKvCacheDtype) {
  const engine::ModelConfig& c = TinyModel()->config;
  BackendSpec o = Options(Device::kCpu);
  o.kv_cache_memory = "1MiB";
  const std::pair<KvDtype, int64_t> cases[] = {{KvDtype::kFp32, 20480},
                                               {KvDtype::kBf16, 10240},
                                               {KvDtype::kFp16, 10240},
                                               {KvDtype::kInt8, 7680}};
  for (const auto& [dtype, block_bytes] : cases) {
    SCOPED_TRACE(engine::KvDtypeName(dtype));
    EXPECT_EQ(engine::KvBlockBytes(c, 16, dtype), block_bytes);
    o.kv_cache_dtype = dtype;
    absl::StatusOr<engine::CpuBackendOptions> cpu = CpuOptions(o, c, int64_t{1} << 30);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    EXPECT_EQ(cpu->kv_cache.num_blocks, (1 << 20) / block_bytes);
    EXPECT_EQ(cpu->kv_cache.dtype, dtype);
    // The backend made from them holds that type, and the null backend
    // accounts for the same blocks.
    absl::StatusOr<std::unique_ptr<engine::Backend>> backend = CreateBackend(o, TinyModel(), kEos);
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->kv_cache().dtype, dtype);
    EXPECT_EQ((*backend)->kv_cache().num_blocks, (1 << 20) / block_bytes);
    EXPECT_EQ((*backend)->kv_bytes_per_token() * 16, block_bytes);
    o.device = Device::kNull;
    absl::StatusOr<std::unique_ptr<engine::Backend>> null = CreateBackend(o, TinyModel(), kEos);
    ASSERT_TRUE(null.ok()) << null.status();
    EXPECT_EQ((*null)->kv_cache().num_blocks, (1 << 20) / block_bytes);
    o.device = Device::kCpu;
  }
  // A size on CUDA counts blocks of the cache's type too (here the weights').
  BackendSpec cuda = Options(Device::kCuda);
  cuda.kv_cache_memory = "1MiB";
  cuda.kv_cache_dtype = KvDtype::kBf16;
  EXPECT_EQ(CudaOptions(cuda, c, Precision::kBf16)->num_blocks, (1 << 20) / 10240);
  EXPECT_EQ(CudaOptions(cuda, c, Precision::kBf16)->kv_cache_dtype, KvDtype::kBf16);
}

TEST(CreateBackendTest, CpuRunsTheCpuBackend) {
  BackendSpec o = Options(Device::kCpu);
  o.kv_cache_memory = "1MiB";
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend = CreateBackend(o, TinyModel(), kEos);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_EQ((*backend)->kv_cache().num_blocks, (1 << 20) / 20480);
}

TEST(CreateBackendTest, NullRunsTheNullBackendWithTheCpusKvAccounting) {
  BackendSpec o = Options(Device::kNull);
  o.kv_cache_memory = "1MiB";
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend = CreateBackend(o, TinyModel(), kEos);
  ASSERT_TRUE(backend.ok()) << backend.status();
  engine::Backend& b = **backend;
  EXPECT_EQ(b.name(), "null");
  EXPECT_THAT(b.Describe(), HasSubstr("NO ARITHMETIC"));
  EXPECT_THAT(b.Describe(), HasSubstr("meaningless"));
  // The blocks the CPU backend would have, none of them held.
  EXPECT_EQ(b.kv_cache().num_blocks, (1 << 20) / 20480);
  EXPECT_EQ(b.kv_bytes_per_token(), 0);
  EXPECT_EQ(b.weight_bytes(), 0);
  absl::StatusOr<engine::NullBackendOptions> null =
      NullOptions(o, TinyModel()->config, int64_t{1} << 30, kEos);
  ASSERT_TRUE(null.ok()) << null.status();
  EXPECT_EQ(null->kv_cache.num_blocks, (1 << 20) / 20480);
  EXPECT_EQ(null->never_emit, kEos);

  // It never emits the tokenizer's EOS id, whatever came before: one sequence
  // decoding through every block of the cache (51 of 16 positions; a random
  // id of the 512 would be EOS about 1.6 times in 816).
  const int num_blocks = b.kv_cache().num_blocks;
  std::vector<int32_t> table(num_blocks);
  for (int i = 0; i < num_blocks; ++i) table[i] = i;
  std::vector<engine::SampleSpec> sampling(1);
  std::vector<int32_t> next(1);
  int32_t token = 1;
  for (int pos = 0; pos < num_blocks * 16; ++pos) {
    const std::vector<int32_t> tokens = {token};
    const std::vector<engine::SequenceStep> seqs = {{1, pos, table}};
    ASSERT_TRUE(b.StepAndSample({tokens, seqs}, sampling, std::span<int32_t>(next)).ok());
    token = next[0];
    ASSERT_NE(token, kEos[0]) << "at position " << pos;
  }

  // A bad --kv_cache_memory is refused as for the CPU.
  o.kv_cache_memory = "100";
  EXPECT_EQ(CreateBackend(o, TinyModel(), kEos).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CreateBackendTest, WithoutAGpuAutoIsTheCpuAndCudaAnError) {
  std::string why;
  if (engine::CudaDeviceUsable(&why)) GTEST_SKIP() << "a CUDA device is usable here";
  BackendSpec o = Options(Device::kAuto);
  o.kv_cache_memory = "1MiB";
  absl::StatusOr<std::unique_ptr<engine::Backend>> automatic = CreateBackend(o, TinyModel(), kEos);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ((*automatic)->name(), "cpu");

  o.device = Device::kCuda;
  absl::StatusOr<std::unique_ptr<engine::Backend>> cuda = CreateBackend(o, TinyModel(), kEos);
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(cuda.status().message()), HasSubstr(why));
}

}  // namespace
}  // namespace coalesce::engine
