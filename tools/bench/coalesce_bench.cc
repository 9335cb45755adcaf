// coalesce-bench: drives a running coalesce server with many concurrent
// streams and reports throughput, latency percentiles and goodput.
//
//   build/bin/coalesce-bench --concurrency=16 --duration=30s            # closed loop
//   build/bin/coalesce-bench --rate=20 --duration=60s --json=out.json  # open loop
//
// Asynchronous: one gRPC callback reactor per stream in flight, no thread per
// request, so thousands of streams cost memory, not threads. The main thread
// decides when to send (closed loop: whenever fewer than --concurrency streams
// are in flight; open loop: at Poisson arrival times) and draws the progress
// line; gRPC's threads run the reactors, which time every message and hand a
// record to the runner when their stream ends.
//
// Counting: every request sent ends as completed (status OK) or failed (any
// other status), or is still in flight when the bench gives up on it. After
// the last send the bench waits --drain_timeout for the streams in flight,
// then cancels what is left (reported as cancelled at the end).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "common/flags.h"
#include "grpcpp/grpcpp.h"
#include "tools/bench/report.h"
#include "tools/bench/workload.h"

using coalesce::bench::IntRange;

// ---------------------------------------------------------------------------
// Flags (read once, in main, into a Config)
// ---------------------------------------------------------------------------

ABSL_FLAG(std::string, server, "localhost:50051", "Address of a coalesce server.");
ABSL_FLAG(int, concurrency, 16,
          "Closed loop: keep this many streams in flight, sending a new request as soon as "
          "one ends.");
ABSL_FLAG(double, rate, 0,
          "Open loop: send this many requests per second on average, with Poisson arrivals "
          "(exponential gaps from --seed), whatever the server's pace. 0: closed loop.");
ABSL_FLAG(int, max_in_flight, 0,
          "Open loop: delay arrivals while this many streams are in flight (the delays are "
          "reported as send lag). 0: no limit.");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(30),
          "How long to send measured requests, after the warm-up. Ignored with --requests.");
ABSL_FLAG(int64_t, requests, 0, "Send this many measured requests instead of using --duration.");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(5),
          "Requests sent during this first period are not in the statistics (the server's "
          "caches, allocator and the connection settle).");
ABSL_FLAG(int64_t, warmup_requests, 0,
          "If above 0: the first N requests are the warm-up, instead of --warmup.");
ABSL_FLAG(IntRange, prompt_tokens, (IntRange{128, 128}),
          "Prompt length in tokens, BOS included: N, or LO:HI for uniform lengths.");
ABSL_FLAG(IntRange, max_new_tokens, (IntRange{128, 128}),
          "max_new_tokens of each request: N or LO:HI. An upper bound: the server has no "
          "'ignore EOS', so the model may end a generation early; the report counts the tokens "
          "that arrived.");
ABSL_FLAG(std::string, workload, "",
          "JSON-lines file of requests, used in order and cycled: {\"prompt\": TEXT} or "
          "{\"prompt_token_ids\": [IDS]}, optionally with \"max_new_tokens\" (else "
          "--max_new_tokens).");
ABSL_FLAG(uint64_t, seed, 1,
          "Seed of the prompts, lengths, arrival times and sampling seeds: the same seed sends "
          "the same requests.");
ABSL_FLAG(double, temperature, 0,
          "Sampling temperature; 0 is greedy. Sampled requests get the seed --seed + index.");
ABSL_FLAG(absl::Duration, timeout, absl::Minutes(10), "Deadline of each request.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(60),
          "After the last send, wait this long for the streams in flight, then cancel them.");
ABSL_FLAG(absl::Duration, wait_for_server, absl::Seconds(10),
          "How long GetModelInfo waits for the server to come up. 0: fail at once.");
ABSL_FLAG(int, vocab_size, 0,
          "If above 0: skip GetModelInfo and use this vocabulary size (with "
          "--context_length), e.g. to measure a server that is not up yet.");
ABSL_FLAG(int, context_length, 2048, "The context length used with --vocab_size.");
ABSL_FLAG(absl::Duration, slo_ttft, absl::Seconds(1),
          "Goodput objective: time to first token at most this.");
ABSL_FLAG(absl::Duration, slo_itl, absl::Milliseconds(100),
          "Goodput objective: mean inter-token latency of the request (time per output token) "
          "at most this.");
ABSL_FLAG(std::string, format, "table", "What to print on stdout: table, json or none.");
ABSL_FLAG(std::string, json, "", "Also write the JSON report to this file.");
ABSL_FLAG(std::string, csv, "",
          "Append a one-row CSV summary to this file (with a header when the file is new), "
          "so that a sweep can collect one row per run.");
