#include "batcher/engine_loop.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace coalesce::batcher {

EngineLoop::EngineLoop(engine::Backend* backend, const engine::Tokenizer* tokenizer,
                       EngineLoopOptions options, const Clock* clock, LoopObserver* observer)
    : backend_(backend),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      scheduler_(options_.scheduler),
      clock_(clock),
      observer_(observer != nullptr ? observer : &no_observer_),
      block_size_(backend->kv_cache().block_size),
      kv_bytes_per_token_(backend->kv_bytes_per_token()),
      capabilities_(backend->capabilities()),
      limits_{.backend = std::string(backend->name()),
              .capabilities = capabilities_,
              .vocab_size = backend->config().vocab_size,
              .max_batch_size = options_.scheduler.max_batch_size,
              .block_size = block_size_,
              .total_blocks = backend->kv_cache().num_blocks},
      output_(tokenizer, backend->config().vocab_size, backend->config().max_seq_len),
      kv_(backend->kv_cache().num_blocks, block_size_, options_.kv_cache),
      step_thread_(options_.overlap_steps ? std::make_unique<StepThread>() : nullptr) {}

EngineLoop::~EngineLoop() { Stop(); }

void EngineLoop::Start() {
  PublishQueueStats();
  thread_ = std::thread([this] { Run(); });
}

absl::StatusOr<uint64_t> EngineLoop::Submit(GenerationRequest request,
                                            std::shared_ptr<OutputSink> sink) {
  if (absl::Status checked = CheckRequest(request, limits_); !checked.ok()) {
    if (checked.code() == absl::StatusCode::kResourceExhausted) observer_->OnRejected("too_long");
    return checked;
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (!device_lost_.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the server's device failed and it is shutting down (", device_lost_.message(), ")"));
  }
  const int waiting = published_.waiting + static_cast<int>(inbox_.size());
  if (waiting >= options_.max_queue) {
    observer_->OnRejected("queue_full");
    return absl::ResourceExhaustedError(
        absl::StrCat("the server is overloaded: ", waiting,
                     " requests are already waiting, its limit; retry after a short pause"));
  }
  const uint64_t id = next_id_++;
  auto seq = std::make_unique<Sequence>(id, std::move(request), std::move(sink));
  const GenerationRequest& r = seq->request;
  if (r.min_tokens > 0) seq->end_tokens = EndTokens(r);
  if (r.n > 1) {
    // Everything but the last token, computed once (sequence.h).
    seq->role = SampleRole::kUnforked;
    seq->tokens.pop_back();
    seq->prefill_end = static_cast<int>(seq->tokens.size());
  }
  seq->kv = kv_.NewSequence(r.cache_partition, r.cache_salt);
  inbox_.push_back(std::move(seq));
  return id;
}

void EngineLoop::Cancel(uint64_t id, absl::Status status) {
  absl::MutexLock lock(&mu_);
  cancels_.emplace_back(id, std::move(status));
}

void EngineLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopping_ = true;
  }
  if (thread_.joinable()) {
    thread_.join();
  } else {
    Tick();  // never started: end what was queued here
  }
}

QueueStats EngineLoop::queue_stats() const {
  absl::MutexLock lock(&mu_);
  return published_;
}

LoopSnapshot EngineLoop::Snapshot() const {
  LoopSnapshot snapshot;
  for (const auto& seq : running_) {
    LoopSnapshot::Seq s{seq->id, {seq->kv.table().begin(), seq->kv.table().end()}};
    s.blocks.insert(s.blocks.end(), seq->kv.reserved().begin(), seq->kv.reserved().end());
    snapshot.running.push_back(std::move(s));
  }
  for (const PaddingRow& row : padding_) snapshot.running.push_back({row.id, row.blocks});
  for (const auto& seq : waiting_) snapshot.waiting.push_back(seq->id);
  snapshot.free_blocks = kv_.AvailableIds();
  snapshot.cached_blocks = kv_.CachedIds();
  snapshot.total_blocks = kv_.num_total();
  for (int32_t id = 0; id < snapshot.total_blocks; ++id) snapshot.refs.push_back(kv_.refs(id));
  return snapshot;
}

