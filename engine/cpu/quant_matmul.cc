#include "engine/cpu/quant_matmul.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/kv_quant.h"
#include "engine/cpu/matmul_panels.h"
#include "engine/cpu/quant_blocks.h"
#include "engine/sampler.h"

namespace coalesce::engine::cpu {
namespace {

static_assert(kQuantPanelRows == kPanel, "a packed panel is one panel of the product");
static_assert(kKBlock % 256 == 0, "a block of k holds whole blocks of every type");

uint16_t Load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
void Store16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
float Half(const uint8_t* p) { return ToFloat(Fp16{Load16(p)}); }

// The 6-bit scales and mins of Q4_K's 8 sub-blocks, packed in 12 bytes
// (gguf_quant.cc's UnpackScalesMins).
void ScalesMins(const uint8_t* s, uint8_t* scale, uint8_t* min) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scale[j] = s[j] & 63;
      min[j] = s[j + 4] & 63;
    } else {
      scale[j] = static_cast<uint8_t>((s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4);
      min[j] = static_cast<uint8_t>((s[j + 4] >> 4) | (s[j] >> 6) << 4);
    }
  }
}

}  // namespace

QuantBlock DecodeQuantBlock(QuantType type, const uint8_t* b) {
  QuantBlock out;
  switch (type) {
    case QuantType::kQ8_0:
      out.d = Load16(b);
      std::memcpy(out.q, b + 2, 32);
      break;
    case QuantType::kQ4_0:
    case QuantType::kQ4_1: {
      out.d = Load16(b);
      const uint8_t* qs = b + 2;
      if (type == QuantType::kQ4_1) {
        out.m = Load16(b + 2);
        qs = b + 4;
      }
      for (int i = 0; i < 16; ++i) {
        out.q[i] = qs[i] & 0x0F;
        out.q[i + 16] = qs[i] >> 4;
      }
      break;
    }
    case QuantType::kQ4_K: {
      out.d = Load16(b);
      out.m = Load16(b + 2);
      ScalesMins(b + 4, out.sc, out.mn);
      const uint8_t* qs = b + 16;
      for (int j = 0; j < 8; ++j) {
        for (int l = 0; l < 32; ++l)
          out.q[32 * j + l] = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
      }
      break;
    }
    case QuantType::kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      std::memcpy(out.sc, b + 192, 16);
      out.d = Load16(b + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        out.q[e] = static_cast<uint8_t>(low | high << 4);
      }
      break;
    }
  }
  return out;
}

namespace {

// Byte offsets of the fields of a group (quant_matmul.h).
struct GroupLayout {
  int d = 0, m = -1, sc = -1, mn = -1, q = 0;
};

GroupLayout LayoutOf(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
      return {.d = 0, .q = 64};
    case QuantType::kQ4_0:
      return {.d = 0, .q = 64};
    case QuantType::kQ4_1:
      return {.d = 0, .m = 64, .q = 128};
    case QuantType::kQ4_K:
      return {.d = 0, .m = 64, .sc = 128, .mn = 384, .q = 640};
    case QuantType::kQ6_K:
      return {.d = 0, .sc = 64, .q = 576};
  }
  return {};
}

// The byte of a 4-bit group that holds row 8 at + c's nibble of column k:
// columns in pairs of 32 bytes, lane c's low 16-bit word column 2p's rows
// c, c + 8, c + 16, c + 24 and its high word column 2p + 1's (quant_matmul.h).
int NibbleByte(const GroupLayout& g, int k, int c, int at) {
  return g.q + (k / 2) * 32 + 4 * c + 2 * (k % 2) + at / 2;
}

