// What the engine loop reports as it works. metrics/ implements it with
// Prometheus; the batcher itself knows nothing of metrics. Called on the
// engine thread, so implementations must be cheap and must not block.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

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
  int free_kv_blocks = 0;
  int total_kv_blocks = 0;
};

struct RequestSummary {
  // "ok" or the lower-case status code name ("cancelled", ...)
  std::string status;
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
  virtual void OnFirstToken(absl::Duration time_to_first_token) {}
  virtual void OnInterToken(absl::Duration gap) {}
  virtual void OnFinished(const RequestSummary& summary) {}
  // A request refused or dropped before it ran: "queue_full", "too_long",
  // "queue_timeout" from the loop; the service adds its own reasons.
  virtual void OnRejected(std::string_view reason) {}
  // A running sequence gave back its KV blocks, to be recomputed later.
  virtual void OnPreempted() {}
};

}  // namespace coalesce::batcher
