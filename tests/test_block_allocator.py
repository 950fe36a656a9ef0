"""kvflow._C.BlockAllocator: explicit behaviour and errors, then random operation sequences checked
against a plain-Python model of the pool (hypothesis state machine)."""

import re

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvflow

BlockAllocator = kvflow._C.BlockAllocator
OutOfBlocksError = kvflow._C.OutOfBlocksError
ROOT = BlockAllocator.ROOT_HASH


def snapshot(pool):
    """Everything a user can observe about the pool."""
    return (
        pool.stats(),
        pool.num_evictable_blocks,
        [pool.ref_count(i) for i in range(pool.num_blocks)],
        [pool.is_cached(i) for i in range(pool.num_blocks)],
    )


def register_chain(pool, block_ids, tokens):
    """Registers block_ids as the consecutive full blocks of tokens; returns the hashes."""
    hashes, parent = [], ROOT
    for i, block_id in enumerate(block_ids):
        parent = pool.register_block(block_id, parent, tokens[i * pool.block_size : (i + 1) * pool.block_size])
        hashes.append(parent)
    return hashes


# ---------------------------------------------------------------------------------------------
# Explicit behaviour


def test_allocate_free_fork_refcounts():
    pool = BlockAllocator(num_blocks=4, block_size=16)
    assert (pool.num_blocks, pool.block_size) == (4, 16)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2] and all(isinstance(i, int) for i in ids)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    pool.fork(ids[:2])
    assert [pool.ref_count(i) for i in range(4)] == [2, 2, 1, 0]
    pool.free(ids)  # a list
    pool.free(0)  # an int
    assert [pool.ref_count(i) for i in range(4)] == [0, 1, 0, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (3, 1)
    assert pool.allocate(0) == []
    assert pool.can_allocate(3) and not pool.can_allocate(4) and not pool.can_allocate(-1)
    pool.free((1,))  # any sequence
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_register_and_lookup_longest_prefix():
    pool = BlockAllocator(8, 4)
    prompt = list(range(100, 111))  # two full blocks and a partial one
    ids = pool.allocate(3)
    h0, h1 = register_chain(pool, ids[:2], prompt)
    assert ROOT == 0
    assert h0 == BlockAllocator.hash_block(ROOT, prompt[:4]) and h1 == BlockAllocator.hash_block(h0, prompt[4:8])
    assert len({ROOT, h0, h1}) == 3 and 0 <= h1 < 2**64
    assert pool.is_cached(ids[0]) and pool.is_cached(ids[1]) and not pool.is_cached(ids[2])
    assert pool.register_block(ids[1], h0, prompt[4:8]) == h1  # re-registering the same content: no-op

    assert pool.lookup(prompt) == ids[:2]
    assert [pool.ref_count(i) for i in ids] == [2, 2, 1]
    assert pool.lookup(prompt[:4] + [0, 0, 0, 0]) == ids[:1]  # partial hit: stops at the first miss
    assert pool.lookup([0, 0, 0, 0] + prompt[4:8]) == []  # same block, other prefix: no hit
    assert pool.lookup(prompt[:7]) == ids[:1]  # a trailing partial block is never a hit
    assert pool.stats()["hits"] == 2 + 1 + 0 + 1
    assert pool.stats()["queries"] == 2 + 2 + 2 + 1  # units: full blocks
    pool.check_invariants()


def test_freed_cached_blocks_stay_findable_until_the_pool_needs_them():
    pool = BlockAllocator(3, 2)
    ids = pool.allocate(2)
    register_chain(pool, ids, [1, 2, 3, 4])
    pool.free(ids)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2 and pool.num_evictable_blocks == 2
    assert pool.lookup([1, 2, 3, 4, 5]) == ids  # revived
    assert [pool.ref_count(i) for i in ids] == [1, 1] and pool.num_free_blocks == 1
    with pytest.raises(OutOfBlocksError):  # revived blocks are no longer evictable
        pool.allocate(2)
    pool.free(ids)
    assert pool.allocate(1) == [2]  # a free block goes before any cached one
    assert pool.num_cached_blocks == 2
    pool.check_invariants()


def test_eviction_order_is_least_recently_released_first():
    pool = BlockAllocator(4, 1)
    ids = pool.allocate(4)
    for token, block_id in enumerate(ids):
        pool.register_block(block_id, ROOT, [token])
    for block_id in (2, 0, 3, 1):
        pool.free(block_id)
    assert pool.allocate(1) == [2]
    assert not pool.is_cached(2) and pool.lookup([2]) == []
    assert pool.allocate(2) == [0, 3]
    assert pool.is_cached(1) and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_freeing_a_block_table_evicts_its_tail_first():
    pool = BlockAllocator(3, 1)
    table = pool.allocate(3)
    register_chain(pool, table, [7, 8, 9])
    pool.free(table)
    assert pool.allocate(1) == [table[2]]
    assert pool.lookup([7, 8, 9]) == table[:2]  # the prefix survives
    pool.check_invariants()


def test_duplicate_content_keeps_the_first_entry():
    pool = BlockAllocator(4, 2)
    a, b = pool.allocate(2)
    assert pool.register_block(a, ROOT, [5, 6]) == pool.register_block(b, ROOT, [5, 6])
    assert pool.is_cached(a) and not pool.is_cached(b) and pool.num_cached_blocks == 1
    pool.free(b)
    assert pool.num_evictable_blocks == 0  # b was never cached: it is plainly free
    assert pool.lookup([5, 6]) == [a]
    pool.check_invariants()


def test_reset_prefix_cache_drops_only_unused_entries():
    pool = BlockAllocator(4, 1)
    ids = pool.allocate(3)
    for token, block_id in enumerate(ids):
        pool.register_block(block_id, ROOT, [token])
    pool.free(ids[:2])
    assert pool.reset_prefix_cache() == 2
    assert [pool.is_cached(i) for i in ids] == [False, False, True]
    assert pool.lookup([0]) == [] and pool.lookup([2]) == [ids[2]]
    assert pool.stats() == {"free": 3, "used": 1, "cached": 1, "hits": 1, "queries": 2}
    pool.check_invariants()


def test_scheduler_flow_with_parallel_sampling_and_prefix_reuse():
    """What a scheduler does: admit, fork for n=2, register full blocks, finish, re-admit."""
    pool = BlockAllocator(16, 4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    # Admission: the hit is capped at len(prompt) - 1 tokens by looking up prompt[:-1].
    assert pool.lookup(prompt[:-1]) == []
    table = pool.allocate(3)
    hashes = register_chain(pool, table[:2], prompt)
    # n=2: the second sample shares the two full prompt blocks, and copies the partial one.
    pool.fork(table[:2])
    sibling = table[:2] + pool.allocate(1)
    assert [pool.ref_count(i) for i in table] == [2, 2, 1]
    # Both samples finish.
    pool.free(table)
    pool.free(sibling)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 2
    # Same prompt again: both full blocks hit.
    hits = pool.lookup(prompt[:-1])
    assert hits == table[:2]
    assert pool.register_block(hits[1], hashes[0], prompt[4:8]) == hashes[1]
    assert pool.stats() == {"free": 14, "used": 2, "cached": 2, "hits": 2, "queries": 4}
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------
# Bad use: each error is raised before anything changes


@pytest.fixture
def busy_pool():
    """8 blocks of 2 tokens: 0 and 1 used (1 held twice), 2 used and cached, 3 evictable, 4..7 free."""
    pool = BlockAllocator(8, 2)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.fork([1])
    h = pool.register_block(2, ROOT, [1, 2])
    pool.register_block(3, h, [3, 4])
    pool.free(3)
    return pool


BAD_USES = [
    # (call, exception, message pattern)
    (lambda p: p.free(5), ValueError, "double free of block 5"),
    (lambda p: p.free(3), ValueError, "double free of block 3"),  # evictable, not in use
    (lambda p: p.free([0, 0]), ValueError, "double free of block 0 .listed 2 times, holds 1 reference"),
    (lambda p: p.free([1, 0, 1, 1]), ValueError, "double free of block 1 .listed 3 times, holds 2 references"),
    (lambda p: p.free([0, 6]), ValueError, "double free of block 6"),
    (lambda p: p.free(8), IndexError, "unknown block id 8"),
    (lambda p: p.free([0, -1]), IndexError, "unknown block id -1"),
    (lambda p: p.fork([0, 7]), ValueError, "fork: block 7 is not in use"),
    (lambda p: p.fork([0, 3]), ValueError, "fork: block 3 is not in use"),
    (lambda p: p.fork([0, 99]), IndexError, "unknown block id 99"),
    (lambda p: p.register_block(5, ROOT, [1, 2]), ValueError, "block 5 is not in use"),
    (lambda p: p.register_block(3, ROOT, [3, 4]), ValueError, "block 3 is not in use"),
    (lambda p: p.register_block(0, ROOT, [1]), ValueError, "block_size = 2 tokens, got 1"),
    (lambda p: p.register_block(0, ROOT, [1, 2, 3]), ValueError, "block_size = 2 tokens, got 3"),
    (lambda p: p.register_block(2, ROOT, [9, 9]), ValueError, "block 2 is already cached with other content"),
    (lambda p: p.register_block(8, ROOT, [1, 2]), IndexError, "unknown block id 8"),
    (lambda p: p.allocate(-1), ValueError, "must be >= 0"),
    (lambda p: p.allocate(9), ValueError, "exceed the pool's capacity of 8"),
    (lambda p: p.allocate(6), OutOfBlocksError, "out of blocks: 6 requested, 5 of 8 allocatable"),
    (lambda p: p.ref_count(8), IndexError, "unknown block id 8"),
    (lambda p: p.is_cached(-3), IndexError, "unknown block id -3"),
]


@pytest.mark.parametrize("call, exception, message", BAD_USES, ids=[m for _, _, m in BAD_USES])
def test_bad_use_raises_and_leaves_the_pool_unchanged(busy_pool, call, exception, message):
    before = snapshot(busy_pool)
    with pytest.raises(exception, match=message):
        call(busy_pool)
    assert snapshot(busy_pool) == before
    busy_pool.check_invariants()
    assert busy_pool.lookup([1, 2, 3, 4]) == [2, 3]  # the cache survived too


def test_out_of_blocks_is_a_runtime_error():
    assert issubclass(OutOfBlocksError, RuntimeError)
    pool = BlockAllocator(1, 1)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="out of blocks"):
        pool.allocate(1)


def test_error_messages_name_the_operation():
    pool = BlockAllocator(2, 1)
    for call, op in [(lambda: pool.free(5), "free"), (lambda: pool.fork([5]), "fork"),
                     (lambda: pool.register_block(5, ROOT, [1]), "register_block")]:
        with pytest.raises(IndexError, match=re.escape(f"{op}: unknown block id 5 (valid ids are 0..1)")):
            call()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (4, 0), (2**31, 16)])
