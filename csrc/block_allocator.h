// The KV cache block pool: block ids with reference counts, and a prefix cache over full blocks.
// Torch-free; the KV tensors live elsewhere, this class only decides which block ids hold what.
//
// Blocks 0..num_blocks-1 each hold block_size tokens. A block is in exactly one of three states:
//   used       ref_count > 0: held by one or more sequences (fork() and lookup() add holders);
//   evictable  ref_count == 0 and cached: still findable by lookup(), handed out by allocate()
//              only once no free block is left, least recently released first;
//   free       ref_count == 0 and not cached.
// num_free_blocks() counts free + evictable (what allocate() can hand out), so
// num_free_blocks() + num_used_blocks() == num_blocks() always.
//
// Prefix cache: a full block is registered under hash = chain_hash(parent_hash, its tokens), where
// parent_hash is the hash of the previous block of the sequence (kRootHash for the first block).
// lookup() recomputes the chain over a prompt's full blocks and returns the longest cached prefix.
// Each entry keeps its parent hash and tokens, and lookup() compares both, so a 64-bit hash
// collision can cost a hit but never return a block holding other tokens.
//
// Errors throw before anything changes, so the allocator is untouched by a failed call:
//   std::out_of_range      a block id outside [0, num_blocks)
//   std::invalid_argument  double free; fork or register of a block not in use; a token count other
//                          than block_size; re-registering a cached block with other content;
//                          allocate(n) with n < 0 or n > num_blocks (it could never succeed)
//   OutOfBlocksError       allocate(n) with n <= num_blocks but fewer than n blocks allocatable now
// Not thread-safe: one scheduler owns it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace kvflow {

// The pool cannot serve an allocation right now; freeing or preempting sequences can fix it.
class OutOfBlocksError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class BlockAllocator {
 public:
  using BlockId = int64_t;
  // Hash of a block given its parent's hash and its tokens [num_tokens]. Replaceable for tests.
  using HashFn = uint64_t (*)(uint64_t parent_hash, const int32_t* tokens, size_t num_tokens);

  // The parent hash of a sequence's first block.
  static constexpr uint64_t kRootHash = 0;

  // splitmix64-style chain over the parent hash and the tokens, two tokens per 64-bit step.
  static uint64_t chain_hash(uint64_t parent_hash, const int32_t* tokens, size_t num_tokens);

  BlockAllocator(int64_t num_blocks, int64_t block_size, HashFn hash = &chain_hash);

  // n distinct block ids, each with ref_count 1; free blocks first, then evictable ones in LRU
  // order (their cache entries are dropped). All or nothing.
  std::vector<BlockId> allocate(int64_t n);
  bool can_allocate(int64_t n) const;

  // Drops one reference per listed id (an id may repeat up to its ref_count). Released ids are
  // handled last to first, so the tail of a sequence's block table becomes the least recently
  // used and is evicted before the prefix it extends.
  void free(BlockId id);
  void free(const std::vector<BlockId>& ids);

  // Adds one reference per listed id (to share blocks between sequences); each must be in use.
  void fork(const std::vector<BlockId>& ids);

  // Caches the used block id as holding token_ids [block_size] after the prefix whose last block
  // hash is parent_hash. Returns the block's hash, the parent_hash of the next block. If the same
  // content is already cached in another block, that entry stays and id stays uncached.
  uint64_t register_block(BlockId id, uint64_t parent_hash, const std::vector<int32_t>& token_ids);

  // The blocks caching the longest prefix of the full blocks of token_ids [num_tokens], each with
  // one more reference (evictable ones come back into use). Counts every full block of token_ids
  // as a query and every returned block as a hit.
  std::vector<BlockId> lookup(const std::vector<int32_t>& token_ids);

  // Drops the cache entries of all evictable blocks (they become free); used blocks keep theirs.
  // Returns the number of entries dropped.
  int64_t reset_prefix_cache();

  int64_t ref_count(BlockId id) const;
  bool is_cached(BlockId id) const;

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_.size()) + num_evictable_; }
  int64_t num_used_blocks() const { return num_used_; }
  int64_t num_cached_blocks() const { return static_cast<int64_t>(index_.size()); }
  int64_t num_evictable_blocks() const { return num_evictable_; }

  struct Stats {
    int64_t free;     // allocatable blocks: free + evictable
    int64_t used;     // blocks with ref_count > 0
    int64_t cached;   // blocks with a cache entry, used or evictable
    int64_t hits;     // blocks returned by lookup(), since construction
    int64_t queries;  // full blocks passed to lookup(), since construction
  };
  Stats stats() const;

  // Walks every structure (O(num_blocks)) and throws std::logic_error on any inconsistency.
  void check_invariants() const;

 private:
  static constexpr int32_t kNone = -1;

  struct Block {
    int32_t ref_count = 0;
    bool cached = false;
    int32_t lru_prev = kNone;  // neighbours in the evictable list, while evictable
    int32_t lru_next = kNone;
    uint64_t hash = 0;            // while cached
    uint64_t parent_hash = 0;     // while cached
    std::vector<int32_t> tokens;  // [block_size] while cached
  };

  // Range-checks the id (std::out_of_range naming op) and returns it as an index.
  int32_t checked(BlockId id, const char* op) const;
  void acquire(int32_t id);  // +1 reference; revives an evictable block
  void release(int32_t id);  // -1 reference; at 0 the block becomes evictable or free
  int32_t take_unused_block();
  void uncache(int32_t id);
  void lru_push_back(int32_t id);
  void lru_unlink(int32_t id);

  struct IdentityHash {
    size_t operator()(uint64_t h) const noexcept { return static_cast<size_t>(h); }
  };

  int64_t block_size_;
  HashFn hash_;
  std::vector<Block> blocks_;                                     // [num_blocks]
  std::vector<int32_t> free_;                                     // free block ids, a stack
  std::unordered_map<uint64_t, int32_t, IdentityHash> index_;     // hash -> cached block
  int32_t lru_head_ = kNone;                                      // least recently released
  int32_t lru_tail_ = kNone;
  int64_t num_evictable_ = 0;
  int64_t num_used_ = 0;
  int64_t hits_ = 0;
  int64_t queries_ = 0;
  std::vector<int32_t> pending_;  // [num_blocks] per-id counts while free() validates
};

}  // namespace kvflow
