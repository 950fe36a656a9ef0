#include "block_allocator.h"

#include <algorithm>
#include <limits>
#include <string>

namespace kvflow {
namespace {

// The splitmix64 finalizer: a bijection on 64 bits with full avalanche.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

std::string block_name(int64_t id) { return "block " + std::to_string(id); }

}  // namespace

uint64_t BlockAllocator::chain_hash(uint64_t parent_hash, const int32_t* tokens, size_t num_tokens) {
  // The length goes into the seed, so an odd tail padded with zeros cannot alias a longer input.
  uint64_t h = mix64(parent_hash ^ (0x9e3779b97f4a7c15ULL * (num_tokens + 1)));
  size_t i = 0;
  for (; i + 1 < num_tokens; i += 2) {
    const uint64_t word = static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) |
                          (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = mix64(h ^ word);
  }
  if (i < num_tokens) h = mix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])));
  return h;
}

BlockAllocator::BlockAllocator(int64_t num_blocks, int64_t block_size, HashFn hash)
    : block_size_(block_size), hash_(hash) {
  if (num_blocks < 1 || num_blocks > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("BlockAllocator: num_blocks must be in [1, 2^31), got " +
                                std::to_string(num_blocks));
  }
  if (block_size < 1 || block_size > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("BlockAllocator: block_size must be in [1, 2^31), got " +
                                std::to_string(block_size));
  }
  if (hash_ == nullptr) throw std::invalid_argument("BlockAllocator: hash function is null");
  blocks_.resize(num_blocks);
  pending_.assign(num_blocks, 0);
  // A stack popped from the back: a fresh pool hands out 0, 1, 2, ...
  free_.reserve(num_blocks);
  for (int64_t id = num_blocks - 1; id >= 0; --id) free_.push_back(static_cast<int32_t>(id));
  index_.reserve(num_blocks);
}

int32_t BlockAllocator::checked(BlockId id, const char* op) const {
  if (id < 0 || id >= num_blocks()) {
    throw std::out_of_range(std::string(op) + ": unknown block id " + std::to_string(id) +
                            " (valid ids are 0.." + std::to_string(num_blocks() - 1) + ")");
  }
  return static_cast<int32_t>(id);
}

bool BlockAllocator::can_allocate(int64_t n) const { return n >= 0 && n <= num_free_blocks(); }

std::vector<BlockAllocator::BlockId> BlockAllocator::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument("allocate: the number of blocks must be >= 0, got " + std::to_string(n));
  if (n > num_blocks()) {
    throw std::invalid_argument("allocate: " + std::to_string(n) + " blocks exceed the pool's capacity of " +
                                std::to_string(num_blocks()) + " blocks");
  }
  if (n > num_free_blocks()) {
    throw OutOfBlocksError("allocate: out of blocks: " + std::to_string(n) + " requested, " +
                           std::to_string(num_free_blocks()) + " of " + std::to_string(num_blocks()) +
                           " allocatable");
  }
  std::vector<BlockId> ids;
  ids.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = take_unused_block();
    blocks_[id].ref_count = 1;
    ids.push_back(id);
  }
  num_used_ += n;
  return ids;
}

int32_t BlockAllocator::take_unused_block() {
  if (!free_.empty()) {
    const int32_t id = free_.back();
    free_.pop_back();
    return id;
  }
  const int32_t id = lru_head_;
  lru_unlink(id);
  --num_evictable_;
  uncache(id);
  return id;
}

void BlockAllocator::free(BlockId id) {
  const int32_t index = checked(id, "free");
  if (blocks_[index].ref_count == 0) {
    throw std::invalid_argument("free: double free of " + block_name(id) + " (it is not in use)");
  }
  release(index);
}

