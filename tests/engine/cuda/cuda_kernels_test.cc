// Each CUDA kernel (engine/cuda/kernels.h) against the CPU engine's
// arithmetic, in float, half and bfloat16 storage, over odd sizes, GQA
// ratios, block sizes and contexts that cross block boundaries. Outputs are
// poisoned (NaN) before each launch so that an unwritten element fails.
//
// Tolerances, as ||gpu - ref|| / ||ref||: float storage 2e-6 (float
// arithmetic in another order); half 2e-3 and bfloat16 1e-2 (one rounding of
// the output to the storage type; the reference sees the same rounded inputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "engine/cpu/kernels.h"
#include "engine/cuda/kernels.h"
#include "engine/sampler.h"
#include "tests/engine/cuda/cuda_test_support.h"

namespace coalesce::engine {
namespace {

using testing::Convert;
using testing::DeviceArray;
using testing::RandomFloats;
using testing::RelativeError;
using testing::Round;
using testing::ToFloats;

template <typename T>
double Tolerance() {
  if constexpr (std::is_same_v<T, float>) {
    return 2e-6;
  } else if constexpr (std::is_same_v<T, __half>) {
    return 2e-3;
  } else {
    return 1e-2;
  }
}

// The relative size of one rounding step of T.
template <typename T>
float StepOf() {
  if constexpr (std::is_same_v<T, float>) {
    return 0x1.0p-22f;
  } else if constexpr (std::is_same_v<T, __half>) {
    return 0x1.0p-10f;
  } else {
    return 0x1.0p-7f;
  }
}

template <typename T>
class CudaKernelTest : public ::testing::Test {
 protected:
  void SetUp() override { COALESCE_REQUIRE_GPU(); }
  std::mt19937 rng_{1234};
};
using StorageTypes = ::testing::Types<float, __half, __nv_bfloat16>;
TYPED_TEST_SUITE(CudaKernelTest, StorageTypes);

TYPED_TEST(CudaKernelTest, EmbedTokensCopiesRows) {
  using T = TypeParam;
  const int vocab = 37, dim = 65;
  const std::vector<float> table = RandomFloats(vocab * dim, this->rng_);
  const std::vector<int32_t> tokens = {0, 36, 5, 5, 17, 1, 36};
  DeviceArray<T> d_table(Convert<T>(table));
  DeviceArray<int32_t> d_tokens(tokens);
  DeviceArray<float> d_x(tokens.size() * dim);
  d_x.Poison();
  CUDA_ASSERT_OK(
      cuda::EmbedTokens<T>(d_table.get(), d_tokens.get(), tokens.size(), dim, d_x.get(), nullptr));
  const std::vector<float> x = d_x.Download();
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int d = 0; d < dim; ++d) {
      ASSERT_EQ(x[t * dim + d], Round<T>(table[tokens[t] * dim + d]))
          << "token " << t << " d " << d;
    }
  }
}

TYPED_TEST(CudaKernelTest, RmsNormWithResidualBiasAndGather) {
  using T = TypeParam;
  for (const int dim : {1, 7, 64, 257, 4096}) {
    for (const bool gather : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "dim " << dim << " gather " << gather);
      const int rows_in = 6;
      const std::vector<int32_t> pick = {5, 0, 3};  // gathered rows
      const int rows_out = gather ? static_cast<int>(pick.size()) : rows_in;
      std::vector<float> x = RandomFloats(rows_in * dim, this->rng_, -2, 2);
      const std::vector<float> delta = RandomFloats(rows_in * dim, this->rng_);
      const std::vector<float> bias = RandomFloats(dim, this->rng_, -0.1f, 0.1f);
      const std::vector<float> weight = RandomFloats(dim, this->rng_, 0.5f, 1.5f);
      DeviceArray<float> d_x(x), d_delta(delta), d_bias(bias), d_weight(weight);
      DeviceArray<int32_t> d_pick(pick);
      DeviceArray<T> d_out(rows_out * dim);
      d_out.Poison();
      CUDA_ASSERT_OK(cuda::RmsNorm<T>(d_x.get(), d_delta.get(), d_bias.get(), d_weight.get(),
                                      gather ? d_pick.get() : nullptr, rows_out, dim, 1e-5f,
                                      d_out.get(), nullptr));
      const std::vector<float> out = ToFloats(d_out.Download());
      const std::vector<float> x_after = d_x.Download();
      std::vector<float> want(rows_out * dim), want_x(rows_out * dim), got_x(rows_out * dim);
      for (int r = 0; r < rows_out; ++r) {
        const int i = gather ? pick[r] : r;
        for (int d = 0; d < dim; ++d) {
          want_x[r * dim + d] = x[i * dim + d] + delta[i * dim + d] + bias[d];
          got_x[r * dim + d] = x_after[i * dim + d];
        }
        cpu::RmsNorm(&want_x[r * dim], weight.data(), dim, 1e-5f, &want[r * dim]);
      }
      for (float& v : want) v = Round<T>(v);
      EXPECT_LT(RelativeError(got_x, want_x), 1e-7);
      EXPECT_LT(RelativeError(out, want), Tolerance<T>());
    }
  }
}

