// The KV cache manager alone: admitting (cached prefix, new blocks, blocks
// reserved for samples), growing, registering, forking, rolling back and
// releasing, with prefix caching on and off; every block accounted for after
// each operation.
#include "batcher/kv_cache_manager.h"

#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::IsEmpty;

constexpr int kBlockSize = 4;

KvCacheManager Manager(int blocks, bool caching) {
  return KvCacheManager(blocks, kBlockSize,
                        {.prefix_caching = caching, .prefix_cache_namespace = "model"});
}

std::vector<int32_t> Tokens(int n, int32_t first = 1) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<int32_t> Table(const SequenceBlocks& seq) {
  return {seq.table().begin(), seq.table().end()};
}

// Every block is held by exactly the holders the test knows of, or available.
void ExpectHolders(const KvCacheManager& kv, const std::vector<const SequenceBlocks*>& seqs) {
  std::vector<int> refs(kv.num_total(), 0);
  for (const SequenceBlocks* s : seqs) {
    for (int32_t id : s->table()) ++refs[id];
    for (int32_t id : s->reserved()) ++refs[id];
  }
  int available = 0;
  for (int32_t id = 0; id < kv.num_total(); ++id) {
    EXPECT_EQ(kv.refs(id), refs[id]) << "block " << id;
    available += refs[id] == 0 ? 1 : 0;
  }
  EXPECT_EQ(kv.num_available(), available);
}

TEST(KvCacheManagerTest, AdmitsGrowsAndReleasesWithoutCaching) {
  KvCacheManager kv = Manager(6, /*caching=*/false);
  const auto tokens = Tokens(9);
  SequenceBlocks a = kv.NewSequence("", "");
  EXPECT_EQ(kv.AdmissionCost(a, tokens, 2, 3), 3);
  auto admitted = kv.Admit(a, tokens, 2, 3, 0);
  ASSERT_TRUE(admitted.has_value());
  EXPECT_EQ(admitted->cached, 0);
  EXPECT_FALSE(admitted->looked_up);
  EXPECT_EQ(a.held(), 3);
  EXPECT_EQ(a.capacity(kBlockSize), 12);
  kv.Grow(a);
  EXPECT_EQ(a.held(), 4);
  ExpectHolders(kv, {&a});
  // Registering does nothing, so the same tokens find nothing cached.
  kv.Register(a, tokens);
  EXPECT_EQ(kv.num_cached(), 0);
  EXPECT_EQ(kv.Releasable(a), 4);
  kv.Release(a);
  EXPECT_EQ(a.held(), 0);
  EXPECT_EQ(kv.num_available(), 6);
  EXPECT_THAT(kv.CachedIds(), IsEmpty());
  SequenceBlocks b = kv.NewSequence("", "");
  EXPECT_EQ(kv.Admit(b, tokens, 2, 3, 0)->cached, 0);
  ExpectHolders(kv, {&b});
}

TEST(KvCacheManagerTest, RefusesWhatIsNotAvailableAndTakesNothing) {
  for (bool caching : {false, true}) {
    KvCacheManager kv = Manager(3, caching);
    SequenceBlocks a = kv.NewSequence("", "");
    ASSERT_TRUE(kv.Admit(a, Tokens(8), 1, 2, 0).has_value());
    SequenceBlocks b = kv.NewSequence("", "");
    EXPECT_FALSE(kv.Admit(b, Tokens(8, 50), 1, 2, 0).has_value());
    EXPECT_EQ(b.held(), 0);
    ExpectHolders(kv, {&a});
  }
}

TEST(KvCacheManagerTest, ACachedPrefixIsTakenAndCostsNothingWhileHeld) {
  KvCacheManager kv = Manager(8, /*caching=*/true);
  const auto tokens = Tokens(10);  // 2 full blocks and 2 positions
  SequenceBlocks a = kv.NewSequence("", "");
  auto first = kv.Admit(a, tokens, 2, 3, 0);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->cached, 0);
  EXPECT_TRUE(first->looked_up);
  kv.Register(a, tokens);  // the two full blocks
  EXPECT_EQ(kv.num_cached(), 2);
  // A second sequence of the same tokens: its two full blocks are held by
  // `a`, so admitting it costs only its third.
  SequenceBlocks b = kv.NewSequence("", "");
  EXPECT_EQ(kv.AdmissionCost(b, tokens, 2, 3), 1);
  auto second = kv.Admit(b, tokens, 2, 3, 0);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->cached, 8);
  EXPECT_EQ(b.table()[0], a.table()[0]);
  EXPECT_EQ(b.table()[1], a.table()[1]);
  EXPECT_NE(b.table()[2], a.table()[2]);
  EXPECT_EQ(kv.Releasable(b), 1);  // the shared ones stay with `a`
  ExpectHolders(kv, {&a, &b});
  // Released, the registered blocks stay cached (available), the rest free.
  kv.Release(a);
  kv.Release(b);
  EXPECT_EQ(kv.num_available(), 8);
  EXPECT_EQ(kv.CachedIds().size(), 2u);
  // A match limit keeps a block out: with prompt log-probabilities, say.
  SequenceBlocks c = kv.NewSequence("", "");
  EXPECT_EQ(kv.Admit(c, tokens, 0, 3, 0)->cached, 0);
  ExpectHolders(kv, {&c});
}

