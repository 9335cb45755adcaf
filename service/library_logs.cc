#include "service/library_logs.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"

namespace coalesce::service {
namespace {

void FromGrpc(gpr_log_func_args* args) {
  LogLevel level = LogLevel::kDebug;
  if (args->severity == GPR_LOG_SEVERITY_ERROR) {
    level = LogLevel::kError;
  } else if (args->severity == GPR_LOG_SEVERITY_INFO) {
    level = LogLevel::kInfo;
  }
  const std::string site = absl::StrCat("grpc ", args->file, ":", args->line);
  LogRateLimited(site, level, absl::StrCat("grpc: ", args->message, " (", site, ")"));
}

void FromProtobuf(google::protobuf::LogLevel severity, const char* file, int line,
                  const std::string& message) {
  LogLevel level = LogLevel::kInfo;
  if (severity == google::protobuf::LOGLEVEL_WARNING) {
    level = LogLevel::kWarning;
  } else if (severity >= google::protobuf::LOGLEVEL_ERROR) {
    level = LogLevel::kError;
  }
  const std::string site = absl::StrCat("protobuf ", file, ":", line);
  LogRateLimited(site, level, absl::StrCat("protobuf: ", message, " (", site, ")"));
}

}  // namespace

void RouteLibraryLogs() {
  gpr_set_log_function(&FromGrpc);
  google::protobuf::SetLogHandler(&FromProtobuf);
}

}  // namespace coalesce::service
