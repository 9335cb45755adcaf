// The admission decision: which waiting requests join the running batch at
// this step boundary, which waiting requests have waited too long, and, when
// nobody may join yet, until when to wait. It is a pure function of the queue
// state and the time, so the coalescing window, priorities and timeouts are
// tested step by step with a fake clock (tests/batcher/scheduler_test.cc).
//
// Order. Waiting requests are considered by effective priority, highest
// first, then by the batch slots their request's other samples already run,
// fewest first (0 but for a request with several samples, some of them
// preempted), then by arrival, oldest first. Effective priority is the
// request's `priority` plus one for every `priority_aging` since it arrived,
// so a low-priority request is never starved: after (difference in
// priority) x priority_aging it ranks with the newer high-priority arrivals,
// and it is older than they are.
//
// Expiry. A waiting request whose deadline has passed expires (the client
// gets DEADLINE_EXCEEDED); one that was never admitted and has waited
// `max_queue_wait` expires too (RESOURCE_EXHAUSTED). Preempted requests were
// admitted once, stream already, and are exempt from max_queue_wait.
//
// The coalescing window (continuous batching, the default):
//   free slots = max_batch_size - running sequences
//   Nothing is admitted while there is no free slot or nobody waits.
//   Otherwise the waiting requests are admitted, in the order above, as
//   soon as ONE of these holds:
//     (a) the window is 0 (coalescing disabled);
//     (b) the waiting requests alone can fill every free slot (a request
//         with several samples takes a slot for each);
//     (c) the oldest waiting request has waited `batch_window`.
//   Until then the decision says "reconsider at oldest arrival + window".
//   Admission takes requests in order while the request's slots and the
//   KV-cache blocks it needs now (its prompt) are free; it stops at the
//   first request that does not fit (no overtaking, so a large request
//   cannot starve).
//
// Tenants (fairness). Every waiting request and running sequence belongs to
// a tenant (QueueState::tenant_weights; without tenants, all to tenant 0).
// Admission shares the batch's slots between the tenants with work (waiting
// or running) in proportion to their weights: a tenant's share is
//   share = max_batch_size x weight / (sum of the weights of tenants with work)
// Each running sequence produces one token per step, so this shares the
// generated tokens, step by step, in the same proportion. Admission takes
// the next request from the tenant that, with it, would run the fewest slots
// per weight (ties: the older request); within a tenant, the order above
// (priority, then arrival). Nothing is reserved: a tenant without waiting
// work has no share, so the others use the whole batch (work-conserving).
// When a tenant's next request does not fit (no free slot, or not enough
// free KV blocks), running sequences of other tenants are preempted for it,
// but only of tenants that, without them, still run at least as many slots
// per weight as the claimant would with the request: from the tenant with
// the most slots per weight, its lowest priority and most recently admitted
// first (Decision::preempt). So a tenant that runs less than its share gets
// its slots within a step, while one at its share takes nothing, and no two
// tenants can preempt each other back and forth: after the exchange the
// claimant still runs no more per weight than the victim. A preempted
// sequence resumes later by recomputation, as after a KV preemption
// (step_planner.h). Only continuous batching preempts. Between tenants only
// this rule preempts; priorities order work within a tenant (below).
//
// Priorities and large requests (preemption within a tenant; without
// tenants, everyone is tenant 0). When the next request does not fit, it may
// also take the room of running sequences of its own tenant:
//   - of a lower effective priority (a running sequence ages from its
//     arrival as a waiting one does, so the gap between two requests stays
//     what it was when both arrived, and a newer request of the same
//     priority never preempts an older one: a preempted low-priority request
//     ranks with new high-priority arrivals after the aging described above
//     and then finishes);
//   - of the same or lower effective priority, but of a request with
//     several samples that, without the victim, still runs at least as many
//     slots as the claimant's request would with it. So the samples of one
//     request (GenerationRequest::n) hold every slot only while nobody else
//     waits; a newcomer takes a sample's slot within a step, and the
//     preempted sample resumes (recomputed, its prefix from the cache) when
//     a slot frees.
// Victims: the lowest effective priority first, then the request running
// the most slots, then the most recently admitted.
//
// Static batching (for comparison): the same rule, but only while nothing
// runs; a batch runs until all of its sequences finish. kStaticPadded is the
// classic form (a fixed-shape batch, as servers without iteration-level
// scheduling run it): a finished sequence keeps its KV blocks and its row in
// every step, recomputing its last position as padding, until the batch
// ends. kStatic drops finished rows from the steps (a stronger baseline).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/time/time.h"