TEST(KvCacheManagerTest, PartitionsAndSaltsNeverShareABlock) {
  KvCacheManager kv = Manager(16, /*caching=*/true);
  const auto tokens = Tokens(9);
  SequenceBlocks a = kv.NewSequence("tenant:a", "");
  ASSERT_TRUE(kv.Admit(a, tokens, 2, 3, 0).has_value());
  kv.Register(a, tokens);
  for (auto [partition, salt] : {std::pair{"tenant:b", ""}, std::pair{"", ""},
                                 std::pair{"tenant:a", "s"}, std::pair{"", "tenant:a"}}) {
    SequenceBlocks other = kv.NewSequence(partition, salt);
    EXPECT_EQ(kv.Admit(other, tokens, 2, 3, 0)->cached, 0) << partition << "/" << salt;
    kv.Release(other);
  }
  SequenceBlocks same = kv.NewSequence("tenant:a", "");
  EXPECT_EQ(kv.Admit(same, tokens, 2, 3, 0)->cached, 8);
}

TEST(KvCacheManagerTest, ForkSharesFullBlocksAndCopiesThePartlyFilledOne) {
  for (bool caching : {false, true}) {
    KvCacheManager kv = Manager(10, caching);
    // A prompt of 7 tokens for 3 samples: 6 computed together (1.5 blocks),
    // 2 blocks for the prompt and one reserved for each other sample.
    const auto computed = Tokens(6);
    SequenceBlocks parent = kv.NewSequence("", "");
    ASSERT_TRUE(kv.Admit(parent, computed, 1, 4, 2).has_value());
    EXPECT_EQ(parent.table().size(), 2u);
    EXPECT_EQ(parent.reserved().size(), 2u);
    const std::vector<int32_t> reserved(parent.reserved().begin(), parent.reserved().end());
    kv.Register(parent, computed);
    std::vector<engine::BlockCopy> copies;
    std::vector<SequenceBlocks> samples = kv.Fork(parent, 6, copies);
    ASSERT_EQ(samples.size(), 2u);
    EXPECT_THAT(parent.reserved(), IsEmpty());
    for (int i = 0; i < 2; ++i) {
      EXPECT_THAT(Table(samples[i]), ElementsAre(parent.table()[0], reserved[i]));
      ASSERT_EQ(copies.size(), 2u);
      EXPECT_EQ(copies[i].from, parent.table()[1]);
      EXPECT_EQ(copies[i].to, reserved[i]);
    }
    ExpectHolders(kv, {&parent, &samples[0], &samples[1]});
    // The shared block goes back only when its last holder lets go.
    kv.Release(parent);
    kv.Release(samples[0]);
    ExpectHolders(kv, {&samples[1]});
    kv.Release(samples[1]);
    EXPECT_EQ(kv.num_available(), 10);
  }
}

TEST(KvCacheManagerTest, ForkOnABlockBoundaryCopiesNothing) {
  KvCacheManager kv = Manager(6, /*caching=*/false);
  SequenceBlocks parent = kv.NewSequence("", "");
  ASSERT_TRUE(kv.Admit(parent, Tokens(8), 2, 4, 1).has_value());
  std::vector<engine::BlockCopy> copies;
  std::vector<SequenceBlocks> samples = kv.Fork(parent, 8, copies);
  EXPECT_THAT(copies, IsEmpty());
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].table().size(), 3u);
  ExpectHolders(kv, {&parent, &samples[0]});
}

