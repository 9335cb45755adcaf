#include "engine/cpu/quant_int8.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/kv_quant.h"

namespace coalesce::engine::cpu {

// The kernel (quant_int8_avx512.cc): groups [g0, g1) of w against the m
// quantized rows.
void Int8MatmulGroupsAvx512(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y,
                            int64_t ldy);

namespace {

uint16_t Load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
float Half(const uint8_t* p) { return ToFloat(Fp16{Load16(p)}); }

// Offsets in a group's block (quant_int8.h).
int ScaleBytes(QuantType type) { return type == QuantType::kQ4_1 ? 64 : 32; }

}  // namespace

bool Int8DotSupported() {
  static const bool supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
  return supported;
}

bool Int8DotType(QuantType type) {
  return type == QuantType::kQ8_0 || type == QuantType::kQ4_0 || type == QuantType::kQ4_1;
}

void Int8Matrix::Free::operator()(uint8_t* p) const { std::free(p); }

absl::StatusOr<Int8Matrix> Int8Matrix::Pack(const QuantizedMatrix& m) {
  if (!Int8DotType(m.type) || m.data == nullptr || m.rows <= 0 || m.cols <= 0 || m.cols % 32 != 0 ||
      m.rows > std::numeric_limits<int>::max() - kInt8GroupRows ||
      m.cols > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("no int8 layout for a ", m.rows, " x ", m.cols,
                                                   " ", QuantTypeName(m.type), " matrix"));
  }
  Int8Matrix out;
  out.type_ = m.type;
  out.rows_ = static_cast<int>(m.rows);
  out.cols_ = static_cast<int>(m.cols);
  out.block_bytes_ = m.type == QuantType::kQ8_0 ? 544 : m.type == QuantType::kQ4_0 ? 288 : 320;
  const int64_t total = out.bytes();
  const size_t alloc = static_cast<size_t>((total + 63) / 64 * 64);
  out.data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, alloc)));
  if (out.data_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", total, " bytes for a ", QuantTypeName(m.type), " matrix"));
  }
  std::memset(out.data_.get(), 0, alloc);
  const int blocks = out.cols_ / 32;
  const int64_t row_bytes = m.row_bytes();
  const int scales = ScaleBytes(m.type);
  for (int r = 0; r < out.rows_; ++r) {
    const int lane = r % kInt8GroupRows;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* src = m.data + r * row_bytes + int64_t{b} * QuantBlockBytes(m.type);
      uint8_t* dst =
          out.data_.get() + (r / kInt8GroupRows) * out.group_bytes() + b * out.block_bytes_;
      std::memcpy(dst + 2 * lane, src, 2);  // d
      if (m.type == QuantType::kQ8_0) {
        for (int k = 0; k < 32; ++k) {
          // q + 128 as an unsigned byte, column k in quad k / 4 at byte k % 4.
          dst[32 + (k / 4) * 64 + lane * 4 + k % 4] = static_cast<uint8_t>(src[2 + k] ^ 0x80);
        }
        continue;
      }
      const uint8_t* qs = src + 2;
      if (m.type == QuantType::kQ4_1) {
        std::memcpy(dst + 32 + 2 * lane, src + 2, 2);  // m
        qs = src + 4;
      }
      for (int k = 0; k < 32; ++k) {
        const int q = k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4;  // the file's element k
        const int within = k % 16;  // columns 4j + c (low) and 4j + 16 + c (high)
        uint8_t& byte = dst[scales + (within / 4) * 64 + lane * 4 + within % 4];
        byte = static_cast<uint8_t>(byte | (k < 16 ? q : q << 4));
      }
    }
  }
  return out;
}

void Int8Matrix::DequantizeRow(int r, float* out) const {
  const int lane = r % kInt8GroupRows;
  const uint8_t* g = group(r / kInt8GroupRows);
  const int scales = ScaleBytes(type_);
  for (int b = 0; b < cols_ / 32; ++b) {
    const uint8_t* blk = g + b * block_bytes_;
    const float d = Half(blk + 2 * lane);
    float* y = out + b * 32;
    for (int k = 0; k < 32; ++k) {
      if (type_ == QuantType::kQ8_0) {
        const int q = static_cast<int8_t>(blk[32 + (k / 4) * 64 + lane * 4 + k % 4] ^ 0x80);
        y[k] = static_cast<float>(q) * d;
        continue;
      }
      const int within = k % 16;
      const uint8_t byte = blk[scales + (within / 4) * 64 + lane * 4 + within % 4];
      const int q = k < 16 ? byte & 0x0F : byte >> 4;
      if (type_ == QuantType::kQ4_0) {
        y[k] = d * static_cast<float>(q - 8);
      } else {
        y[k] = d * static_cast<float>(q) + Half(blk + 32 + 2 * lane);
      }
    }
  }
}

