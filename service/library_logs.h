// gRPC and protobuf write their own log lines: gRPC one per call that a
// client can make fail (a disabled compression algorithm, a message too
// large), protobuf one per malformed string it parses. Left alone, a client
// can fill the log as fast as it can send. RouteLibraryLogs sends both
// through coalesce's log (common/log.h): the same line format, control
// characters escaped, and at most a few lines per call site in any 10 s.
#pragma once

namespace coalesce::service {

// Call once, in main(), before any gRPC or protobuf use.
void RouteLibraryLogs();

}  // namespace coalesce::service
