#include "service/health_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "service/grpc_status.h"
#include "service/request_parser.h"

namespace coalesce::service {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream: the current status, then each change, one write at a
// time. Its state is guarded by the service's mutex. Writes and Finish are
// started outside that mutex (gRPC may run a reaction inline); a write in
// flight or a Finish that one thread has claimed keeps the reactor alive
// until that thread is done with it, since gRPC deletes it (OnDone) only
// after Finish.
class HealthService::WatchReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  WatchReactor(HealthService* service, std::string name)
      : service_(service), name_(std::move(name)) {}

  enum class Action { kNone, kWrite, kFinish };

  // For HealthService's own methods, which hold their mu_: tells the
  // thread-safety analysis that this is the service whose mu_ is held.
  void AssertServiceLockHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(service_->mu_) {
    service_->mu_.AssertHeld();
  }

  // Decides what to do next; call Perform with the result after unlocking.
  Action NextActionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(service_->mu_) {
    if (write_in_flight_ || finish_called_) return Action::kNone;
    if (broken_) {
      finish_called_ = true;
      finish_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the watch was cancelled");
      return Action::kFinish;
    }
    const Status now = service_->StatusOfLocked(name_);
    if (!sent_any_ || now != sent_) {
      sent_any_ = true;
      sent_ = now;
      HealthCheckResponse response;
      response.set_status(now);
      message_ = SerializeMessage(response);
      write_in_flight_ = true;
      return Action::kWrite;
    }
    if (service_->shutdown_) {
      finish_called_ = true;
      finish_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
      return Action::kFinish;
    }
    return Action::kNone;
  }

  void Perform(Action action) {
    switch (action) {
      case Action::kNone:
        return;
      case Action::kWrite:
        StartWrite(&message_);
        return;
      case Action::kFinish:
        Finish(finish_status_);
        return;
    }
  }

  void OnWriteDone(bool ok) override {
    Action action;
    {
      absl::MutexLock lock(&service_->mu_);
      write_in_flight_ = false;
      if (!ok) broken_ = true;
      action = NextActionLocked();
    }
    Perform(action);
  }

  void OnCancel() override {
    Action action;
    {
      absl::MutexLock lock(&service_->mu_);
      broken_ = true;
      action = NextActionLocked();
    }
    Perform(action);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watches_.erase(this);
      if (service_->watches_.empty()) service_->watches_done_.SignalAll();
    }
    delete this;
  }

 private:
  HealthService* const service_;
  const std::string name_;
  // Guarded by service_->mu_.
  bool write_in_flight_ = false;
  bool finish_called_ = false;
  bool broken_ = false;  // cancelled, or a write failed
  bool sent_any_ = false;
  Status sent_ = HealthCheckResponse::UNKNOWN;
  grpc::Status finish_status_;
  // Touched only by the thread that started the write in flight.
  grpc::ByteBuffer message_;
};

HealthService::HealthService(std::vector<std::string> services) : services_(std::move(services)) {}

HealthService::~HealthService() {
  // The server is shut down first, so every Watch has ended or is ending.
  absl::MutexLock lock(&mu_);
  while (!watches_.empty()) watches_done_.Wait(&mu_);
}

HealthService::Status HealthService::StatusOfLocked(const std::string& name) const {
  if (!name.empty() && std::find(services_.begin(), services_.end(), name) == services_.end()) {
    return HealthCheckResponse::SERVICE_UNKNOWN;
  }
  return serving_ && !shutdown_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  {
    absl::MutexLock lock(&mu_);
    serving_ = serving;
  }
  NotifyAll();
}

void HealthService::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  NotifyAll();
}

void HealthService::NotifyAll() {
  std::vector<std::pair<WatchReactor*, WatchReactor::Action>> actions;
  {
    absl::MutexLock lock(&mu_);
    for (WatchReactor* watch : watches_) {
      watch->AssertServiceLockHeld();
      const WatchReactor::Action action = watch->NextActionLocked();
      if (action != WatchReactor::Action::kNone) actions.emplace_back(watch, action);
    }
  }
  for (auto& [watch, action] : actions) watch->Perform(action);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  HealthCheckRequest parsed;
  if (absl::Status s = ParseRequest(*request, &parsed); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  Status status;
  {
    absl::MutexLock lock(&mu_);
    status = StatusOfLocked(parsed.service());
  }
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    std::vector<std::string> known = {"\"\""};
    for (const std::string& s : services_) known.push_back(absl::StrCat("\"", s, "\""));
    reactor->Finish(grpc::Status(
        grpc::StatusCode::NOT_FOUND,
        absl::StrCat("unknown service name; this server reports on ", absl::StrJoin(known, ", "))));
    return reactor;
  }
  HealthCheckResponse out;
  out.set_status(status);
  *response = SerializeMessage(out);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                 const grpc::ByteBuffer* request) {
  HealthCheckRequest parsed;
  if (absl::Status s = ParseRequest(*request, &parsed); !s.ok()) {
    // A reactor that only finishes: never in watches_.
    class Refused : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
     public:
      explicit Refused(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
      void OnDone() override { delete this; }
    };
    return new Refused(s);
  }
  auto* watch = new WatchReactor(this, parsed.service());
  WatchReactor::Action action;
  {
    absl::MutexLock lock(&mu_);
    watches_.insert(watch);
    watch->AssertServiceLockHeld();
    action = watch->NextActionLocked();
  }
  watch->Perform(action);
  return watch;
}

}  // namespace coalesce::service
