#include "service/listener.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"

namespace coalesce::service {
namespace {

// Every record is checked this often, so that the peers of closed
// connections are forgotten.
constexpr absl::Duration kSweepInterval = absl::Seconds(10);
// After accept fails for want of descriptors or memory, the loop waits this
// long before it tries again (the connection waits in the backlog).
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

std::string Errno(int error) { return std::strerror(error); }

// A TCP socket listening on `address`, or -1 with errno: SO_REUSEADDR (a
// port in TIME_WAIT is free) and no SO_REUSEPORT (a port another process
// listens on is not), as gRPC binds. `dual_stack`: an IPv6 socket that takes
// IPv4 too.
int ListenOn(const sockaddr* address, socklen_t length, bool dual_stack) {
  const int fd = socket(address->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1, zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (address->sa_family == AF_INET6) {
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, dual_stack ? &zero : &one, sizeof(int));
  }
  if (bind(fd, address, length) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

absl::Status BindError(int error) {
  std::string why = Errno(error);
  if (error == EADDRINUSE) why += " (another process listens on this port)";
  return absl::UnavailableError(why);
}

int BoundPort(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  if (address.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
}

void SetPort(sockaddr* address, int port) {
  if (address->sa_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(address)->sin_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in6*>(address)->sin6_port = htons(static_cast<uint16_t>(port));
  }
}

// Listening sockets for host:port. As gRPC treats them, 0.0.0.0 and :: (or
// no host) are every address: one IPv6 socket that takes IPv4 too, or an
// IPv4 one where there is no IPv6. A name is each of its addresses, all on
// one port; an address that cannot be bound is left out, unless it is in
// use or none can be bound.
absl::StatusOr<std::vector<int>> ListenSockets(std::string host, int port) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0" || host == "::") {
    sockaddr_in6 any6{};
    any6.sin6_family = AF_INET6;
    any6.sin6_addr = in6addr_any;
    any6.sin6_port = htons(static_cast<uint16_t>(port));
    int fd = ListenOn(reinterpret_cast<sockaddr*>(&any6), sizeof(any6), true);
    if (fd < 0 && errno == EAFNOSUPPORT) {
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      any4.sin_port = htons(static_cast<uint16_t>(port));
      fd = ListenOn(reinterpret_cast<sockaddr*>(&any4), sizeof(any4), false);
    }
    if (fd < 0) return BindError(errno);
    return std::vector<int>{fd};
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* addresses = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve the address: ", gai_strerror(rc)));
  }
  std::vector<int> fds;
  int error = 0;
  for (addrinfo* a = addresses; a != nullptr && error != EADDRINUSE; a = a->ai_next) {
    // Port 0: every address on the port the first one got.
    if (!fds.empty()) SetPort(a->ai_addr, BoundPort(fds.front()));
    const int fd = ListenOn(a->ai_addr, a->ai_addrlen, false);
    if (fd >= 0) {
      fds.push_back(fd);
    } else if (error == 0 || errno == EADDRINUSE) {
      error = errno;
    }
  }
  freeaddrinfo(addresses);
  if (fds.empty() || error == EADDRINUSE) {
    for (int fd : fds) close(fd);
    return BindError(error != 0 ? error : EADDRNOTAVAIL);
  }
  return fds;
}

}  // namespace

// ---------------------------------------------------------------------------
// PeerConnections
// ---------------------------------------------------------------------------

bool PeerConnections::Admit(const std::string& peer, int fd, const SocketId& id) {
  if (max_per_peer_ == 0) return true;
  // The descriptor is new to us: whatever it held before has closed.
  Forget(fd);
  if (count(peer) >= max_per_peer_) {
    SweepPeer(peer);
    if (count(peer) >= max_per_peer_) return false;
  }
  by_fd_[fd] = Record{peer, id};
  by_peer_[peer].insert(fd);
  return true;
}

void PeerConnections::Forget(int fd) {
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return;
  auto peer = by_peer_.find(it->second.peer);
  peer->second.erase(fd);
  if (peer->second.empty()) by_peer_.erase(peer);
  by_fd_.erase(it);
}

void PeerConnections::SweepPeer(const std::string& peer) {
  auto it = by_peer_.find(peer);
  if (it == by_peer_.end()) return;
  std::vector<int> closed;
  for (int fd : it->second) {
    if (!still_open_(fd, by_fd_.at(fd).id)) closed.push_back(fd);
  }
  for (int fd : closed) Forget(fd);
}

void PeerConnections::Sweep() {
  std::vector<int> closed;
  for (const auto& [fd, record] : by_fd_) {
    if (!still_open_(fd, record.id)) closed.push_back(fd);
  }
  for (int fd : closed) Forget(fd);
}

int PeerConnections::count(const std::string& peer) const {
  auto it = by_peer_.find(peer);
  return it == by_peer_.end() ? 0 : static_cast<int>(it->second.size());
}

// ---------------------------------------------------------------------------
// Listener
// ---------------------------------------------------------------------------

bool DescriptorHoldsSocket(int fd, const SocketId& id) {
  char target[64];
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = readlink(link.c_str(), target, sizeof(target));
  return n > 0 && std::string_view(target, n) == absl::StrCat("socket:[", id.inode, "]");
}

std::string PeerAddress(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "";
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&address)->sin_addr, text,
              sizeof(text));
  } else if (address.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&address)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &a, text, sizeof(text));
    }
  }
  return text;
}

