// The matrix product with quantized weights (cpu/quant_matmul.h) against its
// definitions, bit for bit: the panels dequantize every block type to what
// gguf_quant.h's DequantizeToFloat gives (which tests/engine/model holds to
// PyPI's gguf package), and the product equals the float32 definition
// (MatmulReference) on those dequantized weights, for both instruction sets,
// one or two threads, and shapes around every edge (panel rows, tile
// heights, the 1024-value block of k).
#include "engine/cpu/quant_matmul.h"

#include <cmath>
#include <cstdint>
#include <cstring>
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

namespace coalesce::engine::cpu {
namespace {

constexpr QuantType kTypes[] = {QuantType::kQ8_0, QuantType::kQ4_0, QuantType::kQ4_1,
                                QuantType::kQ4_K, QuantType::kQ6_K};

void PutHalf(uint8_t* p, float value) {
  const uint16_t bits = ToFp16(value).bits;
  p[0] = static_cast<uint8_t>(bits);
  p[1] = static_cast<uint8_t>(bits >> 8);
}

// A rows x cols matrix of random blocks: random bytes, with every f16 scale
// set to a finite value (a scale of either sign; Q4_1's and Q4_K's mins too).
std::vector<uint8_t> RandomBlocks(QuantType type, int64_t rows, int64_t cols, uint64_t seed) {
  Rng rng(seed);
  const int64_t blocks = rows * cols / QuantBlockSize(type);
  const int bytes = QuantBlockBytes(type);
  std::vector<uint8_t> data(static_cast<size_t>(blocks * bytes));
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng.NextU64());
  auto scale = [&] { return (rng.NextFloat() - 0.5f) * 0.05f; };
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t* b = data.data() + i * bytes;
    switch (type) {
      case QuantType::kQ8_0:
      case QuantType::kQ4_0:
        PutHalf(b, scale());
        break;
      case QuantType::kQ4_1:
      case QuantType::kQ4_K:
        PutHalf(b, scale());
        PutHalf(b + 2, scale());
        break;
      case QuantType::kQ6_K:
        PutHalf(b + 208, scale());
        break;
    }
  }
  return data;
}

std::vector<float> Dequantized(QuantType type, const std::vector<uint8_t>& data, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  EXPECT_TRUE(DequantizeToFloat(GgmlTypeOf(type), data.data(), n, out.data()).ok());
  return out;
}

void ExpectSameBits(const float* want, const float* got, int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(float)) != 0) {
      FAIL() << what << ": element " << i << " is " << got[i] << ", the definition gives "
             << want[i];
    }
  }
}

TEST(QuantMatmulTest, PanelsHoldTheFileBytesPerWeight) {
  for (QuantType type : kTypes) {
    const int block = QuantBlockSize(type);
    // A group is 32 rows of one block each; Q4_K's 6-bit scales and mins
    // take a byte each (8 + 8 instead of 12 bytes).
    const int64_t file = 32 * int64_t{QuantBlockBytes(type)};
    EXPECT_EQ(QuantGroupBytes(type), type == QuantType::kQ4_K ? file + 32 * 4 : file)
        << QuantTypeName(type);
    const std::vector<uint8_t> data = RandomBlocks(type, 33, block * 2, 1);
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = 33, .cols = block * 2, .data = data.data()});
    ASSERT_TRUE(packed.ok()) << packed.status();
    EXPECT_EQ(packed->num_panels(), 2);
    EXPECT_EQ(packed->bytes(), 2 * 2 * QuantGroupBytes(type));
  }
}

TEST(QuantMatmulTest, EveryRowDequantizesAsTheFileDoes) {
  for (QuantType type : kTypes) {
    const int64_t rows = 70, cols = 3 * int64_t{QuantBlockSize(type)};
    const std::vector<uint8_t> data = RandomBlocks(type, rows, cols, 2);
    const std::vector<float> want = Dequantized(type, data, rows * cols);
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = rows, .cols = cols, .data = data.data()});
    ASSERT_TRUE(packed.ok()) << packed.status();
    std::vector<float> row(static_cast<size_t>(cols));
    for (int r = 0; r < rows; ++r) {
      packed->DequantizeRow(r, row.data());
      ExpectSameBits(want.data() + r * cols, row.data(), cols,
                     absl::StrCat(QuantTypeName(type), " row ", r));
    }
  }
}

struct Shape {
  int m, rows, blocks;  // rows of X, rows of W, blocks per row of W
};

