#include "service/server.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/log.h"
#include "engine/factory/backend_factory.h"
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
  std::unique_ptr<Server> s(new Server(options));
  // The first step to fail ends the start-up; what was built before it goes
  // with `s`, in reverse order.
  for (int (Server::*build)() :
       {&Server::BuildModel, &Server::BuildChatTemplate, &Server::BuildBackend,
        &Server::BuildMetrics, &Server::BuildEngineLoop, &Server::BuildServices,
        &Server::BuildGrpcServer, &Server::BuildHealthPort}) {
    *exit_code = (s.get()->*build)();
    if (*exit_code != 0) return nullptr;
  }
  s->LogServing();
  return s;
}

// A quantized file's blocks are kept, and --quantize applies, for the CPU
// engine only: --quantize for another is a bad flag (exit code 2).
int Server::BuildModel() {
  const bool on_cpu = engine::KeepQuantizedWeights(BackendSpecOf(options_));
  if (options_.quantize.has_value() && !on_cpu) {
    Log(LogLevel::kError,
        absl::StrCat(
            "--quantize=", absl::AsciiStrToLower(engine::QuantTypeName(*options_.quantize)),
            ": quantized weights are for the CPU engine (--device=cpu, or auto without a "
            "usable GPU); the ",
            options_.device == engine::Device::kNull ? "null backend does no arithmetic"
                                                     : "GPU engine takes float weights"));
    return 2;
  }
  const absl::Time load_start = absl::Now();
  absl::StatusOr<engine::LoadedModel> loaded =
      engine::LoadModel({.model = options_.model,
                         .tokenizer = options_.tokenizer,
                         .chat_template = options_.chat_template,
                         .keep_quantized = on_cpu,
                         .quantize = options_.quantize});
  if (!loaded.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot load the model: ", loaded.status().message()));
    return 1;
  }
  model_ = *std::move(loaded);
  const engine::ModelConfig& config = model_.model->config;
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
  return 0;
}

// One given with --chat_template must parse; the model's own one that does
// not is reported, and the model served without.
int Server::BuildChatTemplate() {
  const std::string template_origin =
      options_.chat_template.empty() ? "the model's chat template" : options_.chat_template;
  if (model_.chat_template.empty()) {
    chat_unavailable_ =
        "this model has no chat template (none in its tokenizer_config.json or GGUF metadata): "
        "send prompt text, or start the server with --chat_template=FILE";
    Log(LogLevel::kInfo, "no chat template: Generate takes prompt text or token ids only");
  } else if (absl::StatusOr<chat::ChatTemplate> parsed =
                 chat::ChatTemplate::Parse(model_.chat_template);
             parsed.ok()) {
    chat_template_ = *std::move(parsed);
    LogF(LogLevel::kInfo, "chat template: %s (%d bytes)", template_origin,
         static_cast<int>(model_.chat_template.size()));
  } else if (!options_.chat_template.empty()) {
    Log(LogLevel::kError, absl::StrCat("cannot use the chat template ", options_.chat_template,
                                       ": ", parsed.status().message()));
    return 1;
  } else {
    chat_unavailable_ =
        absl::StrCat("this model's chat template cannot be used (", parsed.status().message(),
                     "): send prompt text, or start the server with --chat_template=FILE");
    Log(LogLevel::kWarning,
        absl::StrCat("the model's chat template cannot be used: ", parsed.status().message(),
                     "; Generate takes prompt text or token ids only"));
  }
  return 0;
}

