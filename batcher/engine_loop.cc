#include "batcher/engine_loop.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace coalesce::batcher {

// What the samples of one request (GenerationRequest::n > 1) share once
// they run apart: the request ends, for the observer, with its last sample.
struct EngineLoop::Group {
  explicit Group(int samples) : unfinished(samples) {}
  int unfinished;             // samples without their final update
  int completion_tokens = 0;  // of the finished ones
  std::string status = "ok";  // the first error's, if any
  bool first_token = false;   // reported
};

// A request from arrival to its last token, or one of its samples. Owned by
// the loop thread once it leaves the inbox.
//
// Several samples. The request first runs as one sequence with `samples` > 1
// that computes all of its prompt but the last token. Then it forks (Fork):
// it becomes sample 0, and each other sample is a new sequence with the same
// id that shares the prompt's full blocks and holds one block of its own,
// reserved at admission, for the rest: a copy of the partly filled last
// block (Backend::CopyBlocks), or, on a backend that cannot copy, the same
// positions computed again. Every sample then computes the prompt's last
// token itself and samples from its own generator.
struct EngineLoop::Sequence {
  Sequence(uint64_t id, GenerationRequest req, std::shared_ptr<OutputSink> out, int index = 0)
      : id(id),
        request(std::move(req)),
        sink(std::move(out)),
        index(index),
        rng(request.seed + static_cast<uint64_t>(index)),
        tokens(request.prompt),
        prefill_end(static_cast<int>(tokens.size())) {
    if (request.controls.active() || request.min_tokens > 0) {
      processor.emplace(request.controls, request.prompt);
    }
  }

  // Positions not yet in the KV cache: the prompt (or everything, after a
  // preemption), or the one token sampled last.
  int pending() const { return static_cast<int>(tokens.size()) - num_cached; }
  bool prefilling() const { return num_cached < prefill_end; }
  // The blocks it must take to run: its tokens', and before a fork also the
  // prompt's last position and one for each other sample.
  int BlocksToAdmit(int block_size) const {
    const int len = static_cast<int>(tokens.size());
    return samples == 1 ? BlocksForTokens(len, block_size)
                        : BlocksForTokens(len + 1, block_size) + samples - 1;
  }
  // How many leading full blocks it may take from the prefix cache: all but
  // the one holding its last token, which it must compute for its logits;
  // before a fork, all (each sample computes the prompt's last token).
  int MatchLimit(int block_size) const {
    if (scoring_prompt()) return 0;  // every prompt position needs its logits
    const int len = static_cast<int>(tokens.size());
    return samples == 1 ? (len - 1) / block_size : len / block_size;
  }
  // With prompt_logprobs: prompt tokens after the first not yet scored.
  bool scoring_prompt() const {
    return request.prompt_logprobs && prompt_scored < static_cast<int>(request.prompt.size()) - 1;
  }
  // The tokens it may not sample now: before min_tokens, those that would
  // end it.
  std::span<const int32_t> banned() const {
    return generated < request.min_tokens ? std::span<const int32_t>(end_tokens)
                                          : std::span<const int32_t>();
  }
  // Whether its logits must be changed before it samples.
  bool processes_logits() const {
    return processor.has_value() && (processor->controls().active() || !banned().empty());
  }

  const uint64_t id;
  const GenerationRequest request;
  const std::shared_ptr<OutputSink> sink;
  const int index;  // the sample
  int tenant = 0;   // EngineLoop::tenant_weights_'s index
  engine::Rng rng;
  int samples = 1;               // > 1: the request before its fork (see above)
  std::shared_ptr<Group> group;  // after a fork; null for a single sample
  std::vector<int32_t> reserve;  // before a fork: a block for each other sample
  bool shares_blocks = false;    // forked: holds blocks its siblings hold
  std::vector<int32_t> tokens;   // [prompt + generated]
  int num_cached = 0;            // leading tokens whose K/V are in the cache
  int prefill_end;               // tokens before this are prefill work
  int generated = 0;
  std::vector<int32_t> blocks;  // KV blocks in position order
  // With prefix caching: the chain root of its salt, the hashes of its full
  // blocks so far, how many of its leading blocks are registered (computed
  // by it, or taken from the cache), and what the cache gave it at its
  // first admission.
  BlockHash prefix_root{};
  std::vector<BlockHash> hashes;
  int registered = 0;
  int cached_prompt_tokens = 0;
  // With prompt_logprobs: the log-probabilities of prompt tokens 1 to
  // prompt_scored, until sent with the first update (sample 0's).
  std::vector<engine::TokenLogprob> prompt_logprobs;
  int prompt_scored = 0;
  bool prompt_logprobs_sent = false;
  // With logits controls or min_tokens: counts its tokens and changes its
  // logits (engine/logits_processor.h).
  std::optional<engine::LogitsProcessor> processor;
  // With min_tokens: the tokens that would end it (end-of-sequence, unless
  // ignored, and stop_token_ids).
  std::vector<int32_t> end_tokens;
  std::optional<engine::TextStream> text;  // from the first admission on
  absl::Time last_token_at;
  absl::Duration window_wait;  // time held by the coalescing window
  bool preempted = false;      // admitted once, then sent back to the queue
  bool done = false;
};