// Writes row r's block into its group.
void Place(QuantType type, const QuantBlock& b, int r, uint8_t* group) {
  const GroupLayout g = LayoutOf(type);
  const int n = QuantBlockSize(type);
  Store16(group + g.d + 2 * r, b.d);
  if (g.m >= 0) Store16(group + g.m + 2 * r, b.m);
  if (type == QuantType::kQ8_0) {
    for (int k = 0; k < 32; ++k) group[g.q + k * 32 + r] = b.q[k];
    return;
  }
  if (type == QuantType::kQ4_K) {
    for (int j = 0; j < 8; ++j) {
      group[g.sc + j * 32 + r] = b.sc[j];
      group[g.mn + j * 32 + r] = b.mn[j];
    }
  }
  if (type == QuantType::kQ6_K) {
    for (int j = 0; j < 16; ++j) group[g.sc + j * 32 + r] = b.sc[j];
  }
  // A column's rows side by side in 8 lanes (quant_matmul.h): lane c holds
  // rows c, c + 8, c + 16, c + 24, 4 bits each (a 16-bit word, NibbleByte)
  // or 6 bits each for Q6_K (bytes 3c to 3c + 2 of the column).
  const int lane = r % 8, at = r / 8;
  if (type == QuantType::kQ6_K) {
    for (int k = 0; k < n; ++k) {
      const uint32_t v = uint32_t{b.q[k]} << (6 * at);
      uint8_t* column = group + g.q + k * 24;
      column[3 * lane] |= static_cast<uint8_t>(v);
      column[3 * lane + 1] |= static_cast<uint8_t>(v >> 8);
      column[3 * lane + 2] |= static_cast<uint8_t>(v >> 16);
    }
    return;
  }
  for (int k = 0; k < n; ++k) {
    group[NibbleByte(g, k, lane, at)] |= static_cast<uint8_t>((b.q[k] & 15) << (4 * (at % 2)));
  }
}

}  // namespace

int64_t QuantGroupBytes(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
      return 1088;
    case QuantType::kQ4_0:
      return 576;
    case QuantType::kQ4_1:
      return 640;
    case QuantType::kQ4_K:
      return 4736;
    case QuantType::kQ6_K:
      return 6720;
  }
  return 0;
}

absl::StatusOr<PackedMatrix> PackedMatrix::Pack(const QuantizedMatrix& m) {
  const int block = QuantBlockSize(m.type);
  if (m.data == nullptr || m.rows <= 0 || m.cols <= 0 || m.cols % block != 0 ||
      m.rows > std::numeric_limits<int>::max() - kQuantPanelRows ||
      m.cols > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot lay out a ", m.rows, " x ", m.cols, " ",
                                                   QuantTypeName(m.type), " matrix as panels"));
  }
  PackedMatrix out;
  out.type_ = m.type;
  out.rows_ = static_cast<int>(m.rows);
  out.cols_ = static_cast<int>(m.cols);
  out.group_bytes_ = QuantGroupBytes(m.type);
  const int groups = out.cols_ / block;
  out.panel_bytes_ = out.group_bytes_ * groups;
  const int64_t total = out.panel_bytes_ * out.num_panels();
  // 64-byte aligned, zeroed (huge_page_memory.h): padding rows are zero
  // weights. 32 bytes more than the panels: a kernel's load of a Q6_K
  // column reads 4 bytes past the last one (quant_panels.h's Q6Column).
  absl::StatusOr<HugePageMemory> memory = HugePageMemory::Allocate(static_cast<size_t>(total + 32));
  if (!memory.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", total, " bytes for a ",
                                                     QuantTypeName(m.type),
                                                     " matrix: ", memory.status().message()));
  }
  out.data_ = *std::move(memory);
  const int64_t row_bytes = m.row_bytes();
  const int block_bytes = QuantBlockBytes(m.type);
  for (int r = 0; r < out.rows_; ++r) {
    uint8_t* panel = out.data_.data() + (r / kQuantPanelRows) * out.panel_bytes_;
    const uint8_t* src = m.data + r * row_bytes;
    for (int g = 0; g < groups; ++g) {
      Place(m.type, DecodeQuantBlock(m.type, src + int64_t{g} * block_bytes), r % kQuantPanelRows,
            panel + g * out.group_bytes_);
    }
  }
  return out;
}