bool EngineLoop::HasWork() const { return stopping_ || !inbox_.empty() || !cancels_.empty(); }

// Nothing can move without new arrivals, cancellations or the passage of
// time: no sequence runs, and nobody waits, or the last decision left the
// engine empty (it found nobody running and admitted nobody, so only time
// can change it: the coalescing window, aging, a timeout) and says when to
// look again. Any other decision is retaken at once: the sequences running
// then, or admitted by it, have since left and freed slots and blocks, even
// if all of them left in the very step they joined.
bool EngineLoop::Idle() const {
  return running_.empty() &&
         (waiting_.empty() || (decision_left_engine_empty_ && reconsider_at_.has_value()));
}

// ---------------------------------------------------------------------------
// The loop
// ---------------------------------------------------------------------------

void EngineLoop::Run() {
  do {
    absl::MutexLock lock(&mu_);
    if (Idle()) {
      const absl::Condition has_work(this, &EngineLoop::HasWork);
      if (reconsider_at_.has_value()) {
        mu_.AwaitWithTimeout(has_work, *reconsider_at_ - clock_->Now());
      } else {
        mu_.Await(has_work);
      }
    }
  } while (Tick());
}

bool EngineLoop::Tick() {
  // 1. Arrivals and cancellations.
  std::vector<std::unique_ptr<Sequence>> arrivals;
  std::vector<std::pair<uint64_t, absl::Status>> cancels;
  bool stopping;
  absl::Status device_lost;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return false;
    arrivals.swap(inbox_);
    cancels.swap(cancels_);
    stopping = stopping_;
    device_lost = device_lost_;
  }
  for (auto& seq : arrivals) {
    seq->tenant = TenantIndex(seq->request.tenant, seq->request.tenant_weight);
    waiting_.push_back(std::move(seq));
  }
  ApplyCancels(std::move(cancels));
  if (stopping) {
    EndAllCancelled();
    FlushDeliveries();
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    return false;
  }
  if (!device_lost.ok()) {
    // Nothing can run any more: requests submitted just before the loss
    // end at once instead of failing a step each.
    EndAllDeviceLost(device_lost);
    FlushDeliveries();
    PublishQueueStats();
    return true;
  }
  Iterate(clock_->Now());
  // With overlap, this step's tokens go out while the next step runs; with
  // no next step coming, or without overlap, now.
  if (step_thread_ == nullptr || running_.empty()) FlushDeliveries();
  return true;
}

void EngineLoop::ApplyCancels(std::vector<std::pair<uint64_t, absl::Status>> cancels) {
  for (auto& [id, status] : cancels) {
    // Every sample of the request: some may wait (preempted) while others run.
    auto matches = [id = id](const std::unique_ptr<Sequence>& s) { return s->id == id; };
    for (auto* queue : {&waiting_, &running_}) {
      for (auto& seq : *queue) {
        if (matches(seq)) FinishWithError(*seq, status);
      }
      std::erase_if(*queue, matches);
    }
  }
}

void EngineLoop::Iterate(absl::Time now) {
  const int running_before = static_cast<int>(running_.size());
  // 2-3.
  ExpireRunning(now);
  EndPaddingIfBatchOver();
  const Decision decision = ScheduleAndAdmit(now);
  // 4-5.
  StepStats stats;
  int preempted = 0;
  if (!running_.empty()) RunStep(stats, preempted);
  if (options_.log_steps && LogEnabled(LogLevel::kDebug) &&
      (stats.num_seqs > 0 || !waiting_.empty())) {
    LogF(LogLevel::kDebug,
         "step: seqs=%d decode_tokens=%d prefill_tokens=%d admitted=%d preempted=%d "
         "running=%d (was %d) waiting=%d free_blocks=%d hold=%s ms=%.1f",
         stats.num_seqs, stats.decode_tokens, stats.prefill_tokens, decision.admit.size(),
         preempted, running_.size(), running_before, waiting_.size(), kv_.num_available(),
         HoldReasonName(decision.hold), absl::ToDoubleMilliseconds(stats.duration));
  }
  PublishQueueStats();
}