// ---------------------------------------------------------------------------
// StepThread
// ---------------------------------------------------------------------------

StepThread::StepThread() : thread_([this] { Run(); }) {}

StepThread::~StepThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StepThread::Post(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  job_ = std::move(job);
  done_ = false;
}

void StepThread::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&done_));
}

void StepThread::Run() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &StepThread::HasJobOrStop));
      if (job_ == nullptr) return;  // stopping, nothing posted
      job = std::move(job_);
      job_ = nullptr;
    }
    job();
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
}

// ---------------------------------------------------------------------------
// EngineLoop
// ---------------------------------------------------------------------------

EngineLoop::EngineLoop(engine::Backend* backend, const engine::Tokenizer* tokenizer,
                       EngineLoopOptions options, const Clock* clock, LoopObserver* observer)
    : backend_(backend),
      tokenizer_(tokenizer),
      options_(options),
      scheduler_(options.scheduler),
      clock_(clock),
      observer_(observer),
      block_size_(backend->kv_cache().block_size),
      total_blocks_(backend->kv_cache().num_blocks),
      kv_bytes_per_token_(backend->kv_bytes_per_token()),
      capabilities_(backend->capabilities()),
      blocks_(backend->kv_cache().num_blocks, options.prefix_caching),
      prefix_root_(PrefixRoot(options.prefix_cache_namespace, "", "")),
      step_thread_(options.overlap_steps ? std::make_unique<StepThread>() : nullptr) {}

EngineLoop::~EngineLoop() { Stop(); }

void EngineLoop::Start() {
  PublishQueueStats();
  thread_ = std::thread([this] { Run(); });
}