def test_bad_construction(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockAllocator(num_blocks, block_size)


# ---------------------------------------------------------------------------------------------
# Random operation sequences against a model


class PoolModel:
    """The expected behaviour in plain Python. A cached block is keyed by its whole token prefix, so
    a lookup hit is right only if the block was registered for exactly that prefix."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.prefix_of = [None] * num_blocks  # the token prefix a cached block ends, else None
        self.block_of = {}  # prefix -> cached block
        self.lru = []  # evictable blocks, least recently released first
        self.hits = self.queries = 0

    def free_ids(self):
        return {i for i in range(self.num_blocks) if self.refs[i] == 0 and self.prefix_of[i] is None}

    def num_free(self):
        return len(self.free_ids()) + len(self.lru)

    def uncache(self, block_id):
        del self.block_of[self.prefix_of[block_id]]
        self.prefix_of[block_id] = None

    def release(self, block_ids):
        for block_id in reversed(block_ids):
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0 and self.prefix_of[block_id] is not None:
                self.lru.append(block_id)

    def acquire(self, block_id):
        if self.refs[block_id] == 0:
            self.lru.remove(block_id)
        self.refs[block_id] += 1

    def expected_hits(self, tokens):
        hits = []
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            block_id = self.block_of.get(tuple(tokens[:end]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits


class BlockAllocatorMachine(RuleBasedStateMachine):
    """Each do_* method runs one call on the pool and the model and checks what it returned; the
    rules draw the arguments, mostly valid ones, sometimes anything (to reach every error)."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3))
    def create(self, num_blocks, block_size):
        self.pool = BlockAllocator(num_blocks, block_size)
        self.model = PoolModel(num_blocks, block_size)
        # Every hash register_block returned, with the prefix it stands for (ROOT: the empty one).
        self.prefix_of_hash = {ROOT: ()}

    # -- one call on both ------------------------------------------------------------------------

    def expect_error(self, call, exception, message):
        before = snapshot(self.pool)
        with pytest.raises(exception, match=message):
            call()
        assert snapshot(self.pool) == before

    def do_allocate(self, n):
        model = self.model
        if n < 0 or n > model.num_blocks:
            return self.expect_error(lambda: self.pool.allocate(n), ValueError, "allocate")
        if n > model.num_free():
            assert not self.pool.can_allocate(n)
            return self.expect_error(lambda: self.pool.allocate(n), OutOfBlocksError, "out of blocks")
        assert self.pool.can_allocate(n)
        free = model.free_ids()
        evicted = model.lru[: max(0, n - len(free))]
        ids = self.pool.allocate(n)
        assert len(ids) == len(set(ids)) == n
        # Free blocks go first; only then the least recently released cached ones.
        assert set(ids) - free == set(evicted) and len(set(ids) & free) == n - len(evicted)
        for block_id in evicted:
            model.lru.remove(block_id)
            model.uncache(block_id)
        for block_id in ids:
            model.refs[block_id] = 1
        return ids

    def do_free(self, ids):
        n, refs = self.model.num_blocks, self.model.refs
        listed = [ids] if isinstance(ids, int) else ids
        if any(not 0 <= i < n for i in listed):
            return self.expect_error(lambda: self.pool.free(ids), IndexError, "unknown block id")
        if any(listed.count(i) > refs[i] for i in listed):
            return self.expect_error(lambda: self.pool.free(ids), ValueError, "double free")
        self.pool.free(ids)
        self.model.release(listed)

    def do_fork(self, ids):
        n, refs = self.model.num_blocks, self.model.refs
        if any(not 0 <= i < n for i in ids):
            return self.expect_error(lambda: self.pool.fork(ids), IndexError, "unknown block id")
        if any(refs[i] == 0 for i in ids):
            return self.expect_error(lambda: self.pool.fork(ids), ValueError, "not in use")
        self.pool.fork(ids)
        for block_id in ids:
            refs[block_id] += 1

    def do_register(self, block_id, parent, tokens):
        model = self.model
        prefix = self.prefix_of_hash.get(parent, (("unknown parent", parent),)) + tuple(tokens)
        call = lambda: self.pool.register_block(block_id, parent, tokens)  # noqa: E731
        if not 0 <= block_id < model.num_blocks:
            return self.expect_error(call, IndexError, "unknown block id")
        if model.refs[block_id] == 0:
            return self.expect_error(call, ValueError, "not in use")
        if len(tokens) != model.block_size:
            return self.expect_error(call, ValueError, "block_size")
        if model.prefix_of[block_id] not in (None, prefix):
            return self.expect_error(call, ValueError, "already cached with other content")
        h = call()
        assert h == BlockAllocator.hash_block(parent, tokens)
        assert self.prefix_of_hash.setdefault(h, prefix) == prefix, "64-bit hash collision in the test"
        # The first block registered with some content keeps it; a later one stays uncached.
        if model.prefix_of[block_id] is None and prefix not in model.block_of:
            model.prefix_of[block_id] = prefix
            model.block_of[prefix] = block_id
        return h

    def do_lookup(self, tokens):
        model, size = self.model, self.model.block_size
        hits = self.pool.lookup(tokens)
        assert hits == model.expected_hits(tokens)
        for i, block_id in enumerate(hits):  # each hit caches exactly the prompt's prefix up to it
            assert model.prefix_of[block_id] == tuple(tokens[: (i + 1) * size])
            model.acquire(block_id)
        model.queries += len(tokens) // size
        model.hits += len(hits)
        return hits

    # -- argument strategies ---------------------------------------------------------------------

    def token_lists(self, min_size=0, max_size=None):
        return st.lists(st.integers(0, 2), min_size=min_size, max_size=max_size)  # few values: sharing

    def used_ids(self):
        return [i for i, refs in enumerate(self.model.refs) if refs > 0]

    def any_id(self):
        return st.integers(-1, self.model.num_blocks)

    def known_prompt(self, data):
        """A registered prefix (or none) followed by a few more tokens."""
        known = sorted(p for p in self.prefix_of_hash.values() if all(isinstance(t, int) for t in p))
        base = data.draw(st.sampled_from(known), label="known prefix")
        return list(base) + data.draw(self.token_lists(max_size=2 * self.model.block_size + 1), label="more")

    # -- rules -----------------------------------------------------------------------------------

    @rule(data=st.data())
    def allocate(self, data):
        self.do_allocate(data.draw(st.integers(-1, self.model.num_blocks + 1), label="n"))

    @rule(data=st.data())
    def free_held(self, data):
        held = [i for i in self.used_ids() for _ in range(self.model.refs[i])]
        if held:
            ids = data.draw(st.lists(st.sampled_from(held), min_size=1), label="ids")
            ids = [i for n, i in enumerate(ids) if ids[:n].count(i) < self.model.refs[i]]  # within refs
            self.do_free(ids[0] if len(ids) == 1 and data.draw(st.booleans(), label="as int") else ids)

    @rule(data=st.data())
    def free_anything(self, data):
        self.do_free(data.draw(self.any_id() | st.lists(self.any_id(), max_size=4), label="ids"))

    @rule(data=st.data())
    def fork(self, data):
        candidates = st.sampled_from(self.used_ids() or [0])
        self.do_fork(data.draw(st.lists(candidates | self.any_id(), max_size=4), label="ids"))

    @rule(data=st.data())
    def register(self, data):
        size, used = self.model.block_size, self.used_ids()
        if used and data.draw(st.integers(0, 3), label="valid") > 0:
            block_id = data.draw(st.sampled_from(used), label="id")
            parent = data.draw(st.sampled_from(sorted(self.prefix_of_hash)), label="parent")
            tokens = data.draw(self.token_lists(size, size), label="tokens")
        else:
            block_id = data.draw(self.any_id(), label="id")
            parent = data.draw(st.sampled_from(sorted(self.prefix_of_hash)) | st.integers(0, 2**64 - 1))
            tokens = data.draw(self.token_lists(max_size=size + 1), label="tokens")
        self.do_register(block_id, parent, tokens)

    @rule(data=st.data())
    def lookup(self, data):
        tokens = self.known_prompt(data)
        if data.draw(st.booleans(), label="cut"):
            tokens = tokens[: data.draw(st.integers(0, len(tokens)), label="cut at")]
        self.do_lookup(tokens)

    @rule(data=st.data())
    def admit_prompt(self, data):
        """What a scheduler does at admission: look up the prompt, allocate the rest, register the
        prompt's full blocks after the hits (the new blocks stay held, like a running request)."""
        size = self.model.block_size
        tokens = self.known_prompt(data)
        hits = self.do_lookup(tokens)
        needed = -(-len(tokens) // size) - len(hits)
        if not self.pool.can_allocate(needed):
            return self.do_free(hits)  # not admitted: give the hits back
        table = hits + self.do_allocate(needed)
        parent = ROOT
        for i, block_id in enumerate(table[: len(tokens) // size]):
            parent = self.do_register(block_id, parent, tokens[i * size : (i + 1) * size])

    @rule()
    def reset_prefix_cache(self):
        dropped = self.model.lru
        assert self.pool.reset_prefix_cache() == len(dropped)
        for block_id in dropped:
            self.model.uncache(block_id)
        self.model.lru = []

    @invariant()
    def pool_matches_model(self):
        pool, model = self.pool, self.model
        assert pool.num_free_blocks + pool.num_used_blocks == model.num_blocks
        refs = [pool.ref_count(i) for i in range(model.num_blocks)]
        assert refs == model.refs and min(refs) >= 0
        assert [pool.is_cached(i) for i in range(model.num_blocks)] == [p is not None for p in model.prefix_of]
        assert pool.num_evictable_blocks == len(model.lru)
        assert pool.stats() == {
            "free": model.num_free(),
            "used": sum(r > 0 for r in model.refs),
            "cached": len(model.block_of),
            "hits": model.hits,
            "queries": model.queries,
        }
        pool.check_invariants()


BlockAllocatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_allocator_state_machine = BlockAllocatorMachine.TestCase