void EngineLoop::ExpireRunning(absl::Time now) {
  for (auto& seq : running_) {
    if (now >= seq->request.deadline) {
      FinishWithError(*seq, absl::DeadlineExceededError("the request's deadline passed"));
    }
  }
  std::erase_if(running_, [](const auto& seq) { return seq->state == SequenceState::kFinished; });
}

// ---------------------------------------------------------------------------
// Admission
// ---------------------------------------------------------------------------

Decision EngineLoop::ScheduleAndAdmit(absl::Time now) {
  const std::vector<WaitingRequest> waiting = WaitingRequests(now);
  // The running sequences matter to the decision when it may preempt them
  // (continuous batching: for a tenant below its share, a higher priority,
  // or a request whose samples hold more than their share); otherwise only
  // their slots do.
  std::vector<RunningEntry> running;
  int slots = 0;
  if (options_.scheduler.mode == BatchingMode::kContinuous) {
    running = RunningEntries();
    for (const RunningEntry& e : running) slots += e.slots;
  } else {
    for (const auto& seq : running_) slots += seq->samples();
  }
  // Blocks that running decodes take in this very step are not free to
  // admit with: admitting into them would only preempt the newcomer again.
  const QueueState state{waiting, slots, std::max(0, kv_.num_available() - ImminentBlocks()),
                         tenant_weights_, running};
  Decision decision = scheduler_.Schedule(state, now);
  reconsider_at_ = decision.reconsider_at;
  decision_left_engine_empty_ = running_.empty() && decision.admit.empty();
  last_hold_ = decision.hold;
  last_decision_at_ = now;
  // The decision names requests by their position in waiting_ (the order
  // `waiting` was built in); each one taken leaves a hole, closed at the end.
  Expire(decision);
  PreemptForAdmission(decision);  // first: the admissions take their room
  const int admitted = Admit(decision, now);
  std::erase(waiting_, nullptr);
  if (admitted > 0) observer_->OnAdmission(admitted);
  return decision;
}

std::vector<WaitingRequest> EngineLoop::WaitingRequests(absl::Time now) {
  // Everyone waiting since the last decision was held by the window if that
  // decision said so.
  if (last_hold_ == HoldReason::kWindowOpen) {
    for (auto& seq : waiting_) {
      seq->window_wait += now - std::max(last_decision_at_, seq->request.arrival);
    }
  }
  std::vector<WaitingRequest> waiting;
  waiting.reserve(waiting_.size());
  for (const auto& seq : waiting_) {
    const int blocks = kv_.AdmissionCost(seq->kv, seq->tokens, seq->MatchLimit(block_size_),
                                         seq->BlocksToAdmit(block_size_));
    waiting.push_back({seq->id, seq->request.arrival, blocks, seq->request.priority,
                       seq->request.deadline, seq->state == SequenceState::kPreempted,
                       seq->samples(), seq->tenant});
  }
  return waiting;
}

std::vector<RunningEntry> EngineLoop::RunningEntries() const {
  std::vector<RunningEntry> entries;
  entries.reserve(running_.size());
  for (const auto& seq : running_) {
    entries.push_back({seq->tenant, seq->request.priority, seq->samples(), kv_.Releasable(seq->kv),
                       seq->id, seq->request.arrival});
  }
  return entries;
}

int EngineLoop::ImminentBlocks() const {
  int imminent = 0;
  for (const auto& seq : running_) {
    if (!seq->prefilling() &&
        static_cast<int>(seq->tokens.size()) > seq->kv.capacity(block_size_)) {
      ++imminent;
    }
  }
  return imminent;
}

