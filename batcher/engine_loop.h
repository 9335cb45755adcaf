// The engine loop: one thread that owns every sequence, the KV-block
// accounting and the backend, and runs the model one step at a time. Other
// threads only Submit and Cancel, which post into an inbox under a mutex.
//
// One iteration (Tick):
//   1. take arrivals and cancellations from the inbox; cancelled requests
//      leave at once, waiting or running, and free their slot and blocks;
//   2. running sequences past their deadline leave (DEADLINE_EXCEEDED);
//   3. the Scheduler expires waiting requests (deadline, max_queue_wait) and
//      picks which join the batch; they get the KV blocks of their prompt;
//   4. the step planner preempts sequences when decodes need blocks that are
//      not free, and splits prompts to fit max_batch_tokens (decodes first)
//      and, beside decodes, max_step_time (by the step cost model, fed with
//      every step's time: step_cost.h);
//   5. one Backend::Step runs every planned chunk; then each sequence whose
//      tokens are all cached samples its next token, streams it, and leaves
//      if it finished.
// With `overlap_steps`, the step runs on a second thread, and the loop thread
// meanwhile hands the previous step's tokens to their streams (the costly
// part of streaming: a gRPC write per stream). Whether a sequence finished
// (EOS, a stop sequence, its length) is still decided before the next step
// is planned, so the tokens and their order are the same either way; only
// the host work no longer adds to the device's.
// So no request waits for the longest one in its batch, new requests join at
// every step boundary, and a long prompt cannot stall the others' tokens.
//
// A request for several samples (GenerationRequest::n) is admitted with a
// slot for each, computes its prompt once, and then runs as one sequence
// per sample that shares the prompt's KV blocks (sequence.h).
//
// The loop's rooms: the Scheduler decides who joins (scheduler.h), the step
// planner what each step runs (step_planner.h), the KV cache manager which
// blocks each sequence holds (kv_cache_manager.h), the output processor what
// each token says to its client (output_processor.h); sequence.h names the
// states a request goes through. The loop holds them together: RunStep is
// plan, run, apply.
//
// A failed step ends the requests of that step with INTERNAL and the loop
// goes on. A step that fails with engine::kDeviceLostCode means no step can
// ever run again: the loop then also ends every other request (INTERNAL for
// those that ran, UNAVAILABLE for those that never did, which a client may
// retry elsewhere), refuses new ones with UNAVAILABLE, and tells the
// observer, whose owner is expected to shut the server down.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "batcher/kv_cache_manager.h"
#include "batcher/observer.h"
#include "batcher/output_processor.h"
#include "batcher/request.h"
#include "batcher/scheduler.h"
#include "batcher/sequence.h"
#include "batcher/step_cost.h"
#include "batcher/step_planner.h"
#include "batcher/step_sampler.h"
#include "batcher/step_thread.h"
#include "common/clock.h"
#include "engine/backend.h"
#include "engine/logits_processor.h"
#include "engine/sampler.h"
#include "engine/tokenizer/tokenizer.h"

namespace coalesce::batcher {

struct EngineLoopOptions {
  SchedulerConfig scheduler;
  // Tokens processed in one step, decodes first, prompt chunks in the rest.
  // At least scheduler.max_batch_size.
  int max_batch_tokens = 2048;
  // Waiting requests (never admitted, or preempted) at most; Submit refuses
  // more with RESOURCE_EXHAUSTED.
  int max_queue = 1024;
  // Log one line per step at debug level: tokens, admissions, departures,
  // preemptions, and why waiting requests were not admitted.
  bool log_steps = false;
  // Run each step on a second thread while this one streams the previous
  // step's tokens (see the top of this file).
  bool overlap_steps = false;
  // Prefix caching, and the name of the model in every block's hash.
  KvCacheOptions kv_cache;
  // Prompt tokens a request with prompt_logprobs prefills in one step at
  // most: each takes a row of logits (the vocabulary's size in floats).
  int max_scored_chunk = 256;
  // A step with decoding sequences in it is planned to take at most this
  // long: its prompt chunks are sized by what the steps so far have cost
  // (step_cost.h, step_planner.h), so that a long prompt does not hold up
  // everyone's next token. Zero: only max_batch_tokens bounds a step.
  absl::Duration max_step_time = absl::ZeroDuration();
};

// The block ownership at one moment, for tests that check invariants.
struct LoopSnapshot {
  struct Seq {
    uint64_t id;  // the request's: each of its samples has it
    // Its KV blocks, and before a fork those reserved for the other samples.
    std::vector<int32_t> blocks;
  };
  std::vector<Seq> running;  // and kStaticPadded's padding rows
  std::vector<uint64_t> waiting;
  // Blocks Allocate may hand out: free ones, then cached ones (held by
  // nobody, kept for their prefix) from the least recently used.
  std::vector<int32_t> free_blocks;
  std::vector<int32_t> cached_blocks;  // the cached ones among free_blocks
  std::vector<int32_t> refs;           // [total_blocks]: holders of each block
  int total_blocks = 0;
};

class EngineLoop {
 public:
  // `backend`, `tokenizer`, `clock` and `observer` must outlive the loop.
  // `observer` may be null (nobody is told anything).
  EngineLoop(engine::Backend* backend, const engine::Tokenizer* tokenizer,
             EngineLoopOptions options, const Clock* clock, LoopObserver* observer);
  ~EngineLoop();  // Stop()s

