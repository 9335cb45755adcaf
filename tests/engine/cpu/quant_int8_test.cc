// The int8 numerics of quantized weights (cpu/quant_int8.h): the layout
// dequantizes every row as the file does, both kernels (AVX2, and
// AVX512-VNNI where the processor has it) equal their scalar definition bit
// for bit (any rows, any thread count, shapes around the 16-row group), a
// row's result does not depend on its batch-mates, and the result stays
// close to the float32 product on the dequantized weights (only the
// activations are rounded). Skipped, saying so, on a processor without AVX2.
#include "engine/cpu/quant_int8.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/kv_quant.h"
#include "engine/cpu/thread_pool.h"
#include "engine/model.h"
#include "engine/model/gguf_quant.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "tests/engine/cpu/random_blocks.h"

namespace coalesce::engine::cpu {
namespace {

constexpr QuantType kTypes[] = {QuantType::kQ8_0, QuantType::kQ4_0, QuantType::kQ4_1,
                                QuantType::kQ4_K, QuantType::kQ6_K};

// Columns for a type: `cols` rounded up to its blocks (256 for the K types).
int ColsFor(QuantType type, int cols) {
  const int block = QuantBlockSize(type);
  return (cols + block - 1) / block * block;
}

std::vector<float> RandomRows(int m, int64_t ld, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(m * ld));
  for (float& v : x) v = rng.NextFloat() * 2.0f - 1.0f;
  return x;
}

class Int8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Int8DotSupported()) GTEST_SKIP() << "this processor has no AVX2: not run";
  }
};

// The instruction sets this processor runs; AVX-512 missing is said once.
std::vector<Int8Isa> Isas() {
  if (BestInt8Isa() == Int8Isa::kAvx512Vnni) return {Int8Isa::kAvx2, Int8Isa::kAvx512Vnni};
  static const bool said = [] {
    std::printf("this processor has no AVX512-VNNI: its int8 kernel is not run\n");
    return true;
  }();
  (void)said;
  return {Int8Isa::kAvx2};
}

const char* IsaName(Int8Isa isa) { return isa == Int8Isa::kAvx2 ? "avx2" : "avx512-vnni"; }

TEST_F(Int8Test, EveryRowDequantizesAsTheFileDoes) {
  for (QuantType type : kTypes) {
    const int64_t rows = 37, cols = ColsFor(type, 96);
    const std::vector<uint8_t> data = RandomBlocks(type, rows, cols, 1);
    std::vector<float> want(static_cast<size_t>(rows * cols));
    ASSERT_TRUE(DequantizeToFloat(GgmlTypeOf(type), data.data(), rows * cols, want.data()).ok());
    auto packed = Int8Matrix::Pack({.type = type, .rows = rows, .cols = cols, .data = data.data()});
    ASSERT_TRUE(packed.ok()) << packed.status();
    std::vector<float> row(static_cast<size_t>(cols));
    for (int r = 0; r < rows; ++r) {
      packed->DequantizeRow(r, row.data());
      ASSERT_EQ(std::memcmp(row.data(), want.data() + r * cols, sizeof(float) * cols), 0)
          << QuantTypeName(type) << " row " << r;
    }
  }
}