TYPED_TEST(CudaKernelTest, SwiGlu) {
  using T = TypeParam;
  const int rows = 3, hidden = 1001;
  const std::vector<float> gate_up = RandomFloats(rows * 2 * hidden, this->rng_, -4, 4);
  DeviceArray<float> d_in(gate_up);
  DeviceArray<T> d_out(rows * hidden);
  d_out.Poison();
  CUDA_ASSERT_OK(cuda::SwiGlu<T>(d_in.get(), rows, hidden, d_out.get(), nullptr));
  const std::vector<float> out = ToFloats(d_out.Download());
  std::vector<float> want(rows * hidden);
  for (int t = 0; t < rows; ++t) {
    for (int i = 0; i < hidden; ++i) {
      const float g = gate_up[t * 2 * hidden + i], u = gate_up[t * 2 * hidden + hidden + i];
      want[t * hidden + i] = Round<T>(g * (1.0f / (1.0f + std::exp(-g))) * u);
    }
  }
  EXPECT_LT(RelativeError(out, want), Tolerance<T>());
}

TYPED_TEST(CudaKernelTest, SkinnyGemmMatchesAPlainProductAndIgnoresOtherRows) {
  using T = TypeParam;
  // k = 6144: x no longer fits the kernel's shared-memory staging from a few
  // rows on, so both of its paths run.
  const std::pair<int, int> shapes[] = {{8, 1},     {8, 33},      {72, 1001}, {1000, 1},
                                        {1000, 33}, {1000, 1001}, {6144, 33}};
  for (const auto& [k, out] : shapes) {
    SCOPED_TRACE(::testing::Message() << "k " << k << " out " << out);
    ASSERT_TRUE(cuda::SkinnyGemmSupported<T>(k));
    const std::vector<float> x = RandomFloats(cuda::kMaxSkinnyRows * k, this->rng_);
    const std::vector<float> w = RandomFloats(out * k, this->rng_);
    DeviceArray<T> d_x(Convert<T>(x)), d_w(Convert<T>(w));
    std::vector<float> alone;  // row 0 computed as the only row
    for (int rows = 1; rows <= cuda::kMaxSkinnyRows; ++rows) {
      DeviceArray<float> d_y(rows * out);
      d_y.Poison();
      CUDA_ASSERT_OK(cuda::SkinnyGemm<T>(d_x.get(), rows, k, d_w.get(), out, d_y.get(), nullptr));
      const std::vector<float> y = d_y.Download();
      std::vector<float> want(rows * out);
      for (int r = 0; r < rows; ++r) {
        for (int o = 0; o < out; ++o) {
          double sum = 0;
          for (int i = 0; i < k; ++i)
            sum += double{Round<T>(x[r * k + i])} * Round<T>(w[o * k + i]);
          want[r * out + o] = static_cast<float>(sum);
        }
      }
      EXPECT_LT(RelativeError(y, want), 1e-5) << rows << " rows";
      if (rows == 1) alone.assign(y.begin(), y.begin() + out);
      // Row 0 is the same bits whatever else is in the product.
      EXPECT_TRUE(std::equal(alone.begin(), alone.end(), y.begin())) << rows << " rows";
    }
  }
}