namespace {

// One block of 32 activations, in scalar code: the definition.
int32_t QuantizeBlockScalar(const float* v, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int c = 0; c < 32; ++c) amax = std::max(amax, std::fabs(v[c]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  int32_t sum = 0;
  for (int c = 0; c < 32; ++c) {
    // Nearest, ties to even. A NaN or an infinity has no int8 value: 0
    // (the scale then carries it into the result).
    const float r = std::nearbyint(v[c] * id);
    q[c] = static_cast<int8_t>(std::isfinite(r) ? std::clamp(r, -127.0f, 127.0f) : 0.0f);
    sum += q[c];
  }
  *scale = d;
  return sum;
}

// The same, 8 lanes at a time (AVX2); a block holding a NaN or an infinity
// goes to the scalar definition.
int32_t QuantizeBlock(const float* v, int8_t* q, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], amax8 = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    // max(|x|, amax): a NaN lane keeps amax, as std::max(amax, NaN) does.
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), amax8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x[i], x[i], _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax8);
  float amax = 0.0f;
  for (const float l : lanes) amax = std::max(amax, l);
  if (!std::isfinite(amax) || _mm256_movemask_ps(nan) != 0) {
    return QuantizeBlockScalar(v, q, scale);
  }
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i n[4];
  // x * id lies in [-127, 127] (rounded, it may touch 127.0x): the
  // conversion rounds to nearest even, as nearbyint does.
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], idv));
  const __m256i limit = _mm256_set1_epi32(127);
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    n[i] = _mm256_max_epi32(_mm256_min_epi32(n[i], limit),
                            _mm256_sub_epi32(_mm256_setzero_si256(), limit));
    total = _mm256_add_epi32(total, n[i]);
  }
  alignas(32) int32_t ints[32];
  for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * i), n[i]);
  for (int c = 0; c < 32; ++c) q[c] = static_cast<int8_t>(ints[c]);
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
  *scale = d;
  int32_t sum = 0;
  for (const int32_t s : sums) sum += s;
  return sum;
}

void Quantize(const float* x, int64_t ldx, int m, int k, Int8Rows& out, bool scalar) {
  const int blocks = k / 32;
  if (out.capacity < int64_t{m} * blocks) {
    out.capacity = int64_t{m} * blocks;
    out.xq.reset(new int8_t[static_cast<size_t>(out.capacity) * 32]);
    out.scale.reset(new float[static_cast<size_t>(out.capacity)]);
    out.sum.reset(new int32_t[static_cast<size_t>(out.capacity)]);
  }
  out.rows = m;
  out.blocks = blocks;
  for (int i = 0; i < m; ++i) {
    for (int b = 0; b < blocks; ++b) {
      const size_t at = static_cast<size_t>(i) * blocks + b;
      const float* v = x + i * ldx + b * 32;
      int8_t* q = out.xq.get() + at * 32;
      out.sum[at] =
          scalar ? QuantizeBlockScalar(v, q, &out.scale[at]) : QuantizeBlock(v, q, &out.scale[at]);
    }
  }
}

}  // namespace

void QuantizeRows(const float* x, int64_t ldx, int m, int k, Int8Rows& out) {
  Quantize(x, ldx, m, k, out, /*scalar=*/false);
}

void Int8MatmulReference(const float* x, int64_t ldx, int m, const Int8Matrix& w, float* y,
                         int64_t ldy) {
  Int8Rows q;
  Quantize(x, ldx, m, w.cols(), q, /*scalar=*/true);
  const int blocks = w.cols() / 32;
  std::vector<float> row(static_cast<size_t>(w.cols()));
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < w.rows(); ++j) {
      const int lane = j % kInt8GroupRows;
      const uint8_t* g = w.group(j / kInt8GroupRows);
      float total = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* blk = g + b * w.block_bytes();
        const int8_t* xq = q.xq.get() + (static_cast<size_t>(i) * blocks + b) * 32;
        const float dx = q.scale[static_cast<size_t>(i) * blocks + b];
        const int32_t sx = q.sum[static_cast<size_t>(i) * blocks + b];
        int32_t dot = 0;
        for (int k = 0; k < 32; ++k) {
          int stored;
          if (w.type() == QuantType::kQ8_0) {
            stored = static_cast<int8_t>(blk[32 + (k / 4) * 64 + lane * 4 + k % 4] ^ 0x80);
          } else {
            const int within = k % 16;
            const uint8_t byte =
                blk[ScaleBytes(w.type()) + (within / 4) * 64 + lane * 4 + within % 4];
            stored = k < 16 ? byte & 0x0F : byte >> 4;
          }
          dot += stored * xq[k];
        }
        if (w.type() == QuantType::kQ4_0) dot -= 8 * sx;
        const float s = Half(blk + 2 * lane) * dx;
        total = std::fma(static_cast<float>(dot), s, total);
        if (w.type() == QuantType::kQ4_1) {
          total = std::fma(Half(blk + 32 + 2 * lane), dx * static_cast<float>(sx), total);
        }
      }
      y[i * ldy + j] = total;
    }
  }
}

void Int8Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const Int8Matrix& w, float* y,
                int64_t ldy) {
  if (m <= 0) return;
  // This thread's rows; the workers read them through `q` (a thread_local
  // named inside the task would be each worker's own).
  thread_local Int8Rows rows;
  Int8Rows& q = rows;
  QuantizeRows(x, ldx, m, w.cols(), q);
  const int groups = w.num_groups();
  const int threads = pool.size();
  if (threads == 1 || int64_t{m} * w.rows() * w.cols() < (int64_t{1} << 17)) {
    Int8MatmulGroupsAvx512(q, w, 0, groups, y, ldy);
    return;
  }
  const int tasks = std::min(groups, threads * 4);
  pool.ParallelFor(tasks, [&](int task, int) {
    const int g0 = static_cast<int>(int64_t{groups} * task / tasks);
    const int g1 = static_cast<int>(int64_t{groups} * (task + 1) / tasks);
    Int8MatmulGroupsAvx512(q, w, g0, g1, y, ldy);
  });
}

}  // namespace coalesce::engine::cpu
