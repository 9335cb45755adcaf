// Timing against the memory read bandwidth on a shared machine, whose
// bandwidth moves by half from minute to minute (other tenants read memory
// too): each timed pass runs right after one pass of the bandwidth probe, so
// that both sample the same minutes, and the probe's pass evicts the caches,
// so the timed pass reads its weights from memory. coalesce-quant-bench and
// coalesce-engine-bench --limits put their floors on it.
#pragma once

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "engine/cpu/memory_bandwidth.h"

namespace coalesce::bench {

struct ProbePairs {
  absl::Status status;                // the first failed pass's
  double seconds = 0, fastest = 0;    // median and least pass
  double bandwidth = 0, highest = 0;  // median and most probe pass, bytes/s
  std::vector<double> probe_passes;   // bytes/s, in order

  // `bytes` over the bandwidth, against the pass: the medians', and the
  // bests' (others on the machine only ever slow either down, so the bests
  // are the quiet machine).
  double MedianShare(double bytes) const { return bytes / bandwidth / seconds; }
  double BestShare(double bytes) const { return bytes / highest / fastest; }
};

// `passes` pairs of a probe pass and pass(i), which returns an absl::Status;
// stops at the first that fails.
template <typename Pass>
ProbePairs TimeAfterProbePasses(engine::MemoryReadProbe& probe, int passes, Pass&& pass) {
  ProbePairs out;
  std::vector<double> seconds;
  for (int i = 0; i < passes; ++i) {
    out.probe_passes.push_back(probe.Pass());
    const absl::Time start = absl::Now();
    out.status = pass(i);
    if (!out.status.ok()) return out;
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  if (seconds.empty()) return out;
  std::vector<double> bandwidths = out.probe_passes;
  std::sort(seconds.begin(), seconds.end());
  std::sort(bandwidths.begin(), bandwidths.end());
  out.seconds = seconds[seconds.size() / 2];
  out.fastest = seconds.front();
  out.bandwidth = bandwidths[bandwidths.size() / 2];
  out.highest = bandwidths.back();
  return out;
}

}  // namespace coalesce::bench