ABSL_FLAG(bool, per_request, false, "Include one record per request in the JSON report.");
ABSL_FLAG(bool, progress, true,
          "Show progress on stderr: a bar when stderr is a terminal, else a line a second.");
ABSL_FLAG(int, channels, 1,
          "gRPC channels (TCP connections) to spread the streams over, round robin. One "
          "connection serializes its frames; several spread the client's work.");

namespace coalesce::bench {
namespace {

using coalesce::v1::GenerateRequest;
using coalesce::v1::GenerateResponse;
using coalesce::v1::Generator;
using SteadyClock = std::chrono::steady_clock;

// Exit codes, also in the usage message.
constexpr int kExitOk = 0;
constexpr int kExitRequestsFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNoServer = 3;

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

enum class Mode { kClosedLoop, kOpenLoop };

struct Config {
  std::string server;
  Mode mode = Mode::kClosedLoop;
  int concurrency = 16;   // closed loop
  double rate = 0;        // open loop, requests/s
  int max_in_flight = 0;  // open loop; 0: unbounded
  absl::Duration duration;
  int64_t requests = 0;  // > 0: count mode, duration ignored
  absl::Duration warmup;
  int64_t warmup_requests = 0;  // > 0: replaces warmup
  WorkloadOptions workload;
  double temperature = 0;
  absl::Duration timeout;
  absl::Duration drain_timeout;
  absl::Duration wait_for_server;
  int vocab_size = 0;  // > 0: no GetModelInfo
  int context_length = 0;
  double slo_ttft_s = 1;
  double slo_itl_s = 0.1;
  std::string format;
  std::string json_path;
  std::string csv_path;
  bool per_request = false;
  bool progress = true;
  int channels = 1;
};

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  c.server = absl::GetFlag(FLAGS_server);
  c.rate = absl::GetFlag(FLAGS_rate);
  c.mode = c.rate > 0 ? Mode::kOpenLoop : Mode::kClosedLoop;
  c.concurrency = absl::GetFlag(FLAGS_concurrency);
  c.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  c.duration = absl::GetFlag(FLAGS_duration);
  c.requests = absl::GetFlag(FLAGS_requests);
  c.warmup = absl::GetFlag(FLAGS_warmup);
  c.warmup_requests = absl::GetFlag(FLAGS_warmup_requests);
  c.workload.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  c.workload.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  c.workload.file = absl::GetFlag(FLAGS_workload);
  c.workload.seed = absl::GetFlag(FLAGS_seed);
  c.temperature = absl::GetFlag(FLAGS_temperature);
  c.timeout = absl::GetFlag(FLAGS_timeout);
  c.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  c.wait_for_server = absl::GetFlag(FLAGS_wait_for_server);
  c.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  c.context_length = absl::GetFlag(FLAGS_context_length);
  c.slo_ttft_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_slo_ttft));
  c.slo_itl_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_slo_itl));
  c.format = absl::GetFlag(FLAGS_format);
  c.json_path = absl::GetFlag(FLAGS_json);
  c.csv_path = absl::GetFlag(FLAGS_csv);
  c.per_request = absl::GetFlag(FLAGS_per_request);
  c.progress = absl::GetFlag(FLAGS_progress);
  c.channels = absl::GetFlag(FLAGS_channels);

  if (c.rate < 0) return absl::InvalidArgumentError("--rate must be >= 0");
  if (c.mode == Mode::kClosedLoop && c.concurrency < 1) {
    return absl::InvalidArgumentError("--concurrency must be at least 1");
  }
  if (c.max_in_flight < 0) return absl::InvalidArgumentError("--max_in_flight must be >= 0");
  if (c.requests < 0 || c.warmup_requests < 0) {
    return absl::InvalidArgumentError("--requests and --warmup_requests must be >= 0");
  }
  if (c.requests == 0 && c.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--duration must be positive (or give --requests)");
  }
  if (c.warmup < absl::ZeroDuration()) return absl::InvalidArgumentError("--warmup must be >= 0");
  if (c.timeout <= absl::ZeroDuration() || c.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--timeout must be positive and --drain_timeout >= 0");
  }
  if (c.format != "table" && c.format != "json" && c.format != "none") {
    return absl::InvalidArgumentError("--format must be table, json or none");
  }
  if (c.channels < 1) return absl::InvalidArgumentError("--channels must be at least 1");
  return c;
}

