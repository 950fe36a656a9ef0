"""What rank 0 sends the other ranks: a step to run, a request for their report, or stop."""

from dataclasses import dataclass


@dataclass
class StepPlan:
    """One model step as the ranks all run it: per request its new tokens, the tokens already in
    its KV cache, its block table and how many rows of logits it samples (0: none due this step),
    and the KV blocks to copy first."""
    token_ids: list[list[int]]
    num_computed_tokens: list[int]
    block_tables: list[list[int]]
    num_sampled_rows: list[int]
    block_copies: list[tuple[int, int]]

    @classmethod
    def of(cls, requests, block_copies: list[tuple[int, int]] | None) -> "StepPlan":
        """The plan of a step of ScheduledRequests (kvflow.engine.model_runner)."""
        return cls([r.token_ids for r in requests], [r.num_computed_tokens for r in requests],
                   [r.block_table for r in requests],
                   [r.num_sampled_rows if r.sampling is not None else 0 for r in requests], list(block_copies or []))

    @property
    def seq_lens(self) -> list[int]:
        return [computed + len(tokens) for computed, tokens in zip(self.num_computed_tokens, self.token_ids)]


@dataclass
class ReportRequest:
    """Each rank answers with its RankReport."""


@dataclass
class RankReport:
    rank: int
    pid: int
    parameter_bytes: dict[str, int]   # per parameter name, the bytes this rank holds
    num_all_reduces: int
    num_all_gathers: int
    collective_seconds: float         # time spent in all-reduces and all-gathers


@dataclass
class Stop:
    """The engine shuts down: each rank leaves its loop."""
