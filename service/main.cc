// coalesce-server: serves one model over gRPC, coalescing concurrent requests
// into shared batches. Flags are read here, once, into ServerOptions.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/flags.h"
#include "common/log.h"
#include "engine/factory/backend_factory.h"
#include "engine/model/quantize.h"
#include "service/library_logs.h"
#include "service/server.h"
#include "service/server_options.h"
#include "service/tenants.h"

namespace {
// The server's defaults are ServerOptions' (service/server_options.h): each
// flag's default is its field's, defined there once.
const coalesce::service::ServerOptions& Defaults() {
  static const coalesce::service::ServerOptions defaults;
  return defaults;
}
}  // namespace

ABSL_FLAG(std::string, host, Defaults().host, "Address the gRPC server listens on.");
ABSL_FLAG(int, port, Defaults().port, "gRPC port. 0 picks a free port (logged at start-up).");
ABSL_FLAG(int, metrics_port, Defaults().metrics_port,
          "Port of the Prometheus endpoint (/metrics). 0 picks a free port; "
          "-1 turns it off.");
ABSL_FLAG(std::string, model, Defaults().model,
          "The model: a GGUF file (llama, qwen2; quantized tensors are dequantized at "
          "load), a Hugging Face folder (config.json, *.safetensors, tokenizer.json; "
          "Llama, Mistral, Qwen2), a llama2.c checkpoint file, or an embedded synthetic "
          "model (synthetic:tiny, synthetic:15m, synthetic:110m, synthetic:1b) with random "
          "weights.");
ABSL_FLAG(std::string, tokenizer, Defaults().tokenizer,
          "The tokenizer, when not the default (the GGUF file's own, tokenizer.json in a "
          "Hugging Face folder, tokenizer.bin beside a llama2.c checkpoint): a "
          "tokenizer.json or a llama2.c tokenizer.bin.");
ABSL_FLAG(std::string, chat_template, Defaults().chat_template,
          "A file holding a chat template (Jinja, as transformers renders them) that "
          "overrides the model's own (tokenizer_config.json's chat_template, a GGUF file's "
          "tokenizer.chat_template). Generate's `messages` and ApplyChatTemplate use it.");
ABSL_FLAG(absl::Duration, batch_window, Defaults().scheduler.batch_window,
          "Coalescing window: a request that could be admitted waits at most this "
          "long for companions, unless enough arrive to fill the free batch slots. "
          "0 (the default, which docs/benchmarks.md supports on a CPU): no wait; "
          "requests that arrive during a step still join together at its end.");
ABSL_FLAG(int, max_batch_size, Defaults().scheduler.max_batch_size,
          "Most sequences in one engine step (1 to 256).");
ABSL_FLAG(std::string, batching,
          std::string(coalesce::batcher::BatchingModeName(Defaults().scheduler.mode)),
          "continuous: sequences join and leave the batch at every step. For comparison: "
          "static: a batch runs until all its sequences finish; static_padded: the same, and "
          "finished sequences keep their rows in every step as padding, as fixed-shape "
          "batches do.");
ABSL_FLAG(int, max_batch_tokens, Defaults().max_batch_tokens,
          "Most tokens processed in one engine step: decode tokens of running sequences "
          "first, prompt chunks in the rest (a longer prompt is split across steps). At "
          "least --max_batch_size.");
ABSL_FLAG(absl::Duration, max_step_time, Defaults().max_step_time,
          "A step with decoding sequences in it is planned to take at most this: the prompt "
          "chunks beside the decodes are sized by what the steps so far have cost, so that a "
          "long prompt does not hold up the others' next token. A step without decodes is "
          "bounded by --max_batch_tokens alone. 0 turns it off.");
ABSL_FLAG(int, max_queue, Defaults().max_queue,
          "Most requests waiting for admission; the next gets RESOURCE_EXHAUSTED at once.");
ABSL_FLAG(absl::Duration, max_queue_wait, Defaults().scheduler.max_queue_wait,
          "A request not admitted within this time fails with RESOURCE_EXHAUSTED. 'inf' "
          "waits forever.");
ABSL_FLAG(absl::Duration, priority_aging, Defaults().scheduler.priority_aging,
          "Every this long a request waits, its priority rises by one, so low-priority "
          "requests are not starved. 0 turns aging off.");
ABSL_FLAG(int, threads, Defaults().threads,
          "Engine compute threads (CPU backend). 0: one per core.");
ABSL_FLAG(std::string, device, coalesce::engine::DeviceName(Defaults().device),
          "Where the model runs: cuda (a start-up error without a usable CUDA device), "
          "cpu, or auto (the GPU when one is usable, else the CPU, logging why). null: "
          "no arithmetic, for measuring the server's own cost (gRPC, streaming, "
          "batching); output is meaningless.");
