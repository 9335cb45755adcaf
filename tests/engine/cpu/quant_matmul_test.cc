// The matrix product with quantized weights (cpu/quant_matmul.h) against its
// definitions: the panels hold every block type as gguf_quant.h's
// DequantizeToFloat reads it (which tests/engine/model holds to PyPI's gguf
// package), the product equals its definition (QuantMatmulReference) bit
// for bit for both instruction sets, one or two threads, and shapes around
// every edge (panel rows, tile heights, the 1024-value block of k), and the
// definition stays within float32's rounding bound of the float32 product
// (MatmulReference) on the dequantized weights.
#include "engine/cpu/quant_matmul.h"

#include <pthread.h>
#include <xmmintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
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

// Rows of X around the tile height (6) and past 48; rows of W around the
// 32-row panel; columns past the 1024-value block of k. One row of X
// against 10 and 17 panels: a thread's panels in two runs read in lockstep,
// and one left over, the last panel part-filled. Two rows of X (the blocks
// straight into both rows' chains) against one and three panels.
const Shape kShapes[] = {{1, 1, 1},   {1, 33, 2},  {2, 31, 1}, {5, 64, 3},  {7, 65, 33},
                         {12, 32, 4}, {13, 40, 1}, {48, 7, 2}, {70, 96, 5}, {1, 100, 40},
                         {1, 300, 3}, {1, 520, 2}, {2, 70, 9}};

// x_scale multiplies the activations: the kernels' codes come times powers
// of two (up to 2^12, and 2^-149 as subnormals) that their scales undo,
// which keeps every bit while the sums stay in float32's normal range.
void CheckProduct(MatmulIsa isa, int threads, CodeFloats codes, float x_scale = 1.0f) {
  ThreadPool pool(threads);
  Rng rng(3);
  for (QuantType type : kTypes) {
    for (const Shape& s : kShapes) {
      // K types have 256-value blocks: fewer of them keep the test quick.
      const int block = QuantBlockSize(type);
      const int k = block * (block == 256 ? (s.blocks + 7) / 8 + 4 : s.blocks);
      const std::vector<uint8_t> data = RandomBlocks(type, s.rows, k, rng.NextU64());
      absl::StatusOr<PackedMatrix> packed =
          PackedMatrix::Pack({.type = type, .rows = s.rows, .cols = k, .data = data.data()});
      ASSERT_TRUE(packed.ok()) << packed.status();
      const int ldx = k + 3, ldy = s.rows + 5;
      std::vector<float> x(static_cast<size_t>(s.m) * ldx);
      // Odd rows 2^20 times smaller: rows of X in different binades.
      for (size_t i = 0; i < x.size(); ++i) {
        const float row = (i / ldx) % 2 == 1 ? 0x1p-20f : 1.0f;
        x[i] = (rng.NextFloat() * 2.0f - 1.0f) * x_scale * row;
      }
      std::vector<float> want(static_cast<size_t>(s.m) * ldy, -1.0f), got = want;
      QuantMatmulReference(x.data(), ldx, s.m, *packed, want.data(), ldy);
      QuantMatmul(pool, x.data(), ldx, s.m, *packed, got.data(), ldy, isa, codes);
      ExpectSameBits(
          want.data(), got.data(), static_cast<int64_t>(want.size()),
          absl::StrCat(QuantTypeName(type), " m=", s.m, " rows=", s.rows, " k=", k,
                       isa == MatmulIsa::kAvx512 ? " AVX-512" : " AVX2", " threads=", threads,
                       " x scale=", x_scale,
                       codes == CodeFloats::kSubnormal ? " subnormal" : " converted", " codes"));
    }
  }
}

TEST(QuantMatmulTest, RowCodesAreTheDequantizedWeights) {
  // dl * q + ml, rounded once, is the file's value (each block formula's
  // products are exact, so the one rounding is the formula's own).
  for (QuantType type : kTypes) {
    const int rows = 40, cols = 2 * QuantBlockSize(type), sub = QuantSubBlockSize(type);
    const std::vector<uint8_t> data = RandomBlocks(type, rows, cols, 6);
    const std::vector<float> want = Dequantized(type, data, int64_t{rows} * cols);
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = rows, .cols = cols, .data = data.data()});
    ASSERT_TRUE(packed.ok()) << packed.status();
    std::vector<float> q(cols), dl(cols / sub), ml(cols / sub);
    for (int r = 0; r < rows; ++r) {
      packed->RowCodes(r, q.data(), dl.data(), ml.data());
      for (int k = 0; k < cols; ++k) {
        ASSERT_EQ(std::fma(dl[k / sub], q[k], ml[k / sub]), want[r * cols + k])
            << QuantTypeName(type) << " row " << r << " k " << k;
      }
    }
  }
}