Listener::Listener(const Options& options, std::vector<int> fds, int port)
    : options_(options),
      fds_(std::move(fds)),
      port_(port),
      peers_(options.max_connections_per_peer, &DescriptorHoldsSocket) {}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Bind(
    const Options& options, std::shared_ptr<grpc::ServerCredentials> creds,
    grpc::ServerBuilder* builder) {
  absl::StatusOr<std::vector<int>> fds = ListenSockets(options.host, options.port);
  if (!fds.ok()) return fds.status();
  std::unique_ptr<Listener> listener(new Listener(options, *fds, BoundPort(fds->front())));
  listener->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (listener->wake_fd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", Errno(errno)));
  listener->acceptor_ = builder->experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, std::move(creds));
  return listener;
}

Listener::~Listener() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Listener::Start() {
  thread_ = std::thread([this] { Run(); });
}

void Listener::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  for (int fd : fds_) close(fd);
  fds_.clear();
}

void Listener::Run() {
  std::vector<pollfd> polls;
  for (int fd : fds_) polls.push_back({fd, POLLIN, 0});
  polls.push_back({wake_fd_, POLLIN, 0});
  absl::Time next_sweep = absl::Now() + kSweepInterval;
  bool back_off = false;
  while (true) {
    // While backing off, only the wake-up is watched.
    const int n = back_off
                      ? poll(&polls.back(), 1, absl::ToInt64Milliseconds(kAcceptBackoff))
                      : poll(polls.data(), polls.size(), absl::ToInt64Milliseconds(kSweepInterval));
    if (n < 0 && errno != EINTR) {
      Log(LogLevel::kError, absl::StrCat("the gRPC port's accept loop failed: poll: ", Errno(errno),
                                         "; no new connection will be taken"));
      return;
    }
    if (polls.back().revents != 0) return;  // Stop
    back_off = false;
    for (size_t i = 0; i + 1 < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      polls[i].revents = 0;
      // Every connection waiting, then the next poll.
      while (true) {
        const int fd = accept4(polls[i].fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
          Take(polls[i].fd, fd);
          continue;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          LogRateLimited("accept", LogLevel::kWarning,
                         absl::StrCat("cannot accept a connection on the gRPC port: ", Errno(errno),
                                      " (it waits in the backlog)"));
          back_off = true;
        }
        break;
      }
    }
    if (absl::Now() >= next_sweep) {
      peers_.Sweep();
      next_sweep = absl::Now() + kSweepInterval;
    }
  }
}

void Listener::Take(int listen_fd, int fd) {
  const std::string peer = PeerAddress(fd);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return;
  }
  if (!peers_.Admit(peer, fd, SocketId{st.st_ino})) {
    // A reset: nothing of the connection lingers on this side.
    const linger reset = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    close(fd);
    LogRateLimited(
        "connection refused", LogLevel::kWarning,
        absl::StrCat("refused a connection from ", peer, ": it has ",
                     options_.max_connections_per_peer, " open (--max_connections_per_peer)"));
    if (options_.on_refused) options_.on_refused();
    return;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters connection;
  connection.listener_fd = listen_fd;
  connection.fd = fd;
  acceptor_->HandleNewConnection(&connection);
}

}  // namespace coalesce::service
