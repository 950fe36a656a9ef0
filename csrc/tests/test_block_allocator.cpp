// Unit tests of kvflow::BlockAllocator: reference counting, errors that leave the pool untouched,
// the prefix cache (register, lookup, LRU eviction, revival) and its safety under hash collisions.
#include <cstdint>
#include <numeric>
#include <set>
#include <stdexcept>
#include <vector>

#include "block_allocator.h"
#include "check.h"

namespace {

using kvflow::BlockAllocator;
using kvflow::OutOfBlocksError;
using Ids = std::vector<BlockAllocator::BlockId>;
using Tokens = std::vector<int32_t>;

constexpr uint64_t kRoot = BlockAllocator::kRootHash;

// Every hash collides with every other: lookups can only be right by comparing the stored content.
uint64_t constant_hash(uint64_t, const int32_t*, size_t) { return 42; }

// Tokens [first, first + n).
Tokens iota_tokens(int32_t first, size_t n) {
  Tokens tokens(n);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

Tokens concat(const Tokens& a, const Tokens& b) {
  Tokens out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

struct Snapshot {
  int64_t free, used, cached, hits, queries;
  std::vector<int64_t> refs;
  std::vector<bool> cached_ids;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const BlockAllocator& a) {
  const auto s = a.stats();
  Snapshot snap{s.free, s.used, s.cached, s.hits, s.queries, {}, {}};
  for (int64_t id = 0; id < a.num_blocks(); ++id) {
    snap.refs.push_back(a.ref_count(id));
    snap.cached_ids.push_back(a.is_cached(id));
  }
  return snap;
}

}  // namespace

KVFLOW_TEST(block_allocator_allocate_free_refcounts) {
  BlockAllocator a(4, 16);
  KVFLOW_CHECK(a.num_blocks() == 4 && a.block_size() == 16);
  KVFLOW_CHECK(a.num_free_blocks() == 4 && a.num_used_blocks() == 0);
  const Ids ids = a.allocate(3);
  KVFLOW_CHECK((ids == Ids{0, 1, 2}));
  KVFLOW_CHECK(a.num_free_blocks() == 1 && a.num_used_blocks() == 3);
  for (auto id : ids) KVFLOW_CHECK(a.ref_count(id) == 1);
  KVFLOW_CHECK(a.ref_count(3) == 0);
  a.free(ids[1]);
  KVFLOW_CHECK(a.ref_count(1) == 0 && a.num_free_blocks() == 2 && a.num_used_blocks() == 2);
  KVFLOW_CHECK(a.allocate(0).empty());
  const Ids more = a.allocate(2);
  KVFLOW_CHECK((std::set<int64_t>(more.begin(), more.end()) == std::set<int64_t>{1, 3}));
  KVFLOW_CHECK(a.num_free_blocks() == 0 && !a.can_allocate(1) && a.can_allocate(0));
  a.free(Ids{0, 1, 2, 3});
  KVFLOW_CHECK(a.num_free_blocks() == 4 && a.num_used_blocks() == 0);
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_fork_shares_blocks) {
  BlockAllocator a(4, 2);
  const Ids ids = a.allocate(2);
  a.fork(ids);
  a.fork(Ids{ids[0]});
  KVFLOW_CHECK(a.ref_count(ids[0]) == 3 && a.ref_count(ids[1]) == 2);
  KVFLOW_CHECK(a.num_used_blocks() == 2);
  a.free(ids);
  KVFLOW_CHECK(a.ref_count(ids[0]) == 2 && a.ref_count(ids[1]) == 1 && a.num_used_blocks() == 2);
  a.free(Ids{ids[0], ids[0], ids[1]});  // a repeated id drops one reference per mention
  KVFLOW_CHECK(a.ref_count(ids[0]) == 0 && a.num_used_blocks() == 0 && a.num_free_blocks() == 4);
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_bad_use_leaves_state_untouched) {
  BlockAllocator a(4, 2);
  const Ids ids = a.allocate(2);
  a.register_block(ids[0], kRoot, {1, 2});
  a.free(ids[0]);  // cached and evictable now
  const Snapshot before = snapshot(a);

  KVFLOW_CHECK_THROWS(a.free(ids[0]), std::invalid_argument);             // double free
  KVFLOW_CHECK_THROWS(a.free(Ids{ids[1], ids[1]}), std::invalid_argument);  // one ref, two frees
  KVFLOW_CHECK_THROWS(a.free(Ids{ids[1], 3}), std::invalid_argument);     // 3 was never allocated
  KVFLOW_CHECK_THROWS(a.free(4), std::out_of_range);
  KVFLOW_CHECK_THROWS(a.free(Ids{ids[1], -1}), std::out_of_range);
  KVFLOW_CHECK_THROWS(a.fork(Ids{ids[1], 2}), std::invalid_argument);
  KVFLOW_CHECK_THROWS(a.fork(Ids{ids[1], 7}), std::out_of_range);
  KVFLOW_CHECK_THROWS(a.ref_count(4), std::out_of_range);
  KVFLOW_CHECK_THROWS(a.is_cached(-1), std::out_of_range);
  KVFLOW_CHECK_THROWS(a.register_block(2, kRoot, {1, 2}), std::invalid_argument);  // not in use
  KVFLOW_CHECK_THROWS(a.register_block(ids[1], kRoot, {1}), std::invalid_argument);
  KVFLOW_CHECK_THROWS(a.register_block(ids[1], kRoot, {1, 2, 3}), std::invalid_argument);
  KVFLOW_CHECK_THROWS(a.register_block(9, kRoot, {1, 2}), std::out_of_range);
  KVFLOW_CHECK_THROWS(a.allocate(-1), std::invalid_argument);
  KVFLOW_CHECK_THROWS(a.allocate(5), std::invalid_argument);  // more than the whole pool
  KVFLOW_CHECK_THROWS(a.allocate(4), OutOfBlocksError);       // only 3 allocatable now
  KVFLOW_CHECK(!a.can_allocate(4) && a.can_allocate(3) && !a.can_allocate(-1));

  KVFLOW_CHECK(snapshot(a) == before);
  KVFLOW_CHECK(a.is_cached(ids[0]));  // the failed allocation evicted nothing
  a.check_invariants();
  KVFLOW_CHECK_THROWS(BlockAllocator(0, 16), std::invalid_argument);
  KVFLOW_CHECK_THROWS(BlockAllocator(4, 0), std::invalid_argument);
}

KVFLOW_TEST(block_allocator_out_of_blocks_is_a_runtime_error) {
  BlockAllocator a(2, 1);
  a.allocate(2);
  bool caught = false;
  try {
    a.allocate(1);
  } catch (const std::runtime_error& e) {  // what pybind11 maps to RuntimeError, absent a translator
    caught = std::string(e.what()).find("out of blocks") != std::string::npos;
  }
  KVFLOW_CHECK(caught);
}

KVFLOW_TEST(block_allocator_register_and_lookup) {
  BlockAllocator a(8, 4);
  const Tokens prompt = iota_tokens(100, 10);  // two full blocks and a partial one
  const Ids ids = a.allocate(3);
  const uint64_t h0 = a.register_block(ids[0], kRoot, Tokens(prompt.begin(), prompt.begin() + 4));
  const uint64_t h1 = a.register_block(ids[1], h0, Tokens(prompt.begin() + 4, prompt.begin() + 8));
  KVFLOW_CHECK(h0 == BlockAllocator::chain_hash(kRoot, prompt.data(), 4));
  KVFLOW_CHECK(h1 == BlockAllocator::chain_hash(h0, prompt.data() + 4, 4));
  KVFLOW_CHECK(h0 != h1 && h0 != kRoot);
  KVFLOW_CHECK(a.is_cached(ids[0]) && a.is_cached(ids[1]) && !a.is_cached(ids[2]));
  KVFLOW_CHECK(a.num_cached_blocks() == 2);
  // Registering the same content again is a no-op that returns the same hash.
  KVFLOW_CHECK(a.register_block(ids[1], h0, Tokens(prompt.begin() + 4, prompt.begin() + 8)) == h1);
  KVFLOW_CHECK_THROWS(a.register_block(ids[1], h0, iota_tokens(0, 4)), std::invalid_argument);

  const Ids hits = a.lookup(prompt);
  KVFLOW_CHECK((hits == Ids{ids[0], ids[1]}));
  KVFLOW_CHECK(a.ref_count(ids[0]) == 2 && a.ref_count(ids[1]) == 2);
  KVFLOW_CHECK(a.stats().queries == 2 && a.stats().hits == 2);
  a.free(hits);
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_partial_prefix_hit) {
  BlockAllocator a(8, 2);
  const Ids ids = a.allocate(3);
  uint64_t h = kRoot;
  for (int i = 0; i < 3; ++i) h = a.register_block(ids[i], h, iota_tokens(2 * i, 2));  // tokens 0..5
  a.free(ids);

  // Second block differs: only the first is a hit, and the chain stops there.
  Ids hits = a.lookup({0, 1, 9, 9, 4, 5});
  KVFLOW_CHECK((hits == Ids{ids[0]}));
  KVFLOW_CHECK(a.stats().queries == 3 && a.stats().hits == 1);
  a.free(hits);
  // Same third block but a different first one: the chain hash differs, so nothing hits.
  hits = a.lookup({7, 7, 2, 3, 4, 5});
  KVFLOW_CHECK(hits.empty());
  // A prefix of the registered chain; the trailing partial block is not queried.
  hits = a.lookup({0, 1, 2, 3, 4});
  KVFLOW_CHECK((hits == Ids{ids[0], ids[1]}));
  KVFLOW_CHECK(a.stats().queries == 3 + 3 + 2 && a.stats().hits == 1 + 0 + 2);
  KVFLOW_CHECK(a.lookup({0}).empty());  // no full block
  a.free(hits);
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_duplicate_content_keeps_first_entry) {
  BlockAllocator a(4, 2);
  const Ids ids = a.allocate(2);
  const uint64_t first = a.register_block(ids[0], kRoot, {5, 6});
  const uint64_t second = a.register_block(ids[1], kRoot, {5, 6});
  KVFLOW_CHECK(first == second);
  KVFLOW_CHECK(a.is_cached(ids[0]) && !a.is_cached(ids[1]) && a.num_cached_blocks() == 1);
  a.free(ids[1]);  // uncached, so truly free
  KVFLOW_CHECK(a.num_free_blocks() == 3 && a.num_cached_blocks() == 1);
  const Ids hits = a.lookup({5, 6});
  KVFLOW_CHECK((hits == Ids{ids[0]}));
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_evicts_least_recently_freed_first) {
  BlockAllocator a(4, 1);
  const Ids ids = a.allocate(4);
  for (int32_t i = 0; i < 4; ++i) a.register_block(ids[i], kRoot, {i});
  // Released one at a time in the order 2, 0, 3, 1: that is the eviction order.
  for (int64_t id : {2, 0, 3, 1}) a.free(id);
  KVFLOW_CHECK(a.num_free_blocks() == 4 && a.num_cached_blocks() == 4 && a.num_evictable_blocks() == 4);
  KVFLOW_CHECK((a.allocate(1) == Ids{2}));
  KVFLOW_CHECK(!a.is_cached(2) && a.num_cached_blocks() == 3);
  KVFLOW_CHECK(a.lookup({2}).empty());  // its entry went with it
  KVFLOW_CHECK((a.allocate(2) == Ids{0, 3}));
  KVFLOW_CHECK(a.is_cached(1) && !a.is_cached(0) && !a.is_cached(3));
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_prefers_free_blocks_and_evicts_chain_tails_first) {
  BlockAllocator a(5, 1);
  const Ids seq = a.allocate(3);
  uint64_t h = kRoot;
  for (int32_t i = 0; i < 3; ++i) h = a.register_block(seq[i], h, {10 + i});
  a.free(seq);  // a block table: released last to first, so the tail is evicted first
  KVFLOW_CHECK(a.num_free_blocks() == 5);
  const Ids fresh = a.allocate(2);  // the two uncached blocks go first
  KVFLOW_CHECK((std::set<int64_t>(fresh.begin(), fresh.end()) == std::set<int64_t>{3, 4}));
  KVFLOW_CHECK(a.num_cached_blocks() == 3);
  KVFLOW_CHECK((a.allocate(1) == Ids{seq[2]}));
  Ids hits = a.lookup({10, 11, 12});
  KVFLOW_CHECK((hits == Ids{seq[0], seq[1]}));  // the prefix survived
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_lookup_revives_cached_block) {
  BlockAllocator a(3, 2);
  const Ids ids = a.allocate(2);
  const uint64_t h = a.register_block(ids[0], kRoot, {1, 2});
  a.register_block(ids[1], h, {3, 4});
  a.free(ids);
  KVFLOW_CHECK(a.num_used_blocks() == 0 && a.num_free_blocks() == 3);
  const Ids hits = a.lookup({1, 2, 3, 4, 5});
  KVFLOW_CHECK((hits == Ids{ids[0], ids[1]}));
  KVFLOW_CHECK(a.ref_count(ids[0]) == 1 && a.ref_count(ids[1]) == 1);
  KVFLOW_CHECK(a.num_used_blocks() == 2 && a.num_free_blocks() == 1);
  // Revived blocks are no longer evictable: the pool now has a single allocatable block.
  KVFLOW_CHECK_THROWS(a.allocate(2), OutOfBlocksError);
  KVFLOW_CHECK((a.allocate(1) == Ids{2}));
  // A lookup of a block that is in use just adds a holder.
  KVFLOW_CHECK((a.lookup({1, 2}) == Ids{ids[0]}) && a.ref_count(ids[0]) == 2);
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_reset_prefix_cache) {
  BlockAllocator a(4, 1);
  const Ids ids = a.allocate(3);
  for (int32_t i = 0; i < 3; ++i) a.register_block(ids[i], kRoot, {i});
  a.free(Ids{ids[0], ids[1]});
  KVFLOW_CHECK(a.reset_prefix_cache() == 2);
  KVFLOW_CHECK(!a.is_cached(ids[0]) && !a.is_cached(ids[1]) && a.is_cached(ids[2]));
  KVFLOW_CHECK(a.num_cached_blocks() == 1 && a.num_free_blocks() == 3 && a.num_evictable_blocks() == 0);
  KVFLOW_CHECK(a.lookup({0}).empty() && (a.lookup({2}) == Ids{ids[2]}));
  a.check_invariants();
}

KVFLOW_TEST(block_allocator_collisions_never_return_other_tokens) {
  BlockAllocator a(4, 2, &constant_hash);
  const Ids ids = a.allocate(3);
  KVFLOW_CHECK(a.register_block(ids[0], kRoot, {1, 2}) == 42);
  KVFLOW_CHECK(a.register_block(ids[1], kRoot, {3, 4}) == 42);  // collides: stays uncached
  KVFLOW_CHECK(a.is_cached(ids[0]) && !a.is_cached(ids[1]));
  KVFLOW_CHECK(a.lookup({3, 4}).empty());
  KVFLOW_CHECK(a.lookup({1, 3}).empty());
  KVFLOW_CHECK((a.lookup({1, 2}) == Ids{ids[0]}));
  // Same key and tokens, wrong parent hash: also a miss.
  BlockAllocator b(4, 2, &constant_hash);
  const Ids other = b.allocate(1);
  b.register_block(other[0], 7, {1, 2});
  KVFLOW_CHECK(b.lookup({1, 2}).empty());
  a.check_invariants();
  b.check_invariants();
}

KVFLOW_TEST(block_allocator_chain_hash_mixes_every_input) {
  const Tokens tokens = iota_tokens(0, 16);
  const uint64_t base = BlockAllocator::chain_hash(kRoot, tokens.data(), tokens.size());
  std::set<uint64_t> seen{base};
  for (size_t i = 0; i < tokens.size(); ++i) {
    Tokens changed = tokens;
    changed[i] ^= 1;
    seen.insert(BlockAllocator::chain_hash(kRoot, changed.data(), changed.size()));
  }
  seen.insert(BlockAllocator::chain_hash(1, tokens.data(), tokens.size()));
  seen.insert(BlockAllocator::chain_hash(kRoot, tokens.data(), tokens.size() - 1));
  // 15 tokens leave an odd tail that a trailing zero token would fill in the same 64-bit word.
  const Tokens padded = concat(iota_tokens(0, 15), {0});
  seen.insert(BlockAllocator::chain_hash(kRoot, padded.data(), padded.size()));
  KVFLOW_CHECK(seen.size() == tokens.size() + 4);
  KVFLOW_CHECK(BlockAllocator::chain_hash(kRoot, tokens.data(), tokens.size()) == base);  // deterministic
}

KVFLOW_TEST(block_allocator_stats) {
  BlockAllocator a(6, 2);
  const Ids ids = a.allocate(3);
  const uint64_t h = a.register_block(ids[0], kRoot, {1, 1});
  a.register_block(ids[1], h, {2, 2});
  a.free(ids[1]);
  auto s = a.stats();
  KVFLOW_CHECK(s.free == 4 && s.used == 2 && s.cached == 2 && s.hits == 0 && s.queries == 0);
  a.free(a.lookup({1, 1, 2, 2, 3, 3, 4}));  // three full blocks queried, two hit
  s = a.stats();
  KVFLOW_CHECK(s.free == 4 && s.used == 2 && s.cached == 2 && s.hits == 2 && s.queries == 3);
  KVFLOW_CHECK(s.free + s.used == a.num_blocks());
  a.check_invariants();
}