absl::StatusOr<uint64_t> EngineLoop::Submit(GenerationRequest request,
                                            std::shared_ptr<OutputSink> sink) {
  if (request.prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  if ((request.logprobs || request.prompt_logprobs) &&
      (!capabilities_.samples_on_host || (request.prompt_logprobs && !capabilities_.all_logits))) {
    return absl::UnimplementedError(absl::StrCat("log-probabilities are not available on the ",
                                                 std::string(backend_->name()), " backend yet"));
  }
  if ((request.controls.active() || request.sampling.min_p > 0.0f || request.min_tokens > 0) &&
      !capabilities_.samples_on_host) {
    return absl::UnimplementedError(absl::StrCat(
        "repetition_penalty, frequency_penalty, presence_penalty, logit_bias, min_p and "
        "min_tokens are not available on the ",
        std::string(backend_->name()), " backend yet"));
  }
  if (request.top_logprobs < 0 || request.top_logprobs > backend_->config().vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs = ", request.top_logprobs, ": 0 to the vocabulary's size"));
  }
  if (request.n < 1 || request.n > options_.scheduler.max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n = ", request.n, " samples: at least 1, and the samples run together, so at most the ",
        options_.scheduler.max_batch_size, " sequences the server batches (max_batch_size)"));
  }
  // Each sample must fit the cache on its own, or it could never finish:
  // preemption makes room only by sending others away. And the prompt must
  // fit with a block for each other sample, to fork.
  const int tokens = static_cast<int>(request.prompt.size()) + request.max_new_tokens;
  if (BlocksForTokens(tokens, block_size_) > total_blocks_ ||
      BlocksForTokens(static_cast<int>(request.prompt.size()), block_size_) + request.n - 1 >
          total_blocks_) {
    if (observer_ != nullptr) observer_->OnRejected("too_long");
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", tokens, " tokens of KV cache (prompt ", request.prompt.size(),
        " + max_new_tokens ", request.max_new_tokens, ") but the server's cache holds ",
        total_blocks_ * block_size_, " tokens; lower max_new_tokens or shorten the prompt"));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (!device_lost_.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the server's device failed and it is shutting down (", device_lost_.message(), ")"));
  }
  const int waiting = published_.waiting + static_cast<int>(inbox_.size());
  if (waiting >= options_.max_queue) {
    if (observer_ != nullptr) observer_->OnRejected("queue_full");
    return absl::ResourceExhaustedError(
        absl::StrCat("the server is overloaded: ", waiting,
                     " requests are already waiting, its limit; retry after a short pause"));
  }
  const uint64_t id = next_id_++;
  auto seq = std::make_unique<Sequence>(id, std::move(request), std::move(sink));
  if (seq->request.min_tokens > 0) seq->end_tokens = EndTokens(seq->request);
  if (seq->request.n > 1) {
    // Everything but the last token, computed once (see Sequence).
    seq->samples = seq->request.n;
    seq->tokens.pop_back();
    seq->prefill_end = static_cast<int>(seq->tokens.size());
  }
  if (options_.prefix_caching) {
    const GenerationRequest& r = seq->request;
    seq->prefix_root =
        r.cache_salt.empty() && r.cache_partition.empty()
            ? prefix_root_
            : PrefixRoot(options_.prefix_cache_namespace, r.cache_partition, r.cache_salt);
  }
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
    LoopSnapshot::Seq s{seq->id, seq->blocks};
    s.blocks.insert(s.blocks.end(), seq->reserve.begin(), seq->reserve.end());
    snapshot.running.push_back(std::move(s));
  }
  for (const PaddingRow& row : padding_) snapshot.running.push_back({row.id, row.blocks});
  for (const auto& seq : waiting_) snapshot.waiting.push_back(seq->id);
  snapshot.free_blocks = blocks_.AvailableIds();
  snapshot.cached_blocks = blocks_.CachedIds();
  for (int32_t id = 0; id < total_blocks_; ++id) snapshot.refs.push_back(blocks_.refs(id));
  snapshot.total_blocks = total_blocks_;
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
         preempted, running_.size(), running_before, waiting_.size(), blocks_.num_available(),
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
  std::erase_if(running_, [](const auto& seq) { return seq->done; });
}

Decision EngineLoop::ScheduleAndAdmit(absl::Time now) {
  // Blocks that running decodes take in this very step are not free to
  // admit with: admitting into them would only preempt the newcomer again.
  int imminent = 0;
  for (const auto& seq : running_) {
    if (!seq->prefilling() &&
        static_cast<int>(seq->tokens.size()) > static_cast<int>(seq->blocks.size()) * block_size_) {
      ++imminent;
    }
  }
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
    // Cached blocks that running sequences hold cost nothing to take; the
    // others come out of the available ones either way.
    int shared = 0;
    if (options_.prefix_caching) {
      ExtendBlockHashes(seq->prefix_root, seq->tokens, block_size_, seq->hashes);
      blocks_.Match(std::span(seq->hashes)
                        .first(std::min<size_t>(seq->hashes.size(), seq->MatchLimit(block_size_))),
                    &shared);
    }
    waiting.push_back({seq->id, seq->request.arrival, seq->BlocksToAdmit(block_size_) - shared,
                       seq->request.priority, seq->request.deadline, seq->preempted, seq->samples,
                       seq->tenant});
  }
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
    for (const auto& seq : running_) slots += seq->samples;
  }
  const QueueState state{waiting, slots, std::max(0, blocks_.num_available() - imminent),
                         tenant_weights_, running};
  Decision decision = scheduler_.Schedule(state, now);
  reconsider_at_ = decision.reconsider_at;
  decision_left_engine_empty_ = running_.empty() && decision.admit.empty();
  last_hold_ = decision.hold;
  last_decision_at_ = now;

  // The decision names requests by their position in waiting_ (the order
  // `waiting` was built in); each one taken leaves a hole, closed at the end.
  for (const Expired& e : decision.expired) {
    const std::unique_ptr<Sequence> seq = std::move(waiting_[e.index]);
    if (e.reason == ExpiryReason::kDeadline) {
      FinishWithError(*seq, absl::DeadlineExceededError(
                                "the request's deadline passed before it was admitted"));
    } else {
      if (observer_ != nullptr) observer_->OnRejected("queue_timeout");
      FinishWithError(*seq, absl::ResourceExhaustedError(absl::StrCat(
                                "the request was not admitted within the server's queue wait "
                                "limit (",
                                absl::FormatDuration(options_.scheduler.max_queue_wait),
                                "): the server is overloaded; retry after a short pause")));
    }
  }
  // Preemptions first: the admissions take their room.
  for (size_t k = 0; k < decision.preempt.size(); ++k) {
    std::unique_ptr<Sequence>& victim = running_[decision.preempt[k]];
    if (observer_ != nullptr) {
      observer_->OnPreemptedForAdmission(PreemptReasonName(decision.preempt_reasons[k]),
                                         victim->request.tenant);
    }
    Preempt(victim, /*for_admission=*/true);
  }
  std::erase(running_, nullptr);
  int admitted = 0;
  for (const int index : decision.admit) {
    // The scheduler admitted it only if its blocks were available, by an
    // estimate that an eviction by an earlier admission of this decision
    // can make short: then it waits for the next decision.
    if (!TakeBlocks(*waiting_[index])) continue;
    std::unique_ptr<Sequence> seq = std::move(waiting_[index]);
    ++admitted;
    if (!seq->preempted) {
      seq->cached_prompt_tokens = seq->num_cached;
      if (observer_ != nullptr && options_.prefix_caching) {
        observer_->OnPrefixCacheLookup(static_cast<int>(seq->tokens.size()), seq->num_cached);
      }
      if (seq->samples == 1) seq->text.emplace(*tokenizer_, seq->tokens.back(), seq->request.stop);
      if (observer_ != nullptr) {
        observer_->OnAdmitted(now - seq->request.arrival, seq->window_wait);
      }
    }
    running_.push_back(std::move(seq));
    // Samples whose shared part is all cached already (or empty) part now.
    Sequence& last = *running_.back();
    if (last.samples > 1 && last.pending() == 0) Fork(last);
  }
  std::erase(waiting_, nullptr);
  if (observer_ != nullptr && admitted > 0) observer_->OnAdmission(admitted);
  return decision;
}

