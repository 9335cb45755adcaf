#include "batcher/block_pool.h"

#include <openssl/sha.h>

#include <numeric>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<BlockHash> Hashes(const std::vector<int32_t>& tokens, int block_size,
                              std::string_view salt = "", std::string_view partition = "") {
  std::vector<BlockHash> hashes;
  ExtendBlockHashes(PrefixRoot("model", partition, salt), tokens, block_size, hashes);
  return hashes;
}

TEST(BlockPoolTest, HandsOutEachBlockOnceAndTakesThemBack) {
  BlockPool blocks(5);
  auto a = blocks.Allocate(3);
  auto b = blocks.Allocate(2);
  ASSERT_TRUE(a && b);
  std::set<int32_t> ids(a->begin(), a->end());
  ids.insert(b->begin(), b->end());
  EXPECT_EQ(ids, (std::set<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(blocks.num_available(), 0);
  EXPECT_FALSE(blocks.Allocate(1).has_value());
  blocks.Release(*a);
  EXPECT_EQ(blocks.num_available(), 3);
  EXPECT_FALSE(blocks.Allocate(4).has_value());
  EXPECT_EQ(blocks.num_available(), 3);  // a failed Allocate takes nothing
}

TEST(BlockPoolTest, BlocksForTokensRoundsUp) {
  EXPECT_EQ(BlocksForTokens(1, 16), 1);
  EXPECT_EQ(BlocksForTokens(16, 16), 1);
  EXPECT_EQ(BlocksForTokens(17, 16), 2);
}

TEST(BlockHashTest, IsAChainedSha256OfTheParentAndTheTokens) {
  const std::vector<int32_t> tokens = {1, 2, 3, 0x01020304, 5, 6, 7};
  std::vector<BlockHash> hashes = Hashes(tokens, 2);
  ASSERT_EQ(hashes.size(), 3u);  // the 7th token is not a full block
  // Recomputed by hand: parent digest, then each token little-endian.
  std::string bytes;
  const BlockHash root = PrefixRoot("model", "", "");
  bytes.assign(reinterpret_cast<const char*>(hashes[0].data()), 32);
  for (int32_t t : {0x03, 0x01020304}) {
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((t >> (8 * i)) & 0xff));
  }
  BlockHash expected;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), expected.data());
  EXPECT_EQ(hashes[1], expected);
  EXPECT_NE(hashes[0], root);

  // Extending a partial chain gives the same chain.
  std::vector<BlockHash> partial;
  ExtendBlockHashes(root, std::span(tokens).first(3), 2, partial);
  ASSERT_EQ(partial.size(), 1u);
  ExtendBlockHashes(root, tokens, 2, partial);
  EXPECT_EQ(partial, hashes);
}

TEST(BlockHashTest, DependsOnEverythingBeforeTheSaltThePartitionAndTheModel) {
  const auto a = Hashes({1, 2, 3, 4}, 2);
  // Same second block, different first: every hash differs.
  const auto b = Hashes({9, 2, 3, 4}, 2);
  EXPECT_NE(a[0], b[0]);
  EXPECT_NE(a[1], b[1]);
  EXPECT_NE(Hashes({1, 2, 3, 4}, 2, "tenant-a"), a);
  EXPECT_NE(Hashes({1, 2, 3, 4}, 2, "tenant-a"), Hashes({1, 2, 3, 4}, 2, "tenant-b"));
  // A partition (a tenant) apart from every other, and from a salt of its name.
  EXPECT_NE(Hashes({1, 2, 3, 4}, 2, "", "tenant-a"), a);
  EXPECT_NE(Hashes({1, 2, 3, 4}, 2, "", "tenant-a"), Hashes({1, 2, 3, 4}, 2, "", "tenant-b"));
  EXPECT_NE(Hashes({1, 2, 3, 4}, 2, "s", "tenant-a"), Hashes({1, 2, 3, 4}, 2, "s", "tenant-b"));
  EXPECT_NE(Hashes({1, 2, 3, 4}, 2, "", "tenant-a"), Hashes({1, 2, 3, 4}, 2, "tenant-a", ""));
  EXPECT_EQ(Hashes({1, 2, 3, 4}, 2, "s", "tenant-a"), Hashes({1, 2, 3, 4}, 2, "s", "tenant-a"));
  EXPECT_NE(PrefixRoot("model", "", ""), PrefixRoot("other", "", ""));
  // Lengths are hashed: ("ab", "", "") and ("a", "b", "") differ.
  EXPECT_NE(PrefixRoot("ab", "", ""), PrefixRoot("a", "b", ""));
  EXPECT_NE(PrefixRoot("a", "b", ""), PrefixRoot("a", "", "b"));
}

