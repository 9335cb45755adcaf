#include "service/generate_reactor.h"

#include <chrono>
#include <utility>

#include "common/log.h"
#include "service/generator_service.h"

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
}  // namespace

GenerateReactor::GenerateReactor(grpc::CallbackServerContext* context, batcher::EngineLoop* loop,
                                 std::string request_id)
    : context_(context), loop_(loop), request_id_(std::move(request_id)) {}

// Finish is never called under mu_, and nothing of the reactor is touched
// after it: gRPC may run OnDone (which deletes the reactor) at once.
absl::Status GenerateReactor::Submit(batcher::GenerationRequest request) {
  absl::StatusOr<uint64_t> id;
  {
    // Held so that an update delivered before Submit returns waits until
    // engine_id_ is set.
    absl::MutexLock lock(&mu_);
    id = loop_->Submit(std::move(request), std::make_shared<Sink>(this));
    if (id.ok()) {
      engine_id_ = *id;
      return absl::OkStatus();
    }
    finish_called_ = true;
  }
  absl::Status error = id.status();
  if (error.code() == absl::StatusCode::kResourceExhausted) {
    // gRPC's own retry policy honours this pushback; others can read it.
    context_->AddTrailingMetadata("grpc-retry-pushback-ms", std::to_string(kRetryPushbackMs));
  }
  Finish(ToGrpcStatus(error));
  return error;
}

void GenerateReactor::Reject(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    finish_called_ = true;
  }
  Finish(ToGrpcStatus(status));
}

void GenerateReactor::Deliver(batcher::StreamUpdate update) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (!stream_broken_) {
      for (int32_t id : update.token_ids) pending_.add_token_ids(id);
      pending_.mutable_text()->append(update.text);
      has_pending_ = true;
    }
    if (update.finished) {
      engine_done_ = true;
      final_status_ = update.status;
      if (update.status.ok()) {
        pending_.set_finish_reason(ToProto(update.finish_reason));
        pending_.mutable_usage()->set_prompt_tokens(update.prompt_tokens);
        pending_.mutable_usage()->set_completion_tokens(update.completion_tokens);
      } else {
        // An error status replaces the final message: drop unsent output.
        pending_.Clear();
        has_pending_ = false;
      }
    }
    action = NextActionLocked();
  }
  // With nothing to do, touch nothing: once the lock is released, a write in
  // flight can complete on a gRPC thread, which then writes the last message,
  // finishes the RPC, and gRPC deletes this reactor (OnDone). A write or a
  // finish that this call started keeps the reactor alive until it is done.
  if (action != Action::kNone) Perform(action);
}

GenerateReactor::Action GenerateReactor::NextActionLocked() {
  if (write_in_flight_ || finish_called_) return Action::kNone;
  if (has_pending_ && !stream_broken_) {
    pending_.set_request_id(request_id_);
    in_flight_.Swap(&pending_);
    pending_.Clear();
    has_pending_ = false;
    write_in_flight_ = true;
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
      StartWrite(&in_flight_);
      return;
    case Action::kFinish: {
      absl::Status status;
      {
        absl::MutexLock lock(&mu_);
        status = final_status_;
      }
      Finish(ToGrpcStatus(status));
      return;
    }
  }
}

void GenerateReactor::OnWriteDone(bool ok) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (!ok) {
      // The client is gone; OnCancel tells the engine. Keep no more output.
      stream_broken_ = true;
      pending_.Clear();
      has_pending_ = false;
    }
    action = NextActionLocked();
  }
  Perform(action);
}

void GenerateReactor::OnCancel() {
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (engine_done_ || engine_id_ == 0) return;
    id = engine_id_;
  }
  // A client whose deadline expires cancels the call itself, and its cancel
  // can reach us a little before our copy of the deadline (sent as a timeout
  // when the call started) expires. Within this slack it counts as a deadline.
  constexpr auto kDeadlineSlack = std::chrono::milliseconds(200);
  const bool past_deadline =
      context_->deadline() - kDeadlineSlack <= std::chrono::system_clock::now();
  LogF(LogLevel::kDebug, "request %d (%s): %s", id, request_id_,
       past_deadline ? "deadline passed" : "cancelled by the client");
  loop_->Cancel(id, past_deadline ? absl::DeadlineExceededError("the request's deadline passed")
                                  : absl::CancelledError("the client cancelled the request"));
}

void GenerateReactor::OnDone() { delete this; }

}  // namespace coalesce::service
