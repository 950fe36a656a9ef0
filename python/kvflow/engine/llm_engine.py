"""The engine: requests in, one model step at a time over every running request, outputs out.

step() = scheduler.schedule() -> model_runner.execute() -> append tokens, detokenize, check stop
conditions, free finished requests' blocks -> RequestOutputs for every request that advanced."""

import logging
import random
import time
from dataclasses import dataclass

import torch

from kvflow._C import BlockAllocator
from kvflow.engine.config import EngineConfig
from kvflow.engine.kv_cache import kv_cache_bytes_per_block
from kvflow.engine.model_runner import ModelRunner, ScheduledRequest
from kvflow.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.engine.sampling_params import SamplingParams
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.engine.stop_strings import StopStringMatcher
from kvflow.loader import load_model
from kvflow.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("kvflow")


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    num_cached_prompt_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        loaded = load_model(config.model, config.torch_dtype, config.device)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        context = loaded.config.max_position_embeddings
        max_model_len = min(config.max_model_len or context, context)
        num_blocks = config.kv_cache_memory // kv_cache_bytes_per_block(loaded.config, config.block_size,
                                                                        config.torch_dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {config.kv_cache_memory} bytes holds no KV block")
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks, config.block_size, config.device)
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                                   config.block_size, config.enable_prefix_caching), self.allocator)
        self._requests: dict[str, _Request] = {}
        self._seeds = random.Random(config.seed)
        logger.info("kvflow engine: %s (%s) loaded in %.2f s; KV cache %d blocks x %d tokens = %d tokens "
                    "(max_model_len %d)", loaded.path, config.dtype, loaded.load_seconds, num_blocks,
                    config.block_size, num_blocks * config.block_size, max_model_len)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queues a request (text, or token ids). Raises ValueError for a malformed one, or one
        that could never fit the model's context or the KV pool."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            if any(not 0 <= t < self.model_config.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(request_id, ids, params, seed)
        self.scheduler.add(seq)
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        self._requests[request_id] = _Request(request_id, text, ids, seq, detokenizer, StopStringMatcher(params.stop),
                                              logprobs=[] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; unknown or finished ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        now = time.perf_counter()
        batch = []
        for s in plan.scheduled:
            seq = s.seq
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
                self._requests[seq.request_id].num_cached_prompt_tokens = seq.num_computed_tokens
            start = seq.num_computed_tokens
            batch.append(ScheduledRequest(seq.token_ids[start:start + s.num_new_tokens], start, seq.block_table,
                                          seq.params if s.samples else None, seq.seed, seq.prompt_token_ids,
                                          seq.output_token_ids))
        sampled = self.runner.execute(batch)
        now = time.perf_counter()
        for s, token in zip(plan.scheduled, sampled):
            if token is not None:
                seq = s.seq
                seq.output_token_ids.append(token.token_id)
                seq.times.token_times.append(now)
                if seq.times.first_token is None:
                    seq.times.first_token = now
                request = self._requests[seq.request_id]
                if request.logprobs is not None:
                    entry = {token.token_id: token.logprob}
                    entry.update({t: lp for t, lp in token.top_logprobs or []})
                    request.logprobs.append(entry)
        self.scheduler.on_step_done(plan.scheduled)
        return [self._advance(s.seq, now) for s, token in zip(plan.scheduled, sampled) if token is not None]

    def _advance(self, seq: Sequence, now: float) -> RequestOutput:
        """Detokenizes seq's new token, applies the stop conditions, and reports it."""
        request = self._requests[seq.request_id]
        params = seq.params
        token = seq.output_token_ids[-1]
        delta, stopped = request.stops.feed(request.detokenizer.step([token]))
        finish = None
        if stopped:
            finish = SequenceStatus.FINISHED_STOPPED
        elif not params.ignore_eos and token in self.tokenizer.stop_token_ids or token in params.stop_token_ids:
            finish = SequenceStatus.FINISHED_STOPPED
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            finish = SequenceStatus.FINISHED_LENGTH
        if finish is not None and not stopped:
            tail, stopped_at_end = request.stops.feed(request.detokenizer.flush())
            delta += tail + ("" if stopped_at_end else request.stops.flush())
        request.text += delta
        if finish is not None:
            seq.times.finished = now
            self.scheduler.finish(seq, finish)
            del self._requests[seq.request_id]
        return self._output(request, delta, [token])

    def _output(self, request: _Request, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        seq = request.seq
        status = seq.status
        completion = CompletionOutput(
            index=seq.index, text=request.text, token_ids=list(seq.output_token_ids),
            finish_reason=status.value if status.finished else None,
            logprobs=None if request.logprobs is None else list(request.logprobs),
            delta_text=delta_text, delta_token_ids=delta_ids)
        t = seq.times
        metrics = RequestMetrics(t.arrival, t.first_scheduled, t.first_token, list(t.token_times), t.finished,
                                 seq.num_preemptions, request.num_cached_prompt_tokens)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             status.finished, metrics)

    # ------------------------------------------------------------------ engine metrics

    def stats(self) -> dict:
        allocator = self.allocator.stats()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": allocator["used"] / self.allocator.num_blocks,
            "prefix_cache_hit_rate": allocator["hits"] / allocator["queries"] if allocator["queries"] else 0.0,
            "preemptions": self.scheduler.num_preemptions,
        }