nlohmann::json ConfigJson(const Config& c) {
  nlohmann::json j = {
      {"server", c.server},
      {"mode", c.mode == Mode::kOpenLoop ? "open" : "closed"},
      {"concurrency", c.mode == Mode::kClosedLoop ? c.concurrency : 0},
      {"rate", c.rate},
      {"max_in_flight", c.max_in_flight},
      {"duration_s", c.requests > 0 ? nlohmann::json(nullptr)
                                    : nlohmann::json(absl::ToDoubleSeconds(c.duration))},
      {"requests", c.requests},
      {"warmup_s", c.warmup_requests > 0 ? 0.0 : absl::ToDoubleSeconds(c.warmup)},
      {"warmup_requests", c.warmup_requests},
      {"prompt_tokens", AbslUnparseFlag(c.workload.prompt_tokens)},
      {"max_new_tokens", AbslUnparseFlag(c.workload.max_new_tokens)},
      {"workload", c.workload.file},
      {"seed", c.workload.seed},
      {"temperature", c.temperature},
      {"timeout_s", absl::ToDoubleSeconds(c.timeout)},
      {"drain_timeout_s", absl::ToDoubleSeconds(c.drain_timeout)},
      {"slo_ttft_s", c.slo_ttft_s},
      {"slo_itl_s", c.slo_itl_s},
      {"channels", c.channels},
  };
  return j;
}

// ---------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------

struct ModelDescription {
  ModelLimits limits;
  nlohmann::json json;
  std::string summary;  // for the table's title
};

absl::StatusOr<ModelDescription> DescribeModel(const Config& config, Generator::Stub& stub) {
  ModelDescription d;
  if (config.vocab_size > 0) {
    d.limits.vocab_size = config.vocab_size;
    d.limits.context_length = config.context_length;
    d.json = {{"vocab_size", config.vocab_size},
              {"context_length", config.context_length},
              {"from_flags", true}};
    d.summary = absl::StrCat("vocab ", config.vocab_size, " (from flags)");
    return d;
  }
  grpc::ClientContext context;
  context.set_wait_for_ready(config.wait_for_server > absl::ZeroDuration());
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + std::max(config.wait_for_server, absl::Seconds(5))));
  coalesce::v1::ModelInfo info;
  const grpc::Status status = stub.GetModelInfo(&context, {}, &info);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("GetModelInfo on ", config.server,
                                               " failed: ", StatusCodeName(status.error_code()),
                                               ": ", status.error_message()));
  }
  d.limits.vocab_size = info.vocab_size();
  d.limits.context_length = info.context_length();
  d.limits.bos_token_id = info.bos_token_id();
  d.limits.eos_token_ids.assign(info.eos_token_ids().begin(), info.eos_token_ids().end());
  d.json = {{"name", info.name()},
            {"backend", info.backend()},
            {"synthetic", info.synthetic()},
            {"vocab_size", info.vocab_size()},
            {"context_length", info.context_length()},
            {"max_batch_size", info.max_batch_size()},
            {"num_parameters", info.num_parameters()},
            {"bos_token_id", info.bos_token_id()},
            {"eos_token_ids", d.limits.eos_token_ids}};
  // The null backend does no arithmetic: the numbers are the server's own
  // cost, not the model's, and the report says so.
  d.summary =
      absl::StrFormat("%s (%s, %.1fM parameters%s%s, max batch %d)", info.name(), info.backend(),
                      info.num_parameters() / 1e6, info.synthetic() ? ", random weights" : "",
                      info.backend() == "null" ? ", NO ARITHMETIC: the server's own cost" : "",
                      info.max_batch_size());
  return d;
}

// ---------------------------------------------------------------------------
// One stream
// ---------------------------------------------------------------------------

// What the runner keeps of a stream in flight, to cancel it at the end. Shared
// with the stream, so that the context outlives both the call and any
// TryCancel; cancelling a finished call is a no-op.
//
// A handle is destroyed only on the driver thread, the one that made it (see
// Runner::ReleaseFinishedCalls). A ClientContext holds a reference to its
// channel; destroyed on one of gRPC's callback threads after the driver has
// dropped the stubs, it would run the channel's destructor there, which shuts
// down and deletes the completion queue that very thread is serving, and the
// process aborts in gRPC. The destructor checks the rule, so that breaking it
// fails every run rather than one in a hundred.
struct CallHandle {
  CallHandle() : driver(std::this_thread::get_id()) {}
  ~CallHandle() {
    if (std::this_thread::get_id() != driver) {
      std::fputs("coalesce-bench: a call's context was destroyed off the driver thread\n", stderr);
      std::abort();
    }
  }
  CallHandle(const CallHandle&) = delete;
  CallHandle& operator=(const CallHandle&) = delete;

