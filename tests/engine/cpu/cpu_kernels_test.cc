// The CPU engine's kernels against their scalar definitions, bit for bit:
// the matrix product (both instruction sets, any thread count, any shape and
// row stride) and attention's two inner loops, over a float32 KV cache and
// over bf16, fp16 and int8 ones; and the conversions into those types
// (kv_quant.h) against what they promise: the nearest value with ties to even,
// and int8's scale and error bound.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/cpu/float_panels.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/kv_quant.h"
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
// the row; one row of X (AVX-512's matrix-vector kernel: 16 rows of W at a
// time, k in steps of 16, prefetching 512 values ahead) with rows of W and
// k around those; and up to 12 rows of X (AVX2 reads W straight for
// those: 8 rows at a time, k in steps of 8, in passes of up to 5 rows of
// X) with rows of W around 8, 16 and 32 and k around 8.
const Shape kShapes[] = {
    {1, 1, 1},      {1, 33, 7},      {2, 31, 17},   {5, 32, 64},    {6, 65, 100},   {7, 47, 1023},
    {11, 64, 1024}, {12, 96, 1025},  {13, 100, 33}, {25, 70, 2100}, {48, 7, 40},    {64, 130, 288},
    {70, 29, 515},  {130, 45, 1025}, {1, 16, 16},   {1, 47, 529},   {1, 100, 2100}, {1, 64, 1024},
    {1, 31, 13},    {1, 97, 776},    {1, 200, 9},   {3, 70, 9},     {4, 97, 776},   {3, 15, 40},
    {4, 17, 3},     {2, 8, 8},       {10, 9, 15},   {9, 33, 24}};

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

// Float32 weights laid out as panels (float_panels.h) give the definition's
// bits too: kShapes, and shapes around the laid-out kernels' own edges: one
// row of X against pairs of panels and a last single one (rows of W 33, 65,
// 96, 97), up to 12 rows of X two panels at a time over 64 values of k
// (k 63, 64, 65, 129), and from 13 rows the tile kernel over 1024.
TEST(FloatPanelsTest, ProductEqualsTheDefinition) {
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  for (const Shape& s : {Shape{1, 33, 63}, Shape{1, 65, 64}, Shape{1, 96, 65}, Shape{1, 97, 129},
                         Shape{2, 65, 129}, Shape{12, 97, 65}, Shape{13, 33, 129},
                         Shape{16, 64, 1100}, Shape{12, 130, 1030}, Shape{3, 5, 1}}) {
    shapes.push_back(s);
  }
  for (const int threads : {1, 3}) {
    ThreadPool pool(threads);
    for (const Shape& s : shapes) {
      const int ldx = s.k + 3, ldy = s.n + 5;
      const std::vector<float> x = RandomValues(static_cast<size_t>(s.m) * ldx, 5);
      const std::vector<float> w = RandomValues(static_cast<size_t>(s.n) * s.k, 6);
      std::vector<float> want(static_cast<size_t>(s.m) * ldy, -7.0f), got = want;
      MatmulReference(x.data(), ldx, s.m, w.data(), s.n, s.k, want.data(), ldy);
      absl::StatusOr<FloatPanels> panels = FloatPanels::Pack(w.data(), s.n, s.k);
      ASSERT_TRUE(panels.ok()) << panels.status();
      FloatPanelsMatmul(pool, x.data(), ldx, s.m, *panels, got.data(), ldy);
      ExpectSameBits(want, got,
                     "m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                         std::to_string(s.k) + " threads " + std::to_string(threads));
    }
  }
}

// A run of panels writes its own rows of W's outputs and nothing else, and
// Row gives back the rows the panels were made from.
TEST(FloatPanelsTest, PanelRunsAndRows) {
  const int m = 3, n = 100, k = 70, ldy = n;
  const std::vector<float> x = RandomValues(static_cast<size_t>(m) * k, 7);
  const std::vector<float> w = RandomValues(static_cast<size_t>(n) * k, 8);
  absl::StatusOr<FloatPanels> panels = FloatPanels::Pack(w.data(), n, k);
  ASSERT_TRUE(panels.ok()) << panels.status();
  EXPECT_EQ(panels->num_panels(), 4);
  EXPECT_EQ(panels->bytes(), int64_t{4} * 32 * k * 4);
  std::vector<float> want(static_cast<size_t>(m) * ldy);
  MatmulReference(x.data(), k, m, w.data(), n, k, want.data(), ldy);
  std::vector<float> got(want.size(), -7.0f);
  FloatPanelsMatmulPanels(x.data(), k, m, *panels, 1, 3, got.data(), ldy);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      const float g = got[static_cast<size_t>(i) * ldy + j];
      if (j >= 32 && j < 96) {
        EXPECT_EQ(g, want[static_cast<size_t>(i) * ldy + j]) << "row " << i << " column " << j;
      } else {
        EXPECT_EQ(g, -7.0f) << "row " << i << " column " << j << " is outside panels 1 and 2";
      }
    }
  }
  std::vector<float> row(k);
  for (const int r : {0, 31, 32, 99}) {
    panels->Row(r, row.data());
    EXPECT_TRUE(std::equal(row.begin(), row.end(), w.begin() + static_cast<size_t>(r) * k))
        << "row " << r;
  }
  EXPECT_FALSE(FloatPanels::Pack(w.data(), 0, k).ok());
  EXPECT_FALSE(FloatPanels::Pack(w.data(), n, 0).ok());
  EXPECT_FALSE(FloatPanels::Pack(nullptr, n, k).ok());
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