namespace {

// The integer of row `lane` of a group at its column k: Q8_0's signed byte,
// Q6_K's 6 bits (0..63), the others' nibble (0..15).
int RowCode(QuantType type, const GroupLayout& g, const uint8_t* group, int lane, int k) {
  if (type == QuantType::kQ8_0) return static_cast<int8_t>(group[g.q + k * 32 + lane]);
  const int c = lane % 8, at = lane / 8;
  if (type == QuantType::kQ6_K) {
    const uint8_t* column = group + g.q + k * 24;
    const uint32_t v = column[3 * c] | column[3 * c + 1] << 8 | column[3 * c + 2] << 16;
    return static_cast<int>(v >> (6 * at)) & 63;
  }
  return (group[NibbleByte(g, k, c, at)] >> (4 * (at % 2))) & 15;
}

}  // namespace

void PackedMatrix::DequantizeRow(int r, float* out) const {
  const int lane = r % kQuantPanelRows;
  const uint8_t* panel = this->panel(r / kQuantPanelRows);
  const GroupLayout g = LayoutOf(type_);
  const int n = QuantBlockSize(type_);
  for (int64_t gi = 0; gi < cols_ / n; ++gi) {
    const uint8_t* group = panel + gi * group_bytes_;
    float* y = out + gi * n;
    const float d = Half(group + g.d + 2 * lane);
    auto code = [&](int k) { return RowCode(type_, g, group, lane, k); };
    switch (type_) {
      case QuantType::kQ8_0:
        for (int k = 0; k < 32; ++k) y[k] = static_cast<float>(code(k)) * d;
        break;
      case QuantType::kQ4_0:
        for (int k = 0; k < 32; ++k) y[k] = d * static_cast<float>(code(k) - 8);
        break;
      case QuantType::kQ4_1: {
        const float m = Half(group + g.m + 2 * lane);
        for (int k = 0; k < 32; ++k) y[k] = d * static_cast<float>(code(k)) + m;
        break;
      }
      case QuantType::kQ4_K: {
        const float dmin = Half(group + g.m + 2 * lane);
        for (int j = 0; j < 8; ++j) {
          const float dl = d * static_cast<float>(group[g.sc + j * 32 + lane]);
          const float ml = dmin * static_cast<float>(group[g.mn + j * 32 + lane]);
          for (int l = 0; l < 32; ++l)
            y[32 * j + l] = dl * static_cast<float>(code(32 * j + l)) - ml;
        }
        break;
      }
      case QuantType::kQ6_K:
        for (int j = 0; j < 16; ++j) {
          const float dl = d * static_cast<float>(static_cast<int8_t>(group[g.sc + j * 32 + lane]));
          for (int l = 0; l < 16; ++l)
            y[16 * j + l] = dl * static_cast<float>(code(16 * j + l) - 32);
        }
        break;
    }
  }
}

void PackedMatrix::RowCodes(int r, float* q, float* dl, float* ml) const {
  const int lane = r % kQuantPanelRows;
  const uint8_t* panel = this->panel(r / kQuantPanelRows);
  const GroupLayout g = LayoutOf(type_);
  const int n = QuantBlockSize(type_);
  for (int64_t gi = 0; gi < cols_ / n; ++gi) {
    const uint8_t* group = panel + gi * group_bytes_;
    for (int k = 0; k < n; ++k)
      q[gi * n + k] = static_cast<float>(RowCode(type_, g, group, lane, k));
    const float d = Half(group + g.d + 2 * lane);
    switch (type_) {
      case QuantType::kQ8_0:
      case QuantType::kQ4_0:
      case QuantType::kQ4_1:
        dl[gi] = d;
        ml[gi] = type_ == QuantType::kQ8_0   ? 0.0f
                 : type_ == QuantType::kQ4_0 ? -8.0f * d
                                             : Half(group + g.m + 2 * lane);
        break;
      case QuantType::kQ4_K: {
        const float dmin = Half(group + g.m + 2 * lane);
        for (int j = 0; j < 8; ++j) {
          dl[gi * 8 + j] = d * static_cast<float>(group[g.sc + j * 32 + lane]);
          ml[gi * 8 + j] = -(dmin * static_cast<float>(group[g.mn + j * 32 + lane]));
        }
        break;
      }
      case QuantType::kQ6_K:
        for (int j = 0; j < 16; ++j) {
          dl[gi * 16 + j] =
              d * static_cast<float>(static_cast<int8_t>(group[g.sc + j * 32 + lane]));
          ml[gi * 16 + j] = -32.0f * dl[gi * 16 + j];
        }
        break;
    }
  }
}