// The paged layout shared by the RoPE and attention tests: sequences of
// given lengths, each with its own blocks drawn at random from a pool.
struct PagedLayout {
  int block_size = 0;
  int max_blocks_per_seq = 0;
  int num_blocks = 0;
  std::vector<int32_t> block_tables;  // [seqs, max_blocks_per_seq]

  PagedLayout(const std::vector<int>& lengths, int block_size_in, std::mt19937& rng)
      : block_size(block_size_in) {
    for (int len : lengths) {
      max_blocks_per_seq = std::max(max_blocks_per_seq, (len + block_size - 1) / block_size);
    }
    num_blocks = static_cast<int>(lengths.size()) * max_blocks_per_seq + 3;
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    block_tables.assign(lengths.size() * max_blocks_per_seq, -1);
    size_t next = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
      for (int b = 0; b * block_size < lengths[s]; ++b) {
        block_tables[s * max_blocks_per_seq + b] = ids[next++];
      }
    }
  }
  int64_t Slot(int seq, int pos) const {
    return int64_t{block_tables[seq * max_blocks_per_seq + pos / block_size]} * block_size +
           pos % block_size;
  }
  int64_t num_slots() const { return int64_t{num_blocks} * block_size; }
};

TYPED_TEST(CudaKernelTest, RopeRotatesQAndWritesKvSlots) {
  using T = TypeParam;
  struct Case {
    int n_heads, n_kv_heads, head_dim, block_size;
    bool bias;
  };
  for (const Case& c : {Case{4, 4, 8, 1, false}, Case{6, 2, 34, 5, true}, Case{8, 1, 64, 16, false},
                        Case{32, 8, 128, 16, true}}) {
    SCOPED_TRACE(::testing::Message() << "heads " << c.n_heads << "/" << c.n_kv_heads << " hd "
                                      << c.head_dim << " bs " << c.block_size);
    const int q_dim = c.n_heads * c.head_dim, kv_dim = c.n_kv_heads * c.head_dim;
    const int width = q_dim + 2 * kv_dim, half = c.head_dim / 2, max_pos = 100;
    const std::vector<int> lengths = {40, 3, 100};
    PagedLayout layout(lengths, c.block_size, this->rng_);
    // Tokens: seq 0 positions 30..39 (a prefill chunk crossing blocks), seq 1
    // position 2, seq 2 position 99.
    std::vector<int32_t> positions, seq_of, slots;
    for (int p = 30; p < 40; ++p) positions.push_back(p), seq_of.push_back(0);
    positions.push_back(2), seq_of.push_back(1);
    positions.push_back(99), seq_of.push_back(2);
    for (size_t t = 0; t < positions.size(); ++t) {
      slots.push_back(static_cast<int32_t>(layout.Slot(seq_of[t], positions[t])));
    }
    const int rows = static_cast<int>(positions.size());
    std::vector<float> cos(max_pos * half), sin(max_pos * half);
    for (int p = 0; p < max_pos; ++p) {
      for (int i = 0; i < half; ++i) {
        const float angle = p * std::pow(10000.0f, -2.0f * i / c.head_dim);
        cos[p * half + i] = std::cos(angle);
        sin[p * half + i] = std::sin(angle);
      }
    }
    const std::vector<float> qkv = RandomFloats(rows * width, this->rng_);
    const std::vector<float> bias = RandomFloats(width, this->rng_, -0.5f, 0.5f);
    DeviceArray<float> d_qkv(qkv), d_bias(bias), d_cos(cos), d_sin(sin);
    DeviceArray<int32_t> d_pos(positions), d_slots(slots);
    DeviceArray<T> d_k(layout.num_slots() * kv_dim), d_v(layout.num_slots() * kv_dim);
    d_k.Poison();
    d_v.Poison();
    CUDA_ASSERT_OK(cuda::RopeAndCacheKv<T>(
        d_qkv.get(), c.bias ? d_bias.get() : nullptr, d_cos.get(), d_sin.get(), d_pos.get(),
        d_slots.get(), rows, c.n_heads, c.n_kv_heads, c.head_dim, d_k.get(), d_v.get(), nullptr));
    const std::vector<float> q_out = d_qkv.Download();
    const std::vector<float> k = ToFloats(d_k.Download()), v = ToFloats(d_v.Download());
    std::vector<bool> written(layout.num_slots(), false);
    for (int t = 0; t < rows; ++t) {
      std::vector<float> row(qkv.begin() + t * width, qkv.begin() + (t + 1) * width);
      if (c.bias) {
        for (int i = 0; i < width; ++i) row[i] += bias[i];
      }
      // The CPU backend's rotation (cpu_backend.cc, step 3).
      for (int i = 0; i < q_dim + kv_dim; i += 2) {
        const int j = (i % c.head_dim) / 2;
        const float cs = cos[positions[t] * half + j], sn = sin[positions[t] * half + j];
        const float v0 = row[i], v1 = row[i + 1];
        row[i] = v0 * cs - v1 * sn;
        row[i + 1] = v0 * sn + v1 * cs;
      }
      for (int i = 0; i < q_dim; ++i) {
        ASSERT_NEAR(q_out[t * width + i], row[i], 1e-6f) << "q of token " << t << " at " << i;
      }
      for (int i = 0; i < kv_dim; ++i) {
        // The device may fuse the rotation's multiply-add: a last-bit
        // difference, which can move the rounding to T by one step.
        const float want_k = row[q_dim + i];
        ASSERT_NEAR(k[slots[t] * kv_dim + i], Round<T>(want_k),
                    1e-6f + std::abs(want_k) * StepOf<T>())
            << "k token " << t;
        ASSERT_EQ(v[slots[t] * kv_dim + i], Round<T>(row[q_dim + kv_dim + i])) << "v token " << t;
      }
      written[slots[t]] = true;
    }
    for (int64_t s = 0; s < layout.num_slots(); ++s) {
      if (!written[s]) {
        ASSERT_TRUE(std::isnan(k[s * kv_dim])) << "slot " << s << " was written";
      }
    }
  }
}