TEST_F(Int8Test, TheKernelEqualsItsDefinitionAndStaysNearTheFloatProduct) {
  struct Shape {
    int m, rows, cols;
  };
  for (const Int8Isa isa : Isas()) {
    for (const int threads : {1, 2}) {
      ThreadPool pool(threads);
      for (QuantType type : kTypes) {
        for (Shape s : {Shape{1, 1, 32}, Shape{1, 17, 64}, Shape{3, 16, 96}, Shape{7, 33, 320},
                        Shape{1, 300, 768}, Shape{20, 48, 256}, Shape{2, 20, 1024}}) {
          s.cols = ColsFor(type, s.cols);
          const std::string what =
              absl::StrCat(QuantTypeName(type), " m=", s.m, " rows=", s.rows, " cols=", s.cols,
                           " threads=", threads, " ", IsaName(isa));
          const std::vector<uint8_t> data = RandomBlocks(type, s.rows, s.cols, s.rows + s.cols);
          auto packed =
              Int8Matrix::Pack({.type = type, .rows = s.rows, .cols = s.cols, .data = data.data()});
          ASSERT_TRUE(packed.ok()) << packed.status();
          const int64_t ldx = s.cols + 5, ldy = s.rows + 3;
          const std::vector<float> x = RandomRows(s.m, ldx, s.m * 31 + s.cols);
          std::vector<float> want(static_cast<size_t>(s.m * ldy), -7.0f), got = want;
          Int8MatmulReference(x.data(), ldx, s.m, *packed, want.data(), ldy);
          Int8Matmul(pool, x.data(), ldx, s.m, *packed, got.data(), ldy, isa);
          ASSERT_EQ(std::memcmp(want.data(), got.data(), sizeof(float) * want.size()), 0) << what;
          // Against float32 on the dequantized weights: the activations'
          // rounding (half a step of max|x| / 127 per block) bounds the error.
          std::vector<float> w(static_cast<size_t>(s.rows) * s.cols), exact(want.size(), -7.0f);
          ASSERT_TRUE(
              DequantizeToFloat(GgmlTypeOf(type), data.data(), int64_t{s.rows} * s.cols, w.data())
                  .ok());
          MatmulReference(x.data(), ldx, s.m, w.data(), s.rows, s.cols, exact.data(), ldy);
          for (int i = 0; i < s.m; ++i) {
            for (int j = 0; j < s.rows; ++j) {
              double bound = 1e-6;
              for (int k = 0; k < s.cols; ++k) {
                bound += std::fabs(w[static_cast<size_t>(j) * s.cols + k]) * (0.5 / 127 + 1e-6);
              }
              ASSERT_NEAR(got[i * ldy + j], exact[i * ldy + j], bound)
                  << what << " " << i << "," << j;
            }
          }
        }
      }
    }
  }
}

TEST_F(Int8Test, BlocksWithNaNsOrInfinitiesFollowTheDefinitionToo) {
  ThreadPool pool(1);
  const int rows = 16, cols = 128;
  const std::vector<uint8_t> data = RandomBlocks(QuantType::kQ8_0, rows, cols, 12);
  auto packed =
      Int8Matrix::Pack({.type = QuantType::kQ8_0, .rows = rows, .cols = cols, .data = data.data()});
  ASSERT_TRUE(packed.ok());
  std::vector<float> x = RandomRows(3, cols, 13);
  x[5] = std::nanf("");                                   // row 0, block 0
  x[cols + 40] = std::numeric_limits<float>::infinity();  // row 1, block 1
  x[2 * cols + 100] = 1e30f;                              // row 2: huge but finite
  std::vector<float> want(3 * rows), got(3 * rows);
  Int8MatmulReference(x.data(), cols, 3, *packed, want.data(), rows);
  for (const Int8Isa isa : Isas()) {
    Int8Matmul(pool, x.data(), cols, 3, *packed, got.data(), rows, isa);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), sizeof(float) * want.size()), 0) << IsaName(isa);
  }
}

TEST_F(Int8Test, ARowGivesTheSameBitsInAnyBatch) {
  ThreadPool pool(2);
  const int rows = 64, cols = 512;
  const std::vector<uint8_t> data = RandomBlocks(QuantType::kQ4_0, rows, cols, 9);
  auto packed =
      Int8Matrix::Pack({.type = QuantType::kQ4_0, .rows = rows, .cols = cols, .data = data.data()});
  ASSERT_TRUE(packed.ok());
  const std::vector<float> x = RandomRows(33, cols, 10);
  std::vector<float> alone(rows), batch(33 * rows);
  Int8Matmul(pool, x.data(), cols, 1, *packed, alone.data(), rows);
  Int8Matmul(pool, x.data(), cols, 33, *packed, batch.data(), rows);
  EXPECT_EQ(std::memcmp(alone.data(), batch.data(), sizeof(float) * rows), 0);
}

TEST(Int8PackTest, RefusesTypesAndShapesWithoutInt8Kernels) {
  const std::vector<uint8_t> data(4096);
  for (const QuantizedMatrix& m :
       {QuantizedMatrix{.type = QuantType::kQ4_K, .rows = 1, .cols = 288, .data = data.data()},
        QuantizedMatrix{.type = QuantType::kQ6_K, .rows = 2, .cols = 32, .data = data.data()},
        QuantizedMatrix{.type = QuantType::kQ8_0, .rows = 1, .cols = 48, .data = data.data()},
        QuantizedMatrix{.type = QuantType::kQ4_0, .rows = 0, .cols = 32, .data = data.data()}}) {
    EXPECT_EQ(Int8Matrix::Pack(m).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace coalesce::engine::cpu
