// The Prometheus metrics of a coalesce server. The engine loop reports to it
// through batcher::LoopObserver; the service reports the requests it rejects
// before they reach the loop. Every metric is documented in docs/metrics.md.
#pragma once

#include <cstdint>
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

// What is being served, for the info metrics and the bandwidth ratio.
struct ServerInfo {
  std::string version;       // of coalesce
  std::string model;         // model name
  std::string architecture;  // e.g. "llama"
  std::string backend;       // "cpu", "cuda"
  bool synthetic = false;
  int64_t parameters = 0;
  // What the KV cache holds ("fp32", "bf16", "fp16", "int8") and how many
  // token positions it has room for.
  std::string kv_cache_dtype = "fp32";
  int64_t kv_cache_capacity_tokens = 0;
  // The device's memory read bandwidth (measured at start-up), bytes/s.
  double memory_bandwidth = 0;
};

class ServerMetrics : public batcher::LoopObserver {
 public:
  ServerMetrics(std::shared_ptr<prometheus::Registry> registry, const ServerInfo& info);

  // LoopObserver
  void OnStep(const batcher::StepStats& stats) override;
  void OnQueue(const batcher::QueueStats& stats) override;
  void OnAdmitted(absl::Duration queue_wait, absl::Duration window_wait) override;
  void OnAdmission(int requests) override;
  void OnFirstToken(absl::Duration time_to_first_token, std::string_view tenant) override;
  void OnInterToken(absl::Duration gap) override;
  void OnFinished(const batcher::RequestSummary& summary) override;

  void OnRejected(std::string_view reason) override;
  void OnPreempted() override;
  void OnPreemptedForAdmission(std::string_view reason, std::string_view tenant) override;
  void OnPrefixCacheLookup(int prompt_tokens, int cached_tokens) override;

  // A Generate stream ended because its client stopped reading.
  void OnStalledStream();

  // A connection to the gRPC port closed at once: its peer address already
  // held --max_connections_per_peer.
  void OnConnectionRefused();

  // A request that ended before the engine loop took it (validation,
  // draining, full queue, a tenant's limit), by lower-case status code
  // name, and its tenant's (--api_keys_file; empty: none named).
  void CountEndedBeforeEngine(std::string_view status, std::string_view tenant = "");

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
  // With --api_keys_file: requests by tenant and status, tokens by tenant
  // and kind (prompt, generated). Their labels come from the file.
  prometheus::Family<prometheus::Counter>& tenant_requests_;
  prometheus::Family<prometheus::Counter>& tenant_tokens_;
  // Sequences preempted to make room for a tenant below its share.
  prometheus::Family<prometheus::Counter>& tenant_preemptions_;
  prometheus::Family<prometheus::Counter>& admission_preemptions_;
  // Time to first token by tenant.
  prometheus::Family<prometheus::Histogram>& tenant_time_to_first_token_;
  prometheus::Counter& stalled_streams_;
  prometheus::Counter& connections_refused_;
  prometheus::Counter& preemptions_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;
  prometheus::Histogram& prefill_tokens_per_step_;
  prometheus::Histogram& decode_tokens_per_step_;
  prometheus::Family<prometheus::Gauge>& kv_blocks_;
  prometheus::Gauge& kv_blocks_free_;
  prometheus::Gauge& kv_blocks_used_;
  prometheus::Gauge& kv_usage_ratio_;
  prometheus::Histogram& window_wait_;
  prometheus::Histogram& admission_size_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Histogram& step_prefill_seconds_;
  prometheus::Histogram& step_decode_seconds_;
  prometheus::Histogram& step_mixed_seconds_;
  prometheus::Gauge& memory_bandwidth_;
  prometheus::Gauge& bandwidth_utilization_;
  prometheus::Counter& prefix_lookup_tokens_;
  prometheus::Counter& prefix_hit_tokens_;
  prometheus::Gauge& prefix_blocks_;
  prometheus::Counter& prefix_evictions_;
  int64_t evictions_seen_ = 0;  // the loop's count at the last OnQueue

  // The last steps' bytes and seconds, for the bandwidth ratio. Touched only
  // by OnStep, which the one engine thread calls.
  static constexpr int kBandwidthWindow = 32;
  const double device_bandwidth_;
  double step_bytes_[kBandwidthWindow] = {};
  double step_secs_[kBandwidthWindow] = {};
  int next_step_slot_ = 0;
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
