// The engine loop: one thread that owns every sequence, the KV-block
// accounting and the backend, and runs the model one step at a time. Other
// threads only Submit and Cancel, which post into an inbox under a mutex.
//
// One iteration:
//   1. take arrivals and cancellations from the inbox;
//   2. end cancelled sequences and free their slots and blocks;
//   3. ask the Scheduler which waiting requests join, and admit them;
//   4. run one Backend::Step over every running sequence: admitted prompts
//      are prefilled together, the others decode one token each;
//   5. sample, stream the output, and retire finished sequences.
// So no request waits for the longest one in its batch, and new requests
// join at every step boundary.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "batcher/block_allocator.h"
#include "batcher/observer.h"
#include "batcher/request.h"
#include "batcher/scheduler.h"
#include "common/clock.h"
#include "engine/backend.h"
#include "engine/sampler.h"
#include "engine/text_stream.h"
#include "engine/tokenizer.h"

namespace coalesce::batcher {

struct EngineLoopOptions {
  SchedulerConfig scheduler;
  // Log a line per step (with why waiting requests were not admitted).
  bool log_steps = false;
};

class EngineLoop {
 public:
  // `backend`, `tokenizer`, `clock` and `observer` must outlive the loop.
  // `observer` may be null.
  EngineLoop(engine::Backend* backend, const engine::Tokenizer* tokenizer,
             EngineLoopOptions options, const Clock* clock, LoopObserver* observer);
  ~EngineLoop();  // Stop()s

  void Start();

  // Queues a request. On success the loop owns it and will Deliver a final
  // update to `sink` exactly once; the returned id names it for Cancel. On
  // error nothing was queued and `sink` is never called: UNAVAILABLE after
  // Stop, RESOURCE_EXHAUSTED when it could never fit the KV cache.
  absl::StatusOr<uint64_t> Submit(GenerationRequest request, std::shared_ptr<OutputSink> sink);

  // Ends the request within one step with `status` (e.g. CANCELLED): its
  // slot and blocks are freed and its sink gets a final update. Unknown or
  // already finished ids are ignored.
  void Cancel(uint64_t id, absl::Status status);

  // Stops taking requests, ends everything still queued or running with
  // finish_reason cancelled, and joins the thread. Idempotent.
  void Stop();

  QueueStats queue_stats() const;

 private:
  struct Sequence;

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();
  // Steps 3-5 of an iteration, after the inbox was drained.
  void Iterate(absl::Time now);
  void Admit(const Decision& decision, absl::Time now);
  void RunStep();
  void Finish(Sequence& seq, StreamUpdate update);
  void FinishWithError(Sequence& seq, absl::Status status);
  // Ends every waiting and running sequence with finish_reason cancelled.
  void EndAllCancelled();
  void PublishQueueStats();

  engine::Backend* const backend_;
  const engine::Tokenizer* const tokenizer_;
  const EngineLoopOptions options_;
  const Scheduler scheduler_;
  const Clock* const clock_;
  LoopObserver* const observer_;
  const int block_size_;

  // ---- Shared with Submit/Cancel callers --------------------------------
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::unique_ptr<Sequence>> inbox_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, absl::Status>> cancels_ ABSL_GUARDED_BY(mu_);
  QueueStats published_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;

  // ---- Owned by the loop thread ------------------------------------------
  BlockAllocator blocks_;
  std::deque<std::unique_ptr<Sequence>> waiting_;   // arrival order
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order
  std::optional<absl::Time> reconsider_at_;
  // Step buffers, reused.
  std::vector<int32_t> step_tokens_;             // [total_tokens]
  std::vector<engine::SequenceStep> step_seqs_;  // [num_seqs]
  std::vector<float> logits_;                    // [num_seqs, vocab]
};

}  // namespace coalesce::batcher