bool EngineLoop::TakeBlocks(Sequence& seq) {
  const int needed = seq.BlocksToAdmit(block_size_);
  const int reserve = seq.samples - 1;
  int matched = 0;
  std::vector<int32_t> blocks;
  if (options_.prefix_caching) {
    ExtendBlockHashes(seq.prefix_root, seq.tokens, block_size_, seq.hashes);
    const auto lookup =
        std::span(seq.hashes)
            .first(std::min<size_t>(seq.hashes.size(), seq.MatchLimit(block_size_)));
    matched = blocks_.Match(lookup);
    // Taken first, so that allocating the rest cannot evict them.
    blocks = blocks_.Take(lookup, matched);
  }
  std::optional<std::vector<int32_t>> rest = blocks_.Allocate(needed - matched);
  if (!rest.has_value()) {
    blocks_.Release(blocks);
    return false;
  }
  blocks.insert(blocks.end(), rest->begin(), rest->end() - reserve);
  seq.reserve.assign(rest->end() - reserve, rest->end());
  seq.blocks = std::move(blocks);
  seq.registered = matched;
  seq.num_cached = matched * block_size_;
  return true;
}

void EngineLoop::RegisterFullBlocks(Sequence& seq) {
  if (!options_.prefix_caching) return;
  const int full = seq.num_cached / block_size_;
  if (seq.registered >= full) return;
  ExtendBlockHashes(seq.prefix_root, std::span(seq.tokens).first(seq.num_cached), block_size_,
                    seq.hashes);
  for (; seq.registered < full; ++seq.registered) {
    blocks_.Register(seq.blocks[seq.registered], seq.hashes[seq.registered]);
  }
}

void EngineLoop::ReleaseBlocks(Sequence& seq) {
  blocks_.Release(seq.reserve);
  seq.reserve.clear();
  blocks_.Release(seq.blocks);
  seq.blocks.clear();
  seq.registered = 0;
}

