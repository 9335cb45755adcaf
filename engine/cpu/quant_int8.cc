#include "engine/cpu/quant_int8.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/kv_quant.h"
#include "engine/cpu/quant_blocks.h"

namespace coalesce::engine::cpu {

namespace {

uint16_t Load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
float Half(const uint8_t* p) { return ToFloat(Fp16{Load16(p)}); }
void Store16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// Where the nibbles of a block begin (quant_int8.h).
int NibbleOffset(QuantType type) { return type == QuantType::kQ4_1 ? 64 : 32; }

// Byte of a lane's column k (< 16) in a run of quads of 64 bytes.
int QuadByte(int lane, int k) { return (k / 4) * 64 + lane * 4 + k % 4; }

// Where a Q6_K lane keeps column k's two high bits: the byte of the block
// (h[t] from 288 on) and the bit they start at (quant_int8.h).
struct HighBits {
  int byte, bit;
};
HighBits Q6HighBits(int lane, int k) {
  const int within = k % 16;
  return {288 + (within / 8) * 64 + lane * 4 + within % 4, 2 * (within % 8 / 4) + (k < 16 ? 0 : 4)};
}

// Row r's block b as stored: its 32 integers and its scales.
struct Stored {
  int q[32] = {};  // Q8_0's signed; the others' unsigned, as in the file
  float d = 0.0f;  // d; Q4_K's d sc
  float m = 0.0f;  // Q4_1's m; Q4_K's dmin mn
  int sc[2] = {};  // Q6_K's scales of columns 0-15 and 16-31
};

Stored Read(const Int8Matrix& w, int r, int b) {
  Stored out;
  const int lane = r % kInt8GroupRows;
  const uint8_t* blk = w.block(r / kInt8GroupRows, b);
  const uint8_t* header = w.header(r / kInt8GroupRows, b);
  const QuantType type = w.type();
  for (int k = 0; k < 32; ++k) {
    if (type == QuantType::kQ8_0) {
      out.q[k] = static_cast<int8_t>(blk[32 + QuadByte(lane, k)] ^ 0x80);
      continue;
    }
    const uint8_t byte = blk[NibbleOffset(type) + QuadByte(lane, k % 16)];
    out.q[k] = k < 16 ? byte & 0x0F : byte >> 4;
    if (type == QuantType::kQ6_K) {
      const HighBits h = Q6HighBits(lane, k);
      out.q[k] |= ((blk[h.byte] >> h.bit) & 3) << 4;
    }
  }
  switch (type) {
    case QuantType::kQ8_0:
    case QuantType::kQ4_0:
      out.d = Half(blk + 2 * lane);
      break;
    case QuantType::kQ4_1:
      out.d = Half(blk + 2 * lane);
      out.m = Half(blk + 32 + 2 * lane);
      break;
    case QuantType::kQ4_K:
      out.d = Half(header + 2 * lane) * static_cast<float>(blk[lane]);
      out.m = Half(header + 32 + 2 * lane) * static_cast<float>(blk[16 + lane]);
      break;
    case QuantType::kQ6_K:
      out.d = Half(header + 2 * lane);
      out.sc[0] = static_cast<int8_t>(blk[lane]);
      out.sc[1] = static_cast<int8_t>(blk[16 + lane]);
      break;
  }
  return out;
}

}  // namespace

bool Int8DotSupported() {
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported;
}

Int8Isa BestInt8Isa() {
  static const Int8Isa isa =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")
          ? Int8Isa::kAvx512Vnni
          : Int8Isa::kAvx2;
  return isa;
}

void Int8MatmulGroups(const Int8Rows& x, const Int8Matrix& w, int g0, int g1, float* y, int64_t ldy,
                      Int8Isa isa) {
  if (isa == Int8Isa::kAvx512Vnni) {
    Int8MatmulGroupsAvx512(x, w, g0, g1, y, ldy);
  } else {
    Int8MatmulGroupsAvx2(x, w, g0, g1, y, ldy);
  }
}

bool Int8DotType(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kQ4_K:
    case QuantType::kQ6_K:
      return true;
  }
  return false;
}