void BlockAllocator::free(const std::vector<BlockId>& ids) {
  for (BlockId id : ids) checked(id, "free");
  // Count each id's releases first, so a repeated id cannot drop below zero halfway through.
  const BlockId* bad = nullptr;
  for (const BlockId& id : ids) {
    if (++pending_[id] > blocks_[id].ref_count && bad == nullptr) bad = &id;
  }
  int32_t bad_count = bad ? pending_[*bad] : 0;
  for (BlockId id : ids) pending_[id] = 0;
  if (bad != nullptr) {
    const int32_t refs = blocks_[*bad].ref_count;
    if (refs == 0) throw std::invalid_argument("free: double free of " + block_name(*bad) + " (it is not in use)");
    throw std::invalid_argument("free: double free of " + block_name(*bad) + " (listed " +
                                std::to_string(bad_count) + " times, holds " + std::to_string(refs) +
                                (refs == 1 ? " reference)" : " references)"));
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) release(static_cast<int32_t>(*it));
}

void BlockAllocator::fork(const std::vector<BlockId>& ids) {
  for (BlockId id : ids) checked(id, "fork");
  for (BlockId id : ids) {
    if (blocks_[id].ref_count == 0) {
      throw std::invalid_argument("fork: " + block_name(id) + " is not in use");
    }
  }
  for (BlockId id : ids) ++blocks_[id].ref_count;
}

void BlockAllocator::acquire(int32_t id) {
  Block& block = blocks_[id];
  if (block.ref_count == 0) {  // only an evictable block can be reached here (through the index)
    lru_unlink(id);
    --num_evictable_;
    ++num_used_;
  }
  ++block.ref_count;
}

void BlockAllocator::release(int32_t id) {
  Block& block = blocks_[id];
  if (--block.ref_count > 0) return;
  --num_used_;
  if (block.cached) {
    lru_push_back(id);
    ++num_evictable_;
  } else {
    free_.push_back(id);
  }
}

uint64_t BlockAllocator::register_block(BlockId id, uint64_t parent_hash, const std::vector<int32_t>& token_ids) {
  const int32_t index = checked(id, "register_block");
  Block& block = blocks_[index];
  if (block.ref_count == 0) {
    throw std::invalid_argument("register_block: " + block_name(id) + " is not in use");
  }
  if (static_cast<int64_t>(token_ids.size()) != block_size_) {
    throw std::invalid_argument("register_block: a block holds block_size = " + std::to_string(block_size_) +
                                " tokens, got " + std::to_string(token_ids.size()) +
                                " (only full blocks can be cached)");
  }
  const uint64_t hash = hash_(parent_hash, token_ids.data(), token_ids.size());
  if (block.cached) {
    if (block.hash == hash && block.parent_hash == parent_hash && block.tokens == token_ids) return hash;
    throw std::invalid_argument("register_block: " + block_name(id) + " is already cached with other content");
  }
  // Same content in another block (or, vanishingly rarely, a hash collision): the first entry stays.
  if (index_.count(hash) != 0) return hash;
  index_.emplace(hash, index);
  block.cached = true;
  block.hash = hash;
  block.parent_hash = parent_hash;
  block.tokens.assign(token_ids.begin(), token_ids.end());
  return hash;
}

std::vector<BlockAllocator::BlockId> BlockAllocator::lookup(const std::vector<int32_t>& token_ids) {
  const size_t block_size = static_cast<size_t>(block_size_);
  const size_t num_full = token_ids.size() / block_size;
  std::vector<BlockId> hits;
  uint64_t parent_hash = kRootHash;
  for (size_t i = 0; i < num_full; ++i) {
    const int32_t* tokens = token_ids.data() + i * block_size;
    const uint64_t hash = hash_(parent_hash, tokens, block_size);
    const auto entry = index_.find(hash);
    if (entry == index_.end()) break;
    const Block& block = blocks_[entry->second];
    if (block.parent_hash != parent_hash || !std::equal(tokens, tokens + block_size, block.tokens.begin())) break;
    hits.push_back(entry->second);
    parent_hash = hash;
  }
  for (BlockId id : hits) acquire(static_cast<int32_t>(id));
  queries_ += static_cast<int64_t>(num_full);
  hits_ += static_cast<int64_t>(hits.size());
  return hits;
}

int64_t BlockAllocator::reset_prefix_cache() {
  const int64_t dropped = num_evictable_;
  for (int32_t id = lru_head_; id != kNone;) {
    const int32_t next = blocks_[id].lru_next;
    blocks_[id].lru_prev = blocks_[id].lru_next = kNone;
    uncache(id);
    free_.push_back(id);
    id = next;
  }
  lru_head_ = lru_tail_ = kNone;
  num_evictable_ = 0;
  return dropped;
}