TEST(QuantMatmulTest, StaysWithinRoundingOfTheFloatProductOnDequantizedWeights) {
  // Both compute sum_k w[k] x[k] in float32; each differs from the exact
  // sum by at most (n + 2) 2^-24 times the sum of its terms' magnitudes (a
  // chain of n fmas; here a chain per sub-block, its scale and offset, and
  // the chain of sub-blocks). A wrong scale, offset or code is off by the
  // size of the terms, not by a rounding.
  ThreadPool pool(2);
  Rng rng(8);
  for (QuantType type : kTypes) {
    const int rows = 50, k = 4 * QuantBlockSize(type), m = 3;
    const int sub = QuantSubBlockSize(type), nsub = k / sub;
    const std::vector<uint8_t> data = RandomBlocks(type, rows, k, rng.NextU64());
    const std::vector<float> w = Dequantized(type, data, int64_t{rows} * k);
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = rows, .cols = k, .data = data.data()});
    ASSERT_TRUE(packed.ok()) << packed.status();
    std::vector<float> x(static_cast<size_t>(m) * k);
    for (float& v : x) v = rng.NextFloat() * 2.0f - 1.0f;
    std::vector<float> want(m * rows), got(m * rows);
    MatmulReference(x.data(), k, m, w.data(), rows, k, want.data(), rows);
    QuantMatmul(pool, x.data(), k, m, *packed, got.data(), rows);
    std::vector<float> q(k), dl(nsub), ml(nsub);
    for (int j = 0; j < rows; ++j) {
      packed->RowCodes(j, q.data(), dl.data(), ml.data());
      for (int i = 0; i < m; ++i) {
        double exact = 0.0, terms = 0.0, factored = 0.0;
        for (int kk = 0; kk < k; ++kk) {
          const double xv = x[i * k + kk];
          exact += double{w[j * k + kk]} * xv;
          terms += std::fabs(double{w[j * k + kk]} * xv);
          factored += std::fabs(double{dl[kk / sub]} * q[kk] * xv) + std::fabs(ml[kk / sub] * xv);
        }
        const double bound = (k + 2) * 0x1p-24 * (terms + factored);
        const double diff = std::fabs(double{got[i * rows + j]} - double{want[i * rows + j]});
        ASSERT_LE(std::fabs(got[i * rows + j] - exact), bound)
            << QuantTypeName(type) << " row " << j << " of X " << i;
        ASSERT_LE(diff, 2 * bound) << QuantTypeName(type) << " row " << j << " of X " << i;
      }
    }
    // And they are not the same computation: some output differs.
    EXPECT_NE(want, got) << QuantTypeName(type);
  }
}

constexpr CodeFloats kCodeFloats[] = {CodeFloats::kConverted, CodeFloats::kSubnormal};

TEST(QuantMatmulTest, EqualsTheDefinitionWithAvx2) {
  for (CodeFloats codes : kCodeFloats) {
    CheckProduct(MatmulIsa::kAvx2, 1, codes);
    CheckProduct(MatmulIsa::kAvx2, 2, codes);
  }
}

TEST(QuantMatmulTest, EqualsTheDefinitionForLargeAndSmallActivations) {
  // 2^100: the subnormal codes' rows scaled by 2^25; 2^105: beyond what
  // they take, so those rows convert.
  for (CodeFloats codes : kCodeFloats) {
    for (float scale : {0x1p64f, 0x1p-64f, 0x1p100f, 0x1p105f}) {
      CheckProduct(BestMatmulIsa(), 2, codes, scale);
    }
  }
}

TEST(QuantMatmulTest, EqualsTheDefinitionWithAvx512) {
  if (BestMatmulIsa() != MatmulIsa::kAvx512) GTEST_SKIP() << "this processor has no AVX-512";
  for (CodeFloats codes : kCodeFloats) {
    CheckProduct(MatmulIsa::kAvx512, 1, codes);
    CheckProduct(MatmulIsa::kAvx512, 2, codes);
  }
}

TEST(QuantMatmulTest, ScalesRowsForSubnormalCodesWhereTheyApply) {
  const int rows = 32, k = 256;
  for (QuantType type : kTypes) {
    const std::vector<uint8_t> data = RandomBlocks(type, rows, k, 6);
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = rows, .cols = k, .data = data.data()});
    ASSERT_TRUE(packed.ok());
    std::vector<float> x(3 * k, 0.25f);
    x[7] = -3.0f;  // largest |x| in [2, 4): s = 124
    x[k + 9] = 0x1p-40f;
    // Q8_0's too (its kernels do not read them): a product of several
    // types with one sub-block size shares them.
    QuantRows one = QuantRowInputs(x.data(), k, 1, *packed, CodeFloats::kSubnormal);
    ASSERT_NE(one.scaled, nullptr) << QuantTypeName(type);
    EXPECT_EQ(one.scaled[7], -3.0f * 0x1p124f);
    EXPECT_EQ(one.scaled[0], 0.25f * 0x1p124f);
    EXPECT_EQ(one.unscale[0], 0x1p25f);
    EXPECT_EQ(QuantRowInputs(x.data(), k, 1, *packed, CodeFloats::kConverted).scaled, nullptr);
    EXPECT_EQ(QuantRowInputs(x.data(), k, 3, *packed, CodeFloats::kSubnormal).scaled, nullptr)
        << "three rows go through the tiles, which convert";
    x[5] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(QuantRowInputs(x.data(), k, 1, *packed, CodeFloats::kSubnormal).scaled, nullptr);
    x[5] = 0x1p104f;
    EXPECT_EQ(QuantRowInputs(x.data(), k, 1, *packed, CodeFloats::kSubnormal).scaled, nullptr);
  }
}

