#include "engine/cpu/products.h"

#include <algorithm>
#include <array>
#include <optional>

#include "engine/cpu/matmul_panels.h"

namespace coalesce::engine::cpu {
namespace {

// Products one loop takes; more run one after another.
constexpr size_t kMaxTogether = 8;

// The product alone, as its own kernel's entry point runs it.
void Alone(ThreadPool& pool, const MatmulProduct& p, const float* x, int64_t ldx, int m, int k) {
  if (p.w.float_panels != nullptr) {
    FloatPanelsMatmul(pool, x, ldx, m, *p.w.float_panels, p.y, p.ldy);
  } else if (p.w.panels != nullptr) {
    QuantMatmul(pool, x, ldx, m, *p.w.panels, p.y, p.ldy);
  } else if (p.w.int8 != nullptr) {
    Int8Matmul(pool, x, ldx, m, *p.w.int8, p.y, p.ldy);
  } else {
    Matmul(pool, x, ldx, m, p.w.f, p.n, k, p.y, p.ldy);
  }
}

// Units of rows a loop may split the product into: W's panels of 32 rows
// (float32, laid out or not, and quantized; QuantPanelsPerUnit of them
// for m rows of X) or int8 groups of 16.
int Units(const MatmulProduct& p, int m) {
  if (p.w.float_panels != nullptr) return p.w.float_panels->num_panels();
  if (p.w.panels != nullptr) {
    const int per = QuantPanelsPerUnit(m);
    return (p.w.panels->num_panels() + per - 1) / per;
  }
  if (p.w.int8 != nullptr) return p.w.int8->num_groups();
  return (p.n + kMatmulRowUnit - 1) / kMatmulRowUnit;
}

// Units [u0, u1) of the product, on this thread.
void RunUnits(const MatmulProduct& p, const float* x, int64_t ldx, int m, int k, const Int8Rows& q,
              const QuantRows& rows, int u0, int u1) {
  if (p.w.float_panels != nullptr) {
    FloatPanelsMatmulPanels(x, ldx, m, *p.w.float_panels, u0, u1, p.y, p.ldy);
  } else if (p.w.int8 != nullptr) {
    Int8MatmulGroups(q, *p.w.int8, u0, u1, p.y, p.ldy);
  } else if (p.w.panels != nullptr) {
    const int per = QuantPanelsPerUnit(m), n = p.w.panels->num_panels();
    (BestMatmulIsa() == MatmulIsa::kAvx512 ? QuantMatmulPanelsAvx512 : QuantMatmulPanelsAvx2)(
        x, ldx, m, rows, *p.w.panels, std::min(n, u0 * per), std::min(n, u1 * per), p.y, p.ldy);
  } else {
    MatmulRows(x, ldx, m, p.w.f, p.n, k, std::min(p.n, u0 * kMatmulRowUnit),
               std::min(p.n, u1 * kMatmulRowUnit), p.y, p.ldy);
  }
}

}  // namespace

void MatmulTogether(ThreadPool& pool, std::span<const MatmulProduct> products, const float* x,
                    int64_t ldx, int m, int k, Int8Rows& int8_rows) {
  const int threads = pool.size();
  int64_t work = 0;
  bool int8 = false;
  for (const MatmulProduct& p : products) {
    work += int64_t{m} * p.n * k;
    int8 = int8 || p.w.int8 != nullptr;
  }
  // Alone where there is one, where the products are too small to split
  // (the kernels' own thresholds: a handoff costs more than it saves), or
  // where X must be prepared first (Matmul across many rows).
  if (products.size() < 2 || products.size() > kMaxTogether || threads == 1 || m <= 0 || k <= 0 ||
      work < (int64_t{1} << 17) || !MatmulSplitsRows(m)) {
    for (const MatmulProduct& p : products) Alone(pool, p, x, ldx, m, k);
    return;
  }
  if (int8) QuantizeRows(x, ldx, m, k, int8_rows);
  // Each product's units in a few tasks per thread, as its own call would
  // split it; the tasks of all of them in one loop.
  struct Piece {
    int units, tasks, first;
  };
  std::array<Piece, kMaxTogether> pieces;  // no allocation in a decode step
  // The quantized products' inputs from X (block sums, scaled rows),
  // computed here once for each sub-block size (16 or 32), not by each task.
  std::array<QuantRows, kMaxTogether> rows{};
  std::optional<QuantRows> rows_by_size[2];
  int total = 0;
  for (size_t i = 0; i < products.size(); ++i) {
    if (const PackedMatrix* w = products[i].w.panels; w != nullptr) {
      std::optional<QuantRows>& r = rows_by_size[QuantSubBlockSize(w->type()) / 32];
      if (!r.has_value()) r = QuantRowInputs(x, ldx, m, *w);
      rows[i] = *r;
    }
    const int units = Units(products[i], m);
    const int per_thread = products[i].w.int8 != nullptr     ? Int8TasksPerThread(m)
                           : products[i].w.panels != nullptr ? QuantTasksPerThread(m)
                                                             : 4;
    const int tasks = EvenTasks(units, threads, per_thread);
    pieces[i] = {units, tasks, total};
    total += tasks;
  }
  pool.ParallelFor(total, [&](int task, int) {
    size_t i = 0;
    while (i + 1 < products.size() && task >= pieces[i + 1].first) ++i;
    const Piece& piece = pieces[i];
    const int t = task - piece.first;
    RunUnits(products[i], x, ldx, m, k, int8_rows, rows[i],
             static_cast<int>(int64_t{piece.units} * t / piece.tasks),
             static_cast<int>(int64_t{piece.units} * (t + 1) / piece.tasks));
  });
}

}  // namespace coalesce::engine::cpu
