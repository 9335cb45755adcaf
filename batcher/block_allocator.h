// Which KV-cache block belongs to whom. The engine owns the memory of the
// blocks; the batcher hands out their ids.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace coalesce::batcher {

class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);

  // `n` block ids, or nullopt (and nothing taken) when fewer are free.
  std::optional<std::vector<int32_t>> Allocate(int n);
  // Returns blocks from Allocate. Each id must be returned exactly once.
  void Free(const std::vector<int32_t>& blocks);

  int num_free() const { return static_cast<int>(free_.size()); }
  const std::vector<int32_t>& free_ids() const { return free_; }
  int num_total() const { return num_total_; }

 private:
  int num_total_;
  std::vector<int32_t> free_;  // a stack: recently freed blocks are reused first
};

// Blocks needed to hold `tokens` positions.
inline int BlocksForTokens(int tokens, int block_size) {
  return (tokens + block_size - 1) / block_size;
}

}  // namespace coalesce::batcher