  const std::thread::id driver;
  grpc::ClientContext context;
  std::atomic<bool> cancelled_by_bench{false};
};

class Runner;

// Reads one Generate stream, timing each message. Deletes itself when the
// stream ends, after handing its record to the runner. The reactions run on
// gRPC's threads; nothing here blocks.
class Stream final : public grpc::ClientReadReactor<GenerateResponse> {
 public:
  Stream(Runner* runner, std::shared_ptr<CallHandle> call, GenerateRequest request,
         RequestRecord record)
      : runner_(runner),
        call_(std::move(call)),
        request_(std::move(request)),
        record_(std::move(record)) {}

  void Start(Generator::Stub* stub, SteadyClock::time_point send) {
    send_ = send;
    stub->async()->Generate(&call_->context, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  Runner* const runner_;
  const std::shared_ptr<CallHandle> call_;
  const GenerateRequest request_;  // read by gRPC until the call ends
  GenerateResponse response_;
  RequestRecord record_;
  SteadyClock::time_point send_;
};

// ---------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------

// Set from the SIGINT handler: 1 stops sending and drains, 2 cancels at once.
std::atomic<int> g_interrupts{0};
extern "C" void OnInterrupt(int) { g_interrupts.fetch_add(1); }

// Owns the sending schedule and the records. Run() is called once, from the
// main thread; the streams report back through OnStreamDone.
class Runner {
 public:
  Runner(const Config& config, std::vector<std::unique_ptr<Generator::Stub>> stubs,
         Workload workload)
      : config_(config), stubs_(std::move(stubs)), workload_(std::move(workload)) {}

  // Sends, drains, and returns the input of the report (records and times).
  ReportInput Run();

  // Streams that never ended, even after cancelling: their reactors may still
  // call back, so the runner must then outlive main.
  int64_t Unfinished() {
    absl::MutexLock lock(&mu_);
    return in_flight_;
  }

  // From a stream that ended (any thread).
  void OnStreamDone(RequestRecord record);
  // From a stream, per message with tokens; for the progress line only.
  void OnTokens(int n) { tokens_received_.fetch_add(n, std::memory_order_relaxed); }

 private:
  // Phases of a run, for the progress line.
  enum class Phase { kWarmup, kMeasuring, kDraining };

  void Launch(bool warmup, double send_lag_s);
  // Drops the handles of the streams that ended. Driver thread only.
  void ReleaseFinishedCalls();
  void WaitForFreeSlot(int64_t limit, absl::Duration timeout);
  void CancelAll();
  void ShowProgress(Phase phase, bool final_line);

  const Config& config_;
  const std::vector<std::unique_ptr<Generator::Stub>> stubs_;
  Workload workload_;  // driver thread only
  SteadyClock::time_point start_;
  int64_t next_index_ = 0;     // driver thread only
  int64_t warmup_sent_ = 0;    // driver thread only
  int64_t measured_sent_ = 0;  // driver thread only

  absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, std::shared_ptr<CallHandle>> calls_ ABSL_GUARDED_BY(mu_);
  // Handles of ended streams, kept for the driver thread to release.
  std::vector<std::shared_ptr<CallHandle>> finished_calls_ ABSL_GUARDED_BY(mu_);
  std::vector<RequestRecord> records_ ABSL_GUARDED_BY(mu_);
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<int64_t> tokens_received_{0};
  // Progress line state (driver thread only).
  bool tty_ = false;
  SteadyClock::time_point next_progress_;
  SteadyClock::time_point last_progress_;
  int64_t last_progress_tokens_ = 0;
  double progress_fraction_ = 0;
};

void Stream::OnReadDone(bool ok) {
  if (!ok) return;  // the stream is over; OnDone brings its status
  const double t = Seconds(SteadyClock::now() - send_);
  const int k = response_.token_ids_size();
  if (k > 0) {
    if (record_.ttft_s < 0) {
      // Tokens that arrive together with the first one waited as long as it
      // did: their gaps are 0 (see report.h).
      record_.ttft_s = t;
      record_.gaps_s.insert(record_.gaps_s.end(), k - 1, 0.0f);
    } else {
      // k tokens since the previous message: k gaps sharing the interval.
      const float gap = static_cast<float>((t - record_.last_token_s) / k);
      record_.gaps_s.insert(record_.gaps_s.end(), k, gap);
    }
    record_.last_token_s = t;
    record_.tokens += k;
    runner_->OnTokens(k);
  }
  ++record_.messages;
  if (response_.finish_reason() != coalesce::v1::FINISH_REASON_UNSPECIFIED) {
    const std::string& name = coalesce::v1::FinishReason_Name(response_.finish_reason());
    record_.finish_reason = name.substr(sizeof("FINISH_REASON_") - 1);
  }
  if (response_.has_usage()) {
    record_.usage_completion_tokens = response_.usage().completion_tokens();
    if (record_.prompt_tokens < 0) record_.prompt_tokens = response_.usage().prompt_tokens();
  }
  StartRead(&response_);
}

void Stream::OnDone(const grpc::Status& status) {
  RequestRecord record = std::move(record_);
  record.e2e_s = Seconds(SteadyClock::now() - send_);
  record.status_code = static_cast<int>(status.error_code());
  if (!status.ok()) {
    record.error = status.error_message();
    record.finish_reason.clear();
    record.cancelled_at_end = call_->cancelled_by_bench.load();
  }
  Runner* runner = runner_;
  // Nothing of the reactor is touched after this; the runner may finish the
  // run as soon as it has the last record.
  delete this;
  runner->OnStreamDone(std::move(record));
}

void Runner::OnStreamDone(RequestRecord record) {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  auto it = calls_.find(record.index);
  if (it != calls_.end()) {
    finished_calls_.push_back(std::move(it->second));
    calls_.erase(it);
  }
  if (record.status_code == 0) {
    ++completed_;
  } else {
    ++failed_;
  }
  records_.push_back(std::move(record));
}

void Runner::Launch(bool warmup, double send_lag_s) {
  ReleaseFinishedCalls();
  const int64_t index = next_index_++;
  RequestSpec spec = workload_.Next();
  GenerateRequest request;
  if (!spec.prompt.empty()) {
    request.set_prompt(spec.prompt);
  } else {
    request.mutable_prompt_token_ids()->Add(spec.prompt_token_ids.begin(),
                                            spec.prompt_token_ids.end());
  }
  request.set_max_new_tokens(spec.max_new_tokens);
  request.set_request_id(absl::StrCat("bench-", index));
  if (config_.temperature > 0) {
    request.mutable_sampling()->set_temperature(static_cast<float>(config_.temperature));
    request.mutable_sampling()->set_seed(config_.workload.seed + static_cast<uint64_t>(index));
  }

  RequestRecord record;
  record.index = index;
  record.warmup = warmup;
  record.send_lag_s = send_lag_s;
  record.prompt_tokens = spec.prompt.empty() ? static_cast<int>(spec.prompt_token_ids.size()) : -1;
  record.max_new_tokens = spec.max_new_tokens;
  (warmup ? warmup_sent_ : measured_sent_)++;

  auto call = std::make_shared<CallHandle>();
  call->context.set_deadline(absl::ToChronoTime(absl::Now() + config_.timeout));
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
    calls_.emplace(index, call);
  }
  const SteadyClock::time_point send = SteadyClock::now();
  record.send_s = Seconds(send - start_);
  auto* stream = new Stream(this, std::move(call), std::move(request), std::move(record));
  stream->Start(stubs_[index % stubs_.size()].get(), send);
}

void Runner::ReleaseFinishedCalls() {
  std::vector<std::shared_ptr<CallHandle>> finished;
  {
    absl::MutexLock lock(&mu_);
    finished.swap(finished_calls_);
  }
  // The contexts are destroyed here, outside the lock.
}

void Runner::WaitForFreeSlot(int64_t limit, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto free_slot = [this, limit]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ < limit; };
  mu_.AwaitWithTimeout(absl::Condition(&free_slot), timeout);
}