  // Runs Tick() on the loop's own thread, sleeping while there is nothing
  // to do. Without Start(), a test drives the loop by calling Tick().
  void Start();

  // Queues a request. On success the loop owns it and will Deliver a final
  // update to `sink` exactly once for each of its samples; the returned id
  // names it (all its samples) for Cancel. On error nothing was queued and
  // `sink` is never called: UNAVAILABLE after Stop or once the device is
  // lost; RESOURCE_EXHAUSTED when the queue is full or the request could
  // never fit the KV cache; INVALID_ARGUMENT for an empty prompt or n
  // outside [1, max_batch_size].
  absl::StatusOr<uint64_t> Submit(GenerationRequest request, std::shared_ptr<OutputSink> sink);

  // Ends the request within one step with `status` (e.g. CANCELLED): its
  // slots and blocks are freed and its sink gets a final update for each
  // sample not yet finished. Unknown or already finished ids are ignored.
  void Cancel(uint64_t id, absl::Status status);

  // Stops taking requests, ends everything still queued or running with
  // finish_reason cancelled, and joins the thread. Idempotent.
  void Stop();

  // One iteration (see the top of this file). False once stopped. Call only
  // from one thread: the loop's own, or a test's when not Start()ed.
  bool Tick();

  QueueStats queue_stats() const;

  // The loop's time source: arrivals and deadlines are measured on it.
  const Clock& clock() const { return *clock_; }
  // Same threading rule as Tick().
  LoopSnapshot Snapshot() const;

 private:
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const;
  void Run();
  void ApplyCancels(std::vector<std::pair<uint64_t, absl::Status>> cancels);
  void Iterate(absl::Time now);
  void ExpireRunning(absl::Time now);

  // ---- Admission (steps 2-3) -----------------------------------------------
  Decision ScheduleAndAdmit(absl::Time now);
  // The waiting sequences as the scheduler sees them, in waiting_'s order.
  std::vector<WaitingRequest> WaitingRequests(absl::Time now);
  // The running sequences as the scheduler sees them, in admission order.
  std::vector<RunningEntry> RunningEntries() const;
  // Blocks the running decodes take in the coming step.
  int ImminentBlocks() const;
  // Carries out the decision's expiries, preemptions and admissions.
  void Expire(const Decision& decision);
  void PreemptForAdmission(const Decision& decision);
  int Admit(const Decision& decision, absl::Time now);
  // Sends a running sequence back to the queue, leaving `slot` empty (the
  // caller closes the hole in running_): for KV blocks, or to make room for
  // an admission (scheduler.h).
  void Preempt(std::unique_ptr<Sequence>& slot, bool for_admission = false);
  // A request with several samples has computed the part they share: it
  // becomes sample 0 and the others join running_ after it (sequence.h).
  void Fork(Sequence& parent);
  // The index of `tenant` in tenant_weights_, whose weight becomes `weight`.
  int TenantIndex(const std::string& tenant, double weight);

