// Several products of one X in one parallel loop (cpu/products.h): each
// gives the bits of its own kernel alone, for float32 (the model's rows and
// laid out as panels), quantized and int8 weights mixed in one call, one row of X or several, any
// thread count.
#include "engine/cpu/products.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/kv_quant.h"
#include "engine/cpu/matmul_panels.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "tests/engine/cpu/random_blocks.h"

namespace coalesce::engine::cpu {
namespace {

TEST(MatmulTogetherTest, EachProductEqualsItsKernelAlone) {
  Rng rng(5);
  const int k = 512;
  // float32, Q8_0 panels, Q8_0 int8 (or panels), float32 laid out as panels,
  // and Q4_0 and Q6_K panels: the loop computes X's block sums once for
  // Q8_0 and Q4_0 (sub-blocks of 32) and once for Q6_K (of 16).
  constexpr int kProducts = 6;
  const int rows[kProducts] = {200, 96, 1000, 130, 70, 100};
  std::vector<float> f(static_cast<size_t>(rows[0]) * k), f2(static_cast<size_t>(rows[3]) * k);
  for (float& v : f) v = rng.NextFloat() - 0.5f;
  for (float& v : f2) v = rng.NextFloat() - 0.5f;
  auto float_panels = FloatPanels::Pack(f2.data(), rows[3], k);
  ASSERT_TRUE(float_panels.ok());
  const std::vector<uint8_t> q1 = RandomBlocks(QuantType::kQ8_0, rows[1], k, rng.NextU64()),
                             q2 = RandomBlocks(QuantType::kQ8_0, rows[2], k, rng.NextU64()),
                             q4 = RandomBlocks(QuantType::kQ4_0, rows[4], k, rng.NextU64()),
                             q5 = RandomBlocks(QuantType::kQ6_K, rows[5], k, rng.NextU64());
  auto q4_panels =
      PackedMatrix::Pack({.type = QuantType::kQ4_0, .rows = rows[4], .cols = k, .data = q4.data()});
  auto q6_panels =
      PackedMatrix::Pack({.type = QuantType::kQ6_K, .rows = rows[5], .cols = k, .data = q5.data()});
  ASSERT_TRUE(q4_panels.ok());
  ASSERT_TRUE(q6_panels.ok());
  auto panels =
      PackedMatrix::Pack({.type = QuantType::kQ8_0, .rows = rows[1], .cols = k, .data = q1.data()});
  ASSERT_TRUE(panels.ok());
  const QuantizedMatrix third{
      .type = QuantType::kQ8_0, .rows = rows[2], .cols = k, .data = q2.data()};
  auto third_panels = PackedMatrix::Pack(third);
  ASSERT_TRUE(third_panels.ok());
  std::optional<Int8Matrix> third_int8;
  if (Int8DotSupported()) {
    auto packed = Int8Matrix::Pack(third);
    ASSERT_TRUE(packed.ok());
    third_int8 = *std::move(packed);
  }
  const MatmulWeights weights[kProducts] = {
      {.f = f.data()},
      {.panels = &*panels},
      third_int8 ? MatmulWeights{.int8 = &*third_int8} : MatmulWeights{.panels = &*third_panels},
      {.float_panels = &*float_panels},
      {.panels = &*q4_panels},
      {.panels = &*q6_panels}};
  for (const int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (const int m : {1, 5, 47}) {
      const std::string what = absl::StrCat("threads ", threads, " m ", m);
      std::vector<float> x(static_cast<size_t>(m) * (k + 3));
      for (float& v : x) v = rng.NextFloat() * 2.0f - 1.0f;
      std::vector<std::vector<float>> alone(kProducts), together(kProducts);
      std::vector<MatmulProduct> products;
      for (int i = 0; i < kProducts; ++i) {
        alone[i].assign(static_cast<size_t>(m) * (rows[i] + 1), -1.0f);
        together[i] = alone[i];
        products.push_back({weights[i], rows[i], together[i].data(), rows[i] + 1});
      }
      if (weights[0].f != nullptr) {
        Matmul(pool, x.data(), k + 3, m, f.data(), rows[0], k, alone[0].data(), rows[0] + 1);
      }
      QuantMatmul(pool, x.data(), k + 3, m, *panels, alone[1].data(), rows[1] + 1);
      if (third_int8) {
        Int8Matmul(pool, x.data(), k + 3, m, *third_int8, alone[2].data(), rows[2] + 1);
      } else {
        QuantMatmul(pool, x.data(), k + 3, m, *third_panels, alone[2].data(), rows[2] + 1);
      }
      // Laid out as panels, the model's rows' bits.
      Matmul(pool, x.data(), k + 3, m, f2.data(), rows[3], k, alone[3].data(), rows[3] + 1);
      QuantMatmul(pool, x.data(), k + 3, m, *q4_panels, alone[4].data(), rows[4] + 1);
      QuantMatmul(pool, x.data(), k + 3, m, *q6_panels, alone[5].data(), rows[5] + 1);
      Int8Rows scratch;
      MatmulTogether(pool, products, x.data(), k + 3, m, k, scratch);
      for (int i = 0; i < kProducts; ++i) {
        EXPECT_EQ(together[i], alone[i]) << what << " product " << i;
      }
    }
  }
}

TEST(MatmulTogetherTest, SplitsUnitsEvenlyOverTasksAndThreads) {
  // 12 units on 2 threads: 6 tasks of 2 (8 tasks would mix tasks of 1 and
  // 2 units and leave one thread 7 units to the other's 5).
  EXPECT_EQ(EvenTasks(12, 2, 4), 6);
  EXPECT_EQ(EvenTasks(24, 2, 4), 8);
  EXPECT_EQ(EvenTasks(500, 2, 4), 4);
  EXPECT_EQ(EvenTasks(12, 3, 4), 12);
  // No even split: as many tasks as allowed.
  EXPECT_EQ(EvenTasks(7, 2, 4), 7);
  EXPECT_EQ(EvenTasks(3, 2, 4), 3);
  EXPECT_EQ(EvenTasks(1, 2, 4), 1);
}

}  // namespace
}  // namespace coalesce::engine::cpu
