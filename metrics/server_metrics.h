// The Prometheus metrics of a coalesce server. The engine loop reports to it
// through batcher::LoopObserver; the service reports the requests it rejects
// before they reach the loop. Every metric is documented in README.md.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/synchronization/mutex.h"
#include "batcher/observer.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace coalesce::metrics {

class ServerMetrics : public batcher::LoopObserver {
 public:
  explicit ServerMetrics(std::shared_ptr<prometheus::Registry> registry);

  // LoopObserver
  void OnStep(const batcher::StepStats& stats) override;
  void OnQueue(const batcher::QueueStats& stats) override;
  void OnAdmitted(absl::Duration queue_wait) override;
  void OnFirstToken(absl::Duration time_to_first_token) override;
  void OnInterToken(absl::Duration gap) override;
  void OnFinished(const batcher::RequestSummary& summary) override;

  void OnRejected(std::string_view reason) override;
  void OnPreempted() override;

  // A request that ended before the engine loop took it (validation,
  // draining, full queue), by lower-case status code name.
  void CountEndedBeforeEngine(std::string_view status);

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  prometheus::Counter& RequestsWithStatus(std::string_view status);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_total_;
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Histogram& queue_wait_;
  prometheus::Histogram& time_to_first_token_;
  prometheus::Histogram& inter_token_latency_;
  prometheus::Histogram& request_duration_;
  prometheus::Histogram& batch_size_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& generated_tokens_;
  prometheus::Family<prometheus::Counter>& rejected_total_;
  prometheus::Counter& preemptions_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;
  prometheus::Histogram& prefill_tokens_per_step_;
  prometheus::Histogram& decode_tokens_per_step_;
  prometheus::Histogram& step_duration_;
  prometheus::Family<prometheus::Gauge>& kv_blocks_;
  prometheus::Gauge& kv_blocks_free_;
  prometheus::Gauge& kv_blocks_used_;
  prometheus::Gauge& kv_usage_ratio_;
};

// Serves `registry` in the Prometheus text format at http://ADDRESS/metrics.
class MetricsEndpoint {
 public:
  // `address` is "host:port"; port 0 picks a free one. Throws nothing:
  // failure to bind is reported by the returned null pointer and `error`.
  static std::unique_ptr<MetricsEndpoint> Start(const std::string& address,
                                                std::shared_ptr<prometheus::Registry> registry,
                                                std::string* error);
  int port() const;

 private:
  explicit MetricsEndpoint(std::unique_ptr<prometheus::Exposer> exposer)
      : exposer_(std::move(exposer)) {}
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace coalesce::metrics
