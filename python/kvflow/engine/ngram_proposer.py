"""N-gram prompt lookup: a request's next tokens guessed from its own context. The proposal is
what followed the latest earlier occurrence of the context's last n tokens, for the longest n in
[prompt_lookup_min, prompt_lookup_max] that occurred before. Where that continuation runs into
the context's end (the context repeats with a period shorter than the proposal: a run of one
token, a short loop), the proposal goes on around the loop. Each sequence keeps an index from
n-gram to where it last ended, extended by the tokens added since the last proposal, so a step
costs a few dictionary operations per request, not a scan of the context."""

from kvflow.engine.sequence import Sequence


class _NgramIndex:
    def __init__(self, sizes: range):
        self.sizes = sizes
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in sizes}  # n -> n-gram -> end of its latest occurrence
        self.indexed = 0  # n-grams ending before this position (exclusive) are in the index

    def extend(self, tokens: list[int]) -> None:
        """Indexes every n-gram that ends before the last token (a continuation follows it)."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.ends[n][tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens = num_tokens
        self.sizes = range(max_n, min_n - 1, -1)  # longest first

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        """Sets each sequence's draft_token_ids (see propose_one)."""
        for seq, limit in zip(seqs, limits):
            seq.draft_token_ids = self.propose_one(seq, limit)

    def propose_one(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow seq's last token; [] when its last
        n tokens never occurred before."""
        count = min(self.num_tokens, limit)
        if count <= 0:
            return []
        index = seq.proposer_state
        if index is None:
            index = seq.proposer_state = _NgramIndex(self.sizes)
        tokens = seq.token_ids
        index.extend(tokens)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            end = index.ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                period = len(tokens) - end
                return [tokens[end + i % period] for i in range(count)]
        return []
