// absl::Status to grpc::Status, for every RPC of the service.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace coalesce::service {

// The codes are the same numbers; the message is kept.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace coalesce::service