void EngineLoop::Expire(const Decision& decision) {
  for (const Expired& e : decision.expired) {
    const std::unique_ptr<Sequence> seq = std::move(waiting_[e.index]);
    if (e.reason == ExpiryReason::kDeadline) {
      FinishWithError(*seq, absl::DeadlineExceededError(
                                "the request's deadline passed before it was admitted"));
    } else {
      observer_->OnRejected("queue_timeout");
      FinishWithError(*seq, absl::ResourceExhaustedError(absl::StrCat(
                                "the request was not admitted within the server's queue wait "
                                "limit (",
                                absl::FormatDuration(options_.scheduler.max_queue_wait),
                                "): the server is overloaded; retry after a short pause")));
    }
  }
}

void EngineLoop::PreemptForAdmission(const Decision& decision) {
  for (size_t k = 0; k < decision.preempt.size(); ++k) {
    std::unique_ptr<Sequence>& victim = running_[decision.preempt[k]];
    observer_->OnPreemptedForAdmission(PreemptReasonName(decision.preempt_reasons[k]),
                                       victim->request.tenant);
    Preempt(victim, /*for_admission=*/true);
  }
  std::erase(running_, nullptr);
}

int EngineLoop::Admit(const Decision& decision, absl::Time now) {
  int admitted = 0;
  for (const int index : decision.admit) {
    // The scheduler admitted it only if its blocks were available, by an
    // estimate that an eviction by an earlier admission of this decision
    // can make short: then it waits for the next decision.
    Sequence& candidate = *waiting_[index];
    const std::optional<KvCacheManager::Admission> blocks =
        kv_.Admit(candidate.kv, candidate.tokens, candidate.MatchLimit(block_size_),
                  candidate.BlocksToAdmit(block_size_), candidate.samples() - 1);
    if (!blocks.has_value()) continue;
    std::unique_ptr<Sequence> seq = std::move(waiting_[index]);
    seq->num_cached = blocks->cached;
    ++admitted;
    if (seq->state == SequenceState::kQueued) {  // its first admission
      seq->cached_prompt_tokens = seq->num_cached;
      if (blocks->looked_up) {
        observer_->OnPrefixCacheLookup(static_cast<int>(seq->tokens.size()), seq->num_cached);
      }
      if (seq->role != SampleRole::kUnforked) {
        output_.Begin(seq->request, seq->tokens.back(), seq->output);
      }
      observer_->OnAdmitted(now - seq->request.arrival, seq->window_wait);
    }
    seq->state = SequenceState::kRunning;
    running_.push_back(std::move(seq));
    // Samples whose shared part is all cached already (or empty) part now.
    Sequence& last = *running_.back();
    if (last.role == SampleRole::kUnforked && last.pending() == 0) Fork(last);
  }
  return admitted;
}

void EngineLoop::Preempt(std::unique_ptr<Sequence>& slot, bool for_admission) {
  Sequence& seq = *slot;
  // Everything it has, prompt and generated tokens, is recomputed on
  // resumption; its sampler and text state carry on, so its output is the
  // same as without the pause. Its registered blocks stay cached, so it may
  // find them again.
  kv_.Release(seq.kv);
  seq.num_cached = 0;
  seq.prefill_end = static_cast<int>(seq.tokens.size());
  seq.state = SequenceState::kPreempted;
  waiting_.push_back(std::move(slot));
  if (!for_admission) observer_->OnPreempted();
}

