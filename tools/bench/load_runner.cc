#include "tools/bench/load_runner.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/grpcpp.h"

namespace coalesce::bench {

using v1::GenerateRequest;
using v1::GenerateResponse;
using v1::Generator;

namespace {

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

std::atomic<int> g_interrupts{0};

}  // namespace

void Interrupt() { g_interrupts.fetch_add(1); }
int Interrupts() { return g_interrupts.load(); }

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

namespace {

// Reads one Generate stream, timing each message. Deletes itself when the
// stream ends, after handing its record to the runner. The reactions run on
// gRPC's threads; nothing here blocks.
class Stream final : public grpc::ClientReadReactor<GenerateResponse> {
 public:
  Stream(Runner* runner, std::shared_ptr<CallHandle> call, GenerateRequest request,
         RequestRecord record, int max_turns)
      : runner_(runner),
        call_(std::move(call)),
        request_(std::move(request)),
        record_(std::move(record)),
        max_turns_(max_turns) {
    // A turn before the last keeps what the next one re-sends.
    if (record_.turn < max_turns_) {
      record_.history.assign(request_.prompt_token_ids().begin(),
                             request_.prompt_token_ids().end());
    }
  }

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
  const int max_turns_;
  SteadyClock::time_point send_;
};

}  // namespace

// ---------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------

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
  if (record_.turn < max_turns_) {
    record_.history.insert(record_.history.end(), response_.token_ids().begin(),
                           response_.token_ids().end());
  }
  if (response_.has_usage()) {
    record_.usage_completion_tokens = response_.usage().completion_tokens();
    record_.cached_prompt_tokens = response_.usage().cached_prompt_tokens();
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
    if (record.turn < config_.workload.turns) {
      next_turns_.push_back({record.conversation, record.turn + 1, std::move(record.history)});
    }
  } else {
    ++failed_;
  }
  record.history.clear();
  record.history.shrink_to_fit();
  records_.push_back(std::move(record));
}

void Runner::Launch(bool warmup, double send_lag_s) {
  ReleaseFinishedCalls();
  const int64_t index = next_index_++;
  std::optional<NextTurn> next;
  {
    absl::MutexLock lock(&mu_);
    if (!next_turns_.empty()) {
      next = std::move(next_turns_.front());
      next_turns_.pop_front();
    }
  }
  RequestSpec spec =
      next.has_value() ? workload_.NextTurn(std::move(next->history)) : workload_.Next();
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
  record.conversation = next.has_value() ? next->conversation : conversations_++;
  record.turn = next.has_value() ? next->turn : 1;
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
  auto* stream = new Stream(this, std::move(call), std::move(request), std::move(record),
                            config_.workload.turns);
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
    if (Interrupts() > 0) return true;
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
  if (Interrupts() > 0 && config_.progress) {
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
    if (!cancelled && (now >= drain_deadline || Interrupts() > 1)) {
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

}  // namespace coalesce::bench
