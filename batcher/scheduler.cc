#include "batcher/scheduler.h"

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_map.h"

namespace coalesce::batcher {

std::string_view BatchingModeName(BatchingMode mode) {
  switch (mode) {
    case BatchingMode::kContinuous:
      return "continuous";
    case BatchingMode::kStatic:
      return "static";
    case BatchingMode::kStaticPadded:
      return "static_padded";
  }
  return "?";
}

std::string_view HoldReasonName(HoldReason reason) {
  switch (reason) {
    case HoldReason::kNone:
      return "none";
    case HoldReason::kNoFreeSlot:
      return "no_free_slot";
    case HoldReason::kWindowOpen:
      return "window_open";
    case HoldReason::kNoFreeBlocks:
      return "no_free_kv_blocks";
    case HoldReason::kStaticBatchRunning:
      return "static_batch_running";
  }
  return "unknown";
}

std::string_view PreemptReasonName(PreemptReason reason) {
  switch (reason) {
    case PreemptReason::kTenantShare:
      return "tenant_share";
    case PreemptReason::kPriority:
      return "priority";
    case PreemptReason::kSamples:
      return "samples";
  }
  return "unknown";
}

namespace {
bool AgingEnabled(const SchedulerConfig& config) {
  return config.priority_aging > absl::ZeroDuration() &&
         config.priority_aging < absl::InfiniteDuration();
}

// Whole aging intervals in `waited` (0 for none or negative).
int64_t AgingLevels(absl::Duration waited, absl::Duration interval) {
  if (waited <= absl::ZeroDuration()) return 0;
  absl::Duration remainder;
  return absl::IDivDuration(waited, interval, &remainder);
}

// Loads (slots per weight) are compared with this much slack, so that
// rounding cannot decide.
constexpr double kLoadSlack = 1e-9;

double WeightOf(const QueueState& state, int tenant) {
  if (state.tenant_weights.empty()) return 1.0;
  return std::max(state.tenant_weights[tenant], 1e-6);
}

// A tenant index out of range counts as tenant 0's.
template <typename T>
int TenantOf(const T& item, int tenants) {
  return item.tenant >= 0 && item.tenant < tenants ? item.tenant : 0;
}

bool ArrivedFirst(const WaitingRequest& a, const WaitingRequest& b) {
  if (a.arrival != b.arrival) return a.arrival < b.arrival;
  return a.id < b.id;
}

TenantShares SharesOf(const QueueState& state, std::span<const WaitingRequest* const> waiting,
                      int max_batch_size) {
  const int tenants = std::max<int>(1, static_cast<int>(state.tenant_weights.size()));
  TenantShares shares;
  shares.share.assign(tenants, 0.0);
  shares.running.assign(tenants, 0);
  std::vector<bool> has_work(tenants, false);
  if (state.running_seqs.empty()) {
    shares.running[0] = state.running;
    has_work[0] = state.running > 0;
  }
  for (const RunningEntry& e : state.running_seqs) {
    shares.running[TenantOf(e, tenants)] += e.slots;
    has_work[TenantOf(e, tenants)] = true;
  }
  for (const WaitingRequest* r : waiting) has_work[TenantOf(*r, tenants)] = true;
  double total = 0;
  for (int t = 0; t < tenants; ++t) total += has_work[t] ? WeightOf(state, t) : 0.0;
  for (int t = 0; t < tenants; ++t) {
    if (has_work[t]) shares.share[t] = max_batch_size * WeightOf(state, t) / total;
  }
  return shares;
}
}  // namespace

TenantShares Scheduler::Shares(const QueueState& state) const {
  std::vector<const WaitingRequest*> waiting;
  for (const WaitingRequest& r : state.waiting) waiting.push_back(&r);
  return SharesOf(state, waiting, config_.max_batch_size);
}

int Scheduler::EffectivePriority(const WaitingRequest& request, absl::Time now) const {
  return EffectivePriority(request.priority, request.arrival, now);
}

int Scheduler::EffectivePriority(int priority, absl::Time arrival, absl::Time now) const {
  if (!AgingEnabled(config_)) return priority;
  const int64_t levels = AgingLevels(now - arrival, config_.priority_aging);
  return static_cast<int>(
      std::min<int64_t>(int64_t{priority} + levels, std::numeric_limits<int>::max()));
}

Decision Scheduler::Schedule(const QueueState& state, absl::Time now) const {
  Decision decision;
  auto reconsider = [&decision](absl::Time t) {
    if (t == absl::InfiniteFuture()) return;
    if (!decision.reconsider_at || t < *decision.reconsider_at) decision.reconsider_at = t;
  };

  // 1. Expiry: deadlines and the queue timeout. The rest stay in line.
  std::vector<const WaitingRequest*> line;
  auto position = [&state](const WaitingRequest* r) {
    return static_cast<int>(r - state.waiting.data());
  };
  for (const WaitingRequest& request : state.waiting) {
    const absl::Time queue_limit =
        request.preempted ? absl::InfiniteFuture() : request.arrival + config_.max_queue_wait;
    if (now >= request.deadline) {
      decision.expired.push_back({position(&request), ExpiryReason::kDeadline});
    } else if (now >= queue_limit) {
      decision.expired.push_back({position(&request), ExpiryReason::kQueueTimeout});
    } else {
      line.push_back(&request);
      reconsider(std::min(request.deadline, queue_limit));
    }
  }
  if (line.empty()) return decision;

  // 2. Order: effective priority, then the slots of the request's samples
  //    running already, then arrival, then id (a total order).
  absl::flat_hash_map<uint64_t, int> request_slots;  // running, by request
  for (const RunningEntry& e : state.running_seqs) request_slots[e.id] += e.slots;
  auto running_of = [&request_slots](uint64_t id) {
    const auto it = request_slots.find(id);
    return it == request_slots.end() ? 0 : it->second;
  };
  std::vector<std::pair<int, const WaitingRequest*>> order;
  for (const WaitingRequest* r : line) order.emplace_back(EffectivePriority(*r, now), r);
  std::sort(order.begin(), order.end(), [&running_of](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    const int ra = running_of(a.second->id), rb = running_of(b.second->id);
    if (ra != rb) return ra < rb;
    if (a.second->arrival != b.second->arrival) return a.second->arrival < b.second->arrival;
    return a.second->id < b.second->id;
  });
  if (AgingEnabled(config_)) {
    // The order can change when the next request ages one level.
    for (const WaitingRequest* r : line) {
      const int64_t levels = AgingLevels(now - r->arrival, config_.priority_aging);
      reconsider(r->arrival + (levels + 1) * config_.priority_aging);
    }
  }

  // 3. Static batching admits only into an empty engine.
  if (config_.mode != BatchingMode::kContinuous && state.running > 0) {
    decision.hold = HoldReason::kStaticBatchRunning;
    return decision;
  }
  const bool may_preempt = config_.mode == BatchingMode::kContinuous && !state.running_seqs.empty();
  const int free_slots = config_.max_batch_size - state.running;
  if (free_slots <= 0 && !may_preempt) {
    decision.hold = HoldReason::kNoFreeSlot;
    return decision;
  }

  // 4. The coalescing window: hold the arrivals until they can fill the free
  //    slots or the oldest has waited long enough.
  absl::Time oldest = absl::InfiniteFuture();
  for (const WaitingRequest* r : line) oldest = std::min(oldest, r->arrival);
  const absl::Time window_end = oldest + config_.batch_window;
  int slots_wanted = 0;
  for (const WaitingRequest* r : line) slots_wanted += r->slots;
  const bool window_closed = config_.batch_window <= absl::ZeroDuration() ||
                             slots_wanted >= free_slots || now >= window_end;
  if (!window_closed) {
    decision.hold = HoldReason::kWindowOpen;
    reconsider(window_end);
    return decision;
  }

  // 5. Admit while slots and KV blocks last, tenant by tenant, in order
  //    within each; stop at the first request that does not fit, unless
  //    preempting for fairness makes room for it.
  TenantShares shares = SharesOf(state, line, config_.max_batch_size);
  const int tenants = static_cast<int>(shares.share.size());
  std::vector<std::vector<const WaitingRequest*>> queues(tenants);
  for (const auto& [priority, request] : order)
    queues[TenantOf(*request, tenants)].push_back(request);
  std::vector<size_t> next(tenants, 0);
  std::vector<int>& running = shares.running;  // and admitted by this decision
  std::vector<bool> gone(state.running_seqs.size(), false);
  int blocks_left = state.free_blocks;
  int slots_left = free_slots;

  // Effective priorities of the running sequences.
  std::vector<int> running_priority;
  for (const RunningEntry& e : state.running_seqs)
    running_priority.push_back(EffectivePriority(e.priority, e.arrival, now));

  // Preempts for `request` of tenant `t` (see the top of scheduler.h);
  // false, and nothing preempted, when it cannot make room.
  auto preempt_for = [&](const WaitingRequest& request, int t) {
    if (!may_preempt) return false;
    const double claimant = (running[t] + request.slots) / WeightOf(state, t);
    const int priority = EffectivePriority(request, now);
    std::vector<int> after = running;
    absl::flat_hash_map<uint64_t, int> request_after = request_slots;
    const int claimant_slots = request_after[request.id] + request.slots;
    std::vector<int> victims;
    std::vector<PreemptReason> reasons;
    int slots = slots_left;
    int blocks = blocks_left;
    while (request.slots > slots || request.blocks_needed > blocks) {
      // Of another tenant: the most loaded tenant, its lowest priority, its
      // latest admitted. Else of the claimant's: the lowest priority, the
      // request running the most slots, the latest admitted.
      int victim = -1;
      double victim_load = 0;
      int own = -1;
      for (int i = 0; i < static_cast<int>(state.running_seqs.size()); ++i) {
        const RunningEntry& e = state.running_seqs[i];
        const int v = TenantOf(e, tenants);
        if (gone[i] || e.id == request.id) continue;
        if (std::find(victims.begin(), victims.end(), i) != victims.end()) continue;
        if (v == t) {
          const int p = running_priority[i];
          const int load = request_after[e.id];
          if (p > priority || (p == priority && load - e.slots < claimant_slots)) continue;
          if (own < 0 || p < running_priority[own] ||
              (p == running_priority[own] && load >= request_after[state.running_seqs[own].id])) {
            own = i;
          }
          continue;
        }
        // The victim's tenant must keep at least the claimant's load.
        if ((after[v] - e.slots) / WeightOf(state, v) < claimant - kLoadSlack) continue;
        const double load = after[v] / WeightOf(state, v);
        if (victim < 0 || load > victim_load ||
            (load == victim_load && e.priority <= state.running_seqs[victim].priority)) {
          victim = i;
          victim_load = load;
        }
      }
      PreemptReason reason = PreemptReason::kTenantShare;
      if (victim < 0) {
        victim = own;
        reason = own >= 0 && running_priority[own] < priority ? PreemptReason::kPriority
                                                              : PreemptReason::kSamples;
      }
      if (victim < 0) return false;
      const RunningEntry& e = state.running_seqs[victim];
      victims.push_back(victim);
      reasons.push_back(reason);
      after[TenantOf(e, tenants)] -= e.slots;
      request_after[e.id] -= e.slots;
      slots += e.slots;
      blocks += e.blocks_released;
    }
    for (size_t k = 0; k < victims.size(); ++k) {
      gone[victims[k]] = true;
      decision.preempt.push_back(victims[k]);
      decision.preempt_reasons.push_back(reasons[k]);
    }
    running = std::move(after);
    request_slots = std::move(request_after);
    slots_left = slots;
    blocks_left = blocks;
    return true;
  };

  while (true) {
    // The tenant that runs the fewest slots per weight with its next
    // request (ties: the older request). If it cannot claim room by
    // preemption, no tenant can: a victim good for another is good for it.
    int pick = -1;
    double pick_load = 0;
    for (int t = 0; t < tenants; ++t) {
      if (next[t] >= queues[t].size()) continue;
      const double load = (running[t] + queues[t][next[t]]->slots) / WeightOf(state, t);
      if (pick < 0 || load < pick_load ||
          (load == pick_load && ArrivedFirst(*queues[t][next[t]], *queues[pick][next[pick]]))) {
        pick = t;
        pick_load = load;
      }
    }
    if (pick < 0) break;
    const WaitingRequest* request = queues[pick][next[pick]];
    if (request->slots > slots_left || request->blocks_needed > blocks_left) {
      const HoldReason reason =
          request->slots > slots_left ? HoldReason::kNoFreeSlot : HoldReason::kNoFreeBlocks;
      if (!preempt_for(*request, pick)) {
        decision.hold = reason;
        break;
      }
    }
    slots_left -= request->slots;
    blocks_left -= request->blocks_needed;
    running[pick] += request->slots;
    request_slots[request->id] += request->slots;
    ++next[pick];
    decision.admit.push_back(position(request));
  }
  return decision;
}

}  // namespace coalesce::batcher