void EngineLoop::Fork(Sequence& parent) {
  const int computed = static_cast<int>(parent.tokens.size());  // the prompt but its last token
  const int n = parent.request.n;
  std::vector<engine::BlockCopy> copies;
  std::vector<SequenceBlocks> blocks = kv_.Fork(parent.kv, computed, copies);
  parent.role = SampleRole::kSample;
  parent.group = std::make_shared<SampleGroup>(n);
  parent.tokens.push_back(parent.request.prompt.back());
  parent.prefill_end = static_cast<int>(parent.tokens.size());
  output_.Begin(parent.request, parent.tokens.back(), parent.output);

  std::vector<std::unique_ptr<Sequence>> children;
  for (int i = 1; i < n; ++i) {
    children.push_back(ForkSample(parent, i, std::move(blocks[i - 1]), computed));
    output_.Begin(children.back()->request, children.back()->tokens.back(),
                  children.back()->output);
  }
  if (!copies.empty()) {
    const absl::Status copied = capabilities_.copies_blocks
                                    ? backend_->CopyBlocks(copies)
                                    : absl::UnimplementedError("no CopyBlocks");
    if (!copied.ok()) {
      // The partly filled block's positions are computed again instead.
      if (capabilities_.copies_blocks)
        Log(LogLevel::kWarning, absl::StrCat("KV block copy failed: ", copied.ToString()));
      for (auto& child : children) child->num_cached = computed / block_size_ * block_size_;
    }
  }
  // The samples follow their parent in admission order.
  auto at = std::find_if(running_.begin(), running_.end(),
                         [&parent](const auto& seq) { return seq.get() == &parent; });
  running_.insert(at + 1, std::make_move_iterator(children.begin()),
                  std::make_move_iterator(children.end()));
}

int EngineLoop::TenantIndex(const std::string& tenant, double weight) {
  auto [it, added] = tenant_ids_.try_emplace(tenant, static_cast<int>(tenant_weights_.size()));
  if (added) {
    tenant_weights_.push_back(weight);
  } else {
    tenant_weights_[it->second] = weight;
  }
  return it->second;
}

// ---------------------------------------------------------------------------
// One step: plan, run, apply
// ---------------------------------------------------------------------------

void EngineLoop::RunStep(StepStats& stats, int& preempted) {
  const StepPlan plan = Plan(stats, preempted);
  if (plan.chunks.empty()) {
    FlushDeliveries();
    return;
  }
  PrepareSampling();
  if (const absl::Status status = RunBatch(stats); !status.ok()) {
    FailStep(status);
    return;
  }
  Apply(stats);
}

std::optional<TenantShares> EngineLoop::CurrentShares() const {
  if (tenant_weights_.size() <= 1) return std::nullopt;
  // Shares need only tenants and slots: no block counts.
  std::vector<WaitingRequest> waiting(waiting_.size());
  for (size_t i = 0; i < waiting_.size(); ++i) waiting[i].tenant = waiting_[i]->tenant;
  std::vector<RunningEntry> running;
  running.reserve(running_.size());
  for (const auto& seq : running_) {
    running.push_back({.tenant = seq->tenant, .slots = seq->samples()});
  }
  QueueState state;
  state.waiting = waiting;
  state.tenant_weights = tenant_weights_;
  state.running_seqs = running;
  return scheduler_.Shares(state);
}

