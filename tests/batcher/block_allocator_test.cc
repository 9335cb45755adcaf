#include "batcher/block_allocator.h"

#include <set>

#include "gtest/gtest.h"

namespace coalesce::batcher {
namespace {

TEST(BlockAllocatorTest, HandsOutEachBlockOnceAndTakesThemBack) {
  BlockAllocator blocks(5);
  auto a = blocks.Allocate(3);
  auto b = blocks.Allocate(2);
  ASSERT_TRUE(a && b);
  std::set<int32_t> ids(a->begin(), a->end());
  ids.insert(b->begin(), b->end());
  EXPECT_EQ(ids, (std::set<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(blocks.num_free(), 0);
  EXPECT_FALSE(blocks.Allocate(1).has_value());
  blocks.Free(*a);
  EXPECT_EQ(blocks.num_free(), 3);
  EXPECT_FALSE(blocks.Allocate(4).has_value());
  EXPECT_EQ(blocks.num_free(), 3);  // a failed Allocate takes nothing
}

TEST(BlockAllocatorTest, BlocksForTokensRoundsUp) {
  EXPECT_EQ(BlocksForTokens(1, 16), 1);
  EXPECT_EQ(BlocksForTokens(16, 16), 1);
  EXPECT_EQ(BlocksForTokens(17, 16), 2);
}

}  // namespace
}  // namespace coalesce::batcher