ABSL_FLAG(std::string, dtype, "auto",
          "Precision of the weights and the KV cache: bf16, fp16 or fp32 on CUDA; only "
          "fp32 on the CPU. auto: bf16 on CUDA, fp32 on the CPU.");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "What the KV cache holds. CPU: fp32, bf16, fp16, or int8 (a float scale per token "
          "and KV head): bf16 and fp16 hold 2x the tokens of fp32 in the same "
          "--kv_cache_memory, int8 about 4x. CUDA: only the weights' precision (--dtype) so "
          "far; int8 and fp8 (e4m3) are refused at start-up. auto: fp32 on the CPU, --dtype "
          "on CUDA.");
ABSL_FLAG(std::string, quantize, "none",
          "CPU: quantize every float32 weight matrix at load to q8_0 or q4_0 blocks (what "
          "llama.cpp's reference quantization writes), for a model whose file holds floats "
          "(a Hugging Face folder): faster decoding for fewer bytes, at a small cost in "
          "quality. A quantized GGUF file's blocks are served as they are without it. none: "
          "keep them float32.");
ABSL_FLAG(
    bool, int8_activations, false,
    "CPU: multiply Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights with activations quantized to int8 per "
    "block of 32, with integer dot products (AVX512-VNNI, else AVX2): faster, but the logits are "
    "no "
    "longer those of the dequantized weights (docs/quality.md measures the difference). "
    "Ignored, with a warning, on a processor without AVX2.");
ABSL_FLAG(std::string, float_panels, "auto",
          "CPU: lay float32 weight matrices out again at start-up as the matrix product's panels "
          "(the same logits; one stream decodes faster; the model's rows are freed once laid "
          "out, so start-up briefly holds both). auto: where the processor's product is AVX2; "
          "true; false: read the model's rows.");
ABSL_FLAG(bool, cuda_graphs, Defaults().cuda_graphs,
          "CUDA: replay decode steps from CUDA graphs captured once per batch-size bucket.");
ABSL_FLAG(int, kv_block_size, Defaults().kv_block_size, "Token positions per KV-cache block.");
ABSL_FLAG(std::string, kv_cache_memory, Defaults().kv_cache_memory,
          "KV-cache size. CPU: a size (512MiB, 2GB), a fraction of physical memory "
          "(0.25), or auto (max_batch_size full-context sequences, at most a quarter "
          "of physical memory). CUDA: a size, a fraction of the device memory free "
          "after weights and activations, or auto (0.9 of it).");
ABSL_FLAG(std::string, fault_injection, "",
          "TESTING ONLY, never in production: device_lost_after_steps:N makes every "
          "engine step after the first N fail as a lost GPU does, to test the "
          "device-loss path (NOT_SERVING, exit code 3) without a GPU.");
ABSL_FLAG(absl::Duration, grace_period, Defaults().grace_period,
          "On SIGTERM/SIGINT, how long running streams may take to finish. Those still "
          "running then end with their final message (finish_reason CANCELLED, with usage), "
          "and the server exits once that is sent (at most 5 s later) and its clients have had "
          "half a second to close their connections.");
ABSL_FLAG(absl::Duration, stream_stall_timeout, Defaults().stream_stall_timeout,
          "A Generate stream whose client reads nothing for this long, while the engine "
          "still generates for it, is ended (CANCELLED) and its batch slot and KV blocks "
          "freed. 'inf' never.");
ABSL_FLAG(int, work_threads, Defaults().work_threads,
          "Threads that parse and tokenize requests, off gRPC's own threads so that a "
          "long prompt delays only its own call (at least 2: large requests, over 64 KiB, "
          "never take the last one, which small ones can always use).");
ABSL_FLAG(absl::Duration, max_connection_age, Defaults().max_connection_age,
          "Close each client connection (with GOAWAY) after about this long, so that "
          "long-lived client channels spread onto new replicas. 'inf' never.");
ABSL_FLAG(absl::Duration, keepalive_time, Defaults().keepalive_time,
          "Ping an idle connection after this long, to find dead peers.");
ABSL_FLAG(absl::Duration, keepalive_timeout, Defaults().keepalive_timeout,
          "Close a connection whose keepalive ping got no answer within this long.");
ABSL_FLAG(absl::Duration, handshake_timeout, Defaults().handshake_timeout,
          "Close a connection that has not finished its TLS handshake and sent the HTTP/2 "
          "preface and SETTINGS within this long (gRPC's default is 120s), so that half-open "
          "connections do not hold descriptors and memory.");
