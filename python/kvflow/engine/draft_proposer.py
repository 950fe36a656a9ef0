"""A draft model's proposals: a smaller (or quantized) model of the same vocabulary runs k greedy
decode steps of its own per verification, masked by the request's grammar where it has one. Its
KV cache has its own tensors, indexed by the target's block ids: a sequence's blocks hold both
models' keys and values, and the pool is sized for the two together.

The draft's cache only ever changes how many drafts are accepted, never which tokens come out
(the target verifies every one), so it is kept simply: each sequence remembers which tokens it
fed the draft at which positions, and the draft catches up from the first position whose token
differs from the sequence's own (all of them after a preemption). Its extra positions (a
proposal's drafts but the last) go into blocks the sequence takes from the pool now, which its
verification step then writes too; blocks holding only rejected positions go back after the step.
"""

from dataclasses import dataclass, field

import torch

from kvflow.engine.model_runner import ModelRunner, ScheduledRequest
from kvflow.engine.sampling_params import SamplingParams
from kvflow.engine.sequence import Sequence

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _DraftState:
    start: int = 0                                 # positions before this hold the draft's keys and values
    fed: list[int] = field(default_factory=list)   # tokens fed at positions start, start + 1, ...
    preemptions: int = 0                           # the sequence's count when the state was made

    def computed(self, seq: Sequence) -> int:
        """Positions whose draft keys and values are valid for seq's tokens now."""
        if seq.num_preemptions != self.preemptions:
            return 0
        tokens = seq.tokens(self.start, len(self.fed))
        same = 0
        while same < len(tokens) and tokens[same] == self.fed[same]:
            same += 1
        return min(self.start + same, seq.num_computed_tokens)


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, config, num_blocks: int, block_size: int, device, allocator,
                 num_tokens: int):
        self.runner = ModelRunner(model, config, num_blocks, block_size, device)
        self.block_size = block_size
        self.allocator = allocator
        self.num_tokens = num_tokens

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        """Sets each sequence's draft_token_ids: up to its limit, from the draft model's greedy
        steps (fewer where the pool has no block to spare for them)."""
        active = []
        for seq, limit in zip(seqs, limits):
            limit = min(limit, self.num_tokens)
            if limit > 0 and self._reserve(seq, seq.num_tokens + limit - 1):
                active.append((seq, limit))
        if not active:
            return
        limits = [limit for _, limit in active]
        followed = [0] * len(active)  # drafts each constrained sequence's grammar has accepted, to undo
        try:
            # The catch-up step: every token the draft has not seen, the last one's logits drawn.
            batch = []
            for seq, _ in active:
                state = seq.proposer_state if isinstance(seq.proposer_state, _DraftState) else None
                start = 0 if state is None else state.computed(seq)
                seq.proposer_state = _DraftState(start, seq.tokens(start, seq.num_tokens - start), seq.num_preemptions)
                batch.append(ScheduledRequest(seq.proposer_state.fed, start, seq.block_table, _GREEDY,
                                              grammar=seq.grammar))
            drafted = [[tokens[0].token_id] for tokens in self._execute(batch)]
            self._follow_grammars(active, drafted, limits, followed)
            for step in range(1, max(limits)):
                rows = [i for i, limit in enumerate(limits) if limit > step]
                if not rows:
                    break
                batch = []
                for i in rows:
                    seq = active[i][0]
                    seq.proposer_state.fed.append(drafted[i][-1])
                    batch.append(ScheduledRequest([drafted[i][-1]], seq.num_tokens + step - 1, seq.block_table,
                                                  _GREEDY, grammar=seq.grammar))
                for i, tokens in zip(rows, self._execute(batch)):
                    drafted[i].append(tokens[0].token_id)
                self._follow_grammars(active, drafted, limits, followed)
        finally:
            for (seq, _), count in zip(active, followed):
                if count:
                    seq.grammar.rollback(count)
        for (seq, _), tokens in zip(active, drafted):
            seq.draft_token_ids = tokens

    @staticmethod
    def _follow_grammars(active: list[tuple[Sequence, int]], drafted: list[list[int]], limits: list[int],
                         followed: list[int]) -> None:
        """Advances each constrained sequence's grammar by its newest draft where another draft
        follows it, so that the next draft step is masked after it (the draft model drafts only
        what the grammar allows); a draft that completes the grammar ends its drafting."""
        for i, (seq, _) in enumerate(active):
            if seq.grammar is None or len(drafted[i]) >= limits[i] or len(drafted[i]) <= followed[i]:
                continue
            if not seq.grammar.accept(drafted[i][-1]):  # the mask allowed it: a grammar engine fault
                drafted[i].pop()
                limits[i] = len(drafted[i])
                continue
            followed[i] += 1
            if seq.grammar.finished:
                limits[i] = len(drafted[i])

    def _execute(self, batch: list[ScheduledRequest]) -> list:
        """The draft's step over batch, split into steps whose requests write no common slot:
        sequences sharing prefix blocks (the prefix cache, parallel samples) catch up on the same
        positions, with the same tokens."""
        groups: list[tuple[set[int], list[int]]] = []
        for i, r in enumerate(batch):
            first, last = r.num_computed_tokens // self.block_size, (r.seq_len - 1) // self.block_size
            written = set(r.block_table[first:last + 1])
            group = next((g for g in groups if not g[0] & written), None)
            if group is None:
                groups.append((written, [i]))
            else:
                group[0].update(written)
                group[1].append(i)
        if len(groups) == 1:
            return self.runner.execute(batch)
        results = [None] * len(batch)
        for _, indices in groups:
            for i, tokens in zip(indices, self.runner.execute([batch[i] for i in indices])):
                results[i] = tokens
        return results

    def _reserve(self, seq: Sequence, num_positions: int) -> bool:
        """Blocks in seq's table for its first num_positions positions, if the pool has them and
        one more to spare."""
        missing = -(-num_positions // self.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.allocator.can_allocate(missing + 1):
            return False
        seq.block_table += self.allocator.allocate(missing)
        return True
