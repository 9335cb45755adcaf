#include "batcher/step_cost.h"

#include <algorithm>
#include <cmath>

namespace coalesce::batcher {

StepShape& StepShape::operator+=(const StepShape& other) {
  rows += other.rows;
  decode_positions += other.decode_positions;
  prefill_positions += other.prefill_positions;
  logit_rows += other.logit_rows;
  scored_rows += other.scored_rows;
  return *this;
}

int64_t ChunkPositions(int cached, int tokens) {
  return int64_t{tokens} * cached + int64_t{tokens} * (tokens + 1) / 2;
}

// Features in units that keep the normal equations well scaled: rows in
// thousands, positions in millions.
StepCostModel::Features StepCostModel::FeaturesOf(const StepShape& shape) {
  return {1.0, shape.rows / 1e3, static_cast<double>(shape.decode_positions) / 1e6,
          static_cast<double>(shape.prefill_positions) / 1e6, shape.logit_rows / 1e3};
}

void StepCostModel::Observe(const StepShape& shape, absl::Duration duration) {
  if (shape.scored_rows > 0) ++scored_steps_;
  std::deque<Sample>& window = shape.prefill_positions > 0 ? prefill_ : decode_;
  window.push_back({FeaturesOf(shape), absl::ToDoubleSeconds(duration)});
  if (window.size() > static_cast<size_t>(kWindow)) window.pop_front();
  Fit();
}

bool StepCostModel::ready() const {
  return prefill_.size() + decode_.size() >= static_cast<size_t>(kMinSteps) &&
         prefill_.size() >= static_cast<size_t>(kMinPrefillSteps);
}

// Least squares over both windows with every coefficient at zero or above: a
// coefficient that comes out negative is left out (kept at zero) and the
// others fit again, until none is negative. A small ridge keeps features the
// window does not vary (every step of one shape) from making the equations
// singular.
void StepCostModel::Fit() {
  std::array<bool, kFeatures> active;
  active.fill(true);
  Features beta{};
  for (int round = 0; round < kFeatures; ++round) {
    // Normal equations of the active features: A beta = b.
    double a[kFeatures][kFeatures] = {};
    double b[kFeatures] = {};
    for (const std::deque<Sample>* window : {&prefill_, &decode_}) {
      for (const Sample& s : *window) {
        for (int i = 0; i < kFeatures; ++i) {
          if (!active[i]) continue;
          b[i] += s.x[i] * s.seconds;
          for (int j = 0; j < kFeatures; ++j) {
            if (active[j]) a[i][j] += s.x[i] * s.x[j];
          }
        }
      }
    }
    for (int i = 0; i < kFeatures; ++i) {
      if (active[i]) {
        a[i][i] += 1e-9 + 1e-6 * a[i][i];
      } else {
        a[i][i] = 1.0;  // beta[i] = 0
      }
    }
    // Gaussian elimination with partial pivoting.
    for (int c = 0; c < kFeatures; ++c) {
      int pivot = c;
      for (int r = c + 1; r < kFeatures; ++r) {
        if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
      }
      for (int j = 0; j < kFeatures; ++j) std::swap(a[c][j], a[pivot][j]);
      std::swap(b[c], b[pivot]);
      if (a[c][c] == 0.0) continue;
      for (int r = c + 1; r < kFeatures; ++r) {
        const double f = a[r][c] / a[c][c];
        for (int j = c; j < kFeatures; ++j) a[r][j] -= f * a[c][j];
        b[r] -= f * b[c];
      }
    }
    for (int c = kFeatures - 1; c >= 0; --c) {
      double sum = b[c];
      for (int j = c + 1; j < kFeatures; ++j) sum -= a[c][j] * beta[j];
      beta[c] = a[c][c] == 0.0 ? 0.0 : sum / a[c][c];
    }
    int most_negative = -1;
    for (int i = 0; i < kFeatures; ++i) {
      if (active[i] && beta[i] < 0 && (most_negative < 0 || beta[i] < beta[most_negative])) {
        most_negative = i;
      }
    }
    if (most_negative < 0) break;
    active[most_negative] = false;
    beta[most_negative] = 0.0;
  }
  for (double& c : beta) c = std::max(c, 0.0);
  coefficients_ = beta;
}

absl::Duration StepCostModel::Predict(const StepShape& shape) const {
  const Features x = FeaturesOf(shape);
  double seconds = 0;
  for (int i = 0; i < kFeatures; ++i) seconds += coefficients_[i] * x[i];
  return absl::Seconds(seconds);
}

int StepCostModel::MaxChunk(const StepShape& so_far, int cached, bool scored, int at_most,
                            absl::Duration target) const {
  auto fits = [&](int tokens) {
    StepShape shape = so_far;
    shape += {.rows = tokens,
              .prefill_positions = ChunkPositions(cached, tokens),
              .logit_rows = scored ? tokens : 1,
              .scored_rows = scored ? tokens : 0};
    return Predict(shape) <= target;
  };
  // The predicted duration grows with the chunk: the largest that fits.
  if (at_most <= 0 || !fits(1)) return 0;
  int lo = 1, hi = at_most;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace coalesce::batcher