StepPlan EngineLoop::Plan(StepStats& stats, int& preempted) {
  // With several tenants, those over their share are preempted first.
  const std::optional<TenantShares> shares = CurrentShares();
  plan_input_.clear();
  for (const auto& seq : running_) {
    const bool over_share =
        shares.has_value() && shares->running[seq->tenant] > shares->share[seq->tenant];
    plan_input_.push_back({seq->num_cached, seq->pending(), seq->prefilling(), seq->kv.held(),
                           seq->request.priority, kv_.Releasable(seq->kv),
                           seq->scoring_prompt() ? options_.max_scored_chunk : 0, over_share,
                           seq->scoring_prompt()});
  }
  const StepPlan plan =
      PlanStep(plan_input_, kv_.num_available(), block_size_, options_.max_batch_tokens,
               {.model = &step_cost_, .target = options_.max_step_time});
  // The plan names sequences by their position in running_: find the chunks'
  // owners before preemption moves anyone.
  step_owner_.clear();
  for (const StepChunk& chunk : plan.chunks) step_owner_.push_back(running_[chunk.index].get());
  for (const int index : plan.preempt) Preempt(running_[index]);
  std::erase(running_, nullptr);
  preempted = static_cast<int>(plan.preempt.size());

  step_tokens_.clear();
  step_seqs_.clear();
  step_shape_ = StepShape();
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    const StepChunk& chunk = plan.chunks[c];
    Sequence& seq = *step_owner_[c];
    if (chunk.new_block) kv_.Grow(seq.kv);
    const auto first = seq.tokens.begin() + seq.num_cached;
    step_tokens_.insert(step_tokens_.end(), first, first + chunk.num_tokens);
    step_seqs_.push_back({chunk.num_tokens, seq.num_cached, seq.kv.table(), seq.scoring_prompt()});
    // Attention reads K and V of every position up to the chunk's last.
    stats.bytes_read += (seq.num_cached + chunk.num_tokens) * kv_bytes_per_token_;
    step_shape_ +=
        ChunkShape(seq.num_cached, chunk.num_tokens, seq.prefilling(), seq.scoring_prompt());
  }
  for (const PaddingRow& row : padding_) {
    step_tokens_.push_back(row.token);
    step_seqs_.push_back({1, row.pos, row.blocks});
    step_owner_.push_back(nullptr);  // nobody reads its token
    step_shape_ += ChunkShape(row.pos, 1, false, false);
  }
  stats.bytes_read += backend_->weight_bytes();
  stats.num_seqs = static_cast<int>(plan.chunks.size());
  stats.prefill_tokens = plan.prefill_tokens;
  stats.decode_tokens = plan.decode_tokens;
  return plan;
}

// A sequence whose tokens will all be cached after the step samples its next
// token; one that is only part-way through its prompt takes a greedy
// placeholder and draws nothing from its Rng (step_sampler.h).
void EngineLoop::PrepareSampling() {
  sampler_.Clear(backend_->config().vocab_size);
  for (size_t i = 0; i < step_owner_.size(); ++i) {
    StepSampler::Chunk chunk;  // greedy, for padding rows
    Sequence* seq = step_owner_[i];
    if (seq != nullptr && seq->pending() == step_seqs_[i].num_tokens &&
        seq->role != SampleRole::kUnforked) {
      chunk.spec.params = seq->request.sampling;
      if (chunk.spec.params.temperature > 0.0f) chunk.spec.uniform = seq->rng.NextFloat();
      chunk.wants_logits = seq->request.logprobs;
      if (seq->processes_logits()) {
        chunk.processor = &*seq->processor;
        chunk.banned = seq->banned();
      }
    }
    sampler_.Add(chunk);
  }
}

absl::Status EngineLoop::RunBatch(StepStats& stats) {
  absl::Status status;
  auto step = [&] {
    const absl::Time start = absl::Now();
    status = sampler_.Run(*backend_, engine::StepBatch{step_tokens_, step_seqs_});
    stats.duration = absl::Now() - start;
  };
  if (step_thread_ != nullptr) {
    // The step reads only the step buffers, the sampler and the sequences'
    // block tables, which nothing below touches until Wait returns.
    step_thread_->Post(step);
    FlushDeliveries();
    step_thread_->Wait();
  } else {
    step();
  }
  return status;
}

void EngineLoop::FailStep(const absl::Status& status) {
  const bool device_lost = status.code() == engine::kDeviceLostCode;
  Log(LogLevel::kError, absl::StrCat("engine step failed", device_lost ? " (device lost)" : "",
                                     ": ", status.ToString()));
  for (Sequence* seq : step_owner_) {
    if (seq == nullptr) continue;  // padding
    FinishWithError(*seq,
                    absl::InternalError(absl::StrCat("engine step failed: ", status.message())));
  }
  std::erase_if(running_, [](const auto& seq) { return seq->state == SequenceState::kFinished; });
  EndPaddingIfBatchOver();
  // Nothing is promised about what a failed step left in the cache.
  kv_.ForgetAll();
  if (device_lost) {
    {
      absl::MutexLock lock(&mu_);
      device_lost_ = status;
    }
    EndAllDeviceLost(status);
  }
  // Every request the failure touched has its final update by now.
  observer_->OnEngineFailure(status, device_lost);
}

