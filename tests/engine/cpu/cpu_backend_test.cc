// CpuBackend: what only the CPU backend has, its options. Results are
// independent of the KV block size and of the thread count. The contract every
// backend keeps (validation, prefill == single steps, batch mates, describing
// itself, sampling) is in backend_contract_test.cc.
#include "engine/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "tests/engine/backend_test_support.h"

namespace coalesce::engine {
namespace {

using testing::Iota;
using testing::OneByOne;
using testing::Prompt;
using testing::Stories;

std::unique_ptr<Backend> MakeBackend(std::shared_ptr<const Model> model, int block_size,
                                     int num_blocks, int threads = 0) {
  auto backend = CreateCpuBackend(
      std::move(model),
      {.kv_cache = {.block_size = block_size, .num_blocks = num_blocks}, .threads = threads});
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

// Block size changes only where K and V live, not what attention computes;
// the thread count changes only who computes which rows.
TEST(CpuBackendTest, BlockSizeAndThreadsDoNotChangeResults) {
  ASSERT_NE(Stories(), nullptr);
  const std::vector<int32_t> prompt = Prompt(20, 512);
  auto reference_backend = MakeBackend(Stories(), 16, 2, 1);
  ASSERT_NE(reference_backend, nullptr);
  const auto reference = OneByOne(*reference_backend, prompt, {0, 1});
  for (const int block_size : {1, 3, 16}) {
    for (const int threads : {1, 2, 3}) {
      const int blocks = (20 + block_size - 1) / block_size;
      auto backend = MakeBackend(Stories(), block_size, blocks, threads);
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

}  // namespace
}  // namespace coalesce::engine
