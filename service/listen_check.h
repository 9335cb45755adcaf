// Why the server cannot listen on an address: gRPC only says that it could
// not, so after a failure the server binds a socket there itself and reports
// what the operating system says ("Address already in use").
#pragma once

#include <string>

namespace coalesce::service {

// The error of binding a TCP socket to host:port, or "" if binding works
// now. `host` is an IPv4 or IPv6 address or a name.
std::string ListenError(const std::string& host, int port);

}  // namespace coalesce::service
