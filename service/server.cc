#include "service/server.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/log.h"
#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/memory_bandwidth.h"
#include "engine/cpu/quant_int8.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "service/backend_factory.h"
#include "service/listen_check.h"

namespace coalesce::service {
namespace {

// A duration as a channel argument's milliseconds.
int Millis(absl::Duration d) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), INT32_MAX));
}

// Connection settings: limits on what a client may send, and how long a
// connection lives and is kept alive.
void ConfigureConnections(const ServerOptions& options, grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(options.max_request_bytes);
  // Compressed requests are refused (UNIMPLEMENTED, before any message is
  // read): gRPC checks --max_request_bytes against the compressed size and
  // then inflates without bound, so 1 MB of gzip became 1 GiB in memory.
  // Requests are small (a prompt); responses are never compressed either.
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  // Connection ageing: a GOAWAY after max_connection_age makes clients
  // reconnect (and re-resolve, so new replicas get traffic); running streams
  // get the grace period to finish first.
  if (options.max_connection_age < absl::InfiniteDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, Millis(options.max_connection_age));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, Millis(options.grace_period));
  }
  // A connection must finish its TLS handshake and send the HTTP/2 preface
  // and SETTINGS within the handshake timeout (gRPC's own deadline covers
  // both); gRPC's default of 120 s let a client hold half-open connections,
  // a descriptor and about 27 KiB of memory each, for two minutes.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             Millis(options.handshake_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Millis(options.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Millis(options.keepalive_timeout));
  // Accept client keepalive pings as often as every 10 s, even between calls.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
}

}  // namespace

