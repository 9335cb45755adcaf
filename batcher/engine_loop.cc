#include "batcher/engine_loop.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace coalesce::batcher {

// A request from admission to its last token. Owned by the loop thread once
// it leaves the inbox.
struct EngineLoop::Sequence {
  Sequence(uint64_t id, GenerationRequest req, std::shared_ptr<OutputSink> out, int blocks)
      : id(id),
        request(std::move(req)),
        sink(std::move(out)),
        blocks_needed(blocks),
        rng(request.seed),
        tokens(request.prompt) {}

  const uint64_t id;
  const GenerationRequest request;
  const std::shared_ptr<OutputSink> sink;
  const int blocks_needed;
  engine::Rng rng;
  std::vector<int32_t> tokens;  // [prompt + generated]
  int num_cached = 0;           // leading tokens whose K/V are in the cache
  int generated = 0;
  std::vector<int32_t> blocks;  // KV blocks in position order
  std::optional<engine::TextStream> text;
  absl::Time last_token_at;
  bool done = false;
};

EngineLoop::EngineLoop(engine::Backend* backend, const engine::Tokenizer* tokenizer,
                       EngineLoopOptions options, const Clock* clock, LoopObserver* observer)
    : backend_(backend),
      tokenizer_(tokenizer),
      options_(options),
      scheduler_(options.scheduler),
      clock_(clock),
      observer_(observer),
      block_size_(backend->kv_cache().block_size),
      blocks_(backend->kv_cache().num_blocks) {}

EngineLoop::~EngineLoop() { Stop(); }

void EngineLoop::Start() {
  PublishQueueStats();
  thread_ = std::thread([this] { Run(); });
}

absl::StatusOr<uint64_t> EngineLoop::Submit(GenerationRequest request,
                                            std::shared_ptr<OutputSink> sink) {
  // Blocks are reserved for the whole sequence at admission, so one that
  // needs more than the pool holds could never run.
  const int tokens = static_cast<int>(request.prompt.size()) + request.max_new_tokens;
  const int blocks = BlocksForTokens(tokens, block_size_);
  if (blocks > blocks_.num_total()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", tokens, " tokens of KV cache (prompt ", request.prompt.size(),
        " + max_new_tokens ", request.max_new_tokens, ") but the server's cache holds ",
        blocks_.num_total() * block_size_, " tokens; lower max_new_tokens or shorten the prompt"));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  const uint64_t id = next_id_++;
  inbox_.push_back(std::make_unique<Sequence>(id, std::move(request), std::move(sink), blocks));
  return id;
}

void EngineLoop::Cancel(uint64_t id, absl::Status status) {
  absl::MutexLock lock(&mu_);
  cancels_.emplace_back(id, std::move(status));
}

void EngineLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) {
    thread_.join();
  } else {
    // Never started: end what was queued here.
    std::vector<std::unique_ptr<Sequence>> inbox;
    {
      absl::MutexLock lock(&mu_);
      inbox.swap(inbox_);
    }
    for (auto& seq : inbox) waiting_.push_back(std::move(seq));
    EndAllCancelled();
  }
}

QueueStats EngineLoop::queue_stats() const {
  absl::MutexLock lock(&mu_);
  return published_;
}

bool EngineLoop::HasWork() const { return stopping_ || !inbox_.empty() || !cancels_.empty(); }

// ---------------------------------------------------------------------------
// The loop
// ---------------------------------------------------------------------------

void EngineLoop::Run() {
  while (true) {
    // 1. Take arrivals and cancellations. Sleep only when nothing can move
    //    without them: no sequence runs, and nobody waits or the coalescing
    //    window holds them (then until the window ends). Waiting requests
    //    with no window pending are decided on at once: the last decision
    //    was made before sequences left and freed their slots and blocks.
    std::vector<std::unique_ptr<Sequence>> arrivals;
    std::vector<std::pair<uint64_t, absl::Status>> cancels;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      if (running_.empty() && (waiting_.empty() || reconsider_at_.has_value())) {
        const absl::Condition has_work(this, &EngineLoop::HasWork);
        if (reconsider_at_.has_value()) {
          mu_.AwaitWithTimeout(has_work, *reconsider_at_ - clock_->Now());
        } else {
          mu_.Await(has_work);
        }
      }
      arrivals.swap(inbox_);
      cancels.swap(cancels_);
      stopping = stopping_;
    }
    for (auto& seq : arrivals) waiting_.push_back(std::move(seq));

    // 2. Cancelled requests leave now, waiting or running.
    for (auto& [id, status] : cancels) {
      auto matches = [id = id](const std::unique_ptr<Sequence>& s) { return s->id == id; };
      if (auto it = std::find_if(waiting_.begin(), waiting_.end(), matches); it != waiting_.end()) {
        FinishWithError(**it, status);
        waiting_.erase(it);
      } else if (auto jt = std::find_if(running_.begin(), running_.end(), matches);
                 jt != running_.end()) {
        FinishWithError(**jt, status);
        running_.erase(jt);
      }
    }

    if (stopping) {
      EndAllCancelled();
      return;
    }

    // 3-5.
    Iterate(clock_->Now());
  }
}

void EngineLoop::Iterate(absl::Time now) {
  std::vector<WaitingRequest> waiting;
  waiting.reserve(waiting_.size());
  for (const auto& seq : waiting_) {
    waiting.push_back({seq->id, seq->request.arrival, seq->blocks_needed});
  }
  const QueueState state{waiting, static_cast<int>(running_.size()), blocks_.num_free()};
  const Decision decision = scheduler_.Schedule(state, now);
  reconsider_at_ = decision.reconsider_at;
  Admit(decision, now);

  if (options_.log_steps && !waiting.empty()) {
    LogF(LogLevel::kDebug, "schedule: waiting=%d running=%d free_blocks=%d admitted=%d hold=%s",
         waiting.size(), state.running, state.free_blocks, decision.admit.size(),
         HoldReasonName(decision.hold));
  }
  if (!running_.empty()) RunStep();
  PublishQueueStats();
}