void EngineLoop::Apply(StepStats& stats) {
  if (options_.max_step_time > absl::ZeroDuration()) {
    step_cost_.Observe(step_shape_, stats.duration);
  }
  const absl::Time now = clock_->Now();
  for (size_t i = 0; i < step_owner_.size(); ++i) {
    if (step_owner_[i] == nullptr) continue;  // padding
    Sequence& seq = *step_owner_[i];
    const int n = step_seqs_[i].num_tokens;
    if (step_seqs_[i].all_logits) {
      output_.ScorePrompt(seq.request, seq.num_cached, sampler_.logits(i, n), seq.output);
    }
    seq.num_cached += n;
    kv_.Register(seq.kv, std::span<const int32_t>(seq.tokens).first(seq.num_cached));
    if (seq.pending() > 0) continue;  // a prompt chunk; more follow
    if (seq.role == SampleRole::kUnforked) {
      Fork(seq);  // the shared part is done; the samples take it from here
      continue;
    }
    ++stats.generated_tokens;
    // The logits it sampled from, when they are here.
    std::span<const float> row;
    if (sampler_.ran_on_host()) row = sampler_.sampled_row(i, step_seqs_[i]);
    Emit(seq, sampler_.next(i), now, row);
  }
  observer_->OnStep(stats);
  std::erase_if(running_, [](const auto& seq) { return seq->state == SequenceState::kFinished; });
  EndPaddingIfBatchOver();
}

void EngineLoop::Emit(Sequence& seq, int32_t token, absl::Time now, std::span<const float> logits) {
  seq.tokens.push_back(token);
  if (seq.output.generated == 0) {
    // A request's first token, whichever sample makes it.
    if (seq.group == nullptr || !std::exchange(seq.group->first_token, true)) {
      observer_->OnFirstToken(now - seq.request.arrival, seq.request.tenant);
    }
  } else {
    observer_->OnInterToken(now - seq.last_token_at);
  }
  seq.last_token_at = now;
  if (seq.processor.has_value()) seq.processor->Accept(token);
  OutputProcessor::Output out = output_.Process(
      seq.request, seq.index, token, static_cast<int>(seq.tokens.size()), logits, seq.output);
  if (!out.finish.has_value()) {
    Deliver(seq, std::move(out.update));
    return;
  }
  if (options_.scheduler.mode == BatchingMode::kStaticPadded) {
    // Its row stays in the batch: the last cached position, recomputed.
    padding_.push_back(
        {seq.id, seq.tokens[seq.num_cached - 1], seq.num_cached - 1, kv_.TakeTable(seq.kv)});
  }
  out.update.finish_reason = *out.finish;
  Finish(seq, std::move(out.update));
}

std::vector<int32_t> EngineLoop::EndTokens(const GenerationRequest& request) const {
  std::vector<int32_t> out = request.stop_token_ids;
  if (!request.ignore_eos) {
    const auto eos = tokenizer_->eos_ids();
    out.insert(out.end(), eos.begin(), eos.end());
  }
  return out;
}

void EngineLoop::EndPaddingIfBatchOver() {
  if (!running_.empty()) return;
  for (PaddingRow& row : padding_) kv_.Release(row.blocks);
  padding_.clear();
}

// ---------------------------------------------------------------------------
// Output and endings
// ---------------------------------------------------------------------------

void EngineLoop::Deliver(Sequence& seq, StreamUpdate update) {
  outbox_.emplace_back(seq.sink, std::move(update));
}

void EngineLoop::FlushDeliveries() {
  for (auto& [sink, update] : outbox_) sink->Deliver(std::move(update));
  outbox_.clear();
}