std::unique_ptr<Server> Server::Start(const ServerOptions& options, int* exit_code) {
  *exit_code = 1;
  std::unique_ptr<Server> s(new Server(options));

  // 1. The model: a quantized file's blocks kept, and --quantize, for the
  // CPU engine only.
  const bool on_cpu = KeepQuantizedWeights(options);
  if (options.quantize.has_value() && !on_cpu) {
    Log(LogLevel::kError,
        absl::StrCat("--quantize=", absl::AsciiStrToLower(engine::QuantTypeName(*options.quantize)),
                     ": quantized weights are for the CPU engine (--device=cpu, or auto without a "
                     "usable GPU); the ",
                     options.device == Device::kNull ? "null backend does no arithmetic"
                                                     : "GPU engine takes float weights"));
    *exit_code = 2;
    return nullptr;
  }
  const absl::Time load_start = absl::Now();
  absl::StatusOr<engine::LoadedModel> loaded =
      engine::LoadModel({.model = options.model,
                         .tokenizer = options.tokenizer,
                         .chat_template = options.chat_template,
                         .keep_quantized = on_cpu,
                         .quantize = options.quantize});
  if (!loaded.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot load the model: ", loaded.status().message()));
    return nullptr;
  }
  s->model_ = *std::move(loaded);
  // A copy: the model itself is let go of once the backend holds what it
  // computes with (below).
  const engine::ModelConfig config = s->model_.model->config;
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
  // The chat template: one given with --chat_template must parse; the
  // model's own one that does not is reported, and the model served without.
  const std::string template_origin =
      options.chat_template.empty() ? "the model's chat template" : options.chat_template;
  if (s->model_.chat_template.empty()) {
    s->chat_unavailable_ =
        "this model has no chat template (none in its tokenizer_config.json or GGUF metadata): "
        "send prompt text, or start the server with --chat_template=FILE";
    Log(LogLevel::kInfo, "no chat template: Generate takes prompt text or token ids only");
  } else if (absl::StatusOr<chat::ChatTemplate> parsed =
                 chat::ChatTemplate::Parse(s->model_.chat_template);
             parsed.ok()) {
    s->chat_template_ = *std::move(parsed);
    LogF(LogLevel::kInfo, "chat template: %s (%d bytes)", template_origin,
         static_cast<int>(s->model_.chat_template.size()));
  } else if (!options.chat_template.empty()) {
    Log(LogLevel::kError, absl::StrCat("cannot use the chat template ", options.chat_template, ": ",
                                       parsed.status().message()));
    return nullptr;
  } else {
    s->chat_unavailable_ =
        absl::StrCat("this model's chat template cannot be used (", parsed.status().message(),
                     "): send prompt text, or start the server with --chat_template=FILE");
    Log(LogLevel::kWarning,
        absl::StrCat("the model's chat template cannot be used: ", parsed.status().message(),
                     "; Generate takes prompt text or token ids only"));
  }

  // 2. The backend (--device, --dtype) and its KV cache.
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend =
      CreateBackend(options, s->model_.model, s->model_.tokenizer->eos_ids());
  if (!backend.ok()) {
    Log(LogLevel::kError, std::string(backend.status().message()));
    if (backend.status().code() == absl::StatusCode::kInvalidArgument) *exit_code = 2;
    return nullptr;
  }
  s->backend_ = *std::move(backend);
  // The backend holds what it computes with. The CPU backend with every
  // matrix laid out again keeps only the model's norms and biases, so
  // letting go of the model here frees its rows: the weights are in memory
  // once (engine/cpu/cpu_backend.h).
  s->model_.model.reset();
  engine::Backend& b = *s->backend_;
  const engine::KvCacheConfig& kv = b.kv_cache();
  const int64_t context_blocks = (config.max_seq_len + kv.block_size - 1) / kv.block_size;
  LogF(LogLevel::kInfo, "backend: %s", b.Describe());
  if (b.name() == "cpu") {
    // The laid-out weights ask for huge pages (engine/cpu/huge_page_memory.h);
    // whether the kernel granted them shows here.
    if (const std::optional<engine::cpu::HugePageUse> use = engine::cpu::ReadHugePageUse();
        use.has_value() && use->resident_bytes > 0) {
      LogF(LogLevel::kInfo, "weights: %.1f of %.1f MB laid out at load on huge pages%s",
           use->huge_bytes / 1e6, use->resident_bytes / 1e6,
           use->huge_bytes < use->resident_bytes / 2
               ? " (/sys/kernel/mm/transparent_hugepage/enabled: `madvise` or `always` "
                 "lets the kernel grant them; decoding reads faster from them)"
               : "");
    }
  }
  if (options.int8_activations && b.name() == "cpu" && !engine::cpu::Int8DotSupported()) {
    Log(LogLevel::kWarning,
        "--int8_activations: this processor has no AVX2; the quantized weights multiply "
        "float32 activations, exactly");
  }
  const engine::BackendCapabilities capabilities = b.capabilities();
  if (!capabilities.runs_model) {
    Log(LogLevel::kWarning,
        "--device=null: the NULL backend does no arithmetic, for measuring the server's own "
        "cost; its output is meaningless. Pass --device=cpu or cuda to run the model.");
  }
  const int64_t kv_capacity_tokens = int64_t{kv.num_blocks} * kv.block_size;
  LogF(LogLevel::kInfo,
       "KV cache: %d blocks of %d tokens (%s, %.1f MiB): %d tokens, %.1f full-context "
       "sequences",
       kv.num_blocks, kv.block_size, engine::KvDtypeName(kv.dtype),
       static_cast<double>(kv_capacity_tokens) * b.kv_bytes_per_token() / 1048576.0,
       kv_capacity_tokens, static_cast<double>(kv.num_blocks) / context_blocks);

  // 3. Metrics, the engine loop and the service.
  metrics::ServerInfo info;
  info.version = COALESCE_VERSION;
  info.model = config.name;
  info.architecture = config.architecture;
  info.backend = std::string(b.name());
  info.synthetic = config.synthetic;
  info.parameters = config.num_parameters();
  info.kv_cache_dtype = engine::KvDtypeName(kv.dtype);
  info.kv_cache_capacity_tokens = kv_capacity_tokens;
  if (capabilities.weights_in_host_memory) {
    info.memory_bandwidth = engine::MeasureMemoryReadBandwidth(
        options.threads > 0 ? options.threads
                            : static_cast<int>(std::thread::hardware_concurrency()));
    LogF(LogLevel::kInfo,
         "memory read bandwidth: %.1f GB/s (measured); one decode step reads at "
         "least %.1f MB of weights",
         info.memory_bandwidth / 1e9, b.weight_bytes() / 1e6);
  } else if (capabilities.runs_model) {
    // Host memory bandwidth says nothing about a GPU's; left unmeasured (0),
    // the bandwidth utilisation metric stays unset (as for the null backend,
    // which reads nothing).
    LogF(LogLevel::kInfo, "one decode step reads at least %.1f MB of weights",
         b.weight_bytes() / 1e6);
  }
  auto registry = std::make_shared<prometheus::Registry>();
  s->metrics_ = std::make_unique<metrics::ServerMetrics>(registry, info);
  if (options.metrics_port >= 0) {
    std::string error;
    s->metrics_endpoint_ = metrics::MetricsEndpoint::Start(
        absl::StrCat(options.host, ":", options.metrics_port), registry, &error);
    if (s->metrics_endpoint_ == nullptr) {
      Log(LogLevel::kError,
          absl::StrCat("cannot serve metrics on port ", options.metrics_port, ": ", error));
      return nullptr;
    }
  }
  batcher::EngineLoopOptions loop_options;
  loop_options.scheduler = options.scheduler;
  loop_options.max_batch_tokens = options.max_batch_tokens;
  loop_options.max_step_time = options.max_step_time;
  loop_options.max_queue = options.max_queue;
  loop_options.log_steps = options.log_steps;
  loop_options.overlap_steps = options.overlap_steps.value_or(capabilities.overlap_pays);
  loop_options.prefix_caching = options.prefix_caching;
  // Blocks are named by the model and how this process computes it.
  loop_options.prefix_cache_namespace =
      absl::StrCat(config.name, "\n", config.source, "\n", b.Describe());
  // The metrics see every loop event; a step that loses the device also
  // requests the shutdown.
  s->watcher_ = std::make_unique<DeviceLossWatcher>(s->metrics_.get(), &s->shutdown_);
  s->loop_ = std::make_unique<batcher::EngineLoop>(&b, s->model_.tokenizer.get(), loop_options,
                                                   RealClock(), s->watcher_.get());
  s->loop_->Start();
  GeneratorServiceOptions service_options;
  if (s->chat_template_.has_value()) {
    service_options.chat_template = &*s->chat_template_;
    service_options.chat_options.bos_token = s->model_.bos_token;
    service_options.chat_options.eos_token = s->model_.eos_token;
  }
  service_options.chat_unavailable = s->chat_unavailable_;
  service_options.max_batch_size = options.scheduler.max_batch_size;
  service_options.work_threads = options.work_threads;
  service_options.max_pending_work = options.max_queue;
  service_options.stream_stall_timeout = options.stream_stall_timeout;
  service_options.split_special_tokens = options.split_special_tokens;
  if (!options.api_keys_file.empty()) {
    absl::StatusOr<std::unique_ptr<Tenants>> tenants =
        Tenants::Load(options.api_keys_file, RealClock());
    if (!tenants.ok()) {
      Log(LogLevel::kError, std::string(tenants.status().message()));
      return nullptr;
    }
    s->tenants_ = *std::move(tenants);
    service_options.tenants = s->tenants_.get();
    LogF(LogLevel::kInfo, "API keys: %d tenants from %s; every Generator call needs one",
         static_cast<int>(s->tenants_->names().size()), options.api_keys_file);
  }
  s->service_ = std::make_unique<GeneratorService>(s->loop_.get(), s->model_.tokenizer.get(), &b,
                                                   service_options, s->metrics_.get());
  // Our own health service (service/health_service.h says why), for the
  // server ("") and the Generator.
  s->health_ = std::make_unique<HealthService>(
      std::vector<std::string>{std::string(v1::Generator::service_full_name())});

  // 4. The gRPC server, on a port of our own accept loop (service/listener.h).
  absl::StatusOr<std::unique_ptr<TlsCredentials>> tls = TlsCredentials::Start(options.tls);
  if (!tls.ok()) {
    Log(LogLevel::kError, std::string(tls.status().message()));
    *exit_code = 2;
    return nullptr;
  }
  s->tls_ = *std::move(tls);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  metrics::ServerMetrics* server_metrics = s->metrics_.get();
  absl::StatusOr<std::unique_ptr<Listener>> listener =
      Listener::Bind({.host = options.host,
                      .port = options.port,
                      .max_connections_per_peer = options.max_connections_per_peer,
                      .on_refused = [server_metrics] { server_metrics->OnConnectionRefused(); }},
                     s->tls_->credentials(), &builder);
  if (!listener.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot listen on ", options.host, ":", options.port, ": ",
                                       listener.status().message()));
    return nullptr;
  }
  s->listener_ = *std::move(listener);
  const int grpc_port = s->listener_->port();
  ConfigureConnections(options, builder);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->health_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr) {
    Log(LogLevel::kError, "cannot start the gRPC server");
    return nullptr;
  }
  s->listener_->Start();
  if (options.health_port >= 0) {
    // Probes that cannot speak TLS: the health service alone, in plaintext.
    s->plain_health_ = std::make_unique<HealthService>(
        std::vector<std::string>{std::string(v1::Generator::service_full_name())});
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(absl::StrCat(options.host, ":", options.health_port),
                                    grpc::InsecureServerCredentials(), &health_port);
    // A port another process listens on is a start-up error: with
    // SO_REUSEPORT (gRPC's default) a second server would share it. (The
    // gRPC port is bound by the Listener, without it.)
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                                      Millis(options.handshake_timeout));
    health_builder.RegisterService(s->plain_health_.get());
    s->health_server_ = health_builder.BuildAndStart();
    if (s->health_server_ == nullptr || health_port == 0) {
      const std::string why = ListenError(options.host, options.health_port);
      Log(LogLevel::kError,
          absl::StrCat("cannot listen on ", options.host, ":", options.health_port,
                       " (--health_port)", why.empty() ? "" : ": ", why));
      return nullptr;
    }
    s->plain_health_->SetServing(true);
    LogF(LogLevel::kInfo, "health service in plaintext on %s:%d", options.host, health_port);
  }
  s->health_->SetServing(true);
  if (options.tls.cert.empty()) {
    Log(LogLevel::kInfo,
        "gRPC in plaintext: anyone who reaches the port can generate; use --tls_cert_file and "
        "--tls_key_file (and --tls_client_ca_file) beyond a trusted network");
  } else {
    LogF(LogLevel::kInfo, "gRPC over %s (%s, re-read every %s)", TlsModeName(options.tls),
         options.tls.cert, absl::FormatDuration(options.tls.reload_interval));
  }
  LogF(LogLevel::kInfo,
       "serving %s on %s:%d (metrics port %d), backend %s, max_batch_size %d, "
       "batch_window %s, batching %s, overlap_steps %s, prefix_caching %s",
       config.name, options.host, grpc_port,
       s->metrics_endpoint_ ? s->metrics_endpoint_->port() : -1, b.name(),
       options.scheduler.max_batch_size, absl::FormatDuration(options.scheduler.batch_window),
       batcher::BatchingModeName(options.scheduler.mode), loop_options.overlap_steps ? "on" : "off",
       loop_options.prefix_caching ? "on" : "off");
  *exit_code = 0;
  return s;
}