struct AttentionCase {
  int head_dim, n_heads, n_kv_heads, block_size, num_splits;
  int split_size = 0;  // 0: num_splits parts of each context; else parts of this many positions
};

TYPED_TEST(CudaKernelTest, PagedAttentionMatchesReference) {
  using T = TypeParam;
  const AttentionCase cases[] = {
      {8, 8, 4, 16, 1},      // stories260K's shape
      {6, 4, 2, 3, 2},       // a head size that is not whole float4s
      {40, 6, 3, 7, 3},      // odd head size and block size
      {32, 3, 1, 16, 64},    // one KV head for three query heads, the most splits
      {64, 8, 1, 16, 5},     // 8 query heads per KV head
      {128, 32, 8, 16, 33},  // Llama-3-8B's heads, many splits
      {256, 4, 4, 1, 2},     // the largest head size, one position per block
      {64, 16, 1, 16, 4},    // the largest GQA ratio
      {96, 12, 4, 5, 64},    // more splits than tiles
      // Fixed-size splits (the split kernel); the contexts reach 300
      // positions, so num_splits >= ceil(300 / split_size).
      {128, 32, 8, 16, 3, 128},  // Llama-3-8B's heads: as many splits as the longest needs
      {128, 32, 8, 16, 8, 128},  // a grid with more splits than any context has
      {64, 8, 1, 16, 3, 128},    // 8 query heads per KV head: two per warp
      {64, 16, 1, 7, 2, 160},    // the largest GQA ratio; splits start inside blocks
      {256, 4, 4, 1, 10, 32},    // the largest head size, one tile per split, blocks of one
      {128, 16, 2, 16, 1, 320},  // one split for every context: written without a combine
      {64, 3, 3, 16, 5, 64},     // one query head per KV head: three warps score nothing
  };
  for (const AttentionCase& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "hd " << c.head_dim << " heads " << c.n_heads << "/" << c.n_kv_heads << " bs "
                 << c.block_size << " splits " << c.num_splits << " of " << c.split_size);
    const int ratio = c.n_heads / c.n_kv_heads, hd = c.head_dim;
    const int q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd;
    const std::vector<int> lengths = {1, 33, 300};
    PagedLayout layout(lengths, c.block_size, this->rng_);
    // Cache contents as stored (rounded to T); the reference reads the same.
    const std::vector<float> k = RandomFloats(layout.num_slots() * kv_dim, this->rng_, -2, 2);
    const std::vector<float> v = RandomFloats(layout.num_slots() * kv_dim, this->rng_);
    // Queries: seq 0 at 0; seq 1 at 28..32 (a prefill chunk); seq 2 at 299.
    std::vector<int32_t> positions = {0}, seq_of = {0};
    for (int p = 28; p < 33; ++p) positions.push_back(p), seq_of.push_back(1);
    positions.push_back(299), seq_of.push_back(2);
    const int rows = static_cast<int>(positions.size());
    const int q_stride = q_dim + 7;  // q sits in a wider row, as in the fused qkv buffer
    const std::vector<float> q = RandomFloats(rows * q_stride, this->rng_, -2, 2);

    DeviceArray<float> d_q(q);
    DeviceArray<T> d_k(Convert<T>(k)), d_v(Convert<T>(v));
    DeviceArray<int32_t> d_pos(positions), d_seq(seq_of), d_tables(layout.block_tables);
    DeviceArray<float> d_partial(rows * c.n_heads * c.num_splits * hd);
    DeviceArray<float> d_ml(rows * c.n_heads * c.num_splits * 2);
    DeviceArray<T> d_out(rows * q_dim);
    d_out.Poison();
    cuda::AttentionShape shape;
    shape.rows = rows;
    shape.n_heads = c.n_heads;
    shape.n_kv_heads = c.n_kv_heads;
    shape.head_dim = hd;
    shape.block_size = c.block_size;
    shape.max_blocks_per_seq = layout.max_blocks_per_seq;
    shape.num_splits = c.num_splits;
    shape.split_size = c.split_size;
    shape.q_stride = q_stride;
    CUDA_ASSERT_OK(cuda::ConfigureAttention<T>(hd, ratio));
    CUDA_ASSERT_OK(cuda::PagedAttention<T>(d_q.get(), d_k.get(), d_v.get(), d_pos.get(),
                                           d_seq.get(), d_tables.get(), shape, d_partial.get(),
                                           d_ml.get(), d_out.get(), nullptr));
    const std::vector<float> out = ToFloats(d_out.Download());

    // The CPU backend's attention (cpu_backend.cc, Attention) in double.
    std::vector<float> want(rows * q_dim);
    for (int t = 0; t < rows; ++t) {
      for (int h = 0; h < c.n_heads; ++h) {
        const int g = h / ratio, ctx = positions[t] + 1;
        std::vector<double> scores(ctx);
        double max_score = -INFINITY;
        for (int p = 0; p < ctx; ++p) {
          const int64_t base = layout.Slot(seq_of[t], p) * kv_dim + g * hd;
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += q[t * q_stride + h * hd + d] * Round<T>(k[base + d]);
          scores[p] = dot / std::sqrt(static_cast<double>(hd));
          max_score = std::max(max_score, scores[p]);
        }
        double sum = 0;
        for (double& s : scores) sum += (s = std::exp(s - max_score));
        for (int d = 0; d < hd; ++d) {
          double o = 0;
          for (int p = 0; p < ctx; ++p) {
            o += scores[p] / sum * Round<T>(v[layout.Slot(seq_of[t], p) * kv_dim + g * hd + d]);
          }
          want[t * q_dim + h * hd + d] = Round<T>(static_cast<float>(o));
        }
      }
    }
    EXPECT_LT(RelativeError(out, want), std::max(Tolerance<T>(), 2e-6));
  }
}

