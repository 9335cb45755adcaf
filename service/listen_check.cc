#include "service/listen_check.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace coalesce::service {

std::string ListenError(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* addresses = nullptr;
  const std::string service = std::to_string(port);
  if (int rc =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &addresses);
      rc != 0) {
    return absl::StrCat("cannot resolve the address: ", gai_strerror(rc));
  }
  std::string error;
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    // As gRPC binds: SO_REUSEADDR (a port in TIME_WAIT is free), no
    // SO_REUSEPORT (a port another process listens on is not).
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      error = std::strerror(errno);
      if (errno == EADDRINUSE) error += " (another process listens on this port)";
    }
    close(fd);
    if (!error.empty()) break;
  }
  freeaddrinfo(addresses);
  return error;
}

}  // namespace coalesce::service