void EngineLoop::Fork(Sequence& parent) {
  const int computed = static_cast<int>(parent.tokens.size());  // the prompt but its last token
  const int full = computed / block_size_;                      // blocks the samples share
  const bool partial = computed % block_size_ != 0;             // block `full` is partly filled
  const int n = parent.samples;
  parent.samples = 1;
  parent.group = std::make_shared<Group>(n);
  parent.shares_blocks = true;
  parent.tokens.push_back(parent.request.prompt.back());
  parent.prefill_end = static_cast<int>(parent.tokens.size());
  parent.text.emplace(*tokenizer_, parent.tokens.back(), parent.request.stop);

  std::vector<std::unique_ptr<Sequence>> children;
  std::vector<engine::BlockCopy> copies;
  for (int i = 1; i < n; ++i) {
    auto child = std::make_unique<Sequence>(parent.id, parent.request, parent.sink, i);
    child->blocks.assign(parent.blocks.begin(), parent.blocks.begin() + full);
    blocks_.Share(child->blocks);
    child->blocks.push_back(parent.reserve[i - 1]);
    if (partial) copies.push_back({.from = parent.blocks[full], .to = child->blocks.back()});
    child->num_cached = computed;
    child->prefix_root = parent.prefix_root;
    child->hashes = parent.hashes;
    child->registered = std::min(parent.registered, full);
    child->cached_prompt_tokens = parent.cached_prompt_tokens;
    // The prompt is scored (sample 0 sends it): nothing left for the others.
    child->prompt_scored = parent.prompt_scored;
    child->prompt_logprobs_sent = true;
    child->group = parent.group;
    child->tenant = parent.tenant;
    child->shares_blocks = true;
    child->end_tokens = parent.end_tokens;
    child->text.emplace(*tokenizer_, child->tokens.back(), child->request.stop);
    children.push_back(std::move(child));
  }
  parent.reserve.clear();
  if (!copies.empty()) {
    const absl::Status copied = capabilities_.copies_blocks
                                    ? backend_->CopyBlocks(copies)
                                    : absl::UnimplementedError("no CopyBlocks");
    if (!copied.ok()) {
      // The partly filled block's positions are computed again instead.
      if (capabilities_.copies_blocks)
        Log(LogLevel::kWarning, absl::StrCat("KV block copy failed: ", copied.ToString()));
      for (auto& child : children) child->num_cached = full * block_size_;
    }
  }
  // The samples follow their parent in admission order.
  auto at = std::find_if(running_.begin(), running_.end(),
                         [&parent](const auto& seq) { return seq.get() == &parent; });
  running_.insert(at + 1, std::make_move_iterator(children.begin()),
                  std::make_move_iterator(children.end()));
}

std::vector<RunningEntry> EngineLoop::RunningEntries() const {
  std::vector<RunningEntry> entries;
  entries.reserve(running_.size());
  for (const auto& seq : running_) {
    entries.push_back({seq->tenant, seq->request.priority, seq->samples, BlocksReleased(*seq),
                       seq->id, seq->request.arrival});
  }
  return entries;
}

