"""The scheduler driven by a fake engine loop over the real C++ BlockAllocator: token budget and
request cap, decodes before prefills, chunked prefill, FCFS admission, preemption and recompute,
prefix caching, rejection at submission, and blocks freed on finish and abort.

Every step the driver also plays the KV cache: it writes each scheduled token into the slot its
block table names, then reads back the whole context the step attends to. A block shared by mistake,
a stale prefix hit or a lost recompute shows up there as a wrong token."""

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kvflow import BlockAllocator
from kvflow.engine.sampling_params import SamplingParams
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import Sequence, SequenceStatus

BS = 4  # tokens per block: small, so a few requests fill a pool


def fake_token(seq):
    """The fake model's next token: its position in the output, so a lost or repeated token shows."""
    return 1000 + len(seq.output_token_ids)


def expected_output(max_tokens):
    return [1000 + i for i in range(max_tokens)]


@dataclass
class Entry:
    rid: str
    start: int          # num_computed_tokens when scheduled
    n: int
    samples: bool


class RegisterRecorder:
    """The allocator, noting which blocks register_block caches."""

    def __init__(self, pool, registered: set):
        self._pool, self._registered = pool, registered

    def register_block(self, block_id, parent_hash, token_ids):
        self._registered.add(block_id)
        return self._pool.register_block(block_id, parent_hash, token_ids)

    def __getattr__(self, name):
        return getattr(self._pool, name)


