// The gRPC port's own accept loop, for a limit on connections per client
// address (--max_connections_per_peer). gRPC's listener takes every
// connection it is offered: one client once held 750 half-open connections,
// a descriptor and up to 27 KiB each, for up to two minutes. Here the server
// binds the port itself, accepts on a thread of its own and hands each
// connection to gRPC (ServerBuilder's external connection acceptor), unless
// its peer address already holds the limit: that one is closed at once, with
// a reset.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace coalesce::service {

// Which socket a descriptor holds: its inode in the kernel's socket file
// system. A closed connection's descriptor number is reused; its socket's
// inode is not.
struct SocketId {
  ino_t inode = 0;
  bool operator==(const SocketId& other) const { return inode == other.inode; }
};

// Whether descriptor `fd` of this process holds socket `id`, asked of
// /proc/self/fd: not a call on the descriptor itself, which gRPC may be
// closing at that moment on another thread. False where /proc cannot say.
bool DescriptorHoldsSocket(int fd, const SocketId& id);

// The open connections of each peer address. gRPC closes a connection's
// descriptor without telling anyone, so a connection counts as open while
// its descriptor still holds its socket (`still_open`: DescriptorHoldsSocket
// for the listener); the count of a peer at its limit is checked before it
// is refused, and every record now and then. Not thread-safe: the accept
// loop's alone.
class PeerConnections {
 public:
  using StillOpen = std::function<bool(int fd, const SocketId& id)>;
  // `max_per_peer` 0: no limit (connections are still counted).
  PeerConnections(int max_per_peer, StillOpen still_open)
      : max_per_peer_(max_per_peer), still_open_(std::move(still_open)) {}

  // Whether a new connection from `peer` (descriptor `fd`, socket `id`) may
  // be served; if so it is recorded. A record of another socket on `fd` is
  // one that closed.
  bool Admit(const std::string& peer, int fd, const SocketId& id);
  // Forgets every connection no longer open.
  void Sweep();
  // Connections of `peer` recorded as open (some may have closed since the
  // last check).
  int count(const std::string& peer) const;
  size_t size() const { return by_fd_.size(); }

 private:
  struct Record {
    std::string peer;
    SocketId id;
  };
  void Forget(int fd);
  // Forgets the connections of `peer` no longer open.
  void SweepPeer(const std::string& peer);

  const int max_per_peer_;
  const StillOpen still_open_;
  absl::flat_hash_map<int, Record> by_fd_;
  absl::flat_hash_map<std::string, absl::flat_hash_set<int>> by_peer_;
};

class Listener {
 public:
  struct Options {
    std::string host;  // an address or a name; 0.0.0.0 or :: is every address, IPv6 and IPv4
    int port = 0;      // 0: a free one
    int max_connections_per_peer = 0;  // 0: no limit
    // Called (on the accept thread) for each connection refused.
    std::function<void()> on_refused;
  };

  // Binds and listens on host:port as gRPC would (SO_REUSEADDR, no
  // SO_REUSEPORT, so a port another process listens on is an error), and
  // registers the acceptor with `builder`, whose connections get `creds`.
  // Connections wait in the backlog until Start.
  static absl::StatusOr<std::unique_ptr<Listener>> Bind(
      const Options& options, std::shared_ptr<grpc::ServerCredentials> creds,
      grpc::ServerBuilder* builder);
  ~Listener();

  int port() const { return port_; }
  // Accepts on a thread of its own: after the gRPC server has started.
  void Start();
  // Closes the listening sockets (new connections are refused) and ends the
  // thread: before the gRPC server shuts down, which would drop what it is
  // handed after.
  void Stop();

 private:
  Listener(const Options& options, std::vector<int> fds, int port);
  void Run();
  // Serves or refuses one accepted connection.
  void Take(int listen_fd, int fd);

  const Options options_;
  std::vector<int> fds_;  // listening sockets
  const int port_;
  int wake_fd_ = -1;  // an eventfd that ends the thread's wait
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  PeerConnections peers_;  // the thread's
  std::thread thread_;
};

// "1.2.3.4" or "2001:db8::1" (an IPv4-mapped IPv6 address as IPv4): the
// peer address of a connected socket, or "" when it has none.
std::string PeerAddress(int fd);

}  // namespace coalesce::service