int EngineLoop::BlocksReleased(const Sequence& seq) const {
  // Without caching or samples no block is shared: all of them.
  int released = static_cast<int>(seq.reserve.size());
  for (const int32_t id : seq.blocks) {
    released += (!options_.prefix_caching && !seq.shares_blocks) || blocks_.refs(id) == 1 ? 1 : 0;
  }
  return released;
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

void EngineLoop::Preempt(std::unique_ptr<Sequence>& slot, bool for_admission) {
  Sequence& seq = *slot;
  // Everything it has, prompt and generated tokens, is recomputed on
  // resumption; its sampler and text state carry on, so its output is the
  // same as without the pause. Its registered blocks stay cached, so it may
  // find them again.
  ReleaseBlocks(seq);
  seq.num_cached = 0;
  seq.prefill_end = static_cast<int>(seq.tokens.size());
  seq.preempted = true;
  waiting_.push_back(std::move(slot));
  if (observer_ != nullptr && !for_admission) observer_->OnPreempted();
}

void EngineLoop::RunStep(StepStats& stats, int& preempted) {
  // 4. Plan: preemptions, then the chunk of every sequence in the step.
  plan_input_.clear();
  // With several tenants, those over their share are preempted first.
  std::optional<TenantShares> shares;
  if (tenant_weights_.size() > 1) {
    // Shares need only tenants and slots: no block counts.
    std::vector<WaitingRequest> waiting(waiting_.size());
    for (size_t i = 0; i < waiting_.size(); ++i) waiting[i].tenant = waiting_[i]->tenant;
    std::vector<RunningEntry> running;
    running.reserve(running_.size());
    for (const auto& seq : running_)
      running.push_back({.tenant = seq->tenant, .slots = seq->samples});
    QueueState state;
    state.waiting = waiting;
    state.tenant_weights = tenant_weights_;
    state.running_seqs = running;
    shares = scheduler_.Shares(state);
  }
  for (const auto& seq : running_) {
    const int held = static_cast<int>(seq->blocks.size() + seq->reserve.size());
    const bool over_share =
        shares.has_value() && shares->running[seq->tenant] > shares->share[seq->tenant];
    plan_input_.push_back({seq->num_cached, seq->pending(), seq->prefilling(), held,
                           seq->request.priority, BlocksReleased(*seq),
                           seq->scoring_prompt() ? options_.max_scored_chunk : 0, over_share,
                           seq->scoring_prompt()});
  }
  const StepPlan plan =
      PlanStep(plan_input_, blocks_.num_available(), block_size_, options_.max_batch_tokens,
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
  StepShape shape;  // for the step cost model
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    const StepChunk& chunk = plan.chunks[c];
    Sequence& seq = *step_owner_[c];
    if (chunk.new_block) seq.blocks.push_back((*blocks_.Allocate(1))[0]);
    const auto first = seq.tokens.begin() + seq.num_cached;
    step_tokens_.insert(step_tokens_.end(), first, first + chunk.num_tokens);
    step_seqs_.push_back({chunk.num_tokens, seq.num_cached, seq.blocks, seq.scoring_prompt()});
    // Attention reads K and V of every position up to the chunk's last.
    stats.bytes_read += (seq.num_cached + chunk.num_tokens) * kv_bytes_per_token_;
    shape += ChunkShape(seq.num_cached, chunk.num_tokens, seq.prefilling(), seq.scoring_prompt());
  }
  for (const PaddingRow& row : padding_) {
    step_tokens_.push_back(row.token);
    step_seqs_.push_back({1, row.pos, row.blocks});
    step_owner_.push_back(nullptr);  // nobody reads its token
    shape += ChunkShape(row.pos, 1, false, false);
  }
  stats.bytes_read += backend_->weight_bytes();
  stats.num_seqs = static_cast<int>(plan.chunks.size());
  stats.prefill_tokens = plan.prefill_tokens;
  stats.decode_tokens = plan.decode_tokens;
  if (plan.chunks.empty()) {
    FlushDeliveries();
    return;
  }

  // 5. Run the step. A sequence whose tokens will all be cached after it
  // samples its next token; one that is only part-way through its prompt
  // takes a greedy placeholder and draws nothing from its Rng.
  // Log-probabilities need the logits: then the step's tokens are sampled
  // here, as the backend would sample them (capabilities().samples_on_host).
  // So do logits controls, applied to a copy of the row (StepOnTheHost).
  step_sampling_.clear();
  step_process_.clear();
  bool need_logits = false;
  for (size_t i = 0; i < step_owner_.size(); ++i) {
    engine::SampleSpec spec;  // greedy, for padding rows
    ProcessSpec process;
    if (step_owner_[i] == nullptr) {
      step_sampling_.push_back(spec);
      step_process_.push_back(process);
      continue;
    }
    Sequence& seq = *step_owner_[i];
    if (seq.pending() == step_seqs_[i].num_tokens && seq.samples == 1) {
      spec.params = seq.request.sampling;
      if (spec.params.temperature > 0.0f) spec.uniform = seq.rng.NextFloat();
      need_logits |= seq.request.logprobs;
      if (seq.processes_logits()) {
        process = {&*seq.processor, seq.banned()};
        need_logits = true;
      }
    }
    need_logits |= step_seqs_[i].all_logits;
    step_sampling_.push_back(spec);
    step_process_.push_back(process);
  }
  step_next_.resize(step_owner_.size());
  step_row_.resize(step_owner_.size());
  absl::Status status;
  auto step = [&] {
    const absl::Time start = absl::Now();
    const engine::StepBatch batch{step_tokens_, step_seqs_};
    if (need_logits) {
      status = StepOnTheHost(batch);
    } else {
      status = backend_->StepAndSample(batch, step_sampling_, std::span<int32_t>(step_next_));
    }
    stats.duration = absl::Now() - start;
  };
  if (step_thread_ != nullptr) {
    // The step reads only the step buffers and the sequences' block lists,
    // which nothing below touches until Wait returns.
    step_thread_->Post(step);
    FlushDeliveries();
    step_thread_->Wait();
  } else {
    step();
  }
  if (!status.ok()) {
    const bool device_lost = status.code() == engine::kDeviceLostCode;
    Log(LogLevel::kError, absl::StrCat("engine step failed", device_lost ? " (device lost)" : "",
                                       ": ", status.ToString()));
    for (Sequence* seq : step_owner_) {
      if (seq == nullptr) continue;  // padding
      FinishWithError(*seq,
                      absl::InternalError(absl::StrCat("engine step failed: ", status.message())));
    }
    std::erase_if(running_, [](const auto& seq) { return seq->done; });
    EndPaddingIfBatchOver();
    // Nothing is promised about what a failed step left in the cache.
    blocks_.ForgetAll();
    if (device_lost) {
      {
        absl::MutexLock lock(&mu_);
        device_lost_ = status;
      }
      EndAllDeviceLost(status);
    }
    // Every request the failure touched has its final update by now.
    if (observer_ != nullptr) observer_->OnEngineFailure(status, device_lost);
    return;
  }

  if (options_.max_step_time > absl::ZeroDuration()) step_cost_.Observe(shape, stats.duration);
  const absl::Time now = clock_->Now();
  const size_t vocab = static_cast<size_t>(backend_->config().vocab_size);
  for (size_t i = 0; i < step_owner_.size(); ++i) {
    if (step_owner_[i] == nullptr) continue;  // padding
    Sequence& seq = *step_owner_[i];
    const int n = step_seqs_[i].num_tokens;
    if (step_seqs_[i].all_logits) {
      ScorePrompt(seq,
                  std::span<const float>(step_logits_).subspan(step_row_[i] * vocab, n * vocab));
    }
    seq.num_cached += n;
    RegisterFullBlocks(seq);
    if (seq.pending() > 0) continue;  // a prompt chunk; more follow
    if (seq.samples > 1) {
      Fork(seq);  // the shared part is done; the samples take it from here
      continue;
    }
    ++stats.generated_tokens;
    std::span<const float> last_row;  // the logits it sampled from
    if (need_logits) {
      const size_t last = step_row_[i] + (step_seqs_[i].all_logits ? n - 1 : 0);
      last_row = std::span<const float>(step_logits_).subspan(last * vocab, vocab);
    }
    Emit(seq, step_next_[i], now, last_row);
  }
  if (observer_ != nullptr) observer_->OnStep(stats);
  std::erase_if(running_, [](const auto& seq) { return seq->done; });
  EndPaddingIfBatchOver();
}

absl::Status EngineLoop::StepOnTheHost(const engine::StepBatch& batch) {
  const size_t vocab = static_cast<size_t>(backend_->config().vocab_size);
  step_logits_.resize(engine::LogitRows(batch) * vocab);
  RETURN_IF_ERROR(backend_->Step(batch, std::span<float>(step_logits_)));
  size_t row = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    step_row_[i] = row;
    row += batch.seqs[i].all_logits ? batch.seqs[i].num_tokens : 1;
    std::span<const float> logits =
        std::span<const float>(step_logits_).subspan((row - 1) * vocab, vocab);
    if (const ProcessSpec& process = step_process_[i]; process.processor != nullptr) {
      // A copy: the row itself stays the model's, for log-probabilities.
      step_scratch_.assign(logits.begin(), logits.end());
      process.processor->Apply(step_scratch_, process.banned);
      logits = step_scratch_;
    }
    step_next_[i] =
        engine::SampleWithUniform(logits, step_sampling_[i].params, step_sampling_[i].uniform);
  }
  return absl::OkStatus();
}

