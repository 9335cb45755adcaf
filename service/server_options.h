// Everything the server binary is configured with, parsed once from flags in
// main() and passed down.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "batcher/engine_loop.h"
#include "batcher/scheduler.h"
#include "engine/factory/backend_factory.h"
#include "engine/model.h"
#include "engine/precision.h"
#include "service/tls.h"

namespace coalesce::service {

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 50051;
  int metrics_port = 9090;              // 0: pick a free port; -1: off
  std::string model = "synthetic:15m";  // preset name or llama2.c file
  std::string tokenizer;                // tokenizer.bin (llama2.c models)
  std::string chat_template;            // a Jinja file overriding the model's template
  // The batcher's defaults, except that a request waits at most a minute.
  batcher::SchedulerConfig scheduler{.max_queue_wait = absl::Seconds(60)};
  int max_batch_tokens = batcher::EngineLoopOptions{}.max_batch_tokens;  // tokens per step
  // A step with decodes in it is planned to take at most this (0: off).
  absl::Duration max_step_time = absl::Milliseconds(200);
  int max_queue = batcher::EngineLoopOptions{}.max_queue;  // waiting requests at most
  int threads = 0;                                         // 0: one per core
  // Where the model runs (engine/factory/backend_factory.h).
  engine::Device device = engine::Device::kAuto;
  // Weights and KV cache; nullopt is auto: bf16 on CUDA, fp32 on the CPU
  // (which computes only in fp32).
  std::optional<engine::Precision> precision;
  // The KV cache's element type; nullopt is auto: fp32 on the CPU, the
  // weights' precision on CUDA.
  std::optional<engine::KvDtype> kv_cache_dtype;
  // --quantize: float32 weight matrices quantized at load (CPU only);
  // nullopt keeps them.
  std::optional<engine::QuantType> quantize;
  // --int8_activations: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices times int8 activations
  // on the CPU (engine::CpuBackendOptions::int8_activations).
  bool int8_activations = false;
  // --float_panels: float32 matrices laid out again as the CPU product's
  // panels (engine::CpuBackendOptions::float_panels); nullopt is auto.
  std::optional<bool> float_panels;
  bool cuda_graphs = true;  // CUDA: replay captured graphs for decode steps
  int kv_block_size = 16;
  std::string kv_cache_memory = "auto";
  // TESTING ONLY (--fault_injection=device_lost_after_steps:N): after N
  // steps every step fails as a lost GPU does. -1: off.
  int fault_device_lost_after_steps = -1;
  absl::Duration grace_period = absl::Seconds(30);
  int max_request_bytes = 4 << 20;
  absl::Duration max_connection_age = absl::Minutes(5);
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // A connection that has not finished its TLS handshake and sent the HTTP/2
  // preface and SETTINGS within this long is closed.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Connections to the gRPC port one peer address may hold; 0: no limit.
  int max_connections_per_peer = 100;
  bool log_steps = false;
  // Reuse the KV blocks of cached prompt prefixes (batcher/block_pool.h).
  bool prefix_caching = batcher::KvCacheOptions{}.prefix_caching;
  // Threads that parse and tokenize requests (at least 2).
  int work_threads = 2;
  // A Generate stream whose client reads nothing for this long is ended.
  absl::Duration stream_stall_timeout = absl::Seconds(10);
  // --overlap_steps: nullopt (auto) overlaps except on the null backend.
  std::optional<bool> overlap_steps;
  // The gRPC port's transport security (service/tls.h): plaintext without
  // a certificate.
  TlsFiles tls;
  // Tenants and their keys (service/tenants.h); empty: no authentication.
  std::string api_keys_file;
  // The default of the requests' split_special_tokens.
  bool split_special_tokens = false;
  // A plaintext port serving only grpc.health.v1.Health, for probes that
  // cannot speak TLS: 0 picks a free port; -1 (default): none.
  int health_port = -1;
};

// --dtype: "auto" (nullopt), "bf16", "fp16" or "fp32".
absl::StatusOr<std::optional<engine::Precision>> ParseDtype(const std::string& text);

// --kv_cache_dtype: "auto" (nullopt), "fp32", "bf16", "fp16", "int8" or
// "fp8" (which backend takes which is engine::PlanBackend's and the backend's
// to say).
absl::StatusOr<std::optional<engine::KvDtype>> ParseKvCacheDtype(const std::string& text);

// --overlap_steps: "auto" (nullopt), "on" or "off".
absl::StatusOr<std::optional<bool>> ParseOverlapSteps(const std::string& text);

// --fault_injection: "" (off: -1) or "device_lost_after_steps:N" (N >= 0).
absl::StatusOr<int> ParseFaultInjection(const std::string& text);

}  // namespace coalesce::service
