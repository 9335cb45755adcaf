#include "metrics/server_metrics.h"

#include <exception>
#include <vector>

namespace coalesce::metrics {
namespace {

using prometheus::Histogram;

// Bucket upper bounds (seconds unless named otherwise), each chosen for the
// range its quantity lives in: an inter-token gap of 0.5 ms and a queue wait
// of 30 s both need resolution.
const Histogram::BucketBoundaries kQueueWaitBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const Histogram::BucketBoundaries kFirstTokenBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const Histogram::BucketBoundaries kInterTokenBuckets = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
const Histogram::BucketBoundaries kRequestDurationBuckets = {
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800};
const Histogram::BucketBoundaries kStepDurationBuckets = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10};
// Sequences per engine step: powers of two up to the largest batch we allow.
const Histogram::BucketBoundaries kBatchSizeBuckets = {1, 2, 4, 8, 16, 32, 64, 128, 256};

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

ServerMetrics::ServerMetrics(std::shared_ptr<prometheus::Registry> registry)
    : registry_(std::move(registry)),
      requests_total_(prometheus::BuildCounter()
                          .Name("coalesce_requests_total")
                          .Help("Generate requests that ended, by final gRPC status "
                                "(ok, cancelled, deadline_exceeded, invalid_argument, ...)")
                          .Register(*registry_)),
      running_(prometheus::BuildGauge()
                   .Name("coalesce_requests_running")
                   .Help("Sequences in the running batch")
                   .Register(*registry_)
                   .Add({})),
      waiting_(prometheus::BuildGauge()
                   .Name("coalesce_requests_waiting")
                   .Help("Requests waiting to be admitted into the batch")
                   .Register(*registry_)
                   .Add({})),
      queue_wait_(prometheus::BuildHistogram()
                      .Name("coalesce_queue_wait_seconds")
                      .Help("Time from arrival to admission into the batch "
                            "(includes the coalescing window)")
                      .Register(*registry_)
                      .Add({}, kQueueWaitBuckets)),
      time_to_first_token_(prometheus::BuildHistogram()
                               .Name("coalesce_time_to_first_token_seconds")
                               .Help("Time from arrival to the first generated token")
                               .Register(*registry_)
                               .Add({}, kFirstTokenBuckets)),
      inter_token_latency_(prometheus::BuildHistogram()
                               .Name("coalesce_inter_token_latency_seconds")
                               .Help("Time between consecutive tokens of one request")
                               .Register(*registry_)
                               .Add({}, kInterTokenBuckets)),
      request_duration_(prometheus::BuildHistogram()
                            .Name("coalesce_request_duration_seconds")
                            .Help("Time from arrival to the end of a request that "
                                  "reached the engine")
                            .Register(*registry_)
                            .Add({}, kRequestDurationBuckets)),
      batch_size_(prometheus::BuildHistogram()
                      .Name("coalesce_batch_size")
                      .Help("Sequences per engine step")
                      .Register(*registry_)
                      .Add({}, kBatchSizeBuckets)),
      prompt_tokens_(prometheus::BuildCounter()
                         .Name("coalesce_prompt_tokens_total")
                         .Help("Prompt tokens processed (prefilled)")
                         .Register(*registry_)
                         .Add({})),
      generated_tokens_(prometheus::BuildCounter()
                            .Name("coalesce_generated_tokens_total")
                            .Help("Tokens generated")
                            .Register(*registry_)
                            .Add({})),
      step_duration_(prometheus::BuildHistogram()
                         .Name("coalesce_engine_step_seconds")
                         .Help("Time of one batched engine step")
                         .Register(*registry_)
                         .Add({}, kStepDurationBuckets)),
      kv_blocks_free_(prometheus::BuildGauge()
                          .Name("coalesce_kv_cache_blocks")
                          .Help("KV-cache blocks by state")
                          .Register(*registry_)
                          .Add({{"state", "free"}})),
      kv_blocks_used_(prometheus::BuildGauge()
                          .Name("coalesce_kv_cache_blocks")
                          .Help("KV-cache blocks by state")
                          .Register(*registry_)
                          .Add({{"state", "used"}})),
      kv_usage_ratio_(prometheus::BuildGauge()
                          .Name("coalesce_kv_cache_usage_ratio")
                          .Help("Fraction of KV-cache blocks in use (0 to 1)")
                          .Register(*registry_)
                          .Add({})) {
  // Create the usual outcomes up front so that rate() sees them from zero.
  for (std::string_view status : {"ok", "cancelled", "deadline_exceeded", "invalid_argument",
                                  "resource_exhausted", "unavailable", "internal"}) {
    RequestsWithStatus(status);
  }
}

prometheus::Counter& ServerMetrics::RequestsWithStatus(std::string_view status) {
  // Family::Add returns the existing child for known labels; the label set is
  // bounded by the number of gRPC status codes.
  return requests_total_.Add({{"status", std::string(status)}});
}

void ServerMetrics::OnStep(const batcher::StepStats& stats) {
  batch_size_.Observe(stats.num_seqs);
  step_duration_.Observe(Seconds(stats.duration));
  prompt_tokens_.Increment(stats.prefill_tokens);
  // Every sequence of a successful step yields one token.
  generated_tokens_.Increment(stats.num_seqs);
}

void ServerMetrics::OnQueue(const batcher::QueueStats& stats) {
  running_.Set(stats.running);
  waiting_.Set(stats.waiting);
  const int used = stats.total_kv_blocks - stats.free_kv_blocks;
  kv_blocks_free_.Set(stats.free_kv_blocks);
  kv_blocks_used_.Set(used);
  kv_usage_ratio_.Set(stats.total_kv_blocks > 0 ? static_cast<double>(used) / stats.total_kv_blocks
                                                : 0.0);
}

void ServerMetrics::OnAdmitted(absl::Duration queue_wait) {
  queue_wait_.Observe(Seconds(queue_wait));
}

void ServerMetrics::OnFirstToken(absl::Duration ttft) {
  time_to_first_token_.Observe(Seconds(ttft));
}

void ServerMetrics::OnInterToken(absl::Duration gap) { inter_token_latency_.Observe(Seconds(gap)); }

void ServerMetrics::OnFinished(const batcher::RequestSummary& summary) {
  RequestsWithStatus(summary.status).Increment();
  request_duration_.Observe(Seconds(summary.duration));
}

void ServerMetrics::CountRejected(std::string_view status) {
  RequestsWithStatus(status).Increment();
}

std::unique_ptr<MetricsEndpoint> MetricsEndpoint::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry,
    std::string* error) {
  try {
    auto exposer = std::make_unique<prometheus::Exposer>(address);
    exposer->RegisterCollectable(registry);
    return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(exposer)));
  } catch (const std::exception& e) {
    // prometheus-cpp (civetweb) reports a port it cannot bind by throwing.
    *error = e.what();
    return nullptr;
  }
}

int MetricsEndpoint::port() const {
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace coalesce::metrics