// Rows of X around the tile heights (6, 12) and past 48; rows of W around
// the 32-row panel; columns past the 1024-value block of k. One row of X
// against 10 and 17 panels: a thread's panels in 2 to 4 runs read in
// lockstep (the types MatvecRunsFor gives several: up to 4 with AVX-512,
// 2 for Q8_0 with AVX2), the last panel part-filled. Two rows of X (AVX2
// reads the blocks straight into both rows' chains) against one and three
// panels.
const Shape kShapes[] = {{1, 1, 1},   {1, 33, 2},  {2, 31, 1}, {5, 64, 3},  {7, 65, 33},
                         {12, 32, 4}, {13, 40, 1}, {48, 7, 2}, {70, 96, 5}, {1, 100, 40},
                         {1, 300, 3}, {1, 520, 2}, {2, 70, 9}};

void CheckProduct(MatmulIsa isa, int threads) {
  ThreadPool pool(threads);
  Rng rng(3);
  for (QuantType type : kTypes) {
    for (const Shape& s : kShapes) {
      // K types have 256-value blocks: fewer of them keep the test quick.
      const int block = QuantBlockSize(type);
      const int k = block * (block == 256 ? (s.blocks + 7) / 8 + 4 : s.blocks);
      const std::vector<uint8_t> data = RandomBlocks(type, s.rows, k, rng.NextU64());
      const std::vector<float> w = Dequantized(type, data, int64_t{s.rows} * k);
      absl::StatusOr<PackedMatrix> packed =
          PackedMatrix::Pack({.type = type, .rows = s.rows, .cols = k, .data = data.data()});
      ASSERT_TRUE(packed.ok()) << packed.status();
      const int ldx = k + 3, ldy = s.rows + 5;
      std::vector<float> x(static_cast<size_t>(s.m) * ldx);
      for (float& v : x) v = rng.NextFloat() * 2.0f - 1.0f;
      std::vector<float> want(static_cast<size_t>(s.m) * ldy, -1.0f), got = want;
      MatmulReference(x.data(), ldx, s.m, w.data(), s.rows, k, want.data(), ldy);
      QuantMatmul(pool, x.data(), ldx, s.m, *packed, got.data(), ldy, isa);
      ExpectSameBits(
          want.data(), got.data(), static_cast<int64_t>(want.size()),
          absl::StrCat(QuantTypeName(type), " m=", s.m, " rows=", s.rows, " k=", k,
                       isa == MatmulIsa::kAvx512 ? " AVX-512" : " AVX2", " threads=", threads));
    }
  }
}

TEST(QuantMatmulTest, EqualsTheFloatDefinitionWithAvx2) {
  CheckProduct(MatmulIsa::kAvx2, 1);
  CheckProduct(MatmulIsa::kAvx2, 2);
}

TEST(QuantMatmulTest, EqualsTheFloatDefinitionWithAvx512) {
  if (BestMatmulIsa() != MatmulIsa::kAvx512) GTEST_SKIP() << "this processor has no AVX-512";
  CheckProduct(MatmulIsa::kAvx512, 1);
  CheckProduct(MatmulIsa::kAvx512, 2);
}

TEST(QuantMatmulTest, ARowGivesTheSameBitsInAnyBatch) {
  // Row 0 of X alone, and among 40 others: the same outputs.
  ThreadPool pool(2);
  const int rows = 96, k = 512;
  const std::vector<uint8_t> data = RandomBlocks(QuantType::kQ4_1, rows, k, 4);
  absl::StatusOr<PackedMatrix> packed =
      PackedMatrix::Pack({.type = QuantType::kQ4_1, .rows = rows, .cols = k, .data = data.data()});
  ASSERT_TRUE(packed.ok());
  Rng rng(5);
  std::vector<float> x(41 * k);
  for (float& v : x) v = rng.NextFloat() - 0.5f;
  std::vector<float> alone(rows), batch(41 * rows);
  QuantMatmul(pool, x.data(), k, 1, *packed, alone.data(), rows);
  QuantMatmul(pool, x.data(), k, 41, *packed, batch.data(), rows);
  ExpectSameBits(alone.data(), batch.data(), rows, "row 0 alone and in a batch of 41");
}

TEST(QuantMatmulTest, RefusesShapesItCannotTake) {
  const std::vector<uint8_t> data(1024);
  for (const QuantizedMatrix& m :
       {QuantizedMatrix{.type = QuantType::kQ4_0, .rows = 2, .cols = 48, .data = data.data()},
        QuantizedMatrix{.type = QuantType::kQ4_K, .rows = 1, .cols = 128, .data = data.data()},
        QuantizedMatrix{.type = QuantType::kQ8_0, .rows = 0, .cols = 32, .data = data.data()},
        QuantizedMatrix{.type = QuantType::kQ8_0, .rows = 1, .cols = 32, .data = nullptr}}) {
    absl::StatusOr<PackedMatrix> packed = PackedMatrix::Pack(m);
    EXPECT_EQ(packed.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace coalesce::engine::cpu