void Runner::CancelAll() {
  std::vector<std::shared_ptr<CallHandle>> calls;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [index, call] : calls_) calls.push_back(call);
  }
  // Outside the lock: TryCancel may run a stream's OnDone on this thread,
  // which takes mu_.
  for (auto& call : calls) {
    call->cancelled_by_bench = true;
    call->context.TryCancel();
  }
}

ReportInput Runner::Run() {
  using std::chrono::duration_cast;
  // Capped so that an infinite --drain_timeout does not overflow a time point.
  auto chrono = [](absl::Duration d) {
    return duration_cast<SteadyClock::duration>(
        absl::ToChronoNanoseconds(std::min(d, absl::Hours(24 * 365))));
  };
  constexpr absl::Duration kProgressTick = absl::Milliseconds(200);

  tty_ = isatty(STDERR_FILENO) != 0;
  start_ = SteadyClock::now();
  next_progress_ = last_progress_ = start_;

  // 1. When the measured part begins and sending ends. With a time warm-up
  //    both are known now; with --warmup_requests the measurement begins at
  //    the first measured send.
  const bool timed_warmup = config_.warmup_requests == 0;
  const bool timed_run = config_.requests == 0;
  SteadyClock::time_point measured_start =
      timed_warmup ? start_ + chrono(config_.warmup) : SteadyClock::time_point::max();
  bool measured_started = timed_warmup && config_.warmup <= absl::ZeroDuration();
  auto in_warmup = [&](SteadyClock::time_point t) {
    return timed_warmup ? t < measured_start : warmup_sent_ < config_.warmup_requests;
  };
  auto sending_over = [&](SteadyClock::time_point t) {
    if (g_interrupts.load() > 0) return true;
    if (timed_run) {
      return measured_start != SteadyClock::time_point::max() &&
             t >= measured_start + chrono(config_.duration);
    }
    return measured_sent_ >= config_.requests;
  };
  auto sending_deadline = [&]() {
    return timed_run && measured_start != SteadyClock::time_point::max()
               ? measured_start + chrono(config_.duration)
               : SteadyClock::time_point::max();
  };
  // How long to block: until `deadline`, but at most one progress tick.
  auto tick_until = [&](SteadyClock::time_point now, SteadyClock::time_point deadline) {
    return absl::FromChrono(std::clamp<SteadyClock::duration>(
        deadline - now, SteadyClock::duration::zero(), chrono(kProgressTick)));
  };
  auto phase_at = [&](SteadyClock::time_point t) {
    return in_warmup(t) ? Phase::kWarmup : Phase::kMeasuring;
  };
  auto update_fraction = [&](SteadyClock::time_point t) {
    if (timed_run && timed_warmup) {
      progress_fraction_ =
          Seconds(t - start_) / absl::ToDoubleSeconds(config_.warmup + config_.duration);
    } else if (timed_run) {
      progress_fraction_ =
          measured_started ? Seconds(t - measured_start) / absl::ToDoubleSeconds(config_.duration)
                           : 0;
    } else {
      progress_fraction_ = static_cast<double>(measured_sent_) / config_.requests;
    }
  };
  auto note_send = [&](SteadyClock::time_point t, bool warmup) {
    if (!warmup && !measured_started) {
      measured_started = true;
      if (!timed_warmup) measured_start = t;
    }
  };

  // 2. Send.
  std::mt19937_64 arrivals(config_.workload.seed ^ 0x9e3779b97f4a7c15ull);
  std::exponential_distribution<double> gap(config_.rate > 0 ? config_.rate : 1);
  SteadyClock::time_point next_arrival =
      start_ + duration_cast<SteadyClock::duration>(std::chrono::duration<double>(gap(arrivals)));
  while (true) {
    SteadyClock::time_point now = SteadyClock::now();
    if (config_.progress && now >= next_progress_) {
      update_fraction(now);
      ShowProgress(phase_at(now), false);
    }
    if (config_.mode == Mode::kClosedLoop) {
      if (sending_over(now)) break;
      WaitForFreeSlot(config_.concurrency, tick_until(now, sending_deadline()));
      {
        absl::MutexLock lock(&mu_);
        if (in_flight_ >= config_.concurrency) continue;
      }
      now = SteadyClock::now();
      if (sending_over(now)) break;
      const bool warmup = in_warmup(now);
      note_send(now, warmup);
      Launch(warmup, 0);
    } else {
      // An arrival is judged by its scheduled time, so the warm-up and the end
      // are the same whatever delays the client had.
      if (sending_over(next_arrival)) {
        // No arrival left in the window, but the window (the measured time)
        // lasts until its end.
        if (sending_over(now)) break;
        std::this_thread::sleep_until(std::min(now + chrono(kProgressTick), sending_deadline()));
        continue;
      }
      if (now < next_arrival) {
        std::this_thread::sleep_until(std::min(next_arrival, now + chrono(kProgressTick)));
        continue;
      }
      if (config_.max_in_flight > 0) {
        WaitForFreeSlot(config_.max_in_flight, tick_until(now, sending_deadline()));
        absl::MutexLock lock(&mu_);
        if (in_flight_ >= config_.max_in_flight) continue;
      }
      const bool warmup = in_warmup(next_arrival);
      note_send(next_arrival, warmup);
      Launch(warmup, Seconds(SteadyClock::now() - next_arrival));
      next_arrival +=
          duration_cast<SteadyClock::duration>(std::chrono::duration<double>(gap(arrivals)));
    }
  }
  const SteadyClock::time_point sending_end = SteadyClock::now();
  if (g_interrupts.load() > 0 && config_.progress) {
    std::fprintf(stderr, "%sinterrupted: draining (Ctrl-C again cancels at once)\n",
                 tty_ ? "\r\033[K" : "");
  }

  // 3. Drain: wait for the streams in flight, then cancel what is left and
  //    wait a little more for their final status.
  const SteadyClock::time_point drain_deadline = sending_end + chrono(config_.drain_timeout);
  bool cancelled = false;
  SteadyClock::time_point give_up = SteadyClock::time_point::max();
  while (true) {
    const SteadyClock::time_point now = SteadyClock::now();
    if (!cancelled && (now >= drain_deadline || g_interrupts.load() > 1)) {
      CancelAll();
      cancelled = true;
      // A cancelled call ends at once, short of a wedged connection.
      give_up = now + std::chrono::seconds(10);
    }
    if (now >= give_up) break;
    if (config_.progress && now >= next_progress_) {
      progress_fraction_ = 1;
      ShowProgress(Phase::kDraining, false);
    }
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    if (mu_.AwaitWithTimeout(absl::Condition(&drained),
                             tick_until(now, cancelled ? give_up : drain_deadline))) {
      break;
    }
  }
  const SteadyClock::time_point drain_end = SteadyClock::now();
  ReleaseFinishedCalls();
  if (config_.progress) {
    progress_fraction_ = 1;
    ShowProgress(Phase::kDraining, true);
  }

  ReportInput input;
  input.measured_sent = measured_sent_;
  input.warmup_sent = warmup_sent_;
  input.measured_start_s =
      measured_started ? Seconds(measured_start - start_) : Seconds(sending_end - start_);
  input.sending_end_s = Seconds(sending_end - start_);
  input.drain_s = Seconds(drain_end - sending_end);
  {
    absl::MutexLock lock(&mu_);
    input.records = std::move(records_);
    records_.clear();
  }
  std::sort(input.records.begin(), input.records.end(),
            [](const RequestRecord& a, const RequestRecord& b) { return a.index < b.index; });
  return input;
}