void EngineLoop::Finish(Sequence& seq, StreamUpdate update) {
  kv_.Release(seq.kv);
  seq.state = SequenceState::kFinished;
  update.index = seq.index;
  update.finished = true;
  update.prompt_tokens = static_cast<int>(seq.request.prompt.size());
  update.completion_tokens = seq.output.generated;
  update.cached_prompt_tokens = seq.cached_prompt_tokens;
  ReportFinished(seq, update);
  // While unforked, a request ends all of its samples at once.
  for (int i = 1; i < seq.samples(); ++i) {
    StreamUpdate sample = update;
    sample.index = i;
    Deliver(seq, std::move(sample));
  }
  Deliver(seq, std::move(update));
}

void EngineLoop::ReportFinished(const Sequence& seq, const StreamUpdate& final_update) {
  RequestSummary summary;
  summary.status =
      final_update.status.ok()
          ? "ok"
          : absl::AsciiStrToLower(absl::StatusCodeToString(final_update.status.code()));
  summary.tenant = seq.request.tenant;
  summary.prompt_tokens = final_update.prompt_tokens;
  summary.completion_tokens = final_update.completion_tokens;
  summary.duration = clock_->Now() - seq.request.arrival;
  if (SampleGroup* group = seq.group.get(); group != nullptr) {
    // The request ends with its last sample.
    group->completion_tokens += summary.completion_tokens;
    if (group->status == "ok") group->status = summary.status;
    if (--group->unfinished > 0) return;
    summary.status = group->status;
    summary.completion_tokens = group->completion_tokens;
  }
  observer_->OnFinished(summary);
}

void EngineLoop::FinishWithError(Sequence& seq, absl::Status status) {
  StreamUpdate update;
  update.status = std::move(status);
  update.finish_reason = FinishReason::kCancelled;
  Finish(seq, std::move(update));
}

void EngineLoop::EndAllCancelled() {
  auto end = [this](std::unique_ptr<Sequence>& seq) {
    StreamUpdate update;
    update.finish_reason = FinishReason::kCancelled;
    Finish(*seq, std::move(update));
  };
  std::for_each(waiting_.begin(), waiting_.end(), end);
  std::for_each(running_.begin(), running_.end(), end);
  waiting_.clear();
  running_.clear();
  EndPaddingIfBatchOver();
  PublishQueueStats();
}

void EngineLoop::EndAllDeviceLost(const absl::Status& cause) {
  // A request that ran had its stream cut short: INTERNAL. One that never
  // ran (and so streamed nothing) may safely be retried on another replica:
  // UNAVAILABLE, the code gRPC clients retry.
  for (auto& seq : running_) {
    FinishWithError(
        *seq, absl::InternalError(absl::StrCat("the server's device failed: ", cause.message())));
  }
  for (auto& seq : waiting_) {
    if (seq->state == SequenceState::kPreempted) {
      FinishWithError(
          *seq, absl::InternalError(absl::StrCat("the server's device failed: ", cause.message())));
    } else {
      FinishWithError(*seq, absl::UnavailableError(
                                absl::StrCat("the server's device failed before this request ran (",
                                             cause.message(), "); retry on another replica")));
    }
  }
  running_.clear();
  waiting_.clear();
  EndPaddingIfBatchOver();
}

void EngineLoop::PublishQueueStats() {
  QueueStats stats;
  stats.running = static_cast<int>(running_.size());
  stats.waiting = static_cast<int>(waiting_.size());
  stats.free_kv_blocks = kv_.num_available();
  stats.total_kv_blocks = kv_.num_total();
  stats.cached_kv_blocks = kv_.num_cached();
  stats.kv_block_evictions = kv_.evictions();
  {
    absl::MutexLock lock(&mu_);
    published_ = stats;
  }
  observer_->OnQueue(stats);
}

}  // namespace coalesce::batcher
