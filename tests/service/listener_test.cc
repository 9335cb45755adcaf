// The bookkeeping of connections per peer address: a peer at its limit is
// refused only while its connections are really open, a reused descriptor
// number is a new connection, and closed connections are forgotten.
#include "service/listener.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <string>

#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

// Descriptors and the sockets they hold, as a test says.
class FakeDescriptors {
 public:
  SocketId Open(int fd) {
    const SocketId id{next_inode_++};
    open_[fd] = id;
    return id;
  }
  void Close(int fd) { open_.erase(fd); }
  PeerConnections::StillOpen still_open() {
    return [this](int fd, const SocketId& id) {
      auto it = open_.find(fd);
      return it != open_.end() && it->second == id;
    };
  }

 private:
  std::map<int, SocketId> open_;
  ino_t next_inode_ = 100;
};

TEST(PeerConnectionsTest, APeerAtItsLimitIsRefusedAndOthersAreNot) {
  FakeDescriptors fds;
  PeerConnections peers(2, fds.still_open());
  EXPECT_TRUE(peers.Admit("10.0.0.1", 5, fds.Open(5)));
  EXPECT_TRUE(peers.Admit("10.0.0.1", 6, fds.Open(6)));
  EXPECT_FALSE(peers.Admit("10.0.0.1", 7, fds.Open(7)));
  fds.Close(7);  // the listener closes a refused connection
  EXPECT_TRUE(peers.Admit("10.0.0.2", 7, fds.Open(7)));
  EXPECT_EQ(peers.count("10.0.0.1"), 2);
  EXPECT_EQ(peers.count("10.0.0.2"), 1);
}

TEST(PeerConnectionsTest, AClosedConnectionFreesItsPlace) {
  FakeDescriptors fds;
  PeerConnections peers(2, fds.still_open());
  ASSERT_TRUE(peers.Admit("10.0.0.1", 5, fds.Open(5)));
  ASSERT_TRUE(peers.Admit("10.0.0.1", 6, fds.Open(6)));
  // gRPC closed descriptor 5 without a word; the limit is checked again.
  fds.Close(5);
  EXPECT_TRUE(peers.Admit("10.0.0.1", 9, fds.Open(9)));
  EXPECT_EQ(peers.count("10.0.0.1"), 2);
}

TEST(PeerConnectionsTest, AReusedDescriptorIsANewConnection) {
  FakeDescriptors fds;
  PeerConnections peers(1, fds.still_open());
  ASSERT_TRUE(peers.Admit("10.0.0.1", 5, fds.Open(5)));
  // Descriptor 5 closed and now holds another socket: another peer's
  // connection (or anything else this process opened).
  fds.Close(5);
  EXPECT_TRUE(peers.Admit("10.0.0.2", 5, fds.Open(5)));
  EXPECT_EQ(peers.count("10.0.0.1"), 0);
  EXPECT_EQ(peers.count("10.0.0.2"), 1);
  // The same number holding some other file: the record is stale.
  fds.Close(5);
  fds.Open(5);
  EXPECT_TRUE(peers.Admit("10.0.0.2", 6, fds.Open(6)));
}

TEST(PeerConnectionsTest, SweepForgetsEveryClosedConnection) {
  FakeDescriptors fds;
  PeerConnections peers(3, fds.still_open());
  for (int fd = 10; fd < 16; ++fd) {
    ASSERT_TRUE(peers.Admit(fd % 2 ? "a" : "b", fd, fds.Open(fd)));
  }
  for (int fd = 10; fd < 15; ++fd) fds.Close(fd);
  peers.Sweep();
  EXPECT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers.count("a"), 1);
  EXPECT_EQ(peers.count("b"), 0);
}

TEST(PeerConnectionsTest, NoLimitKeepsNoRecords) {
  FakeDescriptors fds;
  PeerConnections peers(0, fds.still_open());
  for (int fd = 10; fd < 1000; ++fd) EXPECT_TRUE(peers.Admit("a", fd, fds.Open(fd)));
  EXPECT_EQ(peers.size(), 0u);
}

TEST(DescriptorHoldsSocketTest, TellsAClosedOrReusedDescriptor) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  struct stat st;
  ASSERT_EQ(fstat(pair[0], &st), 0);
  const SocketId id{st.st_ino};
  EXPECT_TRUE(DescriptorHoldsSocket(pair[0], id));
  EXPECT_FALSE(DescriptorHoldsSocket(pair[1], id));
  close(pair[0]);
  EXPECT_FALSE(DescriptorHoldsSocket(pair[0], id));
  // The lowest free number, pair[0]'s again (unless another thread took
  // it), now another socket.
  const int again = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(again, 0);
  EXPECT_FALSE(DescriptorHoldsSocket(again, id));
  close(again);
  close(pair[1]);
}

TEST(PeerAddressTest, NamesTheOtherEndOfASocket) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_EQ(PeerAddress(pair[0]), "");  // not an IP socket
  close(pair[0]);
  close(pair[1]);
  EXPECT_EQ(PeerAddress(-1), "");
}

// On a dual-stack socket an IPv4 client arrives as ::ffff:127.0.0.1: the
// same peer as on an IPv4 socket.
TEST(PeerAddressTest, AnIpv4MappedAddressIsIpv4) {
  const int listener = socket(AF_INET6, SOCK_STREAM, 0);
  if (listener < 0) GTEST_SKIP() << "no IPv6";
  const int zero = 0;
  setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  sockaddr_in6 any{};
  any.sin6_family = AF_INET6;
  any.sin6_addr = in6addr_any;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&any), sizeof(any)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t length = sizeof(any);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&any), &length), 0);
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = any.sin6_port;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  const int accepted = accept(listener, nullptr, nullptr);
  ASSERT_GE(accepted, 0);
  EXPECT_EQ(PeerAddress(accepted), "127.0.0.1");
  close(accepted);
  close(client);
  close(listener);
}

}  // namespace
}  // namespace coalesce::service
