#include "engine/cpu/float_panels.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/matmul_panels.h"

namespace coalesce::engine::cpu {

static_assert(FloatPanels::kRows == kPanel, "a laid-out panel is one panel of the product");

absl::StatusOr<FloatPanels> FloatPanels::Pack(const float* w, int64_t rows, int64_t cols) {
  if (w == nullptr || rows <= 0 || cols <= 0 || rows > std::numeric_limits<int>::max() - kRows ||
      cols > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot lay out a ", rows, " x ", cols, " float32 matrix as panels"));
  }
  FloatPanels out;
  out.rows_ = static_cast<int>(rows);
  out.cols_ = static_cast<int>(cols);
  const int64_t bytes = out.bytes();
  // 64-byte aligned (the kernels' aligned loads), zeroed (huge_page_memory.h):
  // padding rows are zero weights.
  absl::StatusOr<HugePageMemory> memory = HugePageMemory::Allocate(static_cast<size_t>(bytes));
  if (!memory.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes,
                     " bytes for a float32 matrix's panels: ", memory.status().message()));
  }
  out.data_ = *std::move(memory);
  float* data = out.data_.as<float>();
  for (int p = 0; p < out.num_panels(); ++p) {
    float* panel = data + int64_t{p} * cols * kRows;
    const int64_t first = int64_t{p} * kRows;
    const int real = static_cast<int>(std::min<int64_t>(kRows, rows - first));
    if (real < kRows) std::memset(panel, 0, sizeof(float) * cols * kRows);
    // A few columns of the panel's rows at a time: the source rows' lines
    // stay in cache while the panel is written in order.
    constexpr int64_t kCols = 64;
    for (int64_t c0 = 0; c0 < cols; c0 += kCols) {
      const int64_t c1 = std::min(cols, c0 + kCols);
      for (int r = 0; r < real; ++r) {
        const float* src = w + (first + r) * cols;
        for (int64_t c = c0; c < c1; ++c) panel[c * kRows + r] = src[c];
      }
    }
  }
  return out;
}

void FloatPanels::Row(int r, float* out) const {
  const float* panel = this->panel(r / kRows) + r % kRows;
  for (int c = 0; c < cols_; ++c) out[c] = panel[int64_t{c} * kRows];
}

void FloatPanelsMatmulPanels(const float* x, int64_t ldx, int m, const FloatPanels& w, int p0,
                             int p1, float* y, int64_t ldy) {
  if (m <= 0 || p0 >= p1) return;
  const int j0 = p0 * FloatPanels::kRows;
  const int rows = std::min(w.rows(), p1 * FloatPanels::kRows) - j0;
  MatmulLaidOutAvx2(x, ldx, m, w.panel(p0), rows, w.cols(), y + j0, ldy);
}

void FloatPanelsMatmul(ThreadPool& pool, const float* x, int64_t ldx, int m, const FloatPanels& w,
                       float* y, int64_t ldy) {
  if (m <= 0 || w.rows() <= 0) return;
  ForPanelRuns(pool, w.num_panels(), int64_t{m} * w.rows() * w.cols(),
               [&](int p0, int p1) { FloatPanelsMatmulPanels(x, ldx, m, w, p0, p1, y, ldy); });
}

}  // namespace coalesce::engine::cpu
