// coalesce-server's parts, wired: the model and its backend, the metrics
// endpoint, the engine loop, the gRPC services and the gRPC server, built from
// ServerOptions; and their shutdown, in order. main.cc turns flags into
// options and signals into shutdown requests.
#pragma once

#include <memory>
#include <optional>

#include "batcher/engine_loop.h"
#include "chat/chat_template.h"
#include "engine/backend.h"
#include "engine/model/load.h"
#include "grpcpp/server.h"
#include "metrics/server_metrics.h"
#include "service/generator_service.h"
#include "service/health_service.h"
#include "service/listener.h"
#include "service/server_options.h"
#include "service/shutdown.h"
#include "service/tenants.h"
#include "service/tls.h"

namespace coalesce::service {

class Server {
 public:
  // Loads the model, creates the backend and its KV cache, and starts the
  // metrics endpoint, the engine loop and the gRPC server, logging each. On
  // failure, logs why and returns null with the process exit code in
  // `*exit_code`: 2 for a configuration the backend refuses (a bad flag), 1
  // for anything else (a model that does not load, a port in use).
  static std::unique_ptr<Server> Start(const ServerOptions& options, int* exit_code);
  ~Server();

  // Where a shutdown is requested: a signal (main.cc) or a lost device (the
  // engine loop's watcher).
  ShutdownTrigger& shutdown() { return shutdown_; }

  // Blocks until shutdown() is requested; then drains: NOT_SERVING on health
  // (which also ends the Watch streams), new calls refused, running
  // generations given the grace period (after a lost device the loop has
  // already failed them, so a short drain only sends their final status),
  // those still running ended with their final message, and what is left
  // cancelled once that had time to go out. Returns the exit code.
  int WaitAndDrain();

 private:
  explicit Server(const ServerOptions& options) : options_(options) {}

  // Start's steps, in order, each needing those before it. Each builds its
  // part into the members below and logs what it built; on failure it logs
  // why and returns the process exit code (Start's), else 0.
  int BuildModel();         // the model and its tokenizer (--model, --quantize)
  int BuildChatTemplate();  // the model's chat template, or why there is none
  int BuildBackend();       // the backend and its KV cache; lets go of the model
  int BuildMetrics();       // the metrics and their endpoint (--metrics_port)
  int BuildEngineLoop();    // the engine loop, watched for a lost device
  int BuildServices();      // the Generator (with --api_keys_file) and health services
  int BuildGrpcServer();    // TLS, the accept loop and the gRPC server
  int BuildHealthPort();    // --health_port: the health service in plaintext
  // The engine loop's options: the flags', and what the backend is.
  batcher::EngineLoopOptions LoopOptions() const;
  // The start-up log's last lines: the transport, and what is served where.
  void LogServing() const;

  const ServerOptions options_;
  // In the order they are built; destroyed in reverse. (model_.model is
  // let go of once the backend is built: the backend holds what it reads.)
  engine::LoadedModel model_;
  // The model's chat template, parsed; empty when it has none or it does not
  // parse (chat_unavailable_ says which).
  std::optional<chat::ChatTemplate> chat_template_;
  std::string chat_unavailable_;
  std::unique_ptr<engine::Backend> backend_;
  std::unique_ptr<metrics::ServerMetrics> metrics_;
  std::unique_ptr<metrics::MetricsEndpoint> metrics_endpoint_;
  ShutdownTrigger shutdown_;
  std::unique_ptr<DeviceLossWatcher> watcher_;
  std::unique_ptr<batcher::EngineLoop> loop_;
  std::unique_ptr<GeneratorService> service_;
  std::unique_ptr<Tenants> tenants_;  // --api_keys_file; outlives the service's calls
  std::unique_ptr<HealthService> health_;
  // The port's credentials (gRPC asks them for the certificate at each
  // handshake) and its accept loop: both outlive the gRPC server.
  std::unique_ptr<TlsCredentials> tls_;
  std::unique_ptr<Listener> listener_;
  std::unique_ptr<grpc::Server> server_;
  // --health_port: the health service alone, in plaintext.
  std::unique_ptr<HealthService> plain_health_;
  std::unique_ptr<grpc::Server> health_server_;
};

}  // namespace coalesce::service