// The members go in reverse order of their building: the gRPC server first,
// the engine loop (which stops itself) before its backend, the model last.
// The accept loop stops before: it hands nothing to a server going away.
Server::~Server() {
  if (listener_ != nullptr) listener_->Stop();
}

int Server::WaitAndDrain() {
  const ShutdownReason reason = shutdown_.Wait();
  const bool device_lost = reason.exit_code != 0;
  const absl::Duration drain =
      device_lost ? std::min(options_.grace_period, kDeviceLostDrain) : options_.grace_period;
  LogF(device_lost ? LogLevel::kError : LogLevel::kInfo, "%s: draining for at most %s", reason.why,
       absl::FormatDuration(drain));
  const absl::Time drain_end = absl::Now() + drain;
  // New connections are refused from here (gRPC's Shutdown would drop what
  // the accept loop handed it after).
  listener_->Stop();
  health_->Shutdown();
  if (plain_health_ != nullptr) plain_health_->Shutdown();
  // Shutdown sends GOAWAY at once: clients stop sending new calls here, while
  // the calls already running go on. It returns when every call has ended,
  // or cancels those left at its deadline. A call already on its way never
  // reaches the service: the client gets UNAVAILABLE when the transport
  // refuses it, but CANCELLED when gRPC had accepted it and not yet handed it
  // to the service (gRPC cancels those on Shutdown, grpc/grpc#41785).
  std::thread grpc_shutdown(
      [&] { server_->Shutdown(absl::ToChronoTime(drain_end + kFinalMessageTime)); });
  if (!service_->WaitForGenerateCalls(drain_end)) {
    Log(LogLevel::kInfo,
        "grace period over: ending the generations still running with finish_reason "
        "CANCELLED");
  }
  // Ends whatever still runs or waits with its final message.
  loop_->Stop();
  grpc_shutdown.join();
  server_->Wait();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now() + kFinalMessageTime));
    health_server_->Wait();
  }
  absl::SleepFor(kCloseLinger);
  if (device_lost) {
    LogF(LogLevel::kError, "stopped after a lost device: exit code %d", reason.exit_code);
  } else {
    Log(LogLevel::kInfo, "stopped");
  }
  return reason.exit_code;
}

}  // namespace coalesce::service