void EngineLoop::Admit(const Decision& decision, absl::Time now) {
  // The admitted ids are the oldest waiting requests, in order.
  for (size_t i = 0; i < decision.admit.size(); ++i) {
    std::unique_ptr<Sequence> seq = std::move(waiting_.front());
    waiting_.pop_front();
    auto blocks = blocks_.Allocate(seq->blocks_needed);
    // The scheduler admitted it only if its blocks were free.
    seq->blocks = std::move(*blocks);
    seq->text.emplace(*tokenizer_, seq->tokens.back(), seq->request.stop);
    if (observer_ != nullptr) observer_->OnAdmitted(now - seq->request.arrival);
    running_.push_back(std::move(seq));
  }
}

void EngineLoop::RunStep() {
  // 4. One step over every running sequence: the whole remaining prompt of a
  //    newly admitted one, the last sampled token of the others.
  step_tokens_.clear();
  step_seqs_.clear();
  StepStats stats;
  for (const auto& seq : running_) {
    const int n = static_cast<int>(seq->tokens.size()) - seq->num_cached;
    step_tokens_.insert(step_tokens_.end(), seq->tokens.begin() + seq->num_cached,
                        seq->tokens.end());
    step_seqs_.push_back({n, seq->num_cached, seq->blocks});
    (seq->generated == 0 ? stats.prefill_tokens : stats.decode_tokens) += n;
  }
  stats.num_seqs = static_cast<int>(running_.size());
  const int vocab = backend_->config().vocab_size;
  logits_.resize(static_cast<size_t>(stats.num_seqs) * vocab);

  const absl::Time start = absl::Now();
  const absl::Status status = backend_->Step({step_tokens_, step_seqs_}, std::span<float>(logits_));
  stats.duration = absl::Now() - start;
  if (!status.ok()) {
    Log(LogLevel::kError, absl::StrCat("engine step failed: ", status.ToString()));
    for (auto& seq : running_) {
      FinishWithError(*seq,
                      absl::InternalError(absl::StrCat("engine step failed: ", status.message())));
    }
    running_.clear();
    return;
  }
  if (observer_ != nullptr) observer_->OnStep(stats);

  // 5. Sample each sequence's next token and stream it.
  const absl::Time now = clock_->Now();
  const auto eos = tokenizer_->eos_ids();
  const int max_seq_len = backend_->config().max_seq_len;
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence& seq = *running_[i];
    seq.num_cached += step_seqs_[i].num_tokens;
    const int32_t token = engine::Sample(std::span<const float>(logits_).subspan(i * vocab, vocab),
                                         seq.request.sampling, seq.rng);
    seq.tokens.push_back(token);
    ++seq.generated;
    if (observer_ != nullptr) {
      if (seq.generated == 1) {
        observer_->OnFirstToken(now - seq.request.arrival);
      } else {
        observer_->OnInterToken(now - seq.last_token_at);
      }
    }
    seq.last_token_at = now;

    engine::TextStream::Piece piece = seq.text->Push(token);
    StreamUpdate update;
    update.token_ids.push_back(token);
    update.text = std::move(piece.text);
    if (std::find(eos.begin(), eos.end(), token) != eos.end()) {
      update.text += seq.text->Finish();
      update.finish_reason = FinishReason::kEos;
      Finish(seq, std::move(update));
    } else if (piece.stopped) {
      update.finish_reason = FinishReason::kStop;
      Finish(seq, std::move(update));
    } else if (seq.generated >= seq.request.max_new_tokens ||
               static_cast<int>(seq.tokens.size()) >= max_seq_len) {
      update.text += seq.text->Finish();
      update.finish_reason = FinishReason::kLength;
      Finish(seq, std::move(update));
    } else {
      seq.sink->Deliver(std::move(update));
    }
  }
  std::erase_if(running_, [](const auto& seq) { return seq->done; });
}

// ---------------------------------------------------------------------------
// Endings
// ---------------------------------------------------------------------------

void EngineLoop::Finish(Sequence& seq, StreamUpdate update) {
  blocks_.Free(seq.blocks);
  seq.blocks.clear();
  seq.done = true;
  update.finished = true;
  update.prompt_tokens = static_cast<int>(seq.request.prompt.size());
  update.completion_tokens = seq.generated;
  RequestSummary summary;
  summary.status = update.status.ok()
                       ? "ok"
                       : absl::AsciiStrToLower(absl::StatusCodeToString(update.status.code()));
  summary.prompt_tokens = update.prompt_tokens;
  summary.completion_tokens = update.completion_tokens;
  summary.duration = clock_->Now() - seq.request.arrival;
  seq.sink->Deliver(std::move(update));
  if (observer_ != nullptr) observer_->OnFinished(summary);
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
  PublishQueueStats();
}

void EngineLoop::PublishQueueStats() {
  QueueStats stats;
  stats.running = static_cast<int>(running_.size());
  stats.free_kv_blocks = blocks_.num_free();
  stats.total_kv_blocks = blocks_.num_total();
  {
    absl::MutexLock lock(&mu_);
    stats.waiting = static_cast<int>(waiting_.size() + inbox_.size());
    published_ = stats;
  }
  if (observer_ != nullptr) observer_->OnQueue(stats);
}

}  // namespace coalesce::batcher
