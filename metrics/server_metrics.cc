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

// Tokens per engine step, by phase: powers of two up to the largest budget.
const Histogram::BucketBoundaries kBatchTokensBuckets = {1,   2,   4,   8,    16,   32,   64,
                                                         128, 256, 512, 1024, 2048, 4096, 8192};

// One unlabelled metric of a new family.
prometheus::Histogram& NewHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help,
                                    const Histogram::BucketBoundaries& buckets) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add({}, buckets);
}
prometheus::Gauge& NewGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}
prometheus::Counter& NewCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

ServerMetrics::ServerMetrics(std::shared_ptr<prometheus::Registry> registry, const ServerInfo& info)
    : registry_(std::move(registry)),
      requests_total_(prometheus::BuildCounter()
                          .Name("coalesce_requests_total")
                          .Help("Generate requests that ended, by final gRPC status "
                                "(ok, cancelled, deadline_exceeded, invalid_argument, ...)")
                          .Register(*registry_)),
      running_(NewGauge(*registry_, "coalesce_requests_running", "Sequences in the running batch")),
      waiting_(NewGauge(*registry_, "coalesce_requests_waiting",
                        "Requests waiting to be admitted into the batch")),
      queue_wait_(NewHistogram(*registry_, "coalesce_queue_wait_seconds",
                               "Time from arrival to admission into the batch "
                               "(includes the coalescing window)",
                               kQueueWaitBuckets)),
      time_to_first_token_(NewHistogram(*registry_, "coalesce_time_to_first_token_seconds",
                                        "Time from arrival to the first generated token",
                                        kFirstTokenBuckets)),
      inter_token_latency_(NewHistogram(*registry_, "coalesce_inter_token_latency_seconds",
                                        "Time between consecutive tokens of one request",
                                        kInterTokenBuckets)),
      request_duration_(NewHistogram(*registry_, "coalesce_request_duration_seconds",
                                     "Time from arrival to the end of a request that reached "
                                     "the engine",
                                     kRequestDurationBuckets)),
      batch_size_(NewHistogram(*registry_, "coalesce_batch_size", "Sequences per engine step",
                               kBatchSizeBuckets)),
      prompt_tokens_(NewCounter(*registry_, "coalesce_prompt_tokens_total",
                                "Prompt tokens processed (prefilled)")),
      generated_tokens_(
          NewCounter(*registry_, "coalesce_generated_tokens_total", "Tokens generated")),
      rejected_total_(prometheus::BuildCounter()
                          .Name("coalesce_requests_rejected_total")
                          .Help("Requests refused or dropped before they ran, by reason "
                                "(invalid, too_long, queue_full, queue_timeout)")
                          .Register(*registry_)),
      tenant_requests_(prometheus::BuildCounter()
                           .Name("coalesce_tenant_requests_total")
                           .Help("Generate requests that ended, by tenant (--api_keys_file) and "
                                 "final gRPC status")
                           .Register(*registry_)),
      tenant_tokens_(prometheus::BuildCounter()
                         .Name("coalesce_tenant_tokens_total")
                         .Help("Tokens of the requests that ended, by tenant (--api_keys_file) "
                               "and kind (prompt, generated)")
                         .Register(*registry_)),
      tenant_preemptions_(prometheus::BuildCounter()
                              .Name("coalesce_tenant_preemptions_total")
                              .Help("Running sequences of the tenant sent back to the queue to "
                                    "make room for a tenant below its share of the batch "
                                    "(resumed later by recomputation)")
                              .Register(*registry_)),
      admission_preemptions_(prometheus::BuildCounter()
                                 .Name("coalesce_admission_preemptions_total")
                                 .Help("Running sequences sent back to the queue to make room "
                                       "for a waiting request, by reason (tenant_share, "
                                       "priority, samples); resumed later by recomputation")
                                 .Register(*registry_)),
      tenant_time_to_first_token_(prometheus::BuildHistogram()
                                      .Name("coalesce_tenant_time_to_first_token_seconds")
                                      .Help("Time from arrival to the first generated token, by "
                                            "tenant (--api_keys_file)")
                                      .Register(*registry_)),
      stalled_streams_(NewCounter(*registry_, "coalesce_stalled_streams_total",
                                  "Generate streams ended because their client read nothing "
                                  "for --stream_stall_timeout (counted cancelled)")),
      connections_refused_(NewCounter(*registry_, "coalesce_connections_refused_total",
                                      "Connections to the gRPC port closed at once because "
                                      "their peer address already held "
                                      "--max_connections_per_peer")),
      preemptions_(NewCounter(*registry_, "coalesce_preemptions_total",
                              "Running sequences sent back to the queue for lack of KV blocks "
                              "(resumed later by recomputation)")),
      batch_tokens_(prometheus::BuildHistogram()
                        .Name("coalesce_batch_tokens")
                        .Help("Tokens processed per engine step, by phase (prefill, decode); "
                              "a step without tokens of a phase is not observed for it")
                        .Register(*registry_)),
      prefill_tokens_per_step_(batch_tokens_.Add({{"phase", "prefill"}}, kBatchTokensBuckets)),
      decode_tokens_per_step_(batch_tokens_.Add({{"phase", "decode"}}, kBatchTokensBuckets)),
      kv_blocks_(prometheus::BuildGauge()
                     .Name("coalesce_kv_cache_blocks")
                     .Help("KV-cache blocks by state: used (held by running sequences), "
                           "free (the rest, including cached prefix blocks nobody holds)")
                     .Register(*registry_)),
      kv_blocks_free_(kv_blocks_.Add({{"state", "free"}})),
      kv_blocks_used_(kv_blocks_.Add({{"state", "used"}})),
      kv_usage_ratio_(NewGauge(*registry_, "coalesce_kv_cache_usage_ratio",
                               "Fraction of KV-cache blocks in use (0 to 1)")),
      window_wait_(NewHistogram(*registry_, "coalesce_window_wait_seconds",
                                "Time each admitted request was held by the coalescing window",
                                kQueueWaitBuckets)),
      admission_size_(NewHistogram(*registry_, "coalesce_admission_requests",
                                   "Requests admitted together by one scheduling decision",
                                   kBatchSizeBuckets)),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("coalesce_engine_step_seconds")
                        .Help("Time of one batched engine step, by phase: prefill (prompt "
                              "tokens only), decode (decode tokens only), mixed")
                        .Register(*registry_)),
      step_prefill_seconds_(step_seconds_.Add({{"phase", "prefill"}}, kStepDurationBuckets)),
      step_decode_seconds_(step_seconds_.Add({{"phase", "decode"}}, kStepDurationBuckets)),
      step_mixed_seconds_(step_seconds_.Add({{"phase", "mixed"}}, kStepDurationBuckets)),
      memory_bandwidth_(NewGauge(*registry_, "coalesce_memory_bandwidth_bytes_per_second",
                                 "The device's memory read bandwidth, measured at start-up")),
      bandwidth_utilization_(
          NewGauge(*registry_, "coalesce_model_bandwidth_utilization_ratio",
                   "Over the last 32 engine steps: bytes the steps had to read (weights and the KV "
                   "cache they attended to) per second, over the device's memory bandwidth")),
      prefix_lookup_tokens_(NewCounter(*registry_, "coalesce_prefix_cache_lookup_tokens_total",
                                       "Prompt tokens of new requests looked up in the prefix "
                                       "cache (resumed sequences are not counted)")),
      prefix_hit_tokens_(NewCounter(*registry_, "coalesce_prefix_cache_hit_tokens_total",
                                    "Of those, prompt tokens whose KV the prefix cache supplied "
                                    "(not computed)")),
      prefix_blocks_(NewGauge(*registry_, "coalesce_prefix_cache_blocks",
                              "KV-cache blocks registered in the prefix cache: held by running "
                              "sequences, or kept for reuse (counted free in "
                              "coalesce_kv_cache_blocks)")),
      prefix_evictions_(NewCounter(*registry_, "coalesce_prefix_cache_evictions_total",
                                   "Cached prefix blocks evicted to make room, least recently "
                                   "used first")),
      device_bandwidth_(info.memory_bandwidth) {
  memory_bandwidth_.Set(info.memory_bandwidth);
  prometheus::BuildGauge()
      .Name("coalesce_build_info")
      .Help("Always 1; the labels say which coalesce is running")
      .Register(*registry_)
      .Add({{"version", info.version}, {"compiler", __VERSION__}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("coalesce_kv_cache_capacity_tokens")
      .Help(
          "Token positions the KV cache holds (blocks x block size), labelled with what it "
          "holds (dtype: fp32, bf16, fp16, int8)")
      .Register(*registry_)
      .Add({{"dtype", info.kv_cache_dtype}})
      .Set(static_cast<double>(info.kv_cache_capacity_tokens));
  prometheus::BuildGauge()
      .Name("coalesce_model_info")
      .Help("Always 1; the labels describe the model being served")
      .Register(*registry_)
      .Add({{"model", info.model},
            {"architecture", info.architecture},
            {"backend", info.backend},
            {"synthetic", info.synthetic ? "true" : "false"},
            {"parameters", std::to_string(info.parameters)}})
      .Set(1);
  // Create the usual outcomes up front so that rate() sees them from zero.
  for (std::string_view status : {"ok", "cancelled", "deadline_exceeded", "invalid_argument",
                                  "resource_exhausted", "unavailable", "internal"}) {
    RequestsWithStatus(status);
  }
  for (const char* reason :
       {"invalid", "too_long", "queue_full", "queue_timeout", "unauthenticated", "tenant_limit"}) {
    rejected_total_.Add({{"reason", reason}});
  }
}

prometheus::Counter& ServerMetrics::RequestsWithStatus(std::string_view status) {
  // Family::Add returns the existing child for known labels; the label set is
  // bounded by the number of gRPC status codes.
  return requests_total_.Add({{"status", std::string(status)}});
}

void ServerMetrics::OnStep(const batcher::StepStats& stats) {
  batch_size_.Observe(stats.num_seqs);
  const double seconds = Seconds(stats.duration);
  if (stats.decode_tokens == 0) {
    step_prefill_seconds_.Observe(seconds);
  } else if (stats.prefill_tokens == 0) {
    step_decode_seconds_.Observe(seconds);
  } else {
    step_mixed_seconds_.Observe(seconds);
  }
  step_bytes_[next_step_slot_] = static_cast<double>(stats.bytes_read);
  step_secs_[next_step_slot_] = seconds;
  next_step_slot_ = (next_step_slot_ + 1) % kBandwidthWindow;
  double bytes = 0, secs = 0;
  for (int i = 0; i < kBandwidthWindow; ++i) {
    bytes += step_bytes_[i];
    secs += step_secs_[i];
  }
  if (secs > 0 && device_bandwidth_ > 0) {
    bandwidth_utilization_.Set(bytes / secs / device_bandwidth_);
  }
  prompt_tokens_.Increment(stats.prefill_tokens);
  generated_tokens_.Increment(stats.generated_tokens);
  if (stats.prefill_tokens > 0) prefill_tokens_per_step_.Observe(stats.prefill_tokens);
  if (stats.decode_tokens > 0) decode_tokens_per_step_.Observe(stats.decode_tokens);
}

void ServerMetrics::OnQueue(const batcher::QueueStats& stats) {
  running_.Set(stats.running);
  waiting_.Set(stats.waiting);
  const int used = stats.total_kv_blocks - stats.free_kv_blocks;
  kv_blocks_free_.Set(stats.free_kv_blocks);
  kv_blocks_used_.Set(used);
  kv_usage_ratio_.Set(stats.total_kv_blocks > 0 ? static_cast<double>(used) / stats.total_kv_blocks
                                                : 0.0);
  prefix_blocks_.Set(stats.cached_kv_blocks);
  if (stats.kv_block_evictions > evictions_seen_) {
    prefix_evictions_.Increment(static_cast<double>(stats.kv_block_evictions - evictions_seen_));
    evictions_seen_ = stats.kv_block_evictions;
  }
}

void ServerMetrics::OnAdmitted(absl::Duration queue_wait, absl::Duration window_wait) {
  queue_wait_.Observe(Seconds(queue_wait));
  window_wait_.Observe(Seconds(window_wait));
}

void ServerMetrics::OnAdmission(int requests) { admission_size_.Observe(requests); }

void ServerMetrics::OnFirstToken(absl::Duration ttft, std::string_view tenant) {
  time_to_first_token_.Observe(Seconds(ttft));
  if (!tenant.empty()) {
    tenant_time_to_first_token_.Add({{"tenant", std::string(tenant)}}, kFirstTokenBuckets)
        .Observe(Seconds(ttft));
  }
}

void ServerMetrics::OnInterToken(absl::Duration gap) { inter_token_latency_.Observe(Seconds(gap)); }

void ServerMetrics::OnFinished(const batcher::RequestSummary& summary) {
  RequestsWithStatus(summary.status).Increment();
  request_duration_.Observe(Seconds(summary.duration));
  if (!summary.tenant.empty()) {
    tenant_requests_.Add({{"tenant", summary.tenant}, {"status", summary.status}}).Increment();
    tenant_tokens_.Add({{"tenant", summary.tenant}, {"kind", "prompt"}})
        .Increment(summary.prompt_tokens);
    tenant_tokens_.Add({{"tenant", summary.tenant}, {"kind", "generated"}})
        .Increment(summary.completion_tokens);
  }
}

void ServerMetrics::CountEndedBeforeEngine(std::string_view status, std::string_view tenant) {
  RequestsWithStatus(status).Increment();
  if (!tenant.empty()) {
    tenant_requests_.Add({{"tenant", std::string(tenant)}, {"status", std::string(status)}})
        .Increment();
  }
}

void ServerMetrics::OnRejected(std::string_view reason) {
  // Reasons come from a fixed set in the service and the engine loop.
  rejected_total_.Add({{"reason", std::string(reason)}}).Increment();
}

void ServerMetrics::OnPreempted() { preemptions_.Increment(); }

void ServerMetrics::OnPreemptedForAdmission(std::string_view reason, std::string_view tenant) {
  admission_preemptions_.Add({{"reason", std::string(reason)}}).Increment();
  if (reason == "tenant_share") {
    tenant_preemptions_.Add({{"tenant", std::string(tenant)}}).Increment();
  }
}

void ServerMetrics::OnPrefixCacheLookup(int prompt_tokens, int cached_tokens) {
  prefix_lookup_tokens_.Increment(prompt_tokens);
  prefix_hit_tokens_.Increment(cached_tokens);
}

void ServerMetrics::OnStalledStream() { stalled_streams_.Increment(); }

void ServerMetrics::OnConnectionRefused() { connections_refused_.Increment(); }

std::unique_ptr<MetricsEndpoint> MetricsEndpoint::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry,
    std::string* error) {
  try {
    // civetweb's defaults close the connection after each response, which
    // drops the rest of a pipelined batch of requests unanswered; with
    // keep-alive each is answered in turn. A connection holds one of the
    // threads from its accept to its close, whatever it sends: one that
    // sends its request slowly (or never), reads the response slowly, or
    // idles between requests lets go of it after 2 s, and with 8 threads a
    // few such clients leave a scrape free threads (4 threads, held 10 s
    // each, once delayed every scrape by 10 s).
    auto exposer = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", "8", "enable_keep_alive", "yes",
        "keep_alive_timeout_ms", "2000", "request_timeout_ms", "2000"});
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