void QuantBlockSums(const float* x, int64_t ldx, int m, int k, int sub, float* sums) {
  for (int i = 0; i < m; ++i) {
    for (int b = 0; b < k / sub; ++b) {
      float s = 0.0f;
      for (int kk = b * sub; kk < (b + 1) * sub; ++kk) s += x[i * ldx + kk];
      sums[i * (k / sub) + b] = s;
    }
  }
}

namespace {

// Rows of X times 2^s each for subnormal codes (quant_matmul.h), s = 126 -
// e for a row whose largest |x| is below 2^e (at most 127), and 2^(149 - s):
// false where a row's largest |x| is not finite or is 2^104 or more (s
// below 22 would put 2^(149 - s) beyond float).
// k is whole blocks, a multiple of 32.
bool ScaleForSubnormalCodes(const float* x, int64_t ldx, int m, int k, float* scaled,
                            float* unscale) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < m; ++i) {
    const float* row = x + i * ldx;
    // vmaxps passes its second operand on a NaN, so the running maximum
    // goes first and a NaN is passed over (it stays a NaN, scaled).
    __m256 top = _mm256_setzero_ps();
    for (int kk = 0; kk < k; kk += 8) {
      top = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row + kk), magnitude), top);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float largest = *std::max_element(lanes, lanes + 8);
    if (!std::isfinite(largest)) return false;
    int e = 0;
    std::frexp(largest, &e);
    const int s = std::min(127, 126 - e);
    if (s < 22) return false;
    const __m256 scale = _mm256_set1_ps(std::ldexp(1.0f, s));
    float* out = scaled + int64_t{i} * k;
    for (int kk = 0; kk < k; kk += 8) {
      _mm256_storeu_ps(out + kk, _mm256_mul_ps(_mm256_loadu_ps(row + kk), scale));
    }
    unscale[i] = std::ldexp(1.0f, 149 - s);
  }
  return true;
}

// A product of one row against a Q4_0 matrix of 64 rows and 4096 columns
// (147 KB, in a core's cache), timed for `codes`: the fastest of 3 runs of
// 8 products, in seconds.
double TimeCodeFloats(CodeFloats codes, const PackedMatrix& w, const std::vector<float>& x,
                      std::vector<float>& y) {
  const auto panels =
      BestMatmulIsa() == MatmulIsa::kAvx512 ? QuantMatmulPanelsAvx512 : QuantMatmulPanelsAvx2;
  const QuantRows rows = QuantRowInputs(x.data(), w.cols(), 1, w, codes);
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < 8; ++r) {
      panels(x.data(), w.cols(), 1, rows, w, 0, w.num_panels(), y.data(), w.rows());
    }
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

CodeFloats MeasureCodeFloats() {
  constexpr int kRows = 64, kCols = 4096;
  const QuantType type = QuantType::kQ4_0;
  std::vector<uint8_t> blocks(static_cast<size_t>(kRows) * kCols / 32 * QuantBlockBytes(type));
  Rng rng(12345);
  for (uint8_t& b : blocks) b = static_cast<uint8_t>(rng.NextU64());
  for (size_t at = 0; at < blocks.size(); at += QuantBlockBytes(type)) {
    Store16(blocks.data() + at, 0x2c00);  // d = 1/16
  }
  const auto w = PackedMatrix::Pack(
      QuantizedMatrix{.type = type, .rows = kRows, .cols = kCols, .data = blocks.data()});
  if (!w.ok()) return CodeFloats::kConverted;
  std::vector<float> x(kCols), y(kRows);
  for (int kk = 0; kk < kCols; ++kk) x[kk] = static_cast<float>(kk % 29) / 7.0f - 2.0f;
  // Alternating, so that a disturbance of the machine falls on both.
  double converted = 1e30, subnormal = 1e30;
  for (int round = 0; round < 2; ++round) {
    converted = std::min(converted, TimeCodeFloats(CodeFloats::kConverted, *w, x, y));
    subnormal = std::min(subnormal, TimeCodeFloats(CodeFloats::kSubnormal, *w, x, y));
  }
  return subnormal < converted ? CodeFloats::kSubnormal : CodeFloats::kConverted;
}