// With fixed-size splits a token's output is a function of its own context:
// the same bits alone or beside other tokens, with a grid of any number of
// splits, and with one split written directly or through the combine.
TYPED_TEST(CudaKernelTest, SplitAttentionGivesATokenTheSameBitsInAnyLaunch) {
  using T = TypeParam;
  const int hd = 128, n_heads = 32, n_kv_heads = 8, bs = 16, split_size = 128;
  const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
  PagedLayout layout({1, 100, 300}, bs, this->rng_);
  DeviceArray<T> d_k(Convert<T>(RandomFloats(layout.num_slots() * kv_dim, this->rng_, -2, 2)));
  DeviceArray<T> d_v(Convert<T>(RandomFloats(layout.num_slots() * kv_dim, this->rng_)));
  DeviceArray<int32_t> d_tables(layout.block_tables);
  const std::vector<int32_t> positions = {0, 99, 299}, seq_of = {0, 1, 2};
  const std::vector<float> q = RandomFloats(3 * q_dim, this->rng_, -2, 2);
  CUDA_ASSERT_OK(cuda::ConfigureAttention<T>(hd, n_heads / n_kv_heads));
  // Rows `rows` of the three, in a grid of `splits` splits.
  auto run = [&](const std::vector<int>& rows, int splits) {
    std::vector<int32_t> pos, seq;
    std::vector<float> q_rows;
    for (int r : rows) {
      pos.push_back(positions[r]);
      seq.push_back(seq_of[r]);
      q_rows.insert(q_rows.end(), q.begin() + r * q_dim, q.begin() + (r + 1) * q_dim);
    }
    const int n = static_cast<int>(rows.size());
    DeviceArray<float> d_q(q_rows);
    DeviceArray<int32_t> d_pos(pos), d_seq(seq);
    DeviceArray<float> d_partial(n * n_heads * splits * hd), d_ml(n * n_heads * splits * 2);
    DeviceArray<T> d_out(n * q_dim);
    d_out.Poison();
    cuda::AttentionShape shape;
    shape.rows = n;
    shape.n_heads = n_heads;
    shape.n_kv_heads = n_kv_heads;
    shape.head_dim = hd;
    shape.block_size = bs;
    shape.max_blocks_per_seq = layout.max_blocks_per_seq;
    shape.num_splits = splits;
    shape.split_size = split_size;
    shape.q_stride = q_dim;
    EXPECT_EQ(cuda::PagedAttention<T>(d_q.get(), d_k.get(), d_v.get(), d_pos.get(), d_seq.get(),
                                      d_tables.get(), shape, d_partial.get(), d_ml.get(),
                                      d_out.get(), nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return ToFloats(d_out.Download());
  };
  const std::vector<float> together = run({0, 1, 2}, 8);
  auto row = [&](const std::vector<float>& out, int i) {
    return std::vector<float>(out.begin() + i * q_dim, out.begin() + (i + 1) * q_dim);
  };
  for (float x : together) ASSERT_FALSE(std::isnan(x)) << "an output left unwritten";
  EXPECT_EQ(row(run({2}, 3), 0), row(together, 2)) << "299 alone, 3 splits";
  EXPECT_EQ(row(run({1, 2}, 5), 0), row(together, 1)) << "99 beside 299, 5 splits";
  EXPECT_EQ(row(run({0}, 1), 0), row(together, 0)) << "0 alone, written without a combine";
  EXPECT_EQ(row(run({1, 0}, 1), 0), row(together, 1)) << "99 and 0, one split";
}

TYPED_TEST(CudaKernelTest, ConvertAndFill) {
  using T = TypeParam;
  const std::vector<float> in = RandomFloats(1000, this->rng_, -100, 100);
  DeviceArray<float> d_in(in);
  DeviceArray<T> d_out(in.size());
  CUDA_ASSERT_OK(cuda::ConvertFromFloat<T>(d_in.get(), in.size(), d_out.get(), nullptr));
  const std::vector<float> out = ToFloats(d_out.Download());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], Round<T>(in[i])) << i;

  const int64_t n = 100003;
  DeviceArray<T> d_fill(n);
  CUDA_ASSERT_OK(cuda::FillUniform<T>(d_fill.get(), n, 42, 0.5f, 1.0f, nullptr));
  const std::vector<float> fill = ToFloats(d_fill.Download());
  double mean = 0;
  for (float f : fill) {
    ASSERT_GE(f, 0.5f - 1e-3f);
    ASSERT_LE(f, 1.5f + 1e-3f);
    mean += f;
  }
  EXPECT_NEAR(mean / n, 1.0, 0.01);
  EXPECT_NE(fill[0], fill[1]);
}