absl::StatusOr<Int8Matrix> Int8Matrix::Pack(const QuantizedMatrix& m) {
  const int file_block = QuantBlockSize(m.type);
  if (!Int8DotType(m.type) || m.data == nullptr || m.rows <= 0 || m.cols <= 0 ||
      m.cols % file_block != 0 || m.rows > std::numeric_limits<int>::max() - kInt8GroupRows ||
      m.cols > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("no int8 layout for a ", m.rows, " x ", m.cols,
                                                   " ", QuantTypeName(m.type), " matrix"));
  }
  Int8Matrix out;
  out.type_ = m.type;
  out.rows_ = static_cast<int>(m.rows);
  out.cols_ = static_cast<int>(m.cols);
  out.blocks_per_header_ = Int8BlocksPerHeader(m.type);
  out.header_bytes_ = Int8HeaderBytes(m.type);
  out.block_bytes_ = Int8BlockBytes(m.type);
  const int64_t total = out.bytes();
  // 64-byte aligned, zeroed (huge_page_memory.h).
  absl::StatusOr<HugePageMemory> memory = HugePageMemory::Allocate(static_cast<size_t>(total));
  if (!memory.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", total, " bytes for a ",
                                                     QuantTypeName(m.type),
                                                     " matrix: ", memory.status().message()));
  }
  out.data_ = *std::move(memory);
  const int file_blocks = out.cols_ / file_block;
  const int64_t row_bytes = m.row_bytes();
  for (int r = 0; r < out.rows_; ++r) {
    const int g = r / kInt8GroupRows, lane = r % kInt8GroupRows;
    for (int fb = 0; fb < file_blocks; ++fb) {
      const QuantBlock q =
          DecodeQuantBlock(m.type, m.data + r * row_bytes + int64_t{fb} * QuantBlockBytes(m.type));
      for (int sub = 0; sub < out.blocks_per_header_; ++sub) {
        const int b = fb * out.blocks_per_header_ + sub;
        // Writable: the layout's own accessors, on the buffer Pack owns.
        uint8_t* blk = const_cast<uint8_t*>(out.block(g, b));
        uint8_t* header = const_cast<uint8_t*>(out.header(g, b));
        const uint8_t* v = q.q + 32 * sub;  // this block's 32 integers
        if (m.type == QuantType::kQ8_0) {
          Store16(blk + 2 * lane, q.d);
          // q + 128 as an unsigned byte.
          for (int k = 0; k < 32; ++k) blk[32 + QuadByte(lane, k)] = v[k] ^ 0x80;
          continue;
        }
        switch (m.type) {
          case QuantType::kQ4_1:
            Store16(blk + 32 + 2 * lane, q.m);
            [[fallthrough]];
          case QuantType::kQ4_0:
            Store16(blk + 2 * lane, q.d);
            break;
          case QuantType::kQ4_K:
            Store16(header + 2 * lane, q.d);
            Store16(header + 32 + 2 * lane, q.m);
            blk[lane] = q.sc[sub];
            blk[16 + lane] = q.mn[sub];
            break;
          case QuantType::kQ6_K:
            Store16(header + 2 * lane, q.d);
            blk[lane] = q.sc[2 * sub];
            blk[16 + lane] = q.sc[2 * sub + 1];
            break;
          case QuantType::kQ8_0:
            break;
        }
        for (int k = 0; k < 32; ++k) {
          uint8_t& byte = blk[NibbleOffset(m.type) + QuadByte(lane, k % 16)];
          byte = static_cast<uint8_t>(byte | (k < 16 ? v[k] & 15 : (v[k] & 15) << 4));
          if (m.type == QuantType::kQ6_K) {
            const HighBits h = Q6HighBits(lane, k);
            blk[h.byte] |= static_cast<uint8_t>((v[k] >> 4) << h.bit);
          }
        }
      }
    }
  }
  return out;
}

void Int8Matrix::DequantizeRow(int r, float* out) const {
  for (int b = 0; b < cols_ / 32; ++b) {
    const Stored s = Read(*this, r, b);
    float* y = out + b * 32;
    for (int k = 0; k < 32; ++k) {
      const float q = static_cast<float>(s.q[k]);
      switch (type_) {
        case QuantType::kQ8_0:
          y[k] = q * s.d;
          break;
        case QuantType::kQ4_0:
          y[k] = s.d * static_cast<float>(s.q[k] - 8);
          break;
        case QuantType::kQ4_1:
          y[k] = s.d * q + s.m;
          break;
        case QuantType::kQ4_K:
          y[k] = s.d * q - s.m;
          break;
        case QuantType::kQ6_K:
          y[k] = s.d * static_cast<float>(s.sc[k / 16]) * static_cast<float>(s.q[k] - 32);
          break;
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
    out.first_sum.reset(new int32_t[static_cast<size_t>(out.capacity)]);
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
      int32_t first = 0;
      for (int c = 0; c < 16; ++c) first += q[c];
      out.first_sum[at] = first;
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
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < w.rows(); ++j) {
      float total = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        const Stored s = Read(w, j, b);
        const size_t at = static_cast<size_t>(i) * blocks + b;
        const int8_t* xq = q.xq.get() + at * 32;
        const float dx = q.scale[at];
        const int32_t sx = q.sum[at], s1 = q.first_sum[at];
        int32_t first = 0, second = 0;
        for (int k = 0; k < 16; ++k) first += s.q[k] * xq[k];
        for (int k = 16; k < 32; ++k) second += s.q[k] * xq[k];
        int32_t dot = first + second;
        if (w.type() == QuantType::kQ4_0) dot -= 8 * sx;
        if (w.type() == QuantType::kQ6_K) {
          dot = s.sc[0] * (first - 32 * s1) + s.sc[1] * (second - 32 * (sx - s1));
        }
        total = std::fma(static_cast<float>(dot), s.d * dx, total);
        if (w.type() == QuantType::kQ4_1) {
          total = std::fma(s.m, dx * static_cast<float>(sx), total);
        } else if (w.type() == QuantType::kQ4_K) {
          total = std::fma(s.m, -(dx * static_cast<float>(sx)), total);
        }
      }
      y[i * ldy + j] = total;
    }
  }
}

void Int8Matmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const Int8Matrix& w, float* y,
                int64_t ldy, Int8Isa isa) {
  if (m <= 0) return;
  // This thread's rows; the workers read them through `q` (a thread_local
  // named inside the task would be each worker's own).
  thread_local Int8Rows rows;
  Int8Rows& q = rows;
  QuantizeRows(x, ldx, m, w.cols(), q);
  const int groups = w.num_groups();
  const int threads = pool.size();
  if (threads == 1 || int64_t{m} * w.rows() * w.cols() < (int64_t{1} << 17)) {
    Int8MatmulGroups(q, w, 0, groups, y, ldy, isa);
    return;
  }
  const int tasks = std::min(groups, threads * Int8TasksPerThread(m));
  pool.ParallelFor(tasks, [&](int task, int) {
    const int g0 = static_cast<int>(int64_t{groups} * task / tasks);
    const int g1 = static_cast<int>(int64_t{groups} * (task + 1) / tasks);
    Int8MatmulGroups(q, w, g0, g1, y, ldy, isa);
  });
}

}  // namespace coalesce::engine::cpu