void BlockAllocator::uncache(int32_t id) {
  Block& block = blocks_[id];
  index_.erase(block.hash);
  block.cached = false;
  block.tokens.clear();  // keeps the capacity for the next registration
}

void BlockAllocator::lru_push_back(int32_t id) {
  Block& block = blocks_[id];
  block.lru_prev = lru_tail_;
  block.lru_next = kNone;
  if (lru_tail_ == kNone) {
    lru_head_ = id;
  } else {
    blocks_[lru_tail_].lru_next = id;
  }
  lru_tail_ = id;
}

void BlockAllocator::lru_unlink(int32_t id) {
  Block& block = blocks_[id];
  if (block.lru_prev == kNone) {
    lru_head_ = block.lru_next;
  } else {
    blocks_[block.lru_prev].lru_next = block.lru_next;
  }
  if (block.lru_next == kNone) {
    lru_tail_ = block.lru_prev;
  } else {
    blocks_[block.lru_next].lru_prev = block.lru_prev;
  }
  block.lru_prev = block.lru_next = kNone;
}

int64_t BlockAllocator::ref_count(BlockId id) const { return blocks_[checked(id, "ref_count")].ref_count; }

bool BlockAllocator::is_cached(BlockId id) const { return blocks_[checked(id, "is_cached")].cached; }

BlockAllocator::Stats BlockAllocator::stats() const {
  return {num_free_blocks(), num_used_blocks(), num_cached_blocks(), hits_, queries_};
}

void BlockAllocator::check_invariants() const {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::logic_error("BlockAllocator invariant broken: " + what);
  };
  const int32_t n = static_cast<int32_t>(blocks_.size());
  // 0: not listed, 1: in free_, 2: in the evictable list
  std::vector<char> listed(blocks_.size(), 0);
  for (int32_t id : free_) {
    require(id >= 0 && id < n, "free list holds id " + std::to_string(id));
    require(listed[id] == 0, block_name(id) + " is in the free list twice");
    require(blocks_[id].ref_count == 0 && !blocks_[id].cached, block_name(id) + " is free but used or cached");
    listed[id] = 1;
  }
  int64_t evictable = 0;
  int32_t prev = kNone;
  for (int32_t id = lru_head_; id != kNone; id = blocks_[id].lru_next) {
    require(id >= 0 && id < n, "evictable list holds id " + std::to_string(id));
    require(listed[id] == 0, block_name(id) + " is listed twice");
    require(blocks_[id].ref_count == 0 && blocks_[id].cached, block_name(id) + " is evictable but used or uncached");
    require(blocks_[id].lru_prev == prev, "evictable list links of " + block_name(id));
    listed[id] = 2;
    prev = id;
    ++evictable;
  }
  require(lru_tail_ == prev, "evictable list tail");
  require(evictable == num_evictable_, "evictable count");
  int64_t used = 0, cached = 0;
  for (int32_t id = 0; id < n; ++id) {
    const Block& block = blocks_[id];
    require(block.ref_count >= 0, block_name(id) + " has a negative reference count");
    require((block.ref_count > 0) == (listed[id] == 0), block_name(id) + " is both used and unused, or neither");
    used += block.ref_count > 0;
    if (block.cached) {
      ++cached;
      const auto entry = index_.find(block.hash);
      require(entry != index_.end() && entry->second == id, block_name(id) + " is cached but not indexed");
      require(static_cast<int64_t>(block.tokens.size()) == block_size_, block_name(id) + " caches a partial block");
      require(hash_(block.parent_hash, block.tokens.data(), block.tokens.size()) == block.hash,
              block_name(id) + " is indexed under a stale hash");
    }
    require(pending_[id] == 0, "pending count of " + block_name(id));
  }
  require(used == num_used_, "used count");
  require(cached == static_cast<int64_t>(index_.size()), "index holds entries of uncached blocks");
  require(num_free_blocks() + num_used_ == n, "free + used != num_blocks");
}

}  // namespace kvflow
