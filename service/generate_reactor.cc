#include "service/generate_reactor.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "service/grpc_status.h"
#include "service/request_parser.h"

namespace coalesce::service {

// The engine holds the sink, not the reactor: a shared_ptr the engine may
// keep until its final update, pointing at a reactor that lives at least
// that long (see the header).
class GenerateReactor::Sink : public batcher::OutputSink {
 public:
  explicit Sink(GenerateReactor* reactor) : reactor_(reactor) {}
  void Deliver(batcher::StreamUpdate update) override { reactor_->Deliver(std::move(update)); }

 private:
  GenerateReactor* const reactor_;
};

namespace {
// How long a client refused for overload should wait before retrying.
constexpr int kRetryPushbackMs = 1000;

v1::FinishReason ToProto(batcher::FinishReason reason) {
  switch (reason) {
    case batcher::FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case batcher::FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case batcher::FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case batcher::FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void ToProto(const engine::TokenLogprob& in, const engine::Tokenizer* tokenizer,
             v1::TokenLogprob* out) {
  out->set_token_id(in.token);
  out->set_logprob(in.logprob);
  for (const auto& [id, logprob] : in.top) {
    v1::TopLogprob* top = out->add_top();
    top->set_token_id(id);
    top->set_logprob(logprob);
    if (tokenizer != nullptr) top->set_text(engine::Decode(*tokenizer, std::span(&id, 1)));
  }
}
}  // namespace

GenerateReactor::GenerateReactor(grpc::CallbackServerContext* context, batcher::EngineLoop* loop,
                                 Options options)
    : context_(context), loop_(loop), options_(std::move(options)) {}

bool GenerateReactor::cancelled() {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

absl::Status GenerateReactor::Submit(batcher::GenerationRequest request) {
  // Held so that an update delivered before Submit returns waits until
  // engine_id_ is set, and so that a cancellation either comes first (and
  // the request never reaches the engine) or finds engine_id_ set.
  absl::MutexLock lock(&mu_);
  if (cancelled_) return absl::CancelledError("the client cancelled the request");
  const int samples = std::max(request.n, 1);
  pending_.resize(samples);
  has_pending_.assign(samples, false);
  finals_left_ = samples;
  absl::StatusOr<uint64_t> id = loop_->Submit(std::move(request), std::make_shared<Sink>(this));
  if (!id.ok()) return id.status();
  engine_id_ = *id;
  return absl::OkStatus();
}

// Finish is never called under mu_, and nothing of the reactor is touched
// after it: gRPC may run OnDone (which deletes the reactor) at once.
void GenerateReactor::Reject(const absl::Status& status, absl::Duration retry_after) {
  {
    absl::MutexLock lock(&mu_);
    finish_called_ = true;
  }
  if (status.code() == absl::StatusCode::kResourceExhausted) {
    // Overload: gRPC's own retry policy honours this pushback; others can
    // read it. A negative one tells it not to retry (gRPC's retry design,
    // A6): the request could never be served.
    const int64_t ms =
        retry_after < absl::ZeroDuration() ? -1
        : retry_after > absl::ZeroDuration()
            ? absl::ToInt64Milliseconds(absl::Ceil(retry_after, absl::Milliseconds(1)))
            : kRetryPushbackMs;
    context_->AddTrailingMetadata("grpc-retry-pushback-ms", std::to_string(ms));
  }
  SettleTenant();
  Finish(ToGrpcStatus(status));
}

// Before Finish: a client that reads the end of its call and at once sends
// the next must find its tokens charged and its stream free.
void GenerateReactor::SettleTenant() {
  if (tenant_stream_ == nullptr) return;
  int64_t used;
  {
    absl::MutexLock lock(&mu_);
    used = tokens_used_;
  }
  tenant_stream_->Charge(used);
  tenant_stream_.reset();  // the tenant's stream is free again
}

void GenerateReactor::Deliver(batcher::StreamUpdate update) {
  Action action;
  std::optional<absl::Status> cancel_others;
  {
    absl::MutexLock lock(&mu_);
    const int i = update.index;
    if (!stream_broken_ && !failed_) {
      v1::GenerateResponse& out = pending_[i];
      for (int32_t id : update.token_ids) out.add_token_ids(id);
      out.mutable_text()->append(update.text);
      for (const engine::TokenLogprob& lp : update.logprobs) {
        ToProto(lp, options_.tokenizer, out.add_logprobs());
      }
      for (const engine::TokenLogprob& lp : update.prompt_logprobs) {
        ToProto(lp, options_.tokenizer, out.add_prompt_logprobs());
      }
      if (update.finished && update.status.ok()) {
        out.set_finish_reason(ToProto(update.finish_reason));
        out.mutable_usage()->set_prompt_tokens(update.prompt_tokens);
        out.mutable_usage()->set_completion_tokens(update.completion_tokens);
        out.mutable_usage()->set_cached_prompt_tokens(update.cached_prompt_tokens);
      }
      if (!has_pending_[i]) {
        has_pending_[i] = true;
        pending_order_.push_back(i);
      }
    }
    if (update.finished) {
      // Each sample's final update counts the prompt; the tenant pays it once.
      tokens_used_ += update.completion_tokens + (update.index == 0 ? update.prompt_tokens : 0);
      engine_done_ = --finals_left_ == 0;
      if (!update.status.ok() && !failed_) {
        // An error status replaces the final message: drop unsent output,
        // and end the other samples with it.
        failed_ = true;
        final_status_ = update.status;
        for (v1::GenerateResponse& p : pending_) p.Clear();
        has_pending_.assign(has_pending_.size(), false);
        pending_order_.clear();
        if (!engine_done_) cancel_others = update.status;
      }
    }
    action = NextActionLocked();
    if (action == Action::kNone && write_in_flight_ && !engine_done_ && !stalled_ &&
        absl::Now() - write_started_ > options_.stall_timeout) {
      // The client has not taken the last message for stall_timeout while
      // the engine goes on generating for it.
      stalled_ = true;
      action = Action::kEndStalled;
    }
  }
  // With nothing to do, touch nothing: once the lock is released, a write in
  // flight can complete on a gRPC thread, which then writes the last message,
  // finishes the RPC, and gRPC deletes this reactor (OnDone). A write or a
  // finish that this call started keeps the reactor alive until it is done,
  // and so does a stalled stream: it cannot finish before the engine's final
  // update, which only this (the engine's) thread delivers, later.
  // Before the write or finish: once those start, the reactor may be gone;
  // until then the engine has a final update left to deliver.
  if (cancel_others.has_value()) loop_->Cancel(engine_id_, *std::move(cancel_others));
  if (action != Action::kNone) Perform(action);
}

GenerateReactor::Action GenerateReactor::NextActionLocked() {
  if (write_in_flight_ || finish_called_) return Action::kNone;
  if (!pending_order_.empty() && !stream_broken_) {
    // Serialized in Perform, outside the lock, which the engine thread takes
    // for every token it delivers.
    const int i = pending_order_.front();
    pending_order_.pop_front();
    in_flight_message_.Swap(&pending_[i]);
    in_flight_message_.set_index(i);
    pending_[i].Clear();
    has_pending_[i] = false;
    write_in_flight_ = true;
    write_started_ = absl::Now();
    return Action::kWrite;
  }
  if (engine_done_) {
    finish_called_ = true;
    return Action::kFinish;
  }
  return Action::kNone;
}

void GenerateReactor::Perform(Action action) {
  // Started outside the lock: gRPC may run OnWriteDone inline.
  switch (action) {
    case Action::kNone:
      return;
    case Action::kWrite:
      in_flight_message_.set_request_id(request_id_);
      in_flight_ = SerializeMessage(in_flight_message_);
      StartWrite(&in_flight_);
      return;
    case Action::kFinish: {
      absl::Status status;
      {
        absl::MutexLock lock(&mu_);
        status = final_status_;
      }
      SettleTenant();
      Finish(ToGrpcStatus(status));
      return;
    }
    case Action::kEndStalled: {
      absl::Status status;
      {
        absl::MutexLock lock(&mu_);
        status = CancelStatusLocked();
      }
      LogRateLimited(
          "stalled stream", LogLevel::kWarning,
          absl::StrCat("request ", engine_id_, " (", request_id_, "): ended: ", status.message()));
      if (options_.on_stall) options_.on_stall();
      loop_->Cancel(engine_id_, status);
      // Fails the write in flight, so the final update can finish the RPC.
      context_->TryCancel();
      return;
    }
  }
}

absl::Status GenerateReactor::CancelStatusLocked() const {
  if (stalled_) {
    return absl::CancelledError(absl::StrCat("the client read nothing of its stream for ",
                                             absl::FormatDuration(options_.stall_timeout),
                                             " (--stream_stall_timeout)"));
  }
  // A client whose deadline expires cancels the call itself, and its cancel
  // can reach us a little before our copy of the deadline (sent as a timeout
  // when the call started) expires. Within this slack it counts as a deadline.
  constexpr auto kDeadlineSlack = std::chrono::milliseconds(200);
  if (context_->deadline() - kDeadlineSlack <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the request's deadline passed");
  }
  return absl::CancelledError("the client cancelled the request");
}

void GenerateReactor::OnWriteDone(bool ok) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (!ok) {
      // The client is gone; OnCancel tells the engine. Keep no more output.
      stream_broken_ = true;
      for (v1::GenerateResponse& p : pending_) p.Clear();
      has_pending_.assign(has_pending_.size(), false);
      pending_order_.clear();
    }
    action = NextActionLocked();
  }
  Perform(action);
}

void GenerateReactor::OnCancel() {
  uint64_t id;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (engine_done_ || engine_id_ == 0) return;
    id = engine_id_;
    status = CancelStatusLocked();
  }
  LogF(LogLevel::kDebug, "request %d (%s): %s", id, request_id_, status.message());
  loop_->Cancel(id, std::move(status));
}

void GenerateReactor::OnDone() {
  SettleTenant();  // where the call ended without our Finish
  if (options_.on_done) options_.on_done();
  // Orders the deletion after every earlier reaction's use of the state,
  // whichever thread ran it.
  { absl::MutexLock lock(&mu_); }
  delete this;
}

}  // namespace coalesce::service
