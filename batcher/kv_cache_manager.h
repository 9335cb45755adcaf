// The KV cache as the engine loop sees it: which blocks each sequence holds,
// which hold a reusable prefix, and what admitting, growing, forking,
// rolling back and ending a sequence takes and gives back. It answers in
// block ids and block-copy lists; it knows tokens, never text, requests or
// streams. One thread (the engine loop's) uses it.
//
// The blocks themselves (free, in use, cached, and the hash chains that name
// a prefix) are BlockPool's (block_pool.h). The manager holds the one
// prefix-caching switch: with it off, nothing is hashed, matched or
// registered, and a released block is simply free.
//
// A sequence's blocks are a SequenceBlocks, kept inside the sequence but
// written only here: its block table (position p in blocks[p / block_size]),
// before a fork the blocks reserved for its other samples, and with caching
// the hashes of its full blocks and how many of them are registered.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "batcher/block_pool.h"
#include "engine/backend.h"

namespace coalesce::batcher {

class SequenceBlocks {
 public:
  // In position order: the sequence's block table.
  std::span<const int32_t> table() const { return blocks_; }
  // Before a fork: one block for each other sample (KvCacheManager::Fork).
  std::span<const int32_t> reserved() const { return reserve_; }
  // Blocks it holds, reserved ones included.
  int held() const { return static_cast<int>(blocks_.size() + reserve_.size()); }
  // Positions its table covers.
  int capacity(int block_size) const { return static_cast<int>(blocks_.size()) * block_size; }

 private:
  friend class KvCacheManager;
  BlockHash root_{};               // its partition and salt's hash chain root
  std::vector<int32_t> blocks_;    // [positions / block_size], rounded up
  std::vector<int32_t> reserve_;   // before a fork
  std::vector<BlockHash> hashes_;  // of its full blocks so far (with caching)
  int registered_ = 0;             // leading blocks registered or taken from the cache
};

struct KvCacheOptions {
  // Reuse the KV blocks of cached prompt prefixes (block_pool.h): a new
  // request takes the longest chain of cached full blocks that matches its
  // tokens and computes only the rest (at least its last token). A resumed
  // (preempted) sequence may find its own blocks again.
  bool prefix_caching = true;
  // Names what computes the blocks (the model), in every block's hash.
  std::string prefix_cache_namespace;
};

class KvCacheManager {
 public:
  KvCacheManager(int num_blocks, int block_size, KvCacheOptions options);

  int block_size() const { return block_size_; }
  int num_total() const { return pool_.num_total(); }
  // Blocks that can be handed out now: free, or cached and held by nobody.
  int num_available() const { return pool_.num_available(); }
  int num_cached() const { return pool_.num_cached(); }
  int64_t evictions() const { return pool_.evictions(); }

  // The blocks of a new sequence: none yet, its hash chain rooted in
  // `partition` (who may share its cached blocks) and `salt`.
  SequenceBlocks NewSequence(std::string_view partition, std::string_view salt) const;

  // What admitting a sequence of `tokens` costs in available blocks: the
  // `needed` blocks it must hold, less those of its cached prefix (its
  // first `match_limit` full blocks at most) that running sequences hold
  // already. An estimate: an eviction before the admission can make it
  // short, and then Admit fails.
  int AdmissionCost(SequenceBlocks& seq, std::span<const int32_t> tokens, int match_limit,
                    int needed);
  // Gives `seq` (holding nothing) its cached prefix, at most `match_limit`
  // full blocks of `tokens`, and new blocks for the rest of `needed`, the
  // last `reserve` of them kept apart for its other samples. Nullopt, with
  // nothing taken, when the blocks are not available.
  struct Admission {
    int cached = 0;          // leading positions the prefix cache supplied
    bool looked_up = false;  // the prefix cache was consulted (it is on)
  };
  std::optional<Admission> Admit(SequenceBlocks& seq, std::span<const int32_t> tokens,
                                 int match_limit, int needed, int reserve);
  // One more block at the end of the table (its positions have outgrown
  // it). The planner has made sure one is available.
  void Grow(SequenceBlocks& seq);
  // `computed` are the sequence's tokens whose K and V are now in the cache:
  // registers the full blocks among them that are not yet.
  void Register(SequenceBlocks& seq, std::span<const int32_t> computed);

  // The samples of a request part (before: `parent` computed `computed`
  // positions and holds a reserved block for each other sample). Sample i
  // (1 to reserved) shares the parent's full blocks and takes the parent's
  // reserved block i - 1 for the rest; when the last of the computed
  // positions partly fill a block, the copy of it into each sample's own
  // block is appended to `copies`. The parent keeps its blocks and no
  // longer reserves any.
  std::vector<SequenceBlocks> Fork(SequenceBlocks& parent, int computed,
                                   std::vector<engine::BlockCopy>& copies);

  // Takes back the last `k` of the sequence's `computed` positions (tokens
  // that turned out not to be wanted, as a rejected speculation's): blocks
  // past the new end are let go, and the hashes of blocks no longer full
  // dropped. The block holding the new end, if the sequence will write into
  // it again, must be its own: one registered under a hash (the sequence's
  // own registration, or a block others hold) is replaced by a new block,
  // and the copy of its kept positions is appended to `copies`. False (and
  // nothing changed) when that replacement finds no available block.
  bool Rollback(SequenceBlocks& seq, int computed, int k, std::vector<engine::BlockCopy>& copies);

  // The blocks preempting or ending the sequence makes available: those
  // nobody else holds, reserved ones included.
  int Releasable(const SequenceBlocks& seq) const;
  // Lets go of every block of the sequence; registered ones stay cached.
  void Release(SequenceBlocks& seq);
  // Lets go of a block table that is no sequence's any more (a padding row).
  void Release(std::span<const int32_t> blocks) { pool_.Release(blocks); }
  // Moves the sequence's table out (the caller releases it later).
  std::vector<int32_t> TakeTable(SequenceBlocks& seq);
  // After a failed step no block's contents can be trusted: forgets every
  // hash; held blocks are freed when released.
  void ForgetAll() { pool_.ForgetAll(); }

  // For snapshots and tests.
  int refs(int32_t id) const { return pool_.refs(id); }
  std::vector<int32_t> AvailableIds() const { return pool_.AvailableIds(); }
  std::vector<int32_t> CachedIds() const { return pool_.CachedIds(); }

 private:
  // The hashes of `seq`'s first full blocks of `tokens`, at most `limit`.
  std::span<const BlockHash> Lookup(SequenceBlocks& seq, std::span<const int32_t> tokens,
                                    int limit);

  const int block_size_;
  const KvCacheOptions options_;
  const BlockHash default_root_;  // of sequences with no partition and no salt
  BlockPool pool_;
};

}  // namespace coalesce::batcher
