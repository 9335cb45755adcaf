// coalesce-server: serves one model over gRPC, coalescing concurrent requests
// into shared batches. Flags are read here, once, into ServerOptions.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/memory_bandwidth.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "service/generator_service.h"
#include "service/model_loader.h"
#include "service/server_options.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address the gRPC server listens on.");
ABSL_FLAG(int, port, 50051, "gRPC port. 0 picks a free port (logged at start-up).");
ABSL_FLAG(int, metrics_port, 9090,
          "Port of the Prometheus endpoint (/metrics). 0 picks a free port; "
          "-1 turns it off.");
ABSL_FLAG(std::string, model, "synthetic:15m",
          "The model: a Hugging Face folder (config.json, *.safetensors, tokenizer.json; "
          "Llama, Mistral, Qwen2), a llama2.c checkpoint file, or an embedded synthetic "
          "model (synthetic:tiny, synthetic:15m, synthetic:110m, synthetic:1b) with random "
          "weights.");
ABSL_FLAG(std::string, tokenizer, "",
          "The tokenizer, when not the default: tokenizer.json in a Hugging Face folder, "
          "tokenizer.bin beside a llama2.c checkpoint.");
ABSL_FLAG(absl::Duration, batch_window, absl::Milliseconds(5),
          "Coalescing window: a request that could be admitted waits at most this "
          "long for companions, unless enough arrive to fill the free batch slots. "
          "0 disables it.");
ABSL_FLAG(int, max_batch_size, 16, "Most sequences in one engine step (1 to 256).");
ABSL_FLAG(std::string, batching, "continuous",
          "continuous: sequences join and leave the batch at every step. static: "
          "a batch runs until all its sequences finish (for comparison).");
ABSL_FLAG(int, max_batch_tokens, 2048,
          "Most tokens processed in one engine step: decode tokens of running sequences "
          "first, prompt chunks in the rest (a longer prompt is split across steps). At "
          "least --max_batch_size.");
ABSL_FLAG(int, max_queue, 1024,
          "Most requests waiting for admission; the next gets RESOURCE_EXHAUSTED at once.");
ABSL_FLAG(absl::Duration, max_queue_wait, absl::Seconds(60),
          "A request not admitted within this time fails with RESOURCE_EXHAUSTED. 'inf' "
          "waits forever.");
ABSL_FLAG(absl::Duration, priority_aging, absl::Seconds(10),
          "Every this long a request waits, its priority rises by one, so low-priority "
          "requests are not starved. 0 turns aging off.");
ABSL_FLAG(int, threads, 0, "Engine compute threads. 0: one per core.");
ABSL_FLAG(int, kv_block_size, 16, "Token positions per KV-cache block.");
ABSL_FLAG(std::string, kv_cache_memory, "auto",
          "KV-cache size: a size (512MiB, 2GB), a fraction of physical memory "
          "(0.25), or auto (max_batch_size full-context sequences, at most a "
          "quarter of physical memory).");
ABSL_FLAG(absl::Duration, grace_period, absl::Seconds(30),
          "On SIGTERM/SIGINT, how long running streams may take to finish before "
          "they are cancelled.");
ABSL_FLAG(absl::Duration, max_connection_age, absl::Minutes(5),
          "Close each client connection (with GOAWAY) after about this long, so that "
          "long-lived client channels spread onto new replicas. 'inf' never.");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(30),
          "Ping an idle connection after this long, to find dead peers.");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(10),
          "Close a connection whose keepalive ping got no answer within this long.");
ABSL_FLAG(int, max_request_bytes, 4 << 20,
          "Largest request message accepted (RESOURCE_EXHAUSTED above it).");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error.");
ABSL_FLAG(bool, log_steps, false,
          "Log one line per engine step at --log_level=debug: decode and prefill tokens, "
          "admitted, preempted, running, waiting, free KV blocks, and why waiting requests "
          "were not admitted.");