class Sim:
    """A fake engine: schedule -> write KV and sample -> on_step_done -> finish at max_tokens."""

    def __init__(self, num_blocks, *, max_num_seqs=8, budget=32, max_model_len=1024, prefix_caching=True):
        self.pool = BlockAllocator(num_blocks, BS)
        self.config = SchedulerConfig(max_num_seqs, budget, max_model_len, BS, prefix_caching)
        self.sched = Scheduler(self.config, self.pool)
        self.seqs: dict[str, Sequence] = {}
        self.steps: list[list[Entry]] = []
        self.preempted: list[list[tuple[str, int]]] = []   # (request id, outputs it had) per step
        self.finished_at: dict[str, int] = {}              # request id -> index of its last step
        self.kv: dict[tuple[int, int], int] = {}           # (block, slot) -> token written there
        self.next_start: dict[str, int] = {}
        self.arrival: dict[str, int] = {}

    def add(self, rid, prompt, max_tokens):
        seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), seed=0)
        self.sched.add(seq)
        self.seqs[rid] = seq
        self.arrival[rid] = len(self.arrival)
        return seq

    def abort(self, rid):
        self.sched.finish(self.seqs[rid], SequenceStatus.FINISHED_ABORTED)
        self.next_start.pop(rid, None)
        self.check_state()

    def step(self) -> list[Entry]:
        # Blocks registered by this very schedule: their content is written in this step, before
        # any attention reads it, so a request admitted in the same step may share them.
        self.cached_now = set()
        self.sched.allocator = RegisterRecorder(self.pool, self.cached_now)
        try:
            out = self.sched.schedule()
        finally:
            self.sched.allocator = self.pool
        entries = [Entry(s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens, s.samples)
                   for s in out.scheduled]
        for victim in out.preempted:  # may be readmitted in the same step, from scratch
            self.next_start.pop(victim.request_id, None)
        self.check_plan(out, entries)
        self.queues_after_schedule = (len(self.sched.running), len(self.sched.waiting))
        for s, e in zip(out.scheduled, entries):  # every layer writes the step's K/V first ...
            self.write_kv(s.seq, e)
        for s, e in zip(out.scheduled, entries):  # ... then attends
            self.read_kv(s.seq, e)
        for s, e in zip(out.scheduled, entries):
            if e.samples:
                s.seq.output_token_ids.append(fake_token(s.seq))
        self.sched.on_step_done(out.scheduled)
        for s, e in zip(out.scheduled, entries):
            seq = s.seq
            self.next_start[e.rid] = e.start + e.n
            if e.samples and (len(seq.output_token_ids) >= seq.params.max_tokens
                              or seq.num_tokens >= self.config.max_model_len):
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                self.finished_at[e.rid] = len(self.steps)
                del self.next_start[e.rid]
        self.steps.append(entries)
        self.preempted.append([(v.request_id, len(v.output_token_ids)) for v in out.preempted])
        self.check_state()
        return entries

    def run(self, max_steps=2000):
        while self.sched.has_unfinished():
            assert len(self.steps) < max_steps, f"not done after {max_steps} steps: {self.sched.running}"
            self.step()

    # ------------------------------------------------------------------ checks every step

    def check_plan(self, out, entries):
        assert out.num_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        assert len({e.rid for e in entries}) == len(entries), "a request scheduled twice in one step"
        running = {id(seq) for seq in self.sched.running}
        for s, e in zip(out.scheduled, entries):
            assert id(s.seq) in running
            assert e.n >= 1
            assert e.start + e.n <= s.seq.num_tokens
            assert len(s.seq.block_table) * BS >= e.start + e.n, "no slot for a scheduled token"
            if e.rid in self.next_start:  # continues where its last step stopped
                assert e.start == self.next_start[e.rid], (e, self.next_start[e.rid])

    def write_kv(self, seq, e):
        tokens = seq.token_ids
        for p in range(e.start, e.start + e.n):
            block = seq.block_table[p // BS]
            fresh = block in self.cached_now
            assert self.pool.ref_count(block) == 1 or fresh, f"{seq} writes into block {block}, shared with another"
            assert not self.pool.is_cached(block) or fresh, f"{seq} overwrites cached block {block}"
            self.kv[block, p % BS] = tokens[p]

    def read_kv(self, seq, e):
        tokens = seq.token_ids
        context = [self.kv.get((seq.block_table[p // BS], p % BS)) for p in range(e.start + e.n)]
        assert context == tokens[:e.start + e.n], f"{seq} attends to the wrong tokens"

    def check_state(self):
        # FCFS, preemptions included: a preempted request waits ahead of every later arrival
        queue = [self.arrival[seq.request_id] for seq in [*self.sched.running, *self.sched.waiting]]
        assert queue == sorted(queue), "running + waiting out of arrival order"
        pool = self.pool
        pool.check_invariants()
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert all(not seq.block_table for seq in self.sched.waiting), "a waiting request holds blocks"
        refs = Counter(b for seq in self.sched.running for b in seq.block_table)
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [refs[b] for b in range(pool.num_blocks)]
        for seq in self.sched.running:  # blocks for the computed tokens, none ahead of them
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BS), seq

    # ------------------------------------------------------------------ queries

    def entries_of(self, rid):
        return [(t, e) for t, entries in enumerate(self.steps) for e in entries if e.rid == rid]


def prompt(n, base=1):
    return list(range(base, base + n))


# ---------------------------------------------------------------------- budget and order within a step


def test_every_step_respects_budget_and_cap_and_decodes_come_first():
    sim = Sim(num_blocks=400, max_num_seqs=6, budget=20)
    rng = random.Random(0)
    lengths = [rng.randint(1, 45) for _ in range(16)]
    for i, n in enumerate(lengths):
        sim.add(f"r{i}", prompt(n, base=100 * i), max_tokens=rng.randint(1, 12))
    while sim.sched.has_unfinished():
        decoding = [seq.request_id for seq in sim.sched.running if seq.output_token_ids]
        entries = sim.step()
        # every decoding request gets exactly one token, ahead of any prompt chunk
        assert [(e.rid, e.n, e.samples) for e in entries[:len(decoding)]] == [(r, 1, True) for r in decoding]
        assert all(e.rid not in decoding for e in entries[len(decoding):])
        # the budget is left unused only when nothing more could be admitted
        if sum(e.n for e in entries) < sim.config.max_num_batched_tokens:
            num_running, num_waiting = sim.queues_after_schedule
            assert num_waiting == 0 or num_running == sim.config.max_num_seqs
    assert all(sim.seqs[f"r{i}"].status == SequenceStatus.FINISHED_LENGTH for i in range(len(lengths)))
    assert all(seq.output_token_ids == expected_output(seq.params.max_tokens) for seq in sim.seqs.values())
    assert sim.sched.num_preemptions == 0


def test_long_prompt_is_prefilled_in_chunks_beside_other_decodes():
    sim = Sim(num_blocks=100, max_num_seqs=4, budget=16)
    sim.add("short", prompt(5), max_tokens=20)
    sim.step()
    assert sim.seqs["short"].output_token_ids == [1000]
    sim.add("long", prompt(50, base=200), max_tokens=2)
    chunks = []
    while len(sim.seqs["long"].output_token_ids) == 0:
        entries = {e.rid: e for e in sim.step()}
        assert (entries["short"].n, entries["short"].samples) == (1, True)  # keeps decoding meanwhile
        chunks.append((entries["long"].n, entries["long"].samples))
    assert chunks == [(15, False), (15, False), (15, False), (5, True)]
    assert sum(n for n, _ in chunks) == 50
    sim.run()
    assert sim.seqs["long"].output_token_ids == expected_output(2)
    assert sim.seqs["short"].output_token_ids == expected_output(20)


def test_prompt_filling_the_budget_exactly_is_one_chunk():
    sim = Sim(num_blocks=100, budget=16)
    sim.add("a", prompt(16), max_tokens=1)
    assert [(e.n, e.samples) for e in sim.step()] == [(16, True)]
    assert not sim.sched.has_unfinished()


# ---------------------------------------------------------------------- admission order


@pytest.mark.parametrize("num_blocks, max_num_seqs", [(400, 2), (12, 8)], ids=["seq_cap", "tight_pool"])
def test_waiting_requests_are_admitted_in_arrival_order(num_blocks, max_num_seqs):
    sim = Sim(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=24, prefix_caching=False)
    # long ones first: admitting the short ones early would be tempting
    specs = [(30, 6), (25, 4), (3, 2), (2, 1), (20, 3), (1, 5), (9, 2)]
    for i, (n, m) in enumerate(specs):
        sim.add(f"r{i}", prompt(n, base=100 * i), max_tokens=m)
    sim.run()
    admitted = list(dict.fromkeys(e.rid for entries in sim.steps for e in entries))
    assert admitted == [f"r{i}" for i in range(len(specs))]


# ---------------------------------------------------------------------- preemption


def serial_steps(specs, budget):
    """Steps to run the requests one at a time, each prefilled once more from scratch: no request
    may wait longer than the ones ahead of it take this way."""
    return [-(-(n + m) // budget) + m for n, m in specs]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_pool_too_small_for_all_preempts_and_every_request_completes(prefix_caching):
    sim = Sim(num_blocks=12, max_num_seqs=6, budget=32, prefix_caching=prefix_caching)
    specs = [(10, 14), (7, 16), (12, 9), (5, 18), (10, 10), (3, 20)]
    for i, (n, m) in enumerate(specs):
        sim.add(f"r{i}", prompt(n, base=100 * i), max_tokens=m)
    sim.run()

    assert sim.sched.num_preemptions > 0
    for i, (n, m) in enumerate(specs):
        seq = sim.seqs[f"r{i}"]
        assert seq.status == SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(m)
    # no starvation: request i is done once the ones before it (and it) could have run one by one
    bounds = serial_steps(specs, sim.config.max_num_batched_tokens)
    for i in range(len(specs)):
        assert sim.finished_at[f"r{i}"] < sum(bounds[:i + 1]), (i, sim.finished_at)
    assert sim.pool.num_used_blocks == 0


def test_preempted_request_is_recomputed_from_its_prompt_and_outputs():
    sim = Sim(num_blocks=8, max_num_seqs=4, budget=8, prefix_caching=False)
    sim.add("a", prompt(6), max_tokens=20)
    sim.add("b", prompt(6, base=100), max_tokens=20)
    sim.run()

    events = [(t, rid, outputs) for t, step in enumerate(sim.preempted) for rid, outputs in step]
    assert events, "two requests of 26 tokens in a 32-token pool must preempt"
    assert all(rid == "b" for _, rid, _ in events), "the later admitted request is the one preempted"
    assert sim.seqs["b"].num_preemptions == len(events)
    recomputed = 0
    for k, (t, rid, outputs) in enumerate(events):
        until = events[k + 1][0] if k + 1 < len(events) else len(sim.steps)
        later = [e for step, e in sim.entries_of(rid) if t <= step < until]
        assert later[0].start == 0
        if any(e.samples for e in later):  # recomputed before being preempted again
            until_sample = later[:next(j for j, e in enumerate(later) if e.samples) + 1]
            assert sum(e.n for e in until_sample) == 6 + outputs  # the prompt and every output so far
            recomputed += 1
    assert recomputed > 0
    assert sim.seqs["a"].output_token_ids == expected_output(20)
    assert sim.seqs["b"].output_token_ids == expected_output(20)
    assert sim.finished_at["a"] < sim.finished_at["b"]


def test_request_preempted_while_decodes_use_the_whole_budget_restarts_from_scratch():
    # the budget goes to decodes in the step that preempts, so the victim waits a step or more
    sim = Sim(num_blocks=5, max_num_seqs=3, budget=3, prefix_caching=False)
    for i in range(4):
        sim.add(f"r{i}", [7 + i], max_tokens=19)
    sim.run()
    assert sim.sched.num_preemptions > 0
    for i in range(4):
        assert sim.seqs[f"r{i}"].output_token_ids == expected_output(19)


def test_lone_request_as_large_as_the_pool_completes():
    sim = Sim(num_blocks=4, budget=8)
    sim.add("a", prompt(9), max_tokens=7)  # 16 tokens: 4 blocks of 4
    sim.run()
    assert sim.seqs["a"].output_token_ids == expected_output(7)
    assert sim.sched.num_preemptions == 0


def test_two_requests_each_as_large_as_the_pool_both_complete():
    sim = Sim(num_blocks=4, budget=8)
    sim.add("a", prompt(9), max_tokens=7)
    sim.add("b", prompt(9, base=50), max_tokens=7)
    sim.run(max_steps=100)
    assert sim.seqs["a"].output_token_ids == expected_output(7)
    assert sim.seqs["b"].output_token_ids == expected_output(7)


def test_max_tokens_beyond_the_context_is_cut_at_max_model_len():
    sim = Sim(num_blocks=4, max_model_len=16)
    sim.add("a", prompt(10), max_tokens=1000)  # accepted: the context, not max_tokens, bounds it
    sim.run()
    assert sim.seqs["a"].num_tokens == 16
    assert sim.seqs["a"].output_token_ids == expected_output(6)


# ---------------------------------------------------------------------- rejection at submission


@pytest.mark.parametrize("prompt_len, max_tokens, message", [
    (0, 4, "prompt is empty"),
    (64, 1, r"64 tokens.*max_model_len\) is 64"),
    (65, 1, r"65 tokens.*max_model_len\) is 64"),
    (10, 30, r"39 tokens needs 10 KV blocks; the pool has only 8"),
])
def test_impossible_request_is_rejected_when_added(prompt_len, max_tokens, message):
    sim = Sim(num_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        sim.add("bad", prompt(prompt_len), max_tokens=max_tokens)
    assert not sim.sched.has_unfinished()
    sim.add("good", prompt(3), max_tokens=2)  # the scheduler still works
    sim.run()
    assert sim.seqs["good"].output_token_ids == expected_output(2)


# ---------------------------------------------------------------------- prefix caching


SHARED = prompt(12, base=1)  # three full blocks


def start_after_first_has_prefilled(prefix_caching):
    sim = Sim(num_blocks=40, prefix_caching=prefix_caching)
    first = sim.add("first", SHARED + [50, 51], max_tokens=4)
    sim.step()
    assert first.output_token_ids  # its prompt is computed, its full blocks cached
    second = sim.add("second", SHARED + [60, 61, 62], max_tokens=4)
    (entry,) = [e for e in sim.step() if e.rid == "second"]
    return sim, first, second, entry


def test_shared_prefix_is_not_recomputed():
    sim, first, second, entry = start_after_first_has_prefilled(True)
    assert (entry.start, entry.n, entry.samples) == (12, 3, True)
    assert second.block_table[:3] == first.block_table[:3]
    assert sim.pool.stats()["hits"] == 3
    sim.run()
    assert second.output_token_ids == expected_output(4)
    assert sim.pool.num_used_blocks == 0


def test_requests_admitted_in_one_step_share_their_prefix():
    # The blocks the first request fills this step are cached when scheduled, so the second,
    # admitted after it in the same step, reads them instead of computing them again (the fake
    # engine writes every scheduled token before any request reads its context, as the model does).
    sim = Sim(num_blocks=40, budget=64)
    first = sim.add("first", SHARED + prompt(3, base=500), max_tokens=4)
    second = sim.add("second", SHARED + prompt(3, base=600), max_tokens=4)
    entries = {e.rid: e for e in sim.step()}
    assert (entries["first"].start, entries["second"].start) == (0, 12)
    assert second.block_table[:3] == first.block_table[:3]
    sim.run()
    assert first.output_token_ids == second.output_token_ids == expected_output(4)
    assert sim.pool.num_used_blocks == 0


def test_without_prefix_caching_the_shared_prefix_is_recomputed():
    sim, first, second, entry = start_after_first_has_prefilled(False)
    assert (entry.start, entry.n) == (0, 15)
    assert set(second.block_table).isdisjoint(first.block_table)
    assert sim.pool.stats()["hits"] == 0
    sim.run()
    assert second.output_token_ids == expected_output(4)


@pytest.mark.parametrize("first_still_running", [True, False])
def test_fully_cached_prompt_still_computes_its_last_token(first_still_running):
    sim = Sim(num_blocks=40)
    sim.add("first", SHARED, max_tokens=3 if first_still_running else 1)
    sim.step()
    assert sim.seqs["first"].status.finished != first_still_running
    again = sim.add("again", list(SHARED), max_tokens=2)
    (entry,) = [e for e in sim.step() if e.rid == "again"]
    assert (entry.start, entry.n, entry.samples) == (8, 4, True)  # 2 of 3 blocks reused, 1 token at least
    sim.run()
    assert again.output_token_ids == expected_output(2)
    assert sim.pool.num_used_blocks == 0


def test_each_turn_of_a_conversation_reuses_all_the_previous_turns_computed():
    sim = Sim(num_blocks=64)
    history, starts = [], []
    for turn in range(3):
        seq = sim.add(f"turn{turn}", history + prompt(10 - 3 * turn, base=100 * (turn + 1)), max_tokens=5)
        starts.append(sim.step()[0].start)
        sim.run()
        history = seq.token_ids
    # turn 0: 10 + 5 tokens, the last one never computed: 3 full blocks cached; turn 1: 22 + 5
    assert starts == [0, 12, 24]


def test_cached_blocks_evicted_for_others_are_not_hit():
    sim = Sim(num_blocks=4, budget=16)
    sim.add("first", SHARED, max_tokens=1)
    sim.run()  # its 3 full blocks stay cached, unused
    sim.add("filler", prompt(15, base=500), max_tokens=1)  # needs all 4 blocks: evicts them
    sim.run()
    again = sim.add("again", list(SHARED), max_tokens=1)
    (entry,) = sim.step()
    assert entry.start == 0
    assert again.output_token_ids == expected_output(1)


# ---------------------------------------------------------------------- finish and abort


def test_abort_of_running_request_frees_its_blocks_for_the_next_in_line():
    sim = Sim(num_blocks=8, budget=28)
    sim.add("big", prompt(28), max_tokens=4)     # 7 blocks now, 8 at its first decode
    sim.add("next", prompt(10, base=100), max_tokens=2)  # 3 blocks: must wait
    assert [e.rid for e in sim.step()] == ["big"]
    assert [e.rid for e in sim.step()] == ["big"]
    sim.abort("big")
    assert sim.seqs["big"].status == SequenceStatus.FINISHED_ABORTED
    assert sim.pool.num_used_blocks == 0
    assert [e.rid for e in sim.step()] == ["next"]
    sim.run()
    assert all(e.rid != "big" for entries in sim.steps[2:] for e in entries)
    assert sim.seqs["next"].output_token_ids == expected_output(2)
    assert sim.pool.num_used_blocks == 0


def test_abort_mid_prefill_and_while_waiting():
    sim = Sim(num_blocks=40, max_num_seqs=1, budget=8)
    sim.add("chunked", prompt(30), max_tokens=3)
    sim.add("queued", prompt(5, base=100), max_tokens=3)
    sim.add("kept", prompt(5, base=200), max_tokens=3)
    sim.step()
    assert sim.seqs["chunked"].num_computed_tokens == 8 and sim.pool.num_used_blocks == 2
    sim.abort("queued")
    sim.abort("chunked")
    assert sim.pool.num_used_blocks == 0
    sim.run()
    assert [e.rid for entries in sim.steps[1:] for e in entries] == ["kept"] * 3
    assert sim.seqs["queued"].status == SequenceStatus.FINISHED_ABORTED
    assert sim.seqs["queued"].output_token_ids == []
    assert sim.seqs["kept"].output_token_ids == expected_output(3)


def test_abort_of_preempted_request_waiting_for_recompute():
    sim = Sim(num_blocks=8, budget=8)
    sim.add("a", prompt(6), max_tokens=20)
    victim = sim.add("b", prompt(6, base=100), max_tokens=20)
    while not (victim.status == SequenceStatus.WAITING and victim.output_token_ids):
        assert len(sim.steps) < 20, "b was never preempted"
        sim.step()
    sim.abort("b")
    assert sim.pool.num_used_blocks == len(sim.seqs["a"].block_table)
    sim.run()
    assert victim.status == SequenceStatus.FINISHED_ABORTED
    assert sim.seqs["a"].output_token_ids == expected_output(20)
    assert sim.pool.num_used_blocks == 0


# ---------------------------------------------------------------------- random workloads


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_arrivals_and_aborts_keep_every_invariant(seed, prefix_caching):
    rng = random.Random(seed)
    sim = Sim(num_blocks=rng.randint(15, 24), max_num_seqs=rng.randint(1, 6), budget=rng.randint(6, 24),
              max_model_len=60, prefix_caching=prefix_caching)
    templates = [prompt(rng.randint(4, 20), base=1000 * k) for k in range(3)]
    aborted, arrivals = set(), 0
    for _ in range(3000):
        if arrivals < 25 and rng.random() < 0.3:
            head = rng.choice(templates)[:rng.randint(0, 20)]
            tail = prompt(rng.randint(1 if not head else 0, 12), base=100 * arrivals + 50)
            sim.add(f"r{arrivals}", head + tail, max_tokens=rng.randint(1, 30))
            arrivals += 1
        live = list(sim.sched.running) + list(sim.sched.waiting)
        if live and rng.random() < 0.04:
            seq = rng.choice(live)
            sim.abort(seq.request_id)
            aborted.add(seq.request_id)
        if not sim.sched.has_unfinished() and arrivals == 25:
            break
        sim.step()
    assert arrivals == 25 and not sim.sched.has_unfinished()
    for rid, seq in sim.seqs.items():
        if rid in aborted:
            assert seq.status == SequenceStatus.FINISHED_ABORTED
            continue
        expected = min(seq.params.max_tokens, sim.config.max_model_len - len(seq.prompt_token_ids))
        assert seq.status == SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(expected)
    assert sim.pool.num_used_blocks == 0
    if not prefix_caching:
        assert sim.pool.stats()["queries"] == 0


def test_a_sequences_token_range_equals_the_slice_of_prompt_then_output():
    seq = Sequence("r", [10, 11, 12, 13], SamplingParams(), seed=0)
    seq.output_token_ids.extend([20, 21, 22])
    every = [10, 11, 12, 13, 20, 21, 22]
    for start in range(len(every) + 1):
        for count in range(len(every) - start + 2):
            assert seq.tokens(start, count) == every[start:start + count], (start, count)