  // ---- One step (steps 4-5): plan, run, apply ------------------------------
  void RunStep(StepStats& stats, int& preempted);
  // Plans the step, preempts whom it must and fills the step buffers
  // (step_tokens_, step_seqs_, step_owner_, step_shape_).
  StepPlan Plan(StepStats& stats, int& preempted);
  // Running tenants over their share, or nullopt with one tenant.
  std::optional<TenantShares> CurrentShares() const;
  // Tells the sampler how each chunk of the step is sampled.
  void PrepareSampling();
  // Runs the planned step (on the step thread with overlap_steps).
  absl::Status RunBatch(StepStats& stats);
  // Ends the failed step's requests (and, after a device loss, every other).
  void FailStep(const absl::Status& status);
  // Takes the step's results: prompt scores, cached positions, forks and
  // new tokens.
  void Apply(StepStats& stats);
  // Takes the sequence's new token; `logits` (empty unless the step ran on
  // the host) are those it was sampled from.
  void Emit(Sequence& seq, int32_t token, absl::Time now, std::span<const float> logits);
  // The tokens min_tokens bans: stop_token_ids, and the tokenizer's
  // end-of-sequence tokens unless ignore_eos.
  std::vector<int32_t> EndTokens(const GenerationRequest& request) const;

  // ---- Output and endings ----------------------------------------------------
  // Queues an update for the sequence's stream; FlushDeliveries hands the
  // queue to the streams, in order.
  void Deliver(Sequence& seq, StreamUpdate update);
  void FlushDeliveries();
  // Lets go of the sequence's blocks and sends its final update (one for
  // each sample while unforked).
  void Finish(Sequence& seq, StreamUpdate update);
  // Tells the observer the request ended (with its last sample).
  void ReportFinished(const Sequence& seq, const StreamUpdate& final_update);
  void FinishWithError(Sequence& seq, absl::Status status);
  // Ends every waiting and running sequence with finish_reason cancelled.
  void EndAllCancelled();
  // After a device loss: ends every waiting and running sequence with an
  // error naming `cause` (see the top of this file).
  void EndAllDeviceLost(const absl::Status& cause);
  void PublishQueueStats();
  // kStaticPadded: frees the padding rows once no sequence of the batch runs.
  void EndPaddingIfBatchOver();

  engine::Backend* const backend_;
  const engine::Tokenizer* const tokenizer_;
  const EngineLoopOptions options_;
  const Scheduler scheduler_;
  const Clock* const clock_;
  LoopObserver no_observer_;      // observer_ when the caller gave none
  LoopObserver* const observer_;  // never null
  const int block_size_;
  const int64_t kv_bytes_per_token_;
  const engine::BackendCapabilities capabilities_;
  const RequestLimits limits_;  // what Submit accepts
  const OutputProcessor output_;

  // ---- Shared with Submit/Cancel callers --------------------------------
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // The step error that lost the device; OK while the device works. Set
  // once, by the loop thread.
  absl::Status device_lost_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::unique_ptr<Sequence>> inbox_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, absl::Status>> cancels_ ABSL_GUARDED_BY(mu_);
  QueueStats published_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;

  // ---- Owned by the loop thread ------------------------------------------
  KvCacheManager kv_;
  std::vector<std::unique_ptr<Sequence>> waiting_;  // any order: the scheduler orders
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order
  // kStaticPadded: finished sequences of the running batch, whose rows each
  // step recomputes (their last position, with their own KV blocks).
  struct PaddingRow {
    uint64_t id;
    int32_t token;  // the token at `pos`
    int pos;
    std::vector<int32_t> blocks;
  };
  std::vector<PaddingRow> padding_;
  // Tenants by name, and their weights by index (0: requests without one).
  absl::flat_hash_map<std::string, int> tenant_ids_;
  std::vector<double> tenant_weights_;
  std::optional<absl::Time> reconsider_at_;   // from the last decision
  bool decision_left_engine_empty_ = false;   // nobody ran, and it admitted nobody
  HoldReason last_hold_ = HoldReason::kNone;  // of the last decision, taken at...
  absl::Time last_decision_at_;               // ...this time
  // What steps cost, learned from those run (with max_step_time).
  StepCostModel step_cost_;
  // Step buffers, reused.
  std::vector<RunningSequence> plan_input_;      // [num_running]
  std::vector<int32_t> step_tokens_;             // [total_tokens]
  std::vector<engine::SequenceStep> step_seqs_;  // [num_chunks]
  std::vector<Sequence*> step_owner_;            // [num_chunks]
  StepShape step_shape_;                         // for the step cost model
  StepSampler sampler_;                          // how the step's tokens are sampled
  // Updates not yet handed to their streams, in order.
  std::vector<std::pair<std::shared_ptr<OutputSink>, StreamUpdate>> outbox_;
  std::unique_ptr<StepThread> step_thread_;  // with overlap_steps
};

}  // namespace coalesce::batcher
