"""Which tokens of which requests the next model step computes.

Each step fills a token budget under a cap on running requests: first one token for every
running request that is decoding (or the next chunk of one still in its prompt), in admission
order, then prompt chunks of waiting requests in arrival order. Blocks come from the C++
BlockAllocator; a new request first looks its prompt up in the prefix cache. When the pool runs
dry the most recently admitted running request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed. Torch-free: requests and block ids only."""

from collections import deque
from dataclasses import dataclass, field

from kvflow.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256               # running requests at once
    max_num_batched_tokens: int = 2048    # new tokens per step (decode tokens + prompt chunks)
    max_model_len: int = 8192             # prompt + output
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): every running request needs a token each step")


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int       # including the draft tokens
    num_draft_tokens: int = 0  # speculative decoding: seq.draft_token_ids, the last of the new tokens
    num_accepted_tokens: int = 0  # of those drafts, set by the engine after the step
    num_steps: int = 1         # decode steps run back to back (reserve_steps), a token each

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so a new one is due."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (source, destination) block pairs to copy before the step: copy-on-write of shared blocks
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator):
        if allocator.block_size != config.block_size:
            raise ValueError(f"allocator block size {allocator.block_size} != scheduler's {config.block_size}")
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence; raises ValueError for one that could never complete."""
        self.check_fits(len(seq.prompt_token_ids), seq.params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.config.max_model_len:
            raise ValueError(f"the prompt has {prompt_len} tokens; the model's context (max_model_len) is "
                             f"{self.config.max_model_len}, which leaves no room for an answer")
        # The last token sampled is never fed back, so the cache holds at most one token less.
        longest = min(prompt_len + max_tokens - 1, self.config.max_model_len)
        blocks = self._blocks_for(longest)
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"a request of up to {longest} tokens needs {blocks} KV blocks; the pool has only "
                             f"{self.allocator.num_blocks} (raise the KV cache memory or lower max_tokens)")

    def fork(self, parent: Sequence, children: list[Sequence], prompt_len: int) -> None:
        """Parallel samples of parent's request start from its prompt blocks, each with its own
        reference; each recomputes the last prompt token for logits of its own (written into a
        copy of the shared block: see _grow), then draws with its own seed. They are queued first
        in line, in order."""
        block_size = self.config.block_size
        blocks = parent.block_table[: -(-prompt_len // block_size)]
        for seq in reversed(children):
            self.allocator.fork(blocks)
            seq.block_table = list(blocks)
            seq.num_computed_tokens = prompt_len - 1
            seq.block_hashes = parent.block_hashes[: (prompt_len - 1) // block_size]
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = self._fitting_drafts(seq, n, budget)
            if not self._reserve(seq, n + drafts, out):
                break  # seq itself was preempted: it was the last running one
            self._register_full_blocks(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSequence(seq, n + drafts, drafts))
            budget -= n + drafts
            i += 1
        # No admissions in a step that had to preempt: the pool is dry, and a preempted request
        # readmitted at once would only thrash.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not seq.block_table and self.config.enable_prefix_caching:
                self._attach_cached_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            shared = self._shared_blocks(seq, n)
            if not self.allocator.can_allocate(self._missing_blocks(seq, n) + len(shared)):
                # Hand back the cached prefix too: a waiting request holds no blocks, so that the
                # running ones can always finish.
                self._release_blocks(seq)
                seq.num_computed_tokens = 0
                break
            self._grow(seq, n, out, shared)
            self._register_full_blocks(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return out

    def _fitting_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of seq's draft tokens join its n new ones this step: those the token budget
        leaves room for, and none where their blocks would not fit without preempting (a draft
        is a guess; a running request's place is not). seq.draft_token_ids is cut to that."""
        drafts = seq.draft_token_ids
        if not drafts:
            return 0
        count = min(len(drafts), budget - n) if n == seq.num_uncomputed_tokens else 0
        if count > 0 and not self.allocator.can_allocate(self._missing_blocks(seq, n + count)
                                                         + len(self._shared_blocks(seq, n + count))):
            count = 0
        del drafts[count:]
        return count

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of seq, preempting the latest admitted others if needed.
        False if seq had to be preempted itself."""
        while True:
            shared = self._shared_blocks(seq, n)
            if self.allocator.can_allocate(self._missing_blocks(seq, n) + len(shared)):
                break
            victim = self.running[-1]
            dropped = set(victim.block_table)  # its copies this step, if any, are moot now
            out.copies = [(src, dst) for src, dst in out.copies if dst not in dropped]
            self._preempt(victim)
            out.preempted.append(victim)
            out.scheduled = [s for s in out.scheduled if s.seq is not victim]
            if victim is seq:
                return False
        self._grow(seq, n, out, shared)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        """The longest cached run of seq's full blocks, leaving at least one token to compute
        (its logits are what the next token is sampled from)."""
        tokens = seq.token_ids
        hits = self.allocator.lookup(tokens)
        usable = (len(tokens) - 1) // self.config.block_size
        if len(hits) > usable:
            self.allocator.free(hits[usable:])
            hits = hits[:usable]
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.config.block_size
        parent = self.allocator.ROOT_HASH
        seq.block_hashes = []
        for b in range(len(hits)):
            parent = self.allocator.hash_block(parent, tokens[b * self.config.block_size:(b + 1) * self.config.block_size])
            seq.block_hashes.append(parent)

    def reserve_steps(self, plan: SchedulerOutput, steps: int) -> bool:
        """Multi-step decode: the blocks for `steps` tokens of every scheduled sequence (each
        decoding one token, its first block already reserved), taken only where the pool has them
        all without preempting anyone and none is shared. Each ScheduledSequence then covers that
        many steps; else nothing changes and False."""
        if any(self._shared_blocks(s.seq, steps) for s in plan.scheduled):
            return False
        missing = [self._missing_blocks(s.seq, steps) for s in plan.scheduled]
        if not self.allocator.can_allocate(sum(missing)):
            return False
        for s, count in zip(plan.scheduled, missing):
            if count:
                s.seq.block_table += self.allocator.allocate(count)
            s.num_steps = steps
        return True

    # ------------------------------------------------------------------ after the step

    def on_step_done(self, scheduled: list[ScheduledSequence]) -> None:
        """Advance every scheduled sequence past the tokens just computed (the engine appends the
        sampled tokens after). Of a sequence's drafts, only the accepted ones count: the
        rejected ones' keys and values are left behind, and the blocks that hold nothing else
        go back to the pool."""
        for s in scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens + s.num_accepted_tokens + s.num_steps - 1
            seq.draft_token_ids = []
            if s.num_draft_tokens and seq.block_table:
                keep = self._blocks_for(seq.num_computed_tokens)
                if len(seq.block_table) > keep:
                    self.allocator.free(seq.block_table[keep:])
                    del seq.block_table[keep:]

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends seq (stopped, length or aborted) and frees its blocks now; the full blocks of a
        sequence that ended well stay in the prefix cache (those a multi-step run filled since
        its schedule too)."""
        if seq in self.running:
            if status is not SequenceStatus.FINISHED_ABORTED:
                self._register_full_blocks(seq, seq.num_computed_tokens)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.status = status

    # ------------------------------------------------------------------ blocks

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _missing_blocks(self, seq: Sequence, n: int) -> int:
        return max(0, self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table))

    def _shared_blocks(self, seq: Sequence, n: int) -> list[int]:
        """Indices in seq's block table of the blocks the next n tokens write into that other
        sequences also hold (a parallel sample's prompt blocks): they are copied before writing."""
        size, table = self.config.block_size, seq.block_table
        first = seq.num_computed_tokens // size
        last = min((seq.num_computed_tokens + n - 1) // size, len(table) - 1)
        if first == last:  # a decode token: one block at most
            return [first] if self.allocator.ref_count(table[first]) > 1 else []
        return [i for i in range(first, last + 1) if self.allocator.ref_count(table[i]) > 1]

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput, shared: list[int]) -> None:
        """Copies the shared blocks (from _shared_blocks) seq is about to write, and adds the
        blocks its next n tokens need."""
        for i in shared:
            copy = self.allocator.allocate(1)[0]
            out.copies.append((seq.block_table[i], copy))
            self.allocator.free(seq.block_table[i])
            seq.block_table[i] = copy
            del seq.block_hashes[i:]  # the copy is not registered in the prefix cache
        missing = self._missing_blocks(seq, n)
        if missing:
            seq.block_table += self.allocator.allocate(missing)

    def _release_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Caches the blocks that the first num_tokens of seq fill, as soon as they are scheduled:
        a request admitted later in the same step may then share them, because every layer
        writes the step's keys and values before any of its attention reads them."""
        if not self.config.enable_prefix_caching:
            return
        size = self.config.block_size
        full = min(num_tokens, seq.num_tokens) // size
        tokens = None
        while len(seq.block_hashes) < full:
            b = len(seq.block_hashes)
            tokens = tokens or seq.token_ids
            parent = seq.block_hashes[-1] if seq.block_hashes else self.allocator.ROOT_HASH
            seq.block_hashes.append(self.allocator.register_block(seq.block_table[b], parent,
                                                                  tokens[b * size:(b + 1) * size]))
