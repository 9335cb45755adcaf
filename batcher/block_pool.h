// Which KV-cache block belongs to whom, and which blocks hold a reusable
// prefix. The engine owns the memory of the blocks; the batcher hands out
// their ids.
//
// A block is in one of three states:
//   free:    holds nothing anyone will read;
//   in use:  held by one or more running sequences (its reference count);
//   cached:  held by nobody, but its contents are known by their hash, so a
//            later sequence whose prompt starts the same way can take it
//            instead of recomputing it.
// Free and cached blocks are both available: Allocate takes free blocks
// first, then evicts cached ones, least recently used first. Whether blocks
// are registered at all (prefix caching on or off) is the KV cache manager's
// choice (kv_cache_manager.h), which uses this pool.
//
// Prefix caching. A full block's K and V are a pure function of the tokens
// in it and before it. A block is named by a chained SHA-256 hash:
//   root     = SHA-256("coalesce prefix cache v1", namespace, partition, salt)
//   hash[0]  = SHA-256(root, tokens of block 0)
//   hash[i]  = SHA-256(hash[i - 1], tokens of block i)
// (token ids as 32-bit little-endian integers, strings with their lengths),
// so equal hashes mean equal token prefixes, with the odds of a collision
// (one user reading another's context) those of SHA-256. The namespace names
// the model; the partition names who may share (a tenant, or the group of
// tenants it shares with; empty without tenants), and the salt is the
// request's `cache_salt`: requests of different partitions or salts never
// share a block, so a client cannot learn through the cache (its reuse
// counts, its speed) what another partition's prompts were.
//
// Once a running sequence has computed every position of a block, the block
// is registered under its hash (unless another block already is: then it
// stays private). When the last sequence holding a registered block lets go,
// it becomes cached instead of free. Release lets go of a sequence's blocks
// from the last to the first, so a leaf is always used less recently than
// its parent and eviction takes leaves before their parents.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace coalesce::batcher {

using BlockHash = std::array<uint8_t, 32>;

// The root of a namespace's hash chains: `model` names what computed the
// blocks; `partition` (who may share) and `salt` keep apart requests that
// must not share them.
BlockHash PrefixRoot(std::string_view model, std::string_view partition, std::string_view salt);

// Extends `hashes` (the chain of `tokens` from `root` so far: empty, or a
// prefix of it) to name every full block of `tokens`.
void ExtendBlockHashes(const BlockHash& root, std::span<const int32_t> tokens, int block_size,
                       std::vector<BlockHash>& hashes);

// Blocks needed to hold `tokens` positions.
inline int BlocksForTokens(int tokens, int block_size) {
  return (tokens + block_size - 1) / block_size;
}

class BlockPool {
 public:
  explicit BlockPool(int num_blocks);

  int num_total() const { return static_cast<int>(refs_.size()); }
  // Blocks Allocate can hand out now: free plus cached.
  int num_available() const { return static_cast<int>(free_.size()) + num_lru_; }
  // Blocks registered under a hash, in use or not.
  int num_cached() const { return static_cast<int>(by_hash_.size()); }
  int64_t evictions() const { return evictions_; }

  // The longest run of registered blocks matching `hashes` from the start.
  // `in_use` (optional) gets how many of them are held by running sequences
  // (taking those costs no available block).
  int Match(std::span<const BlockHash> hashes, int* in_use = nullptr) const;
  // Takes a reference to each of the first `n` blocks Match found (n at most
  // what it returned) and returns their ids in order.
  std::vector<int32_t> Take(std::span<const BlockHash> hashes, int n);

  // `n` blocks held once each, or nullopt (and nothing taken) when fewer
  // are available. Evicted cached blocks lose their hash.
  std::optional<std::vector<int32_t>> Allocate(int n);

  // Block `id`, held and now fully computed, holds the contents named by
  // `hash`. Registers it unless another block is registered under that hash
  // already (or it is under another). Returns whether it registered.
  bool Register(int32_t id, const BlockHash& hash);
  // Block `id`, registered, no longer holds what its hash names (its holder
  // will write into it again): it is forgotten, and freed when released.
  void Unregister(int32_t id);

  // Takes one more reference to each block, all held already (sequences
  // that fork from one prompt share its blocks).
  void Share(std::span<const int32_t> blocks);

  // Lets go of one reference to each block, from the last to the first.
  void Release(std::span<const int32_t> blocks);

  // Forgets every hash (after a failed step, when no block's contents can
  // be trusted): cached blocks become free, and in-use ones are freed when
  // released.
  void ForgetAll();

  // For tests and snapshots.
  int refs(int32_t id) const { return refs_[id]; }
  bool registered(int32_t id) const { return hash_of_[id].has_value(); }
  // Ids of available blocks: free, then cached from least recently used.
  std::vector<int32_t> AvailableIds() const;
  // Ids of cached (registered, unheld) blocks, least recently used first.
  std::vector<int32_t> CachedIds() const;

 private:
  struct HashOfHash {
    size_t operator()(const BlockHash& h) const;
  };
  void LruPushBack(int32_t id);
  void LruRemove(int32_t id);

  std::vector<int32_t> refs_;                      // [num_blocks]
  std::vector<std::optional<BlockHash>> hash_of_;  // [num_blocks]: registered under
  absl::flat_hash_map<BlockHash, int32_t, HashOfHash> by_hash_;
  std::vector<int32_t> free_;  // a stack: recently freed blocks are reused first
  // Cached blocks, least recently used at the head: an intrusive list.
  std::vector<int32_t> prev_, next_;  // [num_blocks]; -1 ends
  int32_t lru_head_ = -1, lru_tail_ = -1;
  int num_lru_ = 0;
  int64_t evictions_ = 0;
};

}  // namespace coalesce::batcher