// ---------------------------------------------------------------------------
// The KV cache's other types
// ---------------------------------------------------------------------------

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Random floats over many binades (2^-20 to 2^14), both signs, and the values
// exactly halfway between two neighbours of a 16-bit type with `mantissa`
// bits, so that rounding is tried on ties as well as on everything else.
std::vector<float> ConversionInputs(int mantissa) {
  Rng rng(11);
  std::vector<float> v;
  for (int i = 0; i < 20000; ++i) {
    const float x = std::ldexp(1.0f + rng.NextFloat(), static_cast<int>(rng.NextFloat() * 34) - 20);
    v.push_back(rng.NextFloat() < 0.5f ? -x : x);
    // A tie: the low 23 - mantissa bits are 100...0.
    const uint32_t drop = 23 - mantissa;
    const uint32_t tie = (Bits(x) & ~((1u << drop) - 1)) | (1u << (drop - 1));
    v.push_back(FromBits(tie));
  }
  return v;
}

// `got` is a value of the 16-bit type nearest to x (its neighbours, one step
// below and above in the type's encoding, are no nearer), and of two equally
// near it is the one with an even encoding. to_float reads an encoding.
template <typename ToFloatFn>
::testing::AssertionResult IsNearestTiesToEven(float x, uint16_t got, ToFloatFn to_float) {
  const double want = x, at = to_float(got);
  for (const int step : {-1, 1}) {
    const uint16_t other = static_cast<uint16_t>(got + step);
    const double there = to_float(other);
    if (std::isnan(there) || std::signbit(there) != std::signbit(at)) continue;
    const double d_at = std::fabs(want - at), d_there = std::fabs(want - there);
    if (d_there < d_at || (d_there == d_at && (got & 1) != 0)) {
      return ::testing::AssertionFailure()
             << x << " became " << at << " (0x" << std::hex << got << "), but " << there << " (0x"
             << other << ") is " << (d_there < d_at ? "nearer" : "as near and even");
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(KvQuantTest, Bf16RoundsToNearestTiesToEven) {
  auto to_float = [](uint16_t bits) { return static_cast<double>(ToFloat(Bf16{bits})); };
  for (const float x : ConversionInputs(7)) {
    ASSERT_TRUE(IsNearestTiesToEven(x, ToBf16(x).bits, to_float));
  }
  // The ties by hand: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  EXPECT_EQ(ToFloat(ToBf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(ToFloat(ToBf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_EQ(ToFloat(ToBf16(-2.5f)), -2.5f);  // exact values stay
  EXPECT_TRUE(std::isnan(ToFloat(ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not become infinity.
  EXPECT_TRUE(std::isnan(ToFloat(ToBf16(FromBits(0x7F800001u)))));
  EXPECT_EQ(ToFloat(ToBf16(INFINITY)), INFINITY);
  EXPECT_EQ(ToFloat(ToBf16(std::numeric_limits<float>::max())), INFINITY);
}

TEST(KvQuantTest, Fp16RoundsToNearestTiesToEven) {
  auto to_float = [](uint16_t bits) { return static_cast<double>(ToFloat(Fp16{bits})); };
  for (const float x : ConversionInputs(10)) {
    if (std::fabs(x) > 65504.0f || std::fabs(x) < 0x1p-14f) continue;  // fp16's normal range
    ASSERT_TRUE(IsNearestTiesToEven(x, ToFp16(x).bits, to_float));
  }
  EXPECT_EQ(ToFloat(ToFp16(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(ToFloat(ToFp16(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);
  EXPECT_EQ(ToFloat(ToFp16(65504.0f)), 65504.0f);
  EXPECT_EQ(ToFloat(ToFp16(65520.0f)), INFINITY);  // the tie above the largest half
  EXPECT_TRUE(std::isnan(ToFloat(ToFp16(std::numeric_limits<float>::quiet_NaN()))));
}

// scale = max|x| / 127; every value comes back within scale / 2 (plus float
// rounding: x / scale is within 127 * 2^-24 of exact, and q * scale rounds
// once more, so 0.5 + 2e-5 of a scale); the largest comes back as +-127.
TEST(KvQuantTest, Int8RoundTripsWithinHalfAScale) {
  for (const int n : {1, 7, 8, 48, 64, 128}) {
    for (const float magnitude : {1e-30f, 1e-3f, 1.0f, 3e4f}) {
      std::vector<float> x = RandomValues(n, 12 + n);
      for (float& v : x) v *= magnitude;
      std::vector<int8_t> q(n, 99);
      const float scale = QuantizeInt8(x.data(), n, q.data());
      float max = 0.0f;
      for (float v : x) max = std::max(max, std::fabs(v));
      ASSERT_EQ(scale, max / 127.0f) << "n " << n << " magnitude " << magnitude;
      bool has_extreme = false;
      for (int i = 0; i < n; ++i) {
        ASSERT_GE(q[i], -127);
        const float back = q[i] * scale;
        ASSERT_LE(std::fabs(back - x[i]), 0.50002f * scale)
            << "n " << n << " magnitude " << magnitude << " element " << i << ": " << x[i]
            << " came back as " << back << " (q " << int{q[i]} << ", scale " << scale << ")";
        has_extreme = has_extreme || std::abs(q[i]) == 127;
      }
      EXPECT_TRUE(has_extreme) << "n " << n;
    }
  }
}

TEST(KvQuantTest, Int8RoundsTiesToEvenAndHandlesZerosAndNonFinite) {
  // max 127: scale exactly 1, so x / scale is x and the ties are exact.
  const float x[] = {127.0f, 2.5f, 3.5f, -2.5f, 0.5f, -0.49f, 1.5f, -127.0f};
  int8_t q[8];
  EXPECT_EQ(QuantizeInt8(x, 8, q), 1.0f);
  const int8_t want[] = {127, 2, 4, -2, 0, 0, 2, -127};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(q[i], want[i]) << x[i];

  const float zeros[4] = {};
  int8_t qz[4] = {1, 2, 3, 4};
  EXPECT_EQ(QuantizeInt8(zeros, 4, qz), 0.0f);
  for (int8_t v : qz) EXPECT_EQ(v, 0);

  // An infinity or a NaN: a NaN scale, so the head reads back as NaN.
  for (const float bad : {INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN()}) {
    const float y[3] = {1.0f, bad, 2.0f};
    int8_t qy[3] = {5, 5, 5};
    EXPECT_TRUE(std::isnan(QuantizeInt8(y, 3, qy))) << bad;
    for (int8_t v : qy) EXPECT_EQ(v, 0);
  }
}

// Rows of a 16-bit or int8 KV cache and the floats they stand for.
struct TypedRows {
  std::vector<Bf16> bf16;
  std::vector<Fp16> fp16;
  std::vector<int8_t> int8;
  std::vector<float> scales;                              // [count] (int8)
  std::vector<float> as_bf16, as_fp16, as_int8_integers;  // [count * stride] the values read
};

TypedRows MakeRows(int count, int stride, int n, uint64_t seed) {
  const std::vector<float> x = RandomValues(static_cast<size_t>(count) * stride, seed);
  TypedRows r;
  for (float v : x) {
    r.bf16.push_back(ToBf16(v));
    r.fp16.push_back(ToFp16(v));
    r.as_bf16.push_back(ToFloat(r.bf16.back()));
    r.as_fp16.push_back(ToFloat(r.fp16.back()));
  }
  r.int8.resize(x.size());
  for (int o = 0; o < count; ++o) {
    r.scales.push_back(QuantizeInt8(&x[static_cast<size_t>(o) * stride], n,
                                    &r.int8[static_cast<size_t>(o) * stride]));
  }
  for (int8_t q : r.int8) r.as_int8_integers.push_back(static_cast<float>(q));
  return r;
}

// The typed kernels are the float32 kernels on the values the rows stand for:
// DotRows is Dot on them (times the row's scale, for int8), bit for bit.
TEST(AttentionKernelsTest, TypedDotRowsEqualDotOnTheDequantizedRows) {
  for (int n : {1, 7, 8, 48, 64, 100}) {
    for (int count : {1, 3, 4, 5, 16}) {
      const int stride = n + 9;
      const std::vector<float> q = RandomValues(n, 5);
      const TypedRows r = MakeRows(count, stride, n, 6);
      const std::string what = "n " + std::to_string(n) + " count " + std::to_string(count);
      std::vector<float> want(count), got(count);
      for (int o = 0; o < count; ++o) want[o] = Dot(q.data(), &r.as_bf16[o * stride], n);
      DotRows(q.data(), r.bf16.data(), stride, count, n, got.data());
      ExpectSameBits(want, got, "bf16 " + what);
      for (int o = 0; o < count; ++o) want[o] = Dot(q.data(), &r.as_fp16[o * stride], n);
      DotRows(q.data(), r.fp16.data(), stride, count, n, got.data());
      ExpectSameBits(want, got, "fp16 " + what);
      for (int o = 0; o < count; ++o) {
        want[o] = Dot(q.data(), &r.as_int8_integers[o * stride], n) * r.scales[o];
      }
      DotRows(q.data(), r.int8.data(), r.scales.data(), stride, count, n, got.data());
      ExpectSameBits(want, got, "int8 " + what);
    }
  }
}

// AccumulateRows is one fma chain per column over the values the rows stand
// for; for int8 each row's weight is first multiplied by its scale.
TEST(AttentionKernelsTest, TypedAccumulateRowsIsOneFmaChainPerColumn) {
  for (int n : {1, 8, 13, 48, 64, 65, 130}) {
    for (int count : {1, 5, 16}) {
      const int stride = n + 3;
      const std::vector<float> weights = RandomValues(count, 7);
      const TypedRows r = MakeRows(count, stride, n, 8);
      const std::vector<float> start = RandomValues(n, 9);
      const std::string what = "n " + std::to_string(n) + " count " + std::to_string(count);
      auto chain = [&](const std::vector<float>& rows, const float* scales) {
        std::vector<float> out = start;
        for (int i = 0; i < n; ++i) {
          for (int o = 0; o < count; ++o) {
            const float w = scales != nullptr ? weights[o] * scales[o] : weights[o];
            out[i] = std::fma(w, rows[o * stride + i], out[i]);
          }
        }
        return out;
      };
      std::vector<float> got = start;
      AccumulateRows(weights.data(), r.bf16.data(), stride, count, n, got.data());
      ExpectSameBits(chain(r.as_bf16, nullptr), got, "bf16 " + what);
      got = start;
      AccumulateRows(weights.data(), r.fp16.data(), stride, count, n, got.data());
      ExpectSameBits(chain(r.as_fp16, nullptr), got, "fp16 " + what);
      got = start;
      AccumulateRows(weights.data(), r.int8.data(), r.scales.data(), stride, count, n, got.data());
      ExpectSameBits(chain(r.as_int8_integers, r.scales.data()), got, "int8 " + what);
    }
  }
}

// The gathered kernels (several queries over rows given by pointers, each
// row read once for two of them) are the one-query kernels called once per
// query on the same rows, bit for bit, for every cache type, odd head sizes
// and row counts, and odd numbers of queries.
TEST(AttentionKernelsTest, GatheredKernelsEqualTheOneQueryKernelsForEachQuery) {
  for (int n : {1, 7, 8, 13, 48, 64, 65, 100}) {
    for (int count : {1, 3, 4, 5, 16, 17, 40}) {
      for (int num : {1, 2, 3, 5}) {
        const int stride = n + 5;
        const TypedRows r = MakeRows(count, stride, n, 11);
        const std::vector<float> f32 = RandomValues(static_cast<size_t>(count) * stride, 11);
        std::vector<std::vector<float>> q, w, start;
        std::vector<const float*> qp, wp;
        for (int i = 0; i < num; ++i) {
          q.push_back(RandomValues(n, 20 + i));
          w.push_back(RandomValues(count, 40 + i));
          start.push_back(RandomValues(n, 60 + i));
        }
        for (int i = 0; i < num; ++i) {
          qp.push_back(q[i].data());
          wp.push_back(w[i].data());
        }
        const std::string what = "n " + std::to_string(n) + " count " + std::to_string(count) +
                                 " queries " + std::to_string(num);
        auto check = [&](const auto& rows, const float* scales, const std::string& type) {
          using T = typename std::decay_t<decltype(rows)>::value_type;
          // The same rows copied to places in reverse order, by pointer.
          std::vector<T> moved(rows.size());
          std::vector<const T*> at(count);
          for (int o = 0; o < count; ++o) {
            const size_t to = static_cast<size_t>(count - 1 - o) * stride;
            std::copy_n(rows.begin() + static_cast<size_t>(o) * stride, stride, moved.begin() + to);
            at[o] = moved.data() + to;
          }
          std::vector<std::vector<float>> want(num, std::vector<float>(count)), got = want;
          std::vector<float*> gp;
          for (int i = 0; i < num; ++i) {
            if (scales != nullptr) {
              if constexpr (std::is_same_v<T, int8_t>) {
                DotRows(q[i].data(), rows.data(), scales, stride, count, n, want[i].data());
              }
            } else if constexpr (!std::is_same_v<T, int8_t>) {
              DotRows(q[i].data(), rows.data(), stride, count, n, want[i].data());
            }
            gp.push_back(got[i].data());
          }
          if constexpr (std::is_same_v<T, int8_t>) {
            DotRowsGathered(qp.data(), num, at.data(), scales, count, n, gp.data());
          } else {
            DotRowsGathered(qp.data(), num, at.data(), count, n, gp.data());
          }
          for (int i = 0; i < num; ++i) ExpectSameBits(want[i], got[i], type + " dot " + what);
          want = start;
          got = start;
          gp.clear();
          for (int i = 0; i < num; ++i) {
            if constexpr (std::is_same_v<T, int8_t>) {
              AccumulateRows(w[i].data(), rows.data(), scales, stride, count, n, want[i].data());
            } else {
              AccumulateRows(w[i].data(), rows.data(), stride, count, n, want[i].data());
            }
            gp.push_back(got[i].data());
          }
          if constexpr (std::is_same_v<T, int8_t>) {
            AccumulateRowsGathered(wp.data(), num, at.data(), scales, count, n, gp.data());
          } else {
            AccumulateRowsGathered(wp.data(), num, at.data(), count, n, gp.data());
          }
          for (int i = 0; i < num; ++i) {
            ExpectSameBits(want[i], got[i], type + " accumulate " + what);
          }
        };
        check(f32, nullptr, "f32");
        check(r.bf16, nullptr, "bf16");
        check(r.fp16, nullptr, "fp16");
        check(r.int8, r.scales.data(), "int8");
      }
    }
  }
}

}  // namespace
}  // namespace coalesce::engine::cpu
