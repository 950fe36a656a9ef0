"""A request's state as the scheduler and the engine see it: token ids, progress through the KV
cache, blocks, and the timestamps its metrics come from. No tensors."""

import enum
import time
from dataclasses import dataclass, field

from kvflow.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"      # an end token or a stop string
    FINISHED_LENGTH = "length"     # max_tokens or the model's context
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    """One stream of tokens: the prompt, then what is generated after it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 index: int = 0):
        self.request_id = request_id
        self.index = index                     # which of the request's n samples
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0           # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []      # chained hashes of the full blocks registered so far
        self.num_preemptions = 0
        self.times = SequenceTimes()
        # Structured output: this sample's place in its grammar (structured_output.GrammarMatcher),
        # advanced by every token it accepts; None when unconstrained or once finished.
        self.grammar = None
        # Speculative decoding: the tokens proposed to follow this step's (set before each step,
        # verified in it, cleared after), the proposer's own state, and the tallies behind
        # RequestOutput.metrics and the acceptance that turns speculation down for this sequence.
        self.draft_token_ids: list[int] = []
        self.proposer_state = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.speculation = None  # engine.speculation.SpeculationGate, made by the engine

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, count: int) -> list[int]:
        """token_ids[start:start + count], without joining the prompt and the output when the
        range lies in one of them (a decode step's one token)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:start - prompt_len + count]
        if start + count <= prompt_len:
            return self.prompt_token_ids[start:start + count]
        return self.token_ids[start:start + count]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}#{self.index}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
