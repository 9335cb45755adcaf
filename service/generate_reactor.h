// One Generate stream. The engine loop Delivers updates into the reactor's
// outbox from its own thread; the reactor writes them with exactly one write
// in flight. Updates that arrive while a write is in flight are merged into
// the next message, so a slow reader gets fewer, larger messages and never
// slows the engine.
//
// Lifetime: gRPC deletes the reactor in OnDone, which runs only after Finish.
// Finish is called only after the engine's final update (or when Submit
// failed, in which case the engine never calls us). The final update may
// arrive while a write is in flight; then the write's completion, on a gRPC
// thread, finishes the RPC, possibly before the engine's Deliver has
// returned, so Deliver touches nothing after releasing the lock unless it
// started a write or the finish itself.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "batcher/engine_loop.h"
#include "batcher/request.h"
#include "coalesce/v1/generator.grpc.pb.h"

namespace coalesce::service {

class GenerateReactor : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateReactor(grpc::CallbackServerContext* context, batcher::EngineLoop* loop,
                  std::string request_id);

  // Hands the request to the engine loop, or finishes the RPC with the error
  // and returns it.
  absl::Status Submit(batcher::GenerationRequest request);
  // Finishes the RPC at once (a request rejected before submission).
  void Reject(const absl::Status& status);

  // Called by the engine thread through the sink.
  void Deliver(batcher::StreamUpdate update);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  class Sink;
  // What to do after releasing the lock.
  enum class Action { kNone, kWrite, kFinish };
  Action NextActionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Perform(Action action);

  grpc::CallbackServerContext* const context_;
  batcher::EngineLoop* const loop_;
  const std::string request_id_;
  uint64_t engine_id_ = 0;  // set before any reaction can run

  absl::Mutex mu_;
  v1::GenerateResponse pending_ ABSL_GUARDED_BY(mu_);  // not yet written
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed
  bool engine_done_ ABSL_GUARDED_BY(mu_) = false;    // final update received
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status final_status_ ABSL_GUARDED_BY(mu_);
  // The message being written; only the thread that started the write (and
  // then OnWriteDone) touches it.
  v1::GenerateResponse in_flight_;
};

}  // namespace coalesce::service
