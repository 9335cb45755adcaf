#include "batcher/block_allocator.h"

#include <cassert>

namespace coalesce::batcher {

BlockAllocator::BlockAllocator(int num_blocks) : num_total_(num_blocks) {
  free_.reserve(num_blocks);
  // Highest id at the bottom of the stack, so block 0 is handed out first.
  for (int32_t id = num_blocks - 1; id >= 0; --id) free_.push_back(id);
}

std::optional<std::vector<int32_t>> BlockAllocator::Allocate(int n) {
  if (n > num_free()) return std::nullopt;
  std::vector<int32_t> blocks(free_.end() - n, free_.end());
  free_.resize(free_.size() - n);
  return blocks;
}

void BlockAllocator::Free(const std::vector<int32_t>& blocks) {
  for (int32_t id : blocks) {
    assert(id >= 0 && id < num_total_);
    free_.push_back(id);
  }
  assert(num_free() <= num_total_);
}

}  // namespace coalesce::batcher
