// grpc.health.v1.Health, served by coalesce itself (proto/grpc/health/v1/
// health.proto) for two names: "" (the server) and "coalesce.v1.Generator".
// Both share one status: SERVING from start-up until the server drains.
//
// gRPC's built-in health service keeps every Watch stream open until the
// server's shutdown deadline: clients with client-side health checking
// (grpc-go, grpc-java) keep one open all the time, so a drain with nothing
// left to generate still waited out the whole grace period. Here a drain
// (Shutdown) sends NOT_SERVING to every Watch and then ends it with
// UNAVAILABLE, so only generations hold a drain.
//
// Requests arrive as raw bytes and are parsed as the Generator's are
// (service/request_parser.h): bytes that are not a HealthCheckRequest get
// INVALID_ARGUMENT naming the problem, as every other method answers.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace coalesce::service {

using RawHealthService = grpc::health::v1::Health::WithRawCallbackMethod_Check<
    grpc::health::v1::Health::WithRawCallbackMethod_Watch<grpc::health::v1::Health::Service>>;

class HealthService final : public RawHealthService {
 public:
  // The service names answered besides "" (the server).
  explicit HealthService(std::vector<std::string> services);
  ~HealthService() override;

  // SERVING or NOT_SERVING for every name; open Watches see the change.
  void SetServing(bool serving);
  // The drain: NOT_SERVING from now on, and every Watch, open or opened
  // later, ends once it has been sent NOT_SERVING.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Watch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override;

 private:
  class WatchReactor;
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // What `name` reports now.
  Status StatusOfLocked(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lets every Watch act on a change.
  void NotifyAll();

  const std::vector<std::string> services_;
  absl::Mutex mu_;  // guards this and the state of every WatchReactor
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::set<WatchReactor*> watches_ ABSL_GUARDED_BY(mu_);
  absl::CondVar watches_done_;
};

}  // namespace coalesce::service
