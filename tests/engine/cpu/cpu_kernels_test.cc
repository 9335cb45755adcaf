// The CPU engine's kernels against their scalar definitions, bit for bit:
// the matrix product (both instruction sets, any thread count, any shape and
// row stride) and attention's two inner loops.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cpu/kernels.h"
#include "engine/cpu/thread_pool.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"

namespace coalesce::engine::cpu {
namespace {

std::vector<float> RandomValues(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.NextFloat() * 2.0f - 1.0f;
  return v;
}

// Bitwise equality, reported as the first differing element.
void ExpectSameBits(const std::vector<float>& want, const std::vector<float>& got,
                    const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(float)) != 0) {
      FAIL() << what << ": element " << i << " is " << got[i] << ", the definition gives "
             << want[i];
    }
  }
}

struct Shape {
  int m, n, k;
};

// Odd sizes around every edge: rows of X around the tile heights (12 for
// AVX-512, 6 for AVX2) and from 48 on (AVX-512 then runs across rows of X,
// in groups of 64), rows of W around the 32-row panel and the 6-row tile,
// k around the 1024-value block (and k = 1), and a row stride wider than
// the row.
const Shape kShapes[] = {{1, 1, 1},     {1, 33, 7},     {2, 31, 17},    {5, 32, 64},
                         {6, 65, 100},  {7, 47, 1023},  {11, 64, 1024}, {12, 96, 1025},
                         {13, 100, 33}, {25, 70, 2100}, {48, 7, 40},    {64, 130, 288},
                         {70, 29, 515}, {130, 45, 1025}};

void CheckAgainstReference(MatmulIsa isa, int threads) {
  ThreadPool pool(threads);
  for (const Shape& s : kShapes) {
    const int ldx = s.k + 3, ldy = s.n + 5;  // strides wider than the rows
    const std::vector<float> x = RandomValues(static_cast<size_t>(s.m) * ldx, 1);
    const std::vector<float> w = RandomValues(static_cast<size_t>(s.n) * s.k, 2);
    std::vector<float> want(static_cast<size_t>(s.m) * ldy, -7.0f), got = want;
    MatmulReference(x.data(), ldx, s.m, w.data(), s.n, s.k, want.data(), ldy);
    Matmul(pool, x.data(), ldx, s.m, w.data(), s.n, s.k, got.data(), ldy, isa);
    ExpectSameBits(want, got,
                   "m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                       std::to_string(s.k) + " threads " + std::to_string(threads));
  }
}

TEST(MatmulTest, Avx2EqualsTheDefinition) {
  CheckAgainstReference(MatmulIsa::kAvx2, 1);
  CheckAgainstReference(MatmulIsa::kAvx2, 3);
}

TEST(MatmulTest, Avx512EqualsTheDefinition) {
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "this processor has no AVX-512";
  CheckAgainstReference(MatmulIsa::kAvx512, 1);
  CheckAgainstReference(MatmulIsa::kAvx512, 3);
}

// The property the definition buys: a row's result is the same alone and
// in any batch.
TEST(MatmulTest, ARowAloneEqualsTheSameRowInABatch) {
  ThreadPool pool(2);
  const int m = 37, n = 200, k = 300;
  const std::vector<float> x = RandomValues(static_cast<size_t>(m) * k, 3);
  const std::vector<float> w = RandomValues(static_cast<size_t>(n) * k, 4);
  std::vector<float> batch(static_cast<size_t>(m) * n), alone(n);
  Matmul(pool, x.data(), k, m, w.data(), n, k, batch.data(), n);
  for (int i = 0; i < m; ++i) {
    Matmul(pool, x.data() + static_cast<size_t>(i) * k, k, 1, w.data(), n, k, alone.data(), n);
    ExpectSameBits(std::vector<float>(batch.begin() + static_cast<size_t>(i) * n,
                                      batch.begin() + static_cast<size_t>(i + 1) * n),
                   alone, "row " + std::to_string(i));
  }
}

TEST(AttentionKernelsTest, DotRowsEqualsDot) {
  for (int n : {1, 7, 8, 48, 64, 100}) {
    for (int count : {1, 3, 4, 5, 16}) {
      const int stride = n + 9;
      const std::vector<float> q = RandomValues(n, 5);
      const std::vector<float> keys = RandomValues(static_cast<size_t>(count) * stride, 6);
      std::vector<float> want(count), got(count);
      for (int o = 0; o < count; ++o) want[o] = Dot(q.data(), keys.data() + o * stride, n);
      DotRows(q.data(), keys.data(), stride, count, n, got.data());
      ExpectSameBits(want, got, "n " + std::to_string(n) + " count " + std::to_string(count));
    }
  }
}

TEST(AttentionKernelsTest, AccumulateRowsIsOneFmaChainPerColumn) {
  for (int n : {1, 8, 13, 48, 64, 65, 130}) {
    for (int count : {1, 5, 16}) {
      const int stride = n + 3;
      const std::vector<float> weights = RandomValues(count, 7);
      const std::vector<float> rows = RandomValues(static_cast<size_t>(count) * stride, 8);
      std::vector<float> want = RandomValues(n, 9), got = want;
      for (int i = 0; i < n; ++i) {
        for (int o = 0; o < count; ++o)
          want[i] = std::fma(weights[o], rows[o * stride + i], want[i]);
      }
      AccumulateRows(weights.data(), rows.data(), stride, count, n, got.data());
      ExpectSameBits(want, got, "n " + std::to_string(n) + " count " + std::to_string(count));
    }
  }
}

}  // namespace
}  // namespace coalesce::engine::cpu
