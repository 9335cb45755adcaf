#include "batcher/kv_cache_manager.h"

#include <algorithm>
#include <cassert>
#include <utility>

namespace coalesce::batcher {

KvCacheManager::KvCacheManager(int num_blocks, int block_size, KvCacheOptions options)
    : block_size_(block_size),
      options_(std::move(options)),
      default_root_(PrefixRoot(options_.prefix_cache_namespace, "", "")),
      pool_(num_blocks) {}

SequenceBlocks KvCacheManager::NewSequence(std::string_view partition,
                                           std::string_view salt) const {
  SequenceBlocks seq;
  if (options_.prefix_caching) {
    seq.root_ = partition.empty() && salt.empty()
                    ? default_root_
                    : PrefixRoot(options_.prefix_cache_namespace, partition, salt);
  }
  return seq;
}

std::span<const BlockHash> KvCacheManager::Lookup(SequenceBlocks& seq,
                                                  std::span<const int32_t> tokens, int limit) {
  ExtendBlockHashes(seq.root_, tokens, block_size_, seq.hashes_);
  return std::span<const BlockHash>(seq.hashes_)
      .first(std::min<size_t>(seq.hashes_.size(), std::max(limit, 0)));
}

int KvCacheManager::AdmissionCost(SequenceBlocks& seq, std::span<const int32_t> tokens,
                                  int match_limit, int needed) {
  // Cached blocks that running sequences hold cost nothing to take; the
  // others come out of the available ones either way.
  int shared = 0;
  if (options_.prefix_caching) pool_.Match(Lookup(seq, tokens, match_limit), &shared);
  return needed - shared;
}

std::optional<KvCacheManager::Admission> KvCacheManager::Admit(SequenceBlocks& seq,
                                                               std::span<const int32_t> tokens,
                                                               int match_limit, int needed,
                                                               int reserve) {
  assert(seq.held() == 0);
  int matched = 0;
  std::vector<int32_t> blocks;
  if (options_.prefix_caching) {
    const std::span<const BlockHash> lookup = Lookup(seq, tokens, match_limit);
    matched = pool_.Match(lookup);
    // Taken first, so that allocating the rest cannot evict them.
    blocks = pool_.Take(lookup, matched);
  }
  std::optional<std::vector<int32_t>> rest = pool_.Allocate(needed - matched);
  if (!rest.has_value()) {
    pool_.Release(blocks);
    return std::nullopt;
  }
  blocks.insert(blocks.end(), rest->begin(), rest->end() - reserve);
  seq.reserve_.assign(rest->end() - reserve, rest->end());
  seq.blocks_ = std::move(blocks);
  seq.registered_ = matched;
  return Admission{.cached = matched * block_size_, .looked_up = options_.prefix_caching};
}

void KvCacheManager::Grow(SequenceBlocks& seq) {
  std::optional<std::vector<int32_t>> block = pool_.Allocate(1);
  assert(block.has_value());
  seq.blocks_.push_back((*block)[0]);
}

void KvCacheManager::Register(SequenceBlocks& seq, std::span<const int32_t> computed) {
  if (!options_.prefix_caching) return;
  const int full = static_cast<int>(computed.size()) / block_size_;
  if (seq.registered_ >= full) return;
  ExtendBlockHashes(seq.root_, computed, block_size_, seq.hashes_);
  for (; seq.registered_ < full; ++seq.registered_) {
    pool_.Register(seq.blocks_[seq.registered_], seq.hashes_[seq.registered_]);
  }
}

std::vector<SequenceBlocks> KvCacheManager::Fork(SequenceBlocks& parent, int computed,
                                                 std::vector<engine::BlockCopy>& copies) {
  const int full = computed / block_size_;           // blocks the samples share
  const bool partial = computed % block_size_ != 0;  // block `full` is partly filled
  std::vector<SequenceBlocks> samples;
  samples.reserve(parent.reserve_.size());
  for (const int32_t own : parent.reserve_) {
    SequenceBlocks& child = samples.emplace_back();
    child.root_ = parent.root_;
    child.blocks_.assign(parent.blocks_.begin(), parent.blocks_.begin() + full);
    pool_.Share(child.blocks_);
    child.blocks_.push_back(own);
    if (partial) copies.push_back({.from = parent.blocks_[full], .to = own});
    child.hashes_ = parent.hashes_;
    child.registered_ = std::min(parent.registered_, full);
  }
  parent.reserve_.clear();
  return samples;
}

bool KvCacheManager::Rollback(SequenceBlocks& seq, int computed, int k,
                              std::vector<engine::BlockCopy>& copies) {
  assert(k >= 0 && k <= computed);
  const int end = computed - k;
  const int full = end / block_size_;
  const int keep = BlocksForTokens(end, block_size_);
  const int held = static_cast<int>(seq.blocks_.size());
  // The block holding the new end is written again from `end` on: it must
  // be the sequence's alone, and named by no hash.
  if (keep > full && full < held) {
    const int32_t id = seq.blocks_[full];
    if (pool_.refs(id) > 1) {
      std::optional<std::vector<int32_t>> own = pool_.Allocate(1);
      if (!own.has_value()) return false;
      copies.push_back({.from = id, .to = (*own)[0]});
      pool_.Release(std::span<const int32_t>(&id, 1));
      seq.blocks_[full] = (*own)[0];
    } else if (pool_.registered(id)) {
      pool_.Unregister(id);
    }
  }
  if (keep < held) {
    pool_.Release(std::span<const int32_t>(seq.blocks_).subspan(keep));
    seq.blocks_.resize(keep);
  }
  if (static_cast<int>(seq.hashes_.size()) > full) seq.hashes_.resize(full);
  seq.registered_ = std::min(seq.registered_, full);
  return true;
}

int KvCacheManager::Releasable(const SequenceBlocks& seq) const {
  int released = static_cast<int>(seq.reserve_.size());
  for (const int32_t id : seq.blocks_) released += pool_.refs(id) == 1 ? 1 : 0;
  return released;
}

void KvCacheManager::Release(SequenceBlocks& seq) {
  pool_.Release(seq.reserve_);
  seq.reserve_.clear();
  pool_.Release(seq.blocks_);
  seq.blocks_.clear();
  seq.registered_ = 0;
}

std::vector<int32_t> KvCacheManager::TakeTable(SequenceBlocks& seq) {
  std::vector<int32_t> table = std::move(seq.blocks_);
  seq.blocks_.clear();
  seq.registered_ = 0;
  return table;
}

}  // namespace coalesce::batcher
