// One Generate stream. The engine loop Delivers updates into the reactor's
// outbox from its own thread; the reactor writes them with exactly one write
// in flight. Updates that arrive while a write is in flight are merged into
// the next message of their sample, so a slow reader gets fewer, larger
// messages and never slows the engine. With several samples (n), each
// message carries one sample's tokens and its index, samples in the order
// their output came; the RPC ends after every sample's final update. The
// first sample to end with an error ends the others (the request is
// cancelled in the engine) and its status is the RPC's. A reader that takes nothing for
// `stall_timeout` while the engine still generates for it is ended: its slot and KV blocks go to
// others (it would otherwise hold them until keepalive noticed, if ever).
//
// Lifetime: gRPC deletes the reactor in OnDone, which runs only after Finish.
// Finish is called only after the engine's final update (or when the request
// never reached the engine, through Reject or a failed Submit). The final
// update may arrive while a write is in flight; then the write's completion,
// on a gRPC thread, finishes the RPC, possibly before the engine's Deliver
// has returned, so Deliver touches nothing after releasing the lock unless
// it started a write or the finish itself.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "batcher/engine_loop.h"
#include "batcher/request.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "engine/tokenizer/tokenizer.h"
#include "service/tenants.h"

namespace coalesce::service {

class GenerateReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  struct Options {
    absl::Duration stall_timeout = absl::InfiniteDuration();  // see the top of this file
    // Called when a stream is ended for not reading.
    std::function<void()> on_stall;
    // Called last, from OnDone.
    std::function<void()> on_done;
    // Gives the text of the tokens of log-probabilities (TopLogprob.text).
    const engine::Tokenizer* tokenizer = nullptr;
  };
  GenerateReactor(grpc::CallbackServerContext* context, batcher::EngineLoop* loop, Options options);

  // The caller's tenant stream (--api_keys_file), held until the call ends
  // (charged the tokens it used just before the final status goes out);
  // before Submit.
  void set_tenant_stream(std::unique_ptr<Tenants::Stream> stream) {
    tenant_stream_ = std::move(stream);
  }
  // Sets the request_id echoed in every response; before Submit.
  void set_request_id(std::string request_id) { request_id_ = std::move(request_id); }
  // Whether the client has gone (the request need not be prepared further).
  bool cancelled();

  // Hands the request to the engine loop, or returns why it could not
  // (CANCELLED if the client went away before); then the caller Rejects.
  absl::Status Submit(batcher::GenerationRequest request);
  // Finishes the RPC at once with `status`, a request that never reached the
  // engine (RESOURCE_EXHAUSTED with gRPC's retry pushback trailer: after
  // `retry_after`, or a default second; -1, do not retry, for a negative
  // `retry_after`).
  void Reject(const absl::Status& status, absl::Duration retry_after = absl::ZeroDuration());

  // Called by the engine thread through the sink.
  void Deliver(batcher::StreamUpdate update);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  class Sink;
  // What to do after releasing the lock.
  enum class Action { kNone, kWrite, kFinish, kEndStalled };
  Action NextActionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Perform(Action action);
  // The status the engine ends the request with when the client is gone.
  absl::Status CancelStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Charges the tenant the call's tokens and frees its stream; once.
  void SettleTenant();

  grpc::CallbackServerContext* const context_;
  batcher::EngineLoop* const loop_;
  const Options options_;
  std::string request_id_;  // set before any reaction can run
  uint64_t engine_id_ = 0;  // set before any reaction can run

  absl::Mutex mu_;
  // Per sample, the output not yet written, and the samples that have some,
  // in the order it came.
  std::vector<v1::GenerateResponse> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<int> pending_order_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> has_pending_ ABSL_GUARDED_BY(mu_);
  int finals_left_ ABSL_GUARDED_BY(mu_) = 0;  // samples not yet finished
  bool failed_ ABSL_GUARDED_BY(mu_) = false;  // a sample ended with an error
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;      // OnCancel ran
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;        // ended for not reading
  bool engine_done_ ABSL_GUARDED_BY(mu_) = false;    // every sample's final update received
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status final_status_ ABSL_GUARDED_BY(mu_);
  // Prompt and generated tokens of the finished samples, for the tenant.
  int64_t tokens_used_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Tenants::Stream> tenant_stream_;
  // The message being written, and its bytes; only the thread that started
  // the write (and then OnWriteDone) touches them.
  v1::GenerateResponse in_flight_message_;
  grpc::ByteBuffer in_flight_;
};

}  // namespace coalesce::service