// -1: measure; else a CodeFloats.
std::atomic<int> code_floats_set{-1};
// Tasks a thread of a one-row product.
std::atomic<int> one_row_tasks{1};

}  // namespace

CodeFloats QuantCodeFloats() {
  if (const int set = code_floats_set.load(std::memory_order_relaxed); set >= 0) {
    return static_cast<CodeFloats>(set);
  }
  static const CodeFloats measured = MeasureCodeFloats();
  return measured;
}

int QuantTasksPerThread(int m) {
  return m == 1 ? one_row_tasks.load(std::memory_order_relaxed) : 4;
}

void SetQuantTasksPerThread(std::optional<int> tasks) {
  one_row_tasks.store(std::max(1, tasks.value_or(1)), std::memory_order_relaxed);
}

void SetQuantCodeFloats(std::optional<CodeFloats> codes) {
  code_floats_set.store(codes.has_value() ? static_cast<int>(*codes) : -1,
                        std::memory_order_relaxed);
}

QuantRows QuantRowInputs(const float* x, int64_t ldx, int m, const PackedMatrix& w,
                         CodeFloats codes) {
  struct Buffers {
    std::vector<float> sums, scaled;
  };
  thread_local Buffers buffers[2];  // sub-blocks of 16 and of 32
  const int sub = QuantSubBlockSize(w.type()), k = w.cols();
  Buffers& b = buffers[sub == 16 ? 0 : 1];
  b.sums.resize(static_cast<size_t>(m) * (k / sub));
  QuantBlockSums(x, ldx, m, k, sub, b.sums.data());
  QuantRows rows;
  rows.sums = b.sums.data();
  // Q8_0's kernels ignore them; a product of several types shares them.
  if (codes == CodeFloats::kSubnormal && m <= 2) {
    b.scaled.resize(static_cast<size_t>(m) * k);
    if (ScaleForSubnormalCodes(x, ldx, m, k, b.scaled.data(), rows.unscale)) {
      rows.scaled = b.scaled.data();
    }
  }
  return rows;
}

void QuantMatmulReference(const float* x, int64_t ldx, int m, const PackedMatrix& w, float* y,
                          int64_t ldy) {
  const int k = w.cols(), sub = QuantSubBlockSize(w.type()), nsub = k / sub;
  std::vector<float> q(k), dl(nsub), ml(nsub), sums(static_cast<size_t>(m) * nsub);
  QuantBlockSums(x, ldx, m, k, sub, sums.data());
  for (int j = 0; j < w.rows(); ++j) {
    w.RowCodes(j, q.data(), dl.data(), ml.data());
    for (int i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int b = 0; b < nsub; ++b) {
        float t = 0.0f;
        for (int kk = b * sub; kk < (b + 1) * sub; ++kk) t = std::fma(q[kk], x[i * ldx + kk], t);
        if (w.type() != QuantType::kQ8_0) acc = std::fma(ml[b], sums[i * nsub + b], acc);
        acc = std::fma(dl[b], t, acc);
      }
      y[i * ldy + j] = acc;
    }
  }
}

void QuantMatmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const PackedMatrix& w,
                 float* y, int64_t ldy, MatmulIsa isa, CodeFloats codes) {
  if (m <= 0 || w.rows() <= 0) return;
  const auto panels = isa == MatmulIsa::kAvx512 ? QuantMatmulPanelsAvx512 : QuantMatmulPanelsAvx2;
  const QuantRows rows = QuantRowInputs(x, ldx, m, w, codes);
  const int per = QuantPanelsPerUnit(m), n = w.num_panels();
  ForPanelRuns(
      pool, (n + per - 1) / per, int64_t{m} * w.rows() * w.cols(),
      [&](int u0, int u1) {
        panels(x, ldx, m, rows, w, std::min(n, u0 * per), std::min(n, u1 * per), y, ldy);
      },
      QuantTasksPerThread(m));
}

}  // namespace coalesce::engine::cpu