// The backend (--device, --dtype) and its KV cache. A configuration the
// backend refuses (INVALID_ARGUMENT) is a bad flag: exit code 2.
int Server::BuildBackend() {
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend =
      CreateBackend(options_, model_.model, model_.tokenizer->eos_ids());
  if (!backend.ok()) {
    Log(LogLevel::kError, std::string(backend.status().message()));
    return backend.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  backend_ = *std::move(backend);
  // The backend holds what it computes with. The CPU backend with every
  // matrix laid out again keeps only the model's norms and biases, so
  // letting go of the model here frees its rows: the weights are in memory
  // once (engine/cpu/cpu_backend.h).
  model_.model.reset();
  const engine::Backend& b = *backend_;
  const engine::KvCacheConfig& kv = b.kv_cache();
  const int64_t context_blocks = (b.config().max_seq_len + kv.block_size - 1) / kv.block_size;
  LogF(LogLevel::kInfo, "backend: %s", b.Describe());
  engine::LogBackendNotes(b, BackendSpecOf(options_));
  if (!b.capabilities().runs_model) {
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
  return 0;
}

// The metrics, with what the server runs, and --metrics_port's endpoint.
int Server::BuildMetrics() {
  const engine::Backend& b = *backend_;
  const engine::ModelConfig& config = b.config();
  const engine::KvCacheConfig& kv = b.kv_cache();
  const engine::BackendCapabilities capabilities = b.capabilities();
  metrics::ServerInfo info;
  info.version = COALESCE_VERSION;
  info.model = config.name;
  info.architecture = config.architecture;
  info.backend = std::string(b.name());
  info.synthetic = config.synthetic;
  info.parameters = config.num_parameters();
  info.kv_cache_dtype = engine::KvDtypeName(kv.dtype);
  info.kv_cache_capacity_tokens = int64_t{kv.num_blocks} * kv.block_size;
  if (capabilities.weights_in_host_memory) {
    info.memory_bandwidth = engine::MeasureHostMemoryBandwidth(BackendSpecOf(options_));
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
  metrics_ = std::make_unique<metrics::ServerMetrics>(registry, info);
  if (options_.metrics_port >= 0) {
    std::string error;
    metrics_endpoint_ = metrics::MetricsEndpoint::Start(
        absl::StrCat(options_.host, ":", options_.metrics_port), registry, &error);
    if (metrics_endpoint_ == nullptr) {
      Log(LogLevel::kError,
          absl::StrCat("cannot serve metrics on port ", options_.metrics_port, ": ", error));
      return 1;
    }
  }
  return 0;
}

batcher::EngineLoopOptions Server::LoopOptions() const {
  const engine::ModelConfig& config = backend_->config();
  batcher::EngineLoopOptions loop_options;
  loop_options.scheduler = options_.scheduler;
  loop_options.max_batch_tokens = options_.max_batch_tokens;
  loop_options.max_step_time = options_.max_step_time;
  loop_options.max_queue = options_.max_queue;
  loop_options.log_steps = options_.log_steps;
  loop_options.overlap_steps =
      options_.overlap_steps.value_or(backend_->capabilities().overlap_pays);
  loop_options.kv_cache.prefix_caching = options_.prefix_caching;
  // Blocks are named by the model and how this process computes it.
  loop_options.kv_cache.prefix_cache_namespace =
      absl::StrCat(config.name, "\n", config.source, "\n", backend_->Describe());
  return loop_options;
}

int Server::BuildEngineLoop() {
  // The metrics see every loop event; a step that loses the device also
  // requests the shutdown.
  watcher_ = std::make_unique<DeviceLossWatcher>(metrics_.get(), &shutdown_);
  loop_ = std::make_unique<batcher::EngineLoop>(backend_.get(), model_.tokenizer.get(),
                                                LoopOptions(), RealClock(), watcher_.get());
  loop_->Start();
  return 0;
}

int Server::BuildServices() {
  GeneratorServiceOptions service_options;
  if (chat_template_.has_value()) {
    service_options.chat_template = &*chat_template_;
    service_options.chat_options.bos_token = model_.bos_token;
    service_options.chat_options.eos_token = model_.eos_token;
  }
  service_options.chat_unavailable = chat_unavailable_;
  service_options.max_batch_size = options_.scheduler.max_batch_size;
  service_options.work_threads = options_.work_threads;
  service_options.max_pending_work = options_.max_queue;
  service_options.stream_stall_timeout = options_.stream_stall_timeout;
  service_options.split_special_tokens = options_.split_special_tokens;
  if (!options_.api_keys_file.empty()) {
    absl::StatusOr<std::unique_ptr<Tenants>> tenants =
        Tenants::Load(options_.api_keys_file, RealClock());
    if (!tenants.ok()) {
      Log(LogLevel::kError, std::string(tenants.status().message()));
      return 1;
    }
    tenants_ = *std::move(tenants);
    service_options.tenants = tenants_.get();
    LogF(LogLevel::kInfo, "API keys: %d tenants from %s; every Generator call needs one",
         static_cast<int>(tenants_->names().size()), options_.api_keys_file);
  }
  service_ = std::make_unique<GeneratorService>(loop_.get(), model_.tokenizer.get(), backend_.get(),
                                                service_options, metrics_.get());
  // Our own health service (service/health_service.h says why), for the
  // server ("") and the Generator.
  health_ = std::make_unique<HealthService>(
      std::vector<std::string>{std::string(v1::Generator::service_full_name())});
  return 0;
}

// The gRPC server, on a port of our own accept loop (service/listener.h).
// TLS files that cannot be used are a bad flag: exit code 2.
int Server::BuildGrpcServer() {
  absl::StatusOr<std::unique_ptr<TlsCredentials>> tls = TlsCredentials::Start(options_.tls);
  if (!tls.ok()) {
    Log(LogLevel::kError, std::string(tls.status().message()));
    return 2;
  }
  tls_ = *std::move(tls);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  metrics::ServerMetrics* server_metrics = metrics_.get();
  absl::StatusOr<std::unique_ptr<Listener>> listener =
      Listener::Bind({.host = options_.host,
                      .port = options_.port,
                      .max_connections_per_peer = options_.max_connections_per_peer,
                      .on_refused = [server_metrics] { server_metrics->OnConnectionRefused(); }},
                     tls_->credentials(), &builder);
  if (!listener.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot listen on ", options_.host, ":", options_.port, ": ",
                                       listener.status().message()));
    return 1;
  }
  listener_ = *std::move(listener);
  ConfigureConnections(options_, builder);
  builder.RegisterService(service_.get());
  builder.RegisterService(health_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    Log(LogLevel::kError, "cannot start the gRPC server");
    return 1;
  }
  listener_->Start();
  return 0;
}

// Probes that cannot speak TLS: the health service alone, in plaintext.
// Then both health services say SERVING.
int Server::BuildHealthPort() {
  if (options_.health_port >= 0) {
    plain_health_ = std::make_unique<HealthService>(
        std::vector<std::string>{std::string(v1::Generator::service_full_name())});
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(absl::StrCat(options_.host, ":", options_.health_port),
                                    grpc::InsecureServerCredentials(), &health_port);
    // A port another process listens on is a start-up error: with
    // SO_REUSEPORT (gRPC's default) a second server would share it. (The
    // gRPC port is bound by the Listener, without it.)
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                                      Millis(options_.handshake_timeout));
    health_builder.RegisterService(plain_health_.get());
    health_server_ = health_builder.BuildAndStart();
    if (health_server_ == nullptr || health_port == 0) {
      const std::string why = ListenError(options_.host, options_.health_port);
      Log(LogLevel::kError,
          absl::StrCat("cannot listen on ", options_.host, ":", options_.health_port,
                       " (--health_port)", why.empty() ? "" : ": ", why));
      return 1;
    }
    plain_health_->SetServing(true);
    LogF(LogLevel::kInfo, "health service in plaintext on %s:%d", options_.host, health_port);
  }
  health_->SetServing(true);
  return 0;
}

void Server::LogServing() const {
  if (options_.tls.cert.empty()) {
    Log(LogLevel::kInfo,
        "gRPC in plaintext: anyone who reaches the port can generate; use --tls_cert_file and "
        "--tls_key_file (and --tls_client_ca_file) beyond a trusted network");
  } else {
    LogF(LogLevel::kInfo, "gRPC over %s (%s, re-read every %s)", TlsModeName(options_.tls),
         options_.tls.cert, absl::FormatDuration(options_.tls.reload_interval));
  }
  const batcher::EngineLoopOptions loop_options = LoopOptions();
  LogF(LogLevel::kInfo,
       "serving %s on %s:%d (metrics port %d), backend %s, max_batch_size %d, "
       "batch_window %s, batching %s, overlap_steps %s, prefix_caching %s",
       backend_->config().name, options_.host, listener_->port(),
       metrics_endpoint_ ? metrics_endpoint_->port() : -1, backend_->name(),
       options_.scheduler.max_batch_size, absl::FormatDuration(options_.scheduler.batch_window),
       batcher::BatchingModeName(options_.scheduler.mode),
       loop_options.overlap_steps ? "on" : "off",
       loop_options.kv_cache.prefix_caching ? "on" : "off");
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