TEST(QuantMatmulTest, SubnormalCodesStayExactWithTheLargestScales) {
  // d = 65504 (f16's largest) in every block and rows of X up to 2^90
  // (scaled by 2^35; the chains multiplied back by 2^114): the same bits.
  ThreadPool pool(1);
  const int rows = 32, k = 256;
  for (QuantType type : {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ4_K, QuantType::kQ6_K}) {
    std::vector<uint8_t> data = RandomBlocks(type, rows, k, 11);
    const int bytes = QuantBlockBytes(type);
    for (size_t at = type == QuantType::kQ6_K ? 208 : 0; at < data.size(); at += bytes) {
      data[at] = 0xff;  // 0x7bff
      data[at + 1] = 0x7b;
    }
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = rows, .cols = k, .data = data.data()});
    ASSERT_TRUE(packed.ok());
    for (float top : {0x1p-90f, 0x1p60f, 0x1p90f}) {
      std::vector<float> x(k);
      for (int kk = 0; kk < k; ++kk) x[kk] = top * static_cast<float>((kk * 37) % 19 - 9) / 9.0f;
      std::vector<float> want(rows), got(rows);
      QuantMatmulReference(x.data(), k, 1, *packed, want.data(), rows);
      QuantMatmul(pool, x.data(), k, 1, *packed, got.data(), rows, BestMatmulIsa(),
                  CodeFloats::kSubnormal);
      for (float v : want) ASSERT_TRUE(std::isfinite(v)) << "the test's own range";
      ExpectSameBits(want.data(), got.data(), rows,
                     absl::StrCat(QuantTypeName(type), " with d = 65504, |x| up to ", top));
    }
  }
}

TEST(QuantMatmulTest, SubnormalCodesStayExactWhereSubnormalsReadAsZero) {
  // A thread with MXCSR's denormals-are-zero set (by some library) would
  // read every subnormal code as 0: the kernels convert there instead.
  ThreadPool pool(1);  // runs on this thread
  const int rows = 64, k = 512;
  Rng rng(9);
  for (QuantType type : {QuantType::kQ4_0, QuantType::kQ4_K, QuantType::kQ6_K}) {
    const std::vector<uint8_t> data = RandomBlocks(type, rows, k, rng.NextU64());
    absl::StatusOr<PackedMatrix> packed =
        PackedMatrix::Pack({.type = type, .rows = rows, .cols = k, .data = data.data()});
    ASSERT_TRUE(packed.ok());
    std::vector<float> x(k);
    for (float& v : x) v = rng.NextFloat() - 0.5f;
    std::vector<float> want(rows), got(rows);
    QuantMatmulReference(x.data(), k, 1, *packed, want.data(), rows);
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x0040);
    QuantMatmul(pool, x.data(), k, 1, *packed, got.data(), rows, BestMatmulIsa(),
                CodeFloats::kSubnormal);
    _mm_setcsr(csr);
    ExpectSameBits(want.data(), got.data(), rows,
                   absl::StrCat(QuantTypeName(type), " with denormals-are-zero"));
  }
}

TEST(QuantMatmulTest, OneRowProductsTakeOneTaskAThreadUnlessSet) {
  EXPECT_EQ(QuantTasksPerThread(1), 1);
  EXPECT_EQ(QuantTasksPerThread(2), 4);
  SetQuantTasksPerThread(3);
  EXPECT_EQ(QuantTasksPerThread(1), 3);
  EXPECT_EQ(QuantTasksPerThread(64), 4);
  SetQuantTasksPerThread(std::nullopt);
  EXPECT_EQ(QuantTasksPerThread(1), 1);
}

TEST(QuantMatmulTest, CodeFloatsCanBeSetAndMeasured) {
  SetQuantCodeFloats(CodeFloats::kConverted);
  EXPECT_EQ(QuantCodeFloats(), CodeFloats::kConverted);
  SetQuantCodeFloats(CodeFloats::kSubnormal);
  EXPECT_EQ(QuantCodeFloats(), CodeFloats::kSubnormal);
  SetQuantCodeFloats(std::nullopt);
  const CodeFloats measured = QuantCodeFloats();
  EXPECT_EQ(QuantCodeFloats(), measured) << "measured once, not each time";
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

TEST(QuantMatmulTest, LeavesRoomForThreadsWithSmallStacks) {
  // A thread's static thread-local storage comes out of its stack: kernel
  // buffers kept there once made a library's 64 KiB threads (civetweb's,
  // the metrics endpoint's) fail to start.
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 64 * 1024), 0);
  pthread_t thread;
  const int started = pthread_create(
      &thread, &attr, [](void*) -> void* { return nullptr; }, nullptr);
  EXPECT_EQ(started, 0) << "a thread with a 64 KiB stack cannot start: " << std::strerror(started);
  if (started == 0) pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
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
