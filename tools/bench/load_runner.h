// coalesce-bench's load runner: sends a workload to a coalesce server on
// many concurrent streams and records every request (tools/bench/report.h
// turns the records into the report). coalesce_bench.cc reads the flags into
// a Config and prints the report.
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
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tools/bench/report.h"
#include "tools/bench/workload.h"

namespace coalesce::bench {

using SteadyClock = std::chrono::steady_clock;

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

// ---------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------

struct ModelDescription {
  ModelLimits limits;
  nlohmann::json json;
  std::string summary;  // for the table's title
};

// What the server says of its model (GetModelInfo, waiting up to
// --wait_for_server), or the limits given by --vocab_size.
absl::StatusOr<ModelDescription> DescribeModel(const Config& config, v1::Generator::Stub& stub);

// From a SIGINT handler (async-signal-safe): the first stops sending and
// drains, the second cancels at once.
void Interrupt();
// How many interrupts came.
int Interrupts();

struct CallHandle;

// Owns the sending schedule and the records. Run() is called once, from the
// main thread; the streams report back through OnStreamDone.
class Runner {
 public:
  Runner(const Config& config, std::vector<std::unique_ptr<v1::Generator::Stub>> stubs,
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
  const std::vector<std::unique_ptr<v1::Generator::Stub>> stubs_;
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
  // --turns: conversations whose next turn may go out, oldest first; the
  // next Launch takes one before starting a new conversation.
  struct NextTurn {
    int64_t conversation;
    int turn;
    std::vector<int32_t> history;
  };
  std::deque<NextTurn> next_turns_ ABSL_GUARDED_BY(mu_);
  int64_t conversations_ = 0;  // driver thread only
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

}  // namespace coalesce::bench
