// What the engine loop reports as it works. metrics/ implements it with
// Prometheus; the batcher itself knows nothing of metrics. Called on the
// engine thread, so implementations must be cheap and must not block.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace coalesce::batcher {

struct StepStats {
  int num_seqs = 0;          // sequences in the step
  int64_t bytes_read = 0;    // weights plus the KV cache the step's attention reads
  int prefill_tokens = 0;    // prompt (or recomputed) tokens processed
  int decode_tokens = 0;     // one per decoding sequence
  int generated_tokens = 0;  // new tokens sampled (a partial prefill samples none)
  absl::Duration duration;   // time in Backend::Step
};

struct QueueStats {
  int waiting = 0;
  int running = 0;
  int free_kv_blocks = 0;  // available: free, or cached and held by nobody
  int total_kv_blocks = 0;
  int cached_kv_blocks = 0;        // registered under a prefix hash, held or not
  int64_t kv_block_evictions = 0;  // cached blocks taken for other use, ever
};

struct RequestSummary {
  // "ok" or the lower-case status code name ("cancelled", ...)
  std::string status;
  std::string tenant;  // GenerationRequest::tenant
  int prompt_tokens = 0;
  int completion_tokens = 0;
  absl::Duration duration;  // arrival to last token
};

class LoopObserver {
 public:
  virtual ~LoopObserver() = default;
  virtual void OnStep(const StepStats& stats) {}
  virtual void OnQueue(const QueueStats& stats) {}
  // A new request joined the batch after `queue_wait` since its arrival, of
  // which `window_wait` was spent held by the coalescing window.
  virtual void OnAdmitted(absl::Duration queue_wait, absl::Duration window_wait) {}
  // One scheduling decision admitted `requests` (>= 1) at once.
  virtual void OnAdmission(int requests) {}
  // A request's first generated token, `time_to_first_token` after its
  // arrival; `tenant` is the request's (empty without --api_keys_file).
  virtual void OnFirstToken(absl::Duration time_to_first_token, std::string_view tenant) {}
  virtual void OnInterToken(absl::Duration gap) {}
  virtual void OnFinished(const RequestSummary& summary) {}
  // A request refused or dropped before it ran: "queue_full", "too_long",
  // "queue_timeout" from the loop; the service adds its own reasons.
  virtual void OnRejected(std::string_view reason) {}
  // A running sequence gave back its KV blocks, to be recomputed later.
  virtual void OnPreempted() {}
  // A running sequence of `tenant` was sent back to the queue to make room
  // for an admission: `reason` is PreemptReasonName's (scheduler.h): for a
  // tenant below its share, a higher priority, or a request whose samples
  // ran more than their share.
  virtual void OnPreemptedForAdmission(std::string_view reason, std::string_view tenant) {}
  // A new request (not a resumed one) looked its `prompt_tokens` up in the
  // prefix cache and found the KV of the first `cached_tokens` of them.
  virtual void OnPrefixCacheLookup(int prompt_tokens, int cached_tokens) {}
  // A Backend step failed with `status`; the requests of that step have
  // already ended with INTERNAL. `device_lost` when the code is
  // engine::kDeviceLostCode: the device is unusable for good, and the loop has
  // also ended every other request and refuses new ones (EngineLoop says how).
  // Called once per failed step.
  virtual void OnEngineFailure(const absl::Status& status, bool device_lost) {}
};

// Passes every call on to `next` (which may be null). Subclass it to act on
// some callbacks while another observer (the metrics) still gets them all.
class ForwardingObserver : public LoopObserver {
 public:
  explicit ForwardingObserver(LoopObserver* next) : next_(next) {}
  void OnStep(const StepStats& stats) override {
    if (next_ != nullptr) next_->OnStep(stats);
  }
  void OnQueue(const QueueStats& stats) override {
    if (next_ != nullptr) next_->OnQueue(stats);
  }
  void OnAdmitted(absl::Duration queue_wait, absl::Duration window_wait) override {
    if (next_ != nullptr) next_->OnAdmitted(queue_wait, window_wait);
  }
  void OnAdmission(int requests) override {
    if (next_ != nullptr) next_->OnAdmission(requests);
  }
  void OnFirstToken(absl::Duration time_to_first_token, std::string_view tenant) override {
    if (next_ != nullptr) next_->OnFirstToken(time_to_first_token, tenant);
  }
  void OnInterToken(absl::Duration gap) override {
    if (next_ != nullptr) next_->OnInterToken(gap);
  }
  void OnFinished(const RequestSummary& summary) override {
    if (next_ != nullptr) next_->OnFinished(summary);
  }
  void OnRejected(std::string_view reason) override {
    if (next_ != nullptr) next_->OnRejected(reason);
  }
  void OnPreempted() override {
    if (next_ != nullptr) next_->OnPreempted();
  }
  void OnPreemptedForAdmission(std::string_view reason, std::string_view tenant) override {
    if (next_ != nullptr) next_->OnPreemptedForAdmission(reason, tenant);
  }
  void OnPrefixCacheLookup(int prompt_tokens, int cached_tokens) override {
    if (next_ != nullptr) next_->OnPrefixCacheLookup(prompt_tokens, cached_tokens);
  }
  void OnEngineFailure(const absl::Status& status, bool device_lost) override {
    if (next_ != nullptr) next_->OnEngineFailure(status, device_lost);
  }

 private:
  LoopObserver* const next_;
};

}  // namespace coalesce::batcher