TEST(BlockPoolTest, RegisteredBlocksAreFoundSharedAndCachedAfterRelease) {
  BlockPool pool(6);
  const auto h = Hashes({1, 2, 3, 4, 5, 6}, 2);  // three full blocks
  auto a = *pool.Allocate(3);
  EXPECT_EQ(pool.Match(h), 0);
  EXPECT_TRUE(pool.Register(a[0], h[0]));
  EXPECT_TRUE(pool.Register(a[1], h[1]));
  EXPECT_FALSE(pool.Register(a[1], h[1]));  // once
  int in_use = -1;
  EXPECT_EQ(pool.Match(h, &in_use), 2);
  EXPECT_EQ(in_use, 2);
  EXPECT_EQ(pool.num_cached(), 2);

  // A second sequence shares them.
  auto b = pool.Take(h, 2);
  EXPECT_EQ(b, std::vector<int32_t>(a.begin(), a.begin() + 2));
  EXPECT_EQ(pool.refs(a[0]), 2);
  // Another block with the same contents is not registered: it stays private.
  auto c = *pool.Allocate(1);
  EXPECT_FALSE(pool.Register(c[0], h[0]));
  pool.Release(c);
  EXPECT_EQ(pool.num_available(), 3);
  EXPECT_THAT(pool.CachedIds(), IsEmpty());

  pool.Release(a);  // a[2] was never registered: free
  EXPECT_EQ(pool.refs(a[0]), 1);
  EXPECT_EQ(pool.num_available(), 4);
  pool.Release(b);
  EXPECT_EQ(pool.num_available(), 6);
  // Leaves before parents: a[1] is the least recently used.
  EXPECT_THAT(pool.CachedIds(), ElementsAre(a[1], a[0]));
  EXPECT_EQ(pool.Match(h, &in_use), 2);
  EXPECT_EQ(in_use, 0);
}

TEST(BlockPoolTest, AllocateTakesFreeBlocksFirstThenEvictsLeastRecentlyUsed) {
  BlockPool pool(4);
  const auto x = Hashes({1, 1, 2, 2}, 2);
  const auto y = Hashes({7, 7}, 2);
  auto a = *pool.Allocate(2);
  pool.Register(a[0], x[0]);
  pool.Register(a[1], x[1]);
  pool.Release(a);
  auto b = *pool.Allocate(1);
  pool.Register(b[0], y[0]);
  pool.Release(b);
  EXPECT_THAT(pool.CachedIds(), ElementsAre(a[1], a[0], b[0]));
  EXPECT_EQ(pool.num_available(), 4);

  // One free block is left: it goes first, then the leaf of x.
  auto c = *pool.Allocate(2);
  EXPECT_EQ(pool.evictions(), 1);
  EXPECT_THAT(c, ::testing::Contains(a[1]));
  EXPECT_FALSE(pool.registered(a[1]));
  EXPECT_EQ(pool.Match(x), 1);  // the parent is still there
  EXPECT_EQ(pool.Match(y), 1);
  // Taking a cached block makes it in use: not evictable.
  pool.Take(y, 1);
  EXPECT_EQ(pool.num_available(), 1);
  auto d = *pool.Allocate(1);
  EXPECT_EQ(d[0], a[0]);
  EXPECT_EQ(pool.Match(x), 0);
  EXPECT_EQ(pool.evictions(), 2);
  EXPECT_FALSE(pool.Allocate(1).has_value());
}

TEST(BlockPoolTest, ForgetAllDropsEveryHash) {
  BlockPool pool(3);
  const auto h = Hashes({1, 2, 3, 4}, 2);
  auto a = *pool.Allocate(2);
  pool.Register(a[0], h[0]);
  pool.Register(a[1], h[1]);
  pool.Release(std::span(a).subspan(1));  // a[1] cached, a[0] still held
  pool.ForgetAll();
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.Match(h), 0);
  EXPECT_THAT(pool.CachedIds(), IsEmpty());
  pool.Release(std::span(a).first(1));
  EXPECT_THAT(pool.CachedIds(), IsEmpty());
  EXPECT_EQ(pool.num_available(), 3);
}

}  // namespace
}  // namespace coalesce::batcher