std::vector<int32_t> EngineLoop::EndTokens(const GenerationRequest& request) const {
  std::vector<int32_t> out = request.stop_token_ids;
  if (!request.ignore_eos) {
    const auto eos = tokenizer_->eos_ids();
    out.insert(out.end(), eos.begin(), eos.end());
  }
  return out;
}

void EngineLoop::ScorePrompt(Sequence& seq, std::span<const float> rows) {
  const size_t vocab = static_cast<size_t>(backend_->config().vocab_size);
  const std::vector<int32_t>& prompt = seq.request.prompt;
  const int n = static_cast<int>(rows.size() / vocab);
  for (int t = 0; t < n; ++t) {
    // The row after position p scores prompt token p + 1; positions scored
    // before a preemption are not scored again.
    const int p = seq.num_cached + t;
    if (p + 1 >= static_cast<int>(prompt.size())) break;
    if (p != seq.prompt_scored) continue;
    seq.prompt_logprobs.push_back(
        engine::Logprob(rows.subspan(t * vocab, vocab), prompt[p + 1], seq.request.top_logprobs));
    ++seq.prompt_scored;
  }
}

void EngineLoop::EndPaddingIfBatchOver() {
  if (!running_.empty()) return;
  for (PaddingRow& row : padding_) blocks_.Release(row.blocks);
  padding_.clear();
}

