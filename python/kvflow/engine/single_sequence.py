"""Runs one request to completion on the model runner: the prompt in one step, then one token per
step, growing the request's block table as its context grows. The continuous-batching engine runs
many requests through the same runner; this loop is the one-request case (CLI generate, the model
benchmark, the parity tests)."""

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvflow._C import BlockAllocator
from kvflow.engine.model_runner import ModelRunner, ScheduledRequest
from kvflow.engine.sampling_params import SamplingParams


@dataclass
class GenerationStep:
    token_id: int
    finish_reason: str | None = None   # "stop" (end token), "length" (max_tokens or the context), None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class GenerationTimings:
    prompt_tokens: int = 0
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter at each token's arrival

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def generate_tokens(runner: ModelRunner, prompt_token_ids: list[int], params: SamplingParams,
                    stop_token_ids: set[int] | frozenset[int] = frozenset(),
                    timings: GenerationTimings | None = None) -> Iterator[GenerationStep]:
    """Yields each sampled token as soon as it exists. Ends at an end token (stop_token_ids or
    params.stop_token_ids, unless params.ignore_eos), at params.max_tokens, or at the model's
    context length. Stop strings are the detokenizer's business, not this loop's."""
    context = runner.config.max_position_embeddings
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= context:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {context}, "
                         "which leaves no room for an answer")
    max_len = min(context, len(prompt_token_ids) + params.max_tokens)
    blocks_needed = -(-max_len // runner.block_size)
    if blocks_needed > runner.num_blocks:
        raise ValueError(f"the request needs {blocks_needed} KV blocks of {runner.block_size} tokens; the cache "
                         f"holds {runner.num_blocks}")
    end_tokens = set() if params.ignore_eos else set(stop_token_ids)
    end_tokens |= set(params.stop_token_ids)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    block_table: list[int] = []
    output: list[int] = []
    if timings is not None:
        timings.prompt_tokens = len(prompt_token_ids)
        timings.start = time.perf_counter()
    try:
        new_tokens, computed = list(prompt_token_ids), 0
        while True:
            seq_len = computed + len(new_tokens)
            missing = -(-seq_len // runner.block_size) - len(block_table)
            if missing > 0:
                block_table += allocator.allocate(missing)
            request = ScheduledRequest(new_tokens, computed, block_table, params, seed,
                                       prompt_token_ids=prompt_token_ids, output_token_ids=output)
            sampled = runner.execute([request])[0]
            if timings is not None:
                timings.token_times.append(time.perf_counter())
            output.append(sampled.token_id)
            computed = seq_len
            finish = None
            if sampled.token_id in end_tokens:
                finish = "stop"
            elif len(output) >= params.max_tokens or computed + 1 >= max_len + 1 or computed + 1 > context - 1:
                finish = "length"
            yield GenerationStep(sampled.token_id, finish, sampled.logprob, sampled.top_logprobs)
            if finish is not None:
                return
            new_tokens = [sampled.token_id]
    finally:
        allocator.free(block_table)