ABSL_FLAG(int, max_connections_per_peer, Defaults().max_connections_per_peer,
          "Most connections to the gRPC port from one client address (IPv6 or IPv4, port "
          "aside); one more is closed at once. 0: no limit.");
ABSL_FLAG(int, max_request_bytes, Defaults().max_request_bytes,
          "Largest request message accepted (RESOURCE_EXHAUSTED above it).");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain: serve gRPC over TLS (with --tls_key_file). Re-read when the "
          "file changes. Empty: plaintext.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file's certificate.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS).");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(10),
          "How often the TLS files are checked for a change (at least 1s).");
ABSL_FLAG(std::string, api_keys_file, "",
          "JSON file of tenants: each a name, the SHA-256 of its API key (or a client "
          "certificate subject), a weight, a maximum priority, and stream and token limits. "
          "Clients then send 'authorization: Bearer KEY'. Re-read when it changes.");
ABSL_FLAG(bool, split_special_tokens, Defaults().split_special_tokens,
          "Tokenize special tokens written in requests' text (a prompt, the messages' "
          "contents) as the ordinary text they spell, never as control tokens, for requests "
          "that do not set split_special_tokens themselves (transformers' "
          "split_special_tokens). The chat template's own special tokens stay tokens.");
ABSL_FLAG(int, health_port, -1,
          "A plaintext port serving only the gRPC health service, for probes when TLS is on; "
          "0 picks a free port, -1 serves none.");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error.");
ABSL_FLAG(bool, log_steps, Defaults().log_steps,
          "Log one line per engine step at --log_level=debug: decode and prefill tokens, "
          "admitted, preempted, running, waiting, free KV blocks, and why waiting requests "
          "were not admitted.");
ABSL_FLAG(bool, prefix_caching, Defaults().prefix_caching,
          "Reuse the KV cache of prompt prefixes seen before: a request whose tokens begin "
          "as an earlier request's (of the same cache_salt) did takes those whole KV blocks "
          "from the cache and computes only the rest. Cached blocks nobody uses are evicted, "
          "least recently used first, when memory is needed.");
