#include "batcher/block_pool.h"

#include <openssl/sha.h>

#include <cassert>
#include <cstring>
#include <string>

namespace coalesce::batcher {
namespace {

void AppendU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void AppendString(std::string& out, std::string_view s) {
  AppendU32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

BlockHash Sha256(std::string_view bytes) {
  BlockHash out;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), out.data());
  return out;
}

}  // namespace

BlockHash PrefixRoot(std::string_view model, std::string_view partition, std::string_view salt) {
  std::string bytes;
  AppendString(bytes, "coalesce prefix cache v1");
  AppendString(bytes, model);
  AppendString(bytes, partition);
  AppendString(bytes, salt);
  return Sha256(bytes);
}

void ExtendBlockHashes(const BlockHash& root, std::span<const int32_t> tokens, int block_size,
                       std::vector<BlockHash>& hashes) {
  const size_t full = tokens.size() / block_size;
  std::string bytes;
  while (hashes.size() < full) {
    const size_t i = hashes.size();
    const BlockHash& parent = i == 0 ? root : hashes[i - 1];
    bytes.assign(reinterpret_cast<const char*>(parent.data()), parent.size());
    for (int j = 0; j < block_size; ++j) {
      AppendU32(bytes, static_cast<uint32_t>(tokens[i * block_size + j]));
    }
    hashes.push_back(Sha256(bytes));
  }
}

size_t BlockPool::HashOfHash::operator()(const BlockHash& h) const {
  // The digest is uniformly distributed already.
  size_t v;
  std::memcpy(&v, h.data(), sizeof(v));
  return v;
}

BlockPool::BlockPool(int num_blocks)
    : refs_(num_blocks, 0), hash_of_(num_blocks), prev_(num_blocks, -1), next_(num_blocks, -1) {
  free_.reserve(num_blocks);
  // Highest id at the bottom of the stack, so block 0 is handed out first.
  for (int32_t id = num_blocks - 1; id >= 0; --id) free_.push_back(id);
}

int BlockPool::Match(std::span<const BlockHash> hashes, int* in_use) const {
  int n = 0, held = 0;
  for (const BlockHash& h : hashes) {
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    if (refs_[it->second] > 0) ++held;
    ++n;
  }
  if (in_use != nullptr) *in_use = held;
  return n;
}

std::vector<int32_t> BlockPool::Take(std::span<const BlockHash> hashes, int n) {
  std::vector<int32_t> ids;
  ids.reserve(n);
  for (int i = 0; i < n; ++i) {
    const int32_t id = by_hash_.at(hashes[i]);
    if (refs_[id]++ == 0) LruRemove(id);
    ids.push_back(id);
  }
  return ids;
}

std::optional<std::vector<int32_t>> BlockPool::Allocate(int n) {
  if (n > num_available()) return std::nullopt;
  std::vector<int32_t> ids;
  ids.reserve(n);
  while (static_cast<int>(ids.size()) < n && !free_.empty()) {
    ids.push_back(free_.back());
    free_.pop_back();
  }
  while (static_cast<int>(ids.size()) < n) {
    const int32_t id = lru_head_;
    LruRemove(id);
    Unregister(id);
    ++evictions_;
    ids.push_back(id);
  }
  for (int32_t id : ids) {
    assert(refs_[id] == 0);
    refs_[id] = 1;
  }
  return ids;
}

bool BlockPool::Register(int32_t id, const BlockHash& hash) {
  assert(refs_[id] > 0);
  if (hash_of_[id].has_value()) return false;
  if (!by_hash_.emplace(hash, id).second) return false;
  hash_of_[id] = hash;
  return true;
}

void BlockPool::Share(std::span<const int32_t> blocks) {
  for (const int32_t id : blocks) {
    assert(id >= 0 && id < num_total() && refs_[id] > 0);
    ++refs_[id];
  }
}

void BlockPool::Release(std::span<const int32_t> blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t id = *it;
    assert(id >= 0 && id < num_total() && refs_[id] > 0);
    if (--refs_[id] > 0) continue;
    if (hash_of_[id].has_value()) {
      LruPushBack(id);
    } else {
      free_.push_back(id);
    }
  }
}

void BlockPool::ForgetAll() {
  while (lru_head_ >= 0) {
    const int32_t id = lru_head_;
    LruRemove(id);
    free_.push_back(id);
  }
  for (auto& h : hash_of_) h.reset();
  by_hash_.clear();
}

std::vector<int32_t> BlockPool::AvailableIds() const {
  std::vector<int32_t> ids(free_.rbegin(), free_.rend());
  for (int32_t id = lru_head_; id >= 0; id = next_[id]) ids.push_back(id);
  return ids;
}

std::vector<int32_t> BlockPool::CachedIds() const {
  std::vector<int32_t> ids;
  for (int32_t id = lru_head_; id >= 0; id = next_[id]) ids.push_back(id);
  return ids;
}

void BlockPool::LruPushBack(int32_t id) {
  prev_[id] = lru_tail_;
  next_[id] = -1;
  if (lru_tail_ >= 0) {
    next_[lru_tail_] = id;
  } else {
    lru_head_ = id;
  }
  lru_tail_ = id;
  ++num_lru_;
}

void BlockPool::LruRemove(int32_t id) {
  if (prev_[id] >= 0) {
    next_[prev_[id]] = next_[id];
  } else {
    lru_head_ = next_[id];
  }
  if (next_[id] >= 0) {
    prev_[next_[id]] = prev_[id];
  } else {
    lru_tail_ = prev_[id];
  }
  prev_[id] = next_[id] = -1;
  --num_lru_;
}

void BlockPool::Unregister(int32_t id) {
  by_hash_.erase(*hash_of_[id]);
  hash_of_[id].reset();
}

}  // namespace coalesce::batcher