void EngineLoop::Emit(Sequence& seq, int32_t token, absl::Time now, std::span<const float> logits) {
  seq.tokens.push_back(token);
  ++seq.generated;
  if (observer_ != nullptr) {
    if (seq.generated == 1) {
      // A request's first token, whichever sample makes it.
      if (seq.group == nullptr || !std::exchange(seq.group->first_token, true)) {
        observer_->OnFirstToken(now - seq.request.arrival, seq.request.tenant);
      }
    } else {
      observer_->OnInterToken(now - seq.last_token_at);
    }
  }
  seq.last_token_at = now;
  if (seq.processor.has_value()) seq.processor->Accept(token);

  // A stop token's text is not sent, as a stop sequence's is not.
  const bool stop_token =
      std::find(seq.request.stop_token_ids.begin(), seq.request.stop_token_ids.end(), token) !=
      seq.request.stop_token_ids.end();
  engine::TextStream::Piece piece;
  if (!stop_token) piece = seq.text->Push(token);
  StreamUpdate update;
  update.index = seq.index;
  update.token_ids.push_back(token);
  update.text = std::move(piece.text);
  if (seq.request.logprobs) {
    update.logprobs.push_back(engine::Logprob(logits, token, seq.request.top_logprobs));
  }
  if (seq.request.prompt_logprobs && !seq.prompt_logprobs_sent) {
    update.prompt_logprobs = std::move(seq.prompt_logprobs);
    seq.prompt_logprobs_sent = true;
  }
  const auto eos = tokenizer_->eos_ids();
  std::optional<FinishReason> reason;
  if (!seq.request.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
    reason = FinishReason::kEos;
  } else if (stop_token || piece.stopped) {
    reason = FinishReason::kStop;
  } else if (seq.generated >= seq.request.max_new_tokens ||
             static_cast<int>(seq.tokens.size()) >= backend_->config().max_seq_len) {
    reason = FinishReason::kLength;
  }
  if (!reason.has_value()) {
    Deliver(seq, std::move(update));
    return;
  }
  if (options_.scheduler.mode == BatchingMode::kStaticPadded) {
    // Its row stays in the batch: the last cached position, recomputed.
    padding_.push_back(
        {seq.id, seq.tokens[seq.num_cached - 1], seq.num_cached - 1, std::move(seq.blocks)});
    seq.blocks.clear();
  }
  // Unless a stop sequence ended it, the text the stream still holds goes out.
  if (!piece.stopped) update.text += seq.text->Finish();
  update.finish_reason = *reason;
  Finish(seq, std::move(update));
}

void EngineLoop::Deliver(Sequence& seq, StreamUpdate update) {
  outbox_.emplace_back(seq.sink, std::move(update));
}

void EngineLoop::FlushDeliveries() {
  for (auto& [sink, update] : outbox_) sink->Deliver(std::move(update));
  outbox_.clear();
}

// ---------------------------------------------------------------------------
// Endings
// ---------------------------------------------------------------------------

void EngineLoop::Finish(Sequence& seq, StreamUpdate update) {
  ReleaseBlocks(seq);
  seq.done = true;
  update.index = seq.index;
  update.finished = true;
  update.prompt_tokens = static_cast<int>(seq.request.prompt.size());
  update.completion_tokens = seq.generated;
  update.cached_prompt_tokens = seq.cached_prompt_tokens;
  RequestSummary summary;
  summary.status = update.status.ok()
                       ? "ok"
                       : absl::AsciiStrToLower(absl::StatusCodeToString(update.status.code()));
  summary.tenant = seq.request.tenant;
  summary.prompt_tokens = update.prompt_tokens;
  summary.completion_tokens = update.completion_tokens;
  summary.duration = clock_->Now() - seq.request.arrival;
  // Before its fork, a request ends all of its samples at once.
  for (int i = 1; i < seq.samples; ++i) {
    StreamUpdate sample = update;
    sample.index = i;
    Deliver(seq, std::move(sample));
  }
  Deliver(seq, std::move(update));
  if (observer_ == nullptr) return;
  if (Group* group = seq.group.get(); group != nullptr) {
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
    if (seq->preempted) {
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
  stats.free_kv_blocks = blocks_.num_available();
  stats.total_kv_blocks = total_blocks_;
  stats.cached_kv_blocks = blocks_.num_cached();
  stats.kv_block_evictions = blocks_.evictions();
  {
    absl::MutexLock lock(&mu_);
    published_ = stats;
  }
  if (observer_ != nullptr) observer_->OnQueue(stats);
}

}  // namespace coalesce::batcher