// ---------------------------------------------------------------------------
// Sampling
// ---------------------------------------------------------------------------

class CudaSampleTest : public ::testing::Test {
 protected:
  void SetUp() override { COALESCE_REQUIRE_GPU(); }
  // Samples every (row of logits, spec) pair on the device.
  std::vector<int32_t> Sample(const std::vector<float>& logits, int vocab,
                              const std::vector<cuda::DeviceSampleSpec>& specs) {
    const int rows = static_cast<int>(specs.size());
    DeviceArray<float> d_logits(logits), d_probs(logits.size());
    DeviceArray<cuda::DeviceSampleSpec> d_specs(specs);
    DeviceArray<int32_t> d_tokens(rows);
    d_tokens.Poison();
    EXPECT_EQ(cuda::SampleTokens(d_logits.get(), d_specs.get(), rows, vocab, d_probs.get(),
                                 d_tokens.get(), nullptr),
              cudaSuccess);
    return d_tokens.Download();
  }
  std::mt19937 rng_{99};
};

TEST_F(CudaSampleTest, GreedyTakesLowestIdOfTheMaximumAndSkipsNan) {
  const int vocab = 70001;  // odd, and more than 64 per thread
  std::vector<float> logits = RandomFloats(3 * vocab, rng_);
  logits[0 * vocab + 500] = 5.0f;  // row 0: a tie, lowest id wins
  logits[0 * vocab + 60000] = 5.0f;
  logits[1 * vocab + 3] = NAN;  // row 1: NaN above everything is skipped
  logits[1 * vocab + 69999] = 7.0f;
  std::fill(logits.begin() + 2 * vocab, logits.end(), -INFINITY);  // row 2: all -inf
  const std::vector<int32_t> got = Sample(logits, vocab, {{}, {}, {}});
  EXPECT_EQ(got, (std::vector<int32_t>{500, 69999, 0}));
}