ABSL_FLAG(std::string, overlap_steps, "auto",
          "auto, on or off. On: run each engine step on its own thread while the engine "
          "thread streams the previous step's tokens, so that streaming does not add to the "
          "step time. auto: on, except with --device=null, whose steps take no time to "
          "overlap.");

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
  o.chat_template = absl::GetFlag(FLAGS_chat_template);
  o.scheduler.batch_window = absl::GetFlag(FLAGS_batch_window);
  o.scheduler.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  const std::string batching = absl::GetFlag(FLAGS_batching);
  const auto* mode = std::find_if(
      std::begin(batcher::kBatchingModes), std::end(batcher::kBatchingModes),
      [&](batcher::BatchingMode m) { return batcher::BatchingModeName(m) == batching; });
  if (mode == std::end(batcher::kBatchingModes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batching=", batching, ": expected continuous, static or static_padded"));
  }
  o.scheduler.mode = *mode;
  if (o.scheduler.max_batch_size < 1 || o.scheduler.max_batch_size > 256) {
    return absl::InvalidArgumentError("--max_batch_size must be in [1, 256]");
  }
  if (o.scheduler.batch_window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--batch_window must not be negative");
  }
  o.scheduler.max_queue_wait = absl::GetFlag(FLAGS_max_queue_wait);
  o.scheduler.priority_aging = absl::GetFlag(FLAGS_priority_aging);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.max_step_time = absl::GetFlag(FLAGS_max_step_time);
  if (o.max_step_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_step_time must not be negative");
  }
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
  absl::StatusOr<engine::Device> device = engine::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return device.status();
  o.device = *device;
  absl::StatusOr<std::optional<engine::Precision>> precision =
      service::ParseDtype(absl::GetFlag(FLAGS_dtype));
  if (!precision.ok()) return precision.status();
  o.precision = *precision;
  absl::StatusOr<std::optional<engine::KvDtype>> kv_dtype =
      service::ParseKvCacheDtype(absl::GetFlag(FLAGS_kv_cache_dtype));
  if (!kv_dtype.ok()) return kv_dtype.status();
  o.kv_cache_dtype = *kv_dtype;
  absl::StatusOr<std::optional<engine::QuantType>> quantize =
      engine::ParseQuantizeFlag(absl::GetFlag(FLAGS_quantize));
  if (!quantize.ok()) return quantize.status();
  o.quantize = *quantize;
  o.int8_activations = absl::GetFlag(FLAGS_int8_activations);
  absl::StatusOr<std::optional<bool>> float_panels =
      engine::ParseFloatPanelsFlag(absl::GetFlag(FLAGS_float_panels));
  if (!float_panels.ok()) return float_panels.status();
  o.float_panels = *float_panels;
  o.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  absl::StatusOr<int> fault = service::ParseFaultInjection(absl::GetFlag(FLAGS_fault_injection));
  if (!fault.ok()) return fault.status();
  o.fault_device_lost_after_steps = *fault;
  o.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  if (o.kv_block_size < 1 || o.kv_block_size > 1024) {
    return absl::InvalidArgumentError("--kv_block_size must be in [1, 1024]");
  }
  o.kv_cache_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  if (absl::Status s = engine::ParseKvCacheMemory(o.kv_cache_memory).status(); !s.ok()) return s;
  o.grace_period = absl::GetFlag(FLAGS_grace_period);
  o.stream_stall_timeout = absl::GetFlag(FLAGS_stream_stall_timeout);
  if (o.stream_stall_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--stream_stall_timeout must be positive (or inf)");
  }
  o.work_threads = absl::GetFlag(FLAGS_work_threads);
  if (o.work_threads < 2 || o.work_threads > 64) {
    return absl::InvalidArgumentError("--work_threads must be in [2, 64]");
  }
  o.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  o.max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  o.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  o.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  o.handshake_timeout = absl::GetFlag(FLAGS_handshake_timeout);
  if (o.handshake_timeout < absl::Milliseconds(1) || o.handshake_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError("--handshake_timeout must be in [1ms, 24h]");
  }
  o.max_connections_per_peer = absl::GetFlag(FLAGS_max_connections_per_peer);
  if (o.max_connections_per_peer < 0) {
    return absl::InvalidArgumentError("--max_connections_per_peer must be 0 (no limit) or more");
  }
  o.log_steps = absl::GetFlag(FLAGS_log_steps);
  o.prefix_caching = absl::GetFlag(FLAGS_prefix_caching);
  absl::StatusOr<std::optional<bool>> overlap =
      service::ParseOverlapSteps(absl::GetFlag(FLAGS_overlap_steps));
  if (!overlap.ok()) return overlap.status();
  o.overlap_steps = *overlap;
  o.tls.cert = absl::GetFlag(FLAGS_tls_cert_file);
  o.tls.key = absl::GetFlag(FLAGS_tls_key_file);
  o.tls.client_ca = absl::GetFlag(FLAGS_tls_client_ca_file);
  o.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  if (absl::Status s = service::CheckTlsFiles(o.tls); !s.ok()) return s;
  o.api_keys_file = absl::GetFlag(FLAGS_api_keys_file);
  if (!o.api_keys_file.empty()) {
    if (absl::Status s = service::Tenants::Load(o.api_keys_file, RealClock()).status(); !s.ok()) {
      return s;
    }
  }
  o.split_special_tokens = absl::GetFlag(FLAGS_split_special_tokens);
  o.health_port = absl::GetFlag(FLAGS_health_port);
  if (o.health_port < -1 || o.health_port > 65535) {
    return absl::InvalidArgumentError("--health_port must be -1 (none), 0 (any) or a port");
  }
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

// The signals that start a drain. Blocked in every thread (see main); one
// thread of Serve's takes them with sigwait.
sigset_t ShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  return signals;
}

// Serves until SIGINT/SIGTERM (taken by a thread of its own) or a lost
// device; returns the exit code.
int Serve(const ServerOptions& options) {
  int exit_code = 1;
  std::unique_ptr<service::Server> server = service::Server::Start(options, &exit_code);
  if (server == nullptr) return exit_code;
  std::thread signal_thread([&server] {
    const sigset_t signals = ShutdownSignals();
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    server->shutdown().Request(0, strsignal(signal_number));
  });
  exit_code = server->WaitAndDrain();
  // After a lost device the signal thread still waits: wake it to end it.
  if (exit_code != 0) pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  return exit_code;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  coalesce::ParseFlags(
      argc, argv,
      "Serves a Llama-family model over gRPC, coalescing concurrent requests into "
      "shared batches.\nUsage: coalesce-server [--model=FILE|synthetic:NAME] [flags]");
  coalesce::service::RouteLibraryLogs();
  absl::StatusOr<coalesce::service::ServerOptions> options = coalesce::OptionsFromFlags();
  if (!options.ok()) {
    coalesce::Log(coalesce::LogLevel::kError, std::string(options.status().message()));
    return 2;
  }
  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and only sigwait() in Serve() receives them.
  const sigset_t signals = coalesce::ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return coalesce::Serve(*options);
}
