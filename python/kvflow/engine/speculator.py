"""Speculative decoding's engine side: before each step, draft tokens for the running requests
that are decoding; after it, the tallies of what was accepted, per request and engine-wide, and
the gate that turns speculation down for a request whose drafts keep failing."""

from kvflow.engine.ngram_proposer import NgramProposer
from kvflow.engine.sequence import Sequence
from kvflow.engine.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from kvflow.ops.linear import SMALL_LINEAR_MAX_ROWS

# A request whose verifications accept fewer drafts than this on average (a moving average)
# stops proposing for a while: a verification with no accepted draft costs more than a plain step.
MIN_MEAN_ACCEPTED = 0.5
ACCEPTANCE_SMOOTHING = 0.3  # weight of the newest verification in the moving average
FIRST_PAUSE_STEPS = 4       # steps without drafts after the average first falls below; doubles each time
MAX_PAUSE_STEPS = 256
FIRST_DRAFT_LENGTH = 2


class SpeculationGate:
    """One sequence's draft length and pause. The length doubles while every draft is accepted
    (a copied span tends to go on) and falls to one past the accepted run when a draft is
    rejected (where acceptance tends to end): every draft row costs compute. A moving average of
    the drafts accepted per verification pauses speculation for a request whose drafts keep
    failing."""

    def __init__(self):
        self.length = FIRST_DRAFT_LENGTH
        self.mean_accepted = 1.0  # optimistic: a request starts speculating
        self.paused_steps = 0
        self.next_pause = FIRST_PAUSE_STEPS

    def draft_limit(self, k: int) -> int:
        """Drafts worth proposing, at most k."""
        return max(1, min(k, self.length))

    def open(self) -> bool:
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.length = 2 * max(drafted, 1) if accepted == drafted else accepted + 1
        self.mean_accepted += ACCEPTANCE_SMOOTHING * (accepted - self.mean_accepted)
        if self.mean_accepted < MIN_MEAN_ACCEPTED:
            self.paused_steps = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
            self.mean_accepted = MIN_MEAN_ACCEPTED  # one good verification after the pause keeps it going
        elif accepted > 0:
            self.next_pause = FIRST_PAUSE_STEPS


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, device_type: str = "cpu", proposer=None):
        """proposer: the draft model's (draft_proposer.DraftModelProposer) for method draft_model;
        n-gram lookup is made here."""
        self.config = config
        self.max_model_len = max_model_len
        self.max_batch = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[device_type]
        # On the CPU a step of up to SMALL_LINEAR_MAX_ROWS rows runs in a program of exactly its
        # size; one row more pads it to the next class of 8 (cpu_programs.program_batch_size).
        self.max_step_rows = SMALL_LINEAR_MAX_ROWS if device_type == "cpu" else None
        if config.method == "ngram":
            proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        elif proposer is None:
            raise ValueError(f"speculative_config: method {config.method!r} needs its proposer")
        self.proposer = proposer
        self.num_drafts = 0              # verifications (steps of a request with at least one draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens  # drafts accepted at position i

    def propose(self, running: list[Sequence], num_waiting: int = 0) -> None:
        """Sets draft_token_ids of each running sequence that decodes this step (one new token, a
        sampled one) and has room: within max_tokens and the context, and its gate open; none
        while more than disable_by_batch_size requests are running or waiting. A request with a
        grammar keeps the drafts its grammar allows, up to the first it forbids (verification
        masks each row after the drafts before it)."""
        if len(running) + num_waiting > self.max_batch:
            return
        spare_rows = None if self.max_step_rows is None else self.max_step_rows - len(running)
        seqs, limits = [], []
        for seq in running:
            if spare_rows is not None and spare_rows <= 0:
                break
            if seq.num_uncomputed_tokens != 1 or not seq.output_token_ids:
                continue
            gate = seq.speculation
            if gate is None:
                gate = seq.speculation = SpeculationGate()
            if not gate.open():
                continue
            limit = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            limit = min(limit, gate.draft_limit(self.config.num_speculative_tokens))
            if spare_rows is not None:
                limit = min(limit, spare_rows)
                spare_rows -= max(limit, 0)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if seqs:
            self.proposer.propose(seqs, limits)
            for seq in seqs:
                if seq.grammar is not None and seq.draft_token_ids:
                    del seq.draft_token_ids[seq.grammar.valid_prefix(seq.draft_token_ids):]

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification of `drafted` draft tokens of seq, `accepted` of them accepted."""
        seq.num_verifications += 1
        seq.num_draft_tokens += drafted
        seq.num_accepted_tokens += accepted
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        if seq.speculation is not None:
            seq.speculation.record(drafted, accepted)

    def stats(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}