TEST(KvCacheManagerTest, RollbackLetsGoOfBlocksPastTheNewEnd) {
  for (bool caching : {false, true}) {
    KvCacheManager kv = Manager(10, caching);
    const auto tokens = Tokens(11);
    SequenceBlocks a = kv.NewSequence("", "");
    ASSERT_TRUE(kv.Admit(a, tokens, 2, 3, 0).has_value());
    kv.Register(a, tokens);  // 2 full blocks
    const std::vector<int32_t> before = Table(a);
    std::vector<engine::BlockCopy> copies;
    // 11 -> 5 positions: block 2 goes, block 1 is written again from 5 on.
    ASSERT_TRUE(kv.Rollback(a, 11, 6, copies));
    EXPECT_THAT(copies, IsEmpty());  // block 1 is a's alone
    EXPECT_THAT(Table(a), ElementsAre(before[0], before[1]));
    ExpectHolders(kv, {&a});
    // `a` goes on with other tokens from position 5: block 1 now holds them,
    // and is registered under them.
    std::vector<int32_t> other = tokens;
    other[6] = 99;
    kv.Register(a, std::span(other).first(8));
    // The old tokens find only block 0 cached; the new ones both blocks.
    SequenceBlocks b = kv.NewSequence("", "");
    EXPECT_EQ(kv.Admit(b, tokens, 2, 3, 0)->cached, caching ? 4 : 0);
    SequenceBlocks c = kv.NewSequence("", "");
    EXPECT_EQ(kv.Admit(c, other, 2, 3, 0)->cached, caching ? 8 : 0);
    ExpectHolders(kv, {&a, &b, &c});
  }
}

TEST(KvCacheManagerTest, RollbackIntoASharedBlockWritesToACopy) {
  KvCacheManager kv = Manager(8, /*caching=*/true);
  const auto tokens = Tokens(9);
  SequenceBlocks a = kv.NewSequence("", "");
  ASSERT_TRUE(kv.Admit(a, tokens, 2, 3, 0).has_value());
  kv.Register(a, tokens);
  SequenceBlocks b = kv.NewSequence("", "");
  ASSERT_EQ(kv.Admit(b, tokens, 2, 3, 0)->cached, 8);  // shares a's blocks 0 and 1
  std::vector<engine::BlockCopy> copies;
  // b takes back its last 3 positions (9 -> 6): block 1, shared with a, is
  // to be written again, so b gets a copy of it.
  ASSERT_TRUE(kv.Rollback(b, 9, 3, copies));
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].from, a.table()[1]);
  EXPECT_EQ(copies[0].to, b.table()[1]);
  EXPECT_NE(b.table()[1], a.table()[1]);
  EXPECT_EQ(b.table()[0], a.table()[0]);
  EXPECT_EQ(b.table().size(), 2u);
  ExpectHolders(kv, {&a, &b});
  // a's blocks still name its tokens.
  SequenceBlocks c = kv.NewSequence("", "");
  EXPECT_EQ(kv.Admit(c, tokens, 2, 3, 0)->cached, 8);
  ExpectHolders(kv, {&a, &b, &c});
}

TEST(KvCacheManagerTest, RollbackThatFindsNoBlockForItsCopyChangesNothing) {
  KvCacheManager kv = Manager(4, /*caching=*/false);
  SequenceBlocks parent = kv.NewSequence("", "");
  ASSERT_TRUE(kv.Admit(parent, Tokens(8), 2, 3, 1).has_value());
  std::vector<engine::BlockCopy> copies;
  std::vector<SequenceBlocks> samples = kv.Fork(parent, 8, copies);
  ASSERT_EQ(samples.size(), 1u);
  SequenceBlocks other = kv.NewSequence("", "");
  ASSERT_TRUE(kv.Admit(other, Tokens(1), 0, 1, 0).has_value());  // the last block
  ASSERT_EQ(kv.num_available(), 0);
  // The sample goes back into block 1, which its parent holds too: no
  // block is left for its copy.
  const std::vector<int32_t> before = Table(samples[0]);
  EXPECT_FALSE(kv.Rollback(samples[0], 9, 3, copies));
  EXPECT_THAT(Table(samples[0]), ElementsAreArray(before));
  EXPECT_THAT(copies, IsEmpty());
  ExpectHolders(kv, {&parent, &samples[0], &other});
  // Rolling back whole blocks needs no copy.
  EXPECT_TRUE(kv.Rollback(samples[0], 9, 1, copies));
  EXPECT_EQ(samples[0].table().size(), 2u);
  EXPECT_THAT(copies, IsEmpty());
  ExpectHolders(kv, {&parent, &samples[0], &other});
}

TEST(KvCacheManagerTest, ForgetAllLeavesNothingCached) {
  KvCacheManager kv = Manager(4, /*caching=*/true);
  const auto tokens = Tokens(8);
  SequenceBlocks a = kv.NewSequence("", "");
  ASSERT_TRUE(kv.Admit(a, tokens, 2, 2, 0).has_value());
  kv.Register(a, tokens);
  kv.ForgetAll();
  kv.Release(a);
  EXPECT_THAT(kv.CachedIds(), IsEmpty());
  SequenceBlocks b = kv.NewSequence("", "");
  EXPECT_EQ(kv.Admit(b, tokens, 2, 2, 0)->cached, 0);
}

}  // namespace
}  // namespace coalesce::batcher