namespace coalesce {
namespace {

using service::ServerOptions;

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  ServerOptions o;
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.model = absl::GetFlag(FLAGS_model);
  o.tokenizer = absl::GetFlag(FLAGS_tokenizer);
  o.scheduler.batch_window = absl::GetFlag(FLAGS_batch_window);
  o.scheduler.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  const std::string batching = absl::GetFlag(FLAGS_batching);
  if (batching == "continuous") {
    o.scheduler.mode = batcher::BatchingMode::kContinuous;
  } else if (batching == "static") {
    o.scheduler.mode = batcher::BatchingMode::kStatic;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--batching=", batching, ": expected continuous or static"));
  }
  if (o.scheduler.max_batch_size < 1 || o.scheduler.max_batch_size > 256) {
    return absl::InvalidArgumentError("--max_batch_size must be in [1, 256]");
  }
  if (o.scheduler.batch_window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--batch_window must not be negative");
  }
  o.scheduler.max_queue_wait = absl::GetFlag(FLAGS_max_queue_wait);
  o.scheduler.priority_aging = absl::GetFlag(FLAGS_priority_aging);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.max_queue = absl::GetFlag(FLAGS_max_queue);
  if (o.max_batch_tokens < o.scheduler.max_batch_size) {
    return absl::InvalidArgumentError(
        "--max_batch_tokens must be at least --max_batch_size (every decode needs a token)");
  }
  if (o.max_queue < 1) return absl::InvalidArgumentError("--max_queue must be at least 1");
  if (o.scheduler.max_queue_wait <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_queue_wait must be positive");
  }
  o.threads = absl::GetFlag(FLAGS_threads);
  o.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  if (o.kv_block_size < 1 || o.kv_block_size > 1024) {
    return absl::InvalidArgumentError("--kv_block_size must be in [1, 1024]");
  }
  o.kv_cache_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  o.grace_period = absl::GetFlag(FLAGS_grace_period);
  o.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  o.max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  o.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  o.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  o.log_steps = absl::GetFlag(FLAGS_log_steps);
  const std::string level = absl::GetFlag(FLAGS_log_level);
  if (level == "debug") {
    SetLogLevel(LogLevel::kDebug);
  } else if (level == "info") {
    SetLogLevel(LogLevel::kInfo);
  } else if (level == "warning") {
    SetLogLevel(LogLevel::kWarning);
  } else if (level == "error") {
    SetLogLevel(LogLevel::kError);
  } else {
    return absl::InvalidArgumentError("--log_level must be debug, info, warning or error");
  }
  return o;
}

int64_t PhysicalMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

int Serve(const ServerOptions& options) {
  // 1. The model.
  const absl::Time load_start = absl::Now();
  absl::StatusOr<service::LoadedModel> loaded =
      service::LoadModel(options.model, options.tokenizer);
  if (!loaded.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot load the model: ", loaded.status().message()));
    return 1;
  }
  const engine::ModelConfig& config = loaded->model->config;
  LogF(LogLevel::kInfo,
       "model %s from %s: %d layers, dim %d, %d heads (%d kv), vocab %d, context %d, "
       "%.1fM parameters, loaded in %.2f s",
       config.name, config.source, config.n_layers, config.dim, config.n_heads, config.n_kv_heads,
       config.vocab_size, config.max_seq_len, config.num_parameters() / 1e6,
       absl::ToDoubleSeconds(absl::Now() - load_start));
  if (config.synthetic) {
    Log(LogLevel::kWarning,
        "this is a SYNTHETIC model with random weights: its output is not language. "
        "Pass --model=FILE to serve a real model.");
  }

  // 2. The KV cache and the backend.
  absl::StatusOr<service::KvCacheMemory> kv_memory =
      service::ParseKvCacheMemory(options.kv_cache_memory);
  if (!kv_memory.ok()) {
    Log(LogLevel::kError, std::string(kv_memory.status().message()));
    return 2;
  }
  const int64_t block_bytes = engine::KvBlockBytes(config, options.kv_block_size);
  const int64_t context_blocks =
      (config.max_seq_len + options.kv_block_size - 1) / options.kv_block_size;
  const int64_t num_blocks =
      service::KvCacheBlocks(*kv_memory, block_bytes, context_blocks,
                             options.scheduler.max_batch_size, PhysicalMemoryBytes());
  if (num_blocks < 1 || num_blocks > (int64_t{1} << 31) - 1) {
    Log(LogLevel::kError,
        absl::StrCat("--kv_cache_memory=", options.kv_cache_memory, " gives ", num_blocks,
                     " KV blocks of ", block_bytes, " bytes; need at least one"));
    return 2;
  }
  engine::CpuBackendOptions backend_options;
  backend_options.kv_cache = {options.kv_block_size, static_cast<int>(num_blocks)};
  backend_options.threads = options.threads;
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend =
      engine::CreateCpuBackend(loaded->model, backend_options);
  if (!backend.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot start the engine: ", backend.status().message()));
    return 1;
  }
  LogF(LogLevel::kInfo,
       "KV cache: %d blocks of %d tokens (%.1f MiB): %d tokens, %.1f full-context "
       "sequences",
       num_blocks, options.kv_block_size, num_blocks * block_bytes / 1048576.0,
       num_blocks * options.kv_block_size, static_cast<double>(num_blocks) / context_blocks);

  // 3. Metrics, the engine loop and the service.
  auto registry = std::make_shared<prometheus::Registry>();
  metrics::ServerInfo info;
  info.version = COALESCE_VERSION;
  info.model = config.name;
  info.architecture = config.architecture;
  info.backend = std::string((*backend)->name());
  info.synthetic = config.synthetic;
  info.parameters = config.num_parameters();
  info.memory_bandwidth = engine::MeasureMemoryReadBandwidth(
      options.threads > 0 ? options.threads
                          : static_cast<int>(std::thread::hardware_concurrency()));
  LogF(LogLevel::kInfo,
       "memory read bandwidth: %.1f GB/s (measured); one decode step reads at "
       "least %.1f MB of weights",
       info.memory_bandwidth / 1e9, config.num_parameters() * 4 / 1e6);
  metrics::ServerMetrics server_metrics(registry, info);
  std::unique_ptr<metrics::MetricsEndpoint> metrics_endpoint;
  if (options.metrics_port >= 0) {
    std::string error;
    metrics_endpoint = metrics::MetricsEndpoint::Start(
        absl::StrCat(options.host, ":", options.metrics_port), registry, &error);
    if (metrics_endpoint == nullptr) {
      Log(LogLevel::kError,
          absl::StrCat("cannot serve metrics on port ", options.metrics_port, ": ", error));
      return 1;
    }
  }
  batcher::EngineLoopOptions loop_options;
  loop_options.scheduler = options.scheduler;
  loop_options.max_batch_tokens = options.max_batch_tokens;
  loop_options.max_queue = options.max_queue;
  loop_options.log_steps = options.log_steps;
  // The CPU engine holds every weight as float32.
  loop_options.weight_bytes = config.num_parameters() * int64_t{sizeof(float)};
  batcher::EngineLoop loop(backend->get(), loaded->tokenizer.get(), loop_options, RealClock(),
                           &server_metrics);
  loop.Start();
  service::GeneratorService service(&loop, loaded->tokenizer.get(), backend->get(),
                                    options.scheduler.max_batch_size, &server_metrics);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int grpc_port = 0;
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.port),
                           grpc::InsecureServerCredentials(), &grpc_port);
  builder.SetMaxReceiveMessageSize(options.max_request_bytes);
  // Connection ageing: a GOAWAY after max_connection_age makes clients
  // reconnect (and re-resolve, so new replicas get traffic); running streams
  // get the grace period to finish first.
  auto millis = [](absl::Duration d) {
    return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), INT32_MAX));
  };
  if (options.max_connection_age < absl::InfiniteDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, millis(options.max_connection_age));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, millis(options.grace_period));
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, millis(options.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, millis(options.keepalive_timeout));
  // Accept client keepalive pings as often as every 10 s, even between calls.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    Log(LogLevel::kError, absl::StrCat("cannot listen on ", options.host, ":", options.port));
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  LogF(LogLevel::kInfo,
       "serving %s on %s:%d (metrics port %d), backend %s, max_batch_size %d, "
       "batch_window %s, batching %s",
       config.name, options.host, grpc_port, metrics_endpoint ? metrics_endpoint->port() : -1,
       (*backend)->name(), options.scheduler.max_batch_size,
       absl::FormatDuration(options.scheduler.batch_window),
       options.scheduler.mode == batcher::BatchingMode::kStatic ? "static" : "continuous");

  // 4. Wait for SIGINT/SIGTERM (blocked in every thread; see main), then drain:
  //    NOT_SERVING on health, refuse new streams, let running ones finish
  //    within the grace period, then cancel what is left.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  LogF(LogLevel::kInfo, "%s: draining for at most %s", strsignal(signal_number),
       absl::FormatDuration(options.grace_period));
  // Shutdown sends GOAWAY at once: clients stop sending new calls here (a
  // call already on its way is refused in a way gRPC clients retry on another
  // replica, transparently), while the streams already running go on.
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown(absl::ToChronoTime(absl::Now() + options.grace_period));
  loop.Stop();
  server->Wait();
  Log(LogLevel::kInfo, "stopped");
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves a Llama-family model over gRPC, coalescing concurrent requests into "
      "shared batches.\nUsage: coalesce-server [--model=FILE|synthetic:NAME] [flags]");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<coalesce::service::ServerOptions> options = coalesce::OptionsFromFlags();
  if (!options.ok()) {
    coalesce::Log(coalesce::LogLevel::kError, std::string(options.status().message()));
    return 2;
  }
  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and only sigwait() in Serve() receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return coalesce::Serve(*options);
}