namespace coalesce::batcher {

enum class BatchingMode { kContinuous, kStatic, kStaticPadded };
inline constexpr BatchingMode kBatchingModes[] = {BatchingMode::kContinuous, BatchingMode::kStatic,
                                                  BatchingMode::kStaticPadded};
// "continuous", "static", "static_padded".
std::string_view BatchingModeName(BatchingMode mode);

struct SchedulerConfig {
  int max_batch_size = 16;                             // sequences in one engine step
  absl::Duration batch_window = absl::ZeroDuration();  // the server's default (see --batch_window)
  BatchingMode mode = BatchingMode::kContinuous;
  // A request never admitted within this time fails (RESOURCE_EXHAUSTED).
  absl::Duration max_queue_wait = absl::InfiniteDuration();
  // Waiting this long raises a request's effective priority by one. Zero or
  // infinite: no aging.
  absl::Duration priority_aging = absl::Seconds(10);
};

struct WaitingRequest {
  uint64_t id = 0;        // orders requests that arrived at the same instant
  absl::Time arrival;     // when the server received it
  int blocks_needed = 0;  // KV-cache blocks it must hold to be admitted
  int priority = 0;       // higher first
  absl::Time deadline = absl::InfiniteFuture();
  bool preempted = false;  // admitted before: exempt from max_queue_wait
  int slots = 1;           // batch slots it takes: its samples (GenerationRequest::n)
  int tenant = 0;          // index into QueueState::tenant_weights
};

// A running sequence, as preemption sees it.
struct RunningEntry {
  int tenant = 0;
  int priority = 0;
  int slots = 1;            // a request before its samples part takes one per sample
  int blocks_released = 0;  // KV blocks that preempting it makes available
  uint64_t id = 0;          // its request's (WaitingRequest::id): a request's samples share it
  absl::Time arrival{};     // its request's: running sequences age as waiting ones do
};

struct QueueState {
  std::span<const WaitingRequest> waiting;  // any order
  int running = 0;                          // batch slots taken now
  int free_blocks = 0;                      // KV-cache blocks not held
  // Each tenant's weight (> 0), by index; empty: one tenant, 0.
  std::span<const double> tenant_weights;
  // The running sequences, in admission order, their slots adding up to
  // `running`. Empty: the running slots are all tenant 0's and nothing is
  // preempted.
  std::span<const RunningEntry> running_seqs;
};

// Each tenant's fair share of the batch's slots (see the top of this file),
// 0 for a tenant without work, and the slots it runs now.
struct TenantShares {
  std::vector<double> share;
  std::vector<int> running;
};

// Why waiting requests were not (all) admitted; for logs and tests.
enum class HoldReason {
  kNone,                // everyone waiting was admitted, or nobody waits
  kNoFreeSlot,          // the batch is full
  kWindowOpen,          // coalescing: waiting for companions
  kNoFreeBlocks,        // the next request's KV blocks are not free
  kStaticBatchRunning,  // static mode: the current batch has not finished
};
std::string_view HoldReasonName(HoldReason reason);

enum class ExpiryReason { kDeadline, kQueueTimeout };

// Why a running sequence was preempted for an admission (see above).
enum class PreemptReason {
  kTenantShare,  // another tenant below its share
  kPriority,     // a higher effective priority of its own tenant
  kSamples,      // its request's samples ran more slots than their share
};
// "tenant_share", "priority", "samples".
std::string_view PreemptReasonName(PreemptReason reason);

struct Expired {
  int index;  // position in QueueState::waiting
  ExpiryReason reason;
  bool operator==(const Expired&) const = default;
};

// Requests are named by their position in QueueState::waiting, so the caller
// finds each one without a search.
struct Decision {
  std::vector<Expired> expired;  // leave the queue now, with an error
  std::vector<int> admit;        // join the batch now, in this order
  // Positions in QueueState::running_seqs to send back to the queue before
  // the admissions, to make room for them, and why (same order).
  std::vector<int> preempt;
  std::vector<PreemptReason> preempt_reasons;
  HoldReason hold = HoldReason::kNone;
  // Set when the decision can change by the passage of time alone (the
  // window ends, a deadline or queue timeout falls due, aging reorders):
  // the caller should decide again no later than this.
  std::optional<absl::Time> reconsider_at;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config) : config_(config) {}
  Decision Schedule(const QueueState& state, absl::Time now) const;
  const SchedulerConfig& config() const { return config_; }

  // `request`'s priority after waiting until `now`.
  int EffectivePriority(const WaitingRequest& request, absl::Time now) const;
  // A request's priority `now`, had it `priority` on arrival.
  int EffectivePriority(int priority, absl::Time arrival, absl::Time now) const;

  // The shares of the tenants in `state` (waiting and running work only).
  TenantShares Shares(const QueueState& state) const;

 private:
  SchedulerConfig config_;
};

}  // namespace coalesce::batcher