TEST_F(CudaSampleTest, RestrictionsThatLeaveOneTokenGiveTheArgmax) {
  const int vocab = 32000;
  std::vector<float> logits;
  std::vector<cuda::DeviceSampleSpec> specs;
  std::vector<int32_t> want;
  for (int r = 0; r < 6; ++r) {
    std::vector<float> row = RandomFloats(vocab, rng_, -3, 3);
    Rng unused(0);
    want.push_back(engine::Sample(row, {}, unused));
    logits.insert(logits.end(), row.begin(), row.end());
    const float u = (r + 0.5f) / 6;
    specs.push_back(r % 2 == 0 ? cuda::DeviceSampleSpec{1.0f, 1, 1.0f, u}
                               : cuda::DeviceSampleSpec{0.7f, 0, 1e-6f, u});
  }
  EXPECT_EQ(Sample(logits, vocab, specs), want);
}

// With the draws on an even grid u_i = (i + 0.5) / N, each token is drawn
// about N * p times whatever order the draw walks the tokens in, so the
// device's counts must match the CPU sampler's within a draw or two.
TEST_F(CudaSampleTest, DrawsFollowTheCpuSamplersDistribution) {
  const int vocab = 1000, n = 4096;
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> row(vocab);
  for (float& x : row) x = normal(rng_);
  const SamplingParams settings[] = {
      {.temperature = 1.0f},
      {.temperature = 0.7f, .top_k = 50},
      {.temperature = 1.3f, .top_p = 0.9f},
      {.temperature = 1.0f, .top_k = 100, .top_p = 0.5f},
  };
  for (const SamplingParams& params : settings) {
    SCOPED_TRACE(::testing::Message() << "T " << params.temperature << " top_k " << params.top_k
                                      << " top_p " << params.top_p);
    std::vector<float> logits;
    std::vector<cuda::DeviceSampleSpec> specs;
    std::map<int32_t, int> cpu_counts, gpu_counts;
    for (int i = 0; i < n; ++i) {
      const float u = (i + 0.5f) / n;
      logits.insert(logits.end(), row.begin(), row.end());
      specs.push_back({params.temperature, params.top_k, params.top_p, u});
      ++cpu_counts[SampleWithUniform(row, params, u)];
    }
    for (int32_t token : Sample(logits, vocab, specs)) ++gpu_counts[token];
    for (const auto& [token, count] : cpu_counts) {
      EXPECT_NEAR(gpu_counts[token], count, 2) << "token " << token;
    }
    for (const auto& [token, count] : gpu_counts) {
      EXPECT_TRUE(cpu_counts.count(token) > 0 || count <= 2)
          << "token " << token << " drawn " << count << " times on the device only";
    }
  }
}

}  // namespace
}  // namespace coalesce::engine