// ---------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------

void Runner::ShowProgress(Phase phase, bool final_line) {
  const SteadyClock::time_point now = SteadyClock::now();
  // A bar redrawn 5 times a second on a terminal; a line a second in a log.
  next_progress_ = now + (tty_ ? std::chrono::milliseconds(200) : std::chrono::seconds(1));
  if (final_line && tty_) {
    std::fputs("\r\033[K", stderr);  // the table follows on stdout
    return;
  }
  if (final_line) return;
  int64_t in_flight, completed, failed;
  {
    absl::MutexLock lock(&mu_);
    in_flight = in_flight_;
    completed = completed_;
    failed = failed_;
  }
  const int64_t tokens = tokens_received_.load(std::memory_order_relaxed);
  const double dt = Seconds(now - last_progress_);
  const double tokens_per_s = dt > 0 ? (tokens - last_progress_tokens_) / dt : 0;
  last_progress_ = now;
  last_progress_tokens_ = tokens;

  const char* phase_name = phase == Phase::kWarmup      ? "warm-up"
                           : phase == Phase::kMeasuring ? "running"
                                                        : "draining";
  const double fraction = std::clamp(progress_fraction_, 0.0, 1.0);
  std::string line =
      absl::StrFormat("%-8s %5.1f s  sent %d  done %d  failed %d  in flight %d  %.0f tokens/s",
                      phase_name, Seconds(now - start_), warmup_sent_ + measured_sent_, completed,
                      failed, in_flight, tokens_per_s);
  if (tty_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    std::fprintf(stderr, "\r\033[K[%s] %3.0f%% %s", bar.c_str(), fraction * 100, line.c_str());
  } else {
    std::fprintf(stderr, "%3.0f%% %s\n", fraction * 100, line.c_str());
  }
  std::fflush(stderr);
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

std::string Title(const Config& c, const std::string& model) {
  std::string how =
      c.mode == Mode::kClosedLoop
          ? absl::StrFormat("closed loop, %d streams", c.concurrency)
          : absl::StrFormat("open loop, Poisson %g requests/s%s", c.rate,
                            c.max_in_flight > 0
                                ? absl::StrCat(", at most ", c.max_in_flight, " in flight")
                                : "");
  std::string amount = c.requests > 0 ? absl::StrCat(c.requests, " requests")
                                      : absl::StrCat(absl::FormatDuration(c.duration));
  std::string warmup = c.warmup_requests > 0
                           ? absl::StrCat(c.warmup_requests, " warm-up requests")
                           : absl::StrCat(absl::FormatDuration(c.warmup), " warm-up");
  return absl::StrCat("coalesce-bench: ", how, ", ", amount, " after ", warmup, "\nserver  ",
                      c.server, ": ", model);
}

int Main() {
  absl::StatusOr<Config> config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "coalesce-bench: %s\n", std::string(config.status().message()).c_str());
    return kExitUsage;
  }
  const Config& c = *config;

  // One channel per --channels, each its own connection: gRPC shares a
  // subchannel between equal channels unless told otherwise.
  std::vector<std::unique_ptr<Generator::Stub>> stubs;
  for (int i = 0; i < c.channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("coalesce.bench.channel", i);
    stubs.push_back(Generator::NewStub(
        grpc::CreateCustomChannel(c.server, grpc::InsecureChannelCredentials(), args)));
  }

  absl::StatusOr<ModelDescription> model = DescribeModel(c, *stubs[0]);
  if (!model.ok()) {
    std::fprintf(stderr, "coalesce-bench: %s\n", std::string(model.status().message()).c_str());
    return kExitNoServer;
  }
  absl::StatusOr<Workload> workload = Workload::Create(c.workload, model->limits);
  if (!workload.ok()) {
    std::fprintf(stderr, "coalesce-bench: %s\n", std::string(workload.status().message()).c_str());
    return kExitUsage;
  }
  const std::string workload_line =
      absl::StrCat("load    ", workload->Describe(),
                   c.temperature > 0 ? absl::StrFormat(", temperature %g", c.temperature)
                                     : std::string(", greedy"),
                   "; EOS may end a generation early");

  std::signal(SIGINT, OnInterrupt);
  // Leaked on purpose when streams never ended: their reactors hold it.
  auto* runner = new Runner(c, std::move(stubs), *std::move(workload));
  ReportInput input = runner->Run();
  const int64_t unfinished = runner->Unfinished();
  std::signal(SIGINT, SIG_DFL);

  input.config = ConfigJson(c);
  input.config["interrupted"] = g_interrupts.load() > 0;
  input.model = model->json;
  input.title = Title(c, model->summary);
  input.workload = workload_line;
  input.slo_ttft_s = c.slo_ttft_s;
  input.slo_itl_s = c.slo_itl_s;
  const Report report = BuildReport(std::move(input));

  // 4. Outputs. A file that cannot be written is an error, after the others.
  int exit_code = kExitOk;
  const nlohmann::json json = ToJson(report, c.per_request);
  if (c.format == "table") std::fputs(FormatTable(report).c_str(), stdout);
  if (c.format == "json") std::printf("%s\n", json.dump(2).c_str());
  std::fflush(stdout);
  if (!c.json_path.empty()) {
    std::ofstream out(c.json_path);
    out << json.dump(2) << "\n";
    out.close();
    if (!out) {
      std::fprintf(stderr, "coalesce-bench: cannot write %s\n", c.json_path.c_str());
      exit_code = kExitUsage;
    }
  }
  if (!c.csv_path.empty()) {
    if (absl::Status s = AppendCsv(c.csv_path, report); !s.ok()) {
      std::fprintf(stderr, "coalesce-bench: %s\n", std::string(s.message()).c_str());
      exit_code = kExitUsage;
    }
  }
  if (exit_code == kExitOk && (report.failed > 0 || report.in_flight_at_end > 0 ||
                               report.warmup_failed > 0 || report.warmup_in_flight_at_end > 0)) {
    exit_code = kExitRequestsFailed;
  }
  if (unfinished > 0) {
    // Streams gRPC never ended still point at the runner: leave without
    // destructors rather than race them.
    std::fflush(nullptr);
    std::_Exit(exit_code);
  }
  delete runner;
  return exit_code;
}

}  // namespace
}  // namespace coalesce::bench

int main(int argc, char** argv) {
  coalesce::ParseFlags(
      argc, argv,
      "Load generator for a coalesce server: closed loop (--concurrency) or open loop "
      "(--rate), reporting throughput, TTFT, inter-token and end-to-end latency "
      "percentiles, and goodput under --slo_ttft/--slo_itl.\n"
      "Usage: coalesce-bench --server=HOST:PORT [--concurrency=16 | --rate=20] "
      "[--duration=30s | --requests=N] [--json=FILE] [--csv=FILE]\n"
      "Exit status: 0 every request succeeded; 1 some request failed or was cancelled at "
      "the end (or a flag did not parse: absl's own exit); 2 a flag value or workload the "
      "bench refuses, or an output file that cannot be written; 3 the server did not answer "
      "GetModelInfo.");
  return coalesce::bench::Main();
}
