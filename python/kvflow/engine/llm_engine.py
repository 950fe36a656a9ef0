"""The engine: requests in, one model step at a time over every running request, outputs out.

step() = scheduler.schedule() -> model_runner.execute() -> append tokens, detokenize, check stop
conditions, free finished requests' blocks -> RequestOutputs for every request that advanced."""

import dataclasses
import logging
import random
import time
import weakref
from dataclasses import dataclass, field

import torch

from kvflow import platform
from kvflow._C import BlockAllocator
from kvflow.engine.config import CPU_KV_CACHE_MEMORY, EngineConfig
from kvflow.engine.cpu_threads import CpuThreadGovernor
from kvflow.engine.distributed.rank_group import RankGroup, TensorParallelError
from kvflow.engine.distributed.step_plan import RankReport, ReportRequest, Stop
from kvflow.engine.distributed.worker import rank_report, start_rank_group
from kvflow.engine.draft_proposer import DraftModelProposer
from kvflow.engine.kv_cache import cuda_kv_cache_budget, kv_cache_bytes_per_block
from kvflow.engine.model_runner import ModelRunner, SampledToken, ScheduledRequest
from kvflow.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.engine.sampling_params import SamplingParams, SamplingParamsError, check_int, check_text
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.engine.speculator import Speculator
from kvflow.engine.stop_strings import StopStringMatcher
from kvflow.engine.structured_output import StructuredOutputCompiler
from kvflow.layers.tensor_parallel import SINGLE_RANK, TensorParallel
from kvflow.loader import load_model
from kvflow.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("kvflow")

MAX_CUDA_GRAPH_BATCH = 256  # larger decode batches run eagerly: launch overhead matters less there


class EngineDeadError(RuntimeError):
    """The engine can run no more steps (a tensor-parallel rank died or hung); the reason says why."""


@dataclass
class _Sample:
    """One of a request's n parallel samples, with its own text stream."""
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    unforked: list[_Sample]  # samples 1..n-1 until sample 0 has computed the prompt
    num_cached_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(sample.seq.status.finished for sample in self.samples)


def sample_seed(seed: int, index: int) -> int:
    """Sample i of a request draws with a seed derived from (seed, i); sample 0 with seed itself."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


def load_engine_model(config: EngineConfig, parallel: TensorParallel, device: torch.device, ranks_here: int = 1):
    """The engine's model (this rank's shard of it) as config says; ranks_here: the ranks on this
    machine, which share its free memory for packed weight copies."""
    return load_model(config.model, config.torch_dtype, device, config.cpu_prepack_weights, config.max_model_len,
                      cpu_reserved_bytes=config.kv_cache_memory or CPU_KV_CACHE_MEMORY,
                      dequantize_weights=config.dequantize_weights, parallel=parallel, memory_share=1 / ranks_here)


def num_kv_blocks(config: EngineConfig, loaded, draft, device: torch.device) -> int:
    """KV blocks in kv_cache_memory (by default 1 GiB on the CPU, and on CUDA what
    gpu_memory_utilization leaves), a draft model's keys and values in the same blocks."""
    context = loaded.config.max_position_embeddings
    max_model_len = min(config.max_model_len or context, context)
    kv_cache_memory = config.kv_cache_memory
    if kv_cache_memory is None:
        kv_cache_memory = CPU_KV_CACHE_MEMORY if device.type != "cuda" else cuda_kv_cache_budget(
            loaded.model, loaded.config, config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
            max_model_len, config.gpu_memory_utilization, device)
    bytes_per_block = kv_cache_bytes_per_block(loaded.config, config.block_size, config.torch_dtype)
    if draft is not None:
        bytes_per_block += kv_cache_bytes_per_block(draft.config, config.block_size, config.torch_dtype)
    num_blocks = kv_cache_memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {kv_cache_memory} bytes holds no KV block")
    return num_blocks


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if not config.on_cuda:
            platform.set_batch_invariant(config.batch_invariant)
        elif config.batch_invariant:
            raise ValueError("batch_invariant is a CPU mode: the CUDA kernels have none")
        if config.tensor_parallel_size > 1 and config.speculative_config is not None \
                and config.speculative_config.method == "draft_model":
            raise ValueError("speculative_config: a draft model does not run with tensor_parallel_size > 1 "
                             "(the n-gram method does)")
        self.platform = platform.hold(self)  # the CPU instruction set stays as it is while this engine lives
        if not config.on_cuda and not self.platform.vector_kernels:
            logger.warning("kvflow: this CPU (%s) has no AVX2; the portable scalar kernels will be correct but slow",
                           self.platform.model)
        self.ranks: RankGroup | None = None  # tensor parallelism: the group, this process rank 0
        self.dead: str | None = None  # why the engine can run no more steps (a rank failed)
        device = torch.device(config.device)
        parallel = SINGLE_RANK
        if config.tensor_parallel_size > 1:
            self.ranks = start_rank_group(config)
            parallel, device = self.ranks.parallel, self.ranks.device
            # The ranks stop when the engine is shut down, collected, or at exit, whichever comes first.
            self._stop_ranks = weakref.finalize(self, self.ranks.close, Stop())
        try:
            self._build(config, parallel, device)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, parallel: TensorParallel, device: torch.device) -> None:
        tensor_parallel = self.ranks is not None
        self.cpu_threads = None if config.on_cuda or tensor_parallel else CpuThreadGovernor(torch.get_num_threads())
        loaded = load_engine_model(config, parallel, device, 1 if self.ranks is None else self.ranks.local_size)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        context = loaded.config.max_position_embeddings
        max_model_len = min(config.max_model_len or context, context)
        draft = self._load_draft(loaded) if config.speculative_config is not None else None
        if tensor_parallel:  # every rank loaded: the KV budget's profiling step has collectives
            self.ranks.synchronize()
        num_blocks = num_kv_blocks(config, loaded, draft, device)
        if tensor_parallel:
            num_blocks = self.ranks.agree_min(num_blocks)
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks, config.block_size, device,
                                  cpu_programs=not (config.enforce_eager or tensor_parallel), ranks=self.ranks)
        if self.runner.cpu_programs is not None:
            self.runner.cpu_programs.capture_idle(1)  # the first decode step of a lone request, ready
        if config.on_cuda and not (config.enforce_eager or tensor_parallel):
            start = time.perf_counter()
            sizes = self.runner.capture_decode_graphs(min(config.max_num_seqs, MAX_CUDA_GRAPH_BATCH), max_model_len)
            logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", sizes, time.perf_counter() - start)
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                                   config.block_size, config.enable_prefix_caching), self.allocator)
        self._requests: dict[str, _Request] = {}
        self._seeds = random.Random(config.seed)
        self._prompt_tokens = 0          # admitted so far
        self._cached_prompt_tokens = 0   # of which the prefix cache served
        self._generated_tokens = 0
        self._unforked_samples = 0       # samples 1..n-1 of requests whose prompt is not computed yet
        self._step_failures = 0          # model steps that raised (each aborted its requests)
        self._finished_requests: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}  # by finish reason
        self._grammar_compiler: StructuredOutputCompiler | None = None  # made for the first constrained request
        self.speculator = None
        if config.speculative_config is not None:
            proposer = None if draft is None else DraftModelProposer(
                draft.model, draft.config, num_blocks, config.block_size, config.device, self.allocator,
                config.speculative_config.num_speculative_tokens)
            self.speculator = Speculator(config.speculative_config, max_model_len,
                                         "cuda" if config.on_cuda else "cpu", proposer)
        logger.info("kvflow engine: %s (%s) loaded in %.2f s; KV cache %d blocks x %d tokens = %d tokens "
                    "(max_model_len %d)", loaded.path, config.dtype, loaded.load_seconds, num_blocks,
                    config.block_size, num_blocks * config.block_size, max_model_len)

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (nothing to do in one process). The engine runs no
        more steps after it."""
        if self.ranks is not None:
            self.ranks = None
            self.dead = self.dead or "the engine was shut down"
            self._stop_ranks()

    def parallel_reports(self) -> list[RankReport]:
        """Tensor parallelism: every rank's report (rank 0's first): the bytes of each parameter it
        holds and its collectives so far."""
        if self.ranks is None:
            raise ValueError("the engine runs in one process (tensor_parallel_size 1)")
        self.ranks.broadcast(ReportRequest())
        return self.ranks.gather_reports(rank_report(self.ranks, self.runner.model))

    def _load_draft(self, target):
        """speculative_config's draft model (None for other methods), in the target's dtype and on
        its device, its GGUF weights kept in their blocks. ValueError where its vocabulary is not
        the target's: its tokens would mean other text."""
        spec = self.config.speculative_config
        if spec.method != "draft_model":
            return None
        draft = load_model(spec.model, self.config.torch_dtype, self.config.device, False, self.config.max_model_len)
        probe = "Speculative decoding, 1 2 3: naïve café?"
        if (draft.config.vocab_size != target.config.vocab_size
                or draft.tokenizer.encode(probe) != target.tokenizer.encode(probe)):
            raise ValueError(f"speculative_config: the draft model {draft.path} has another vocabulary than the "
                             f"target's ({draft.config.vocab_size} tokens against {target.config.vocab_size}, or "
                             "other token ids for the same text): its drafts would mean other text")
        logger.info("kvflow draft model: %s loaded in %.2f s", draft.path, draft.load_seconds)
        return draft

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Queues a request (text, or token ids). Raises ValueError for a malformed one, or one
        that could never fit the model's context or the KV pool. arrival_time (perf_counter)
        defaults to now."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if params is not None and not isinstance(params, SamplingParams):
            raise SamplingParamsError("params", f"must be SamplingParams, got {type(params).__name__}")
        # The engine's own copy, checked again: the caller's may have been changed since it was made.
        params = SamplingParams() if params is None else dataclasses.replace(params)
        if not isinstance(request_id, str):
            raise SamplingParamsError("request_id", f"must be a string, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.prompt_token_ids(prompt)
        self.check_request(ids, params)
        grammar = None if params.structured_outputs is None else self.compile_grammar(params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        samples = []
        for index in range(params.n):
            seq = Sequence(request_id, ids, params, sample_seed(seed, index), index)
            if grammar is not None:  # each sample its own matcher
                seq.grammar = self._grammar_compiler.matcher(grammar)
            if arrival_time is not None:
                seq.times.arrival = arrival_time
            samples.append(_Sample(seq, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                                   StopStringMatcher(params.stop), logprobs=[] if params.logprobs is not None else None))
        self.scheduler.add(samples[0].seq)
        self._requests[request_id] = _Request(request_id, text if text is not None else prompt_text, ids, samples,
                                              samples[1:])
        self._unforked_samples += params.n - 1

    def prompt_token_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids, checked: text
        must be valid Unicode, ids ints (not floats or bools) in the vocabulary, and neither empty."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(check_text("prompt", prompt))
            if not ids:
                raise SamplingParamsError("prompt", "must not be empty")
            return prompt, ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise SamplingParamsError("prompt", "must be text or a non-empty list of token ids")
        self.check_num_prompt_ids(len(prompt))  # before looking at each id: the list may be huge
        vocab = self.model_config.vocab_size
        return None, [check_int("prompt", t, 0, vocab - 1) for t in prompt]

    def check_num_prompt_ids(self, count: int) -> None:
        """A prompt of `count` token ids must leave room for an answer; judged by the count alone.
        Reads only fixed configuration, so any thread may call it."""
        if count >= self.max_model_len:
            raise SamplingParamsError("prompt", f"has {count} tokens; the model's context (max_model_len) is "
                                                f"{self.max_model_len}, which leaves no room for an answer")

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError unless a request of these (checked) ids and params can be served:
        its stop tokens in the vocabulary, and its length within the context and the KV pool."""
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"must be token ids in [0, {vocab})")
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a request's structured_outputs (SamplingParamsError for one that
        cannot be compiled)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = StructuredOutputCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler.compile(params.structured_outputs)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request now and frees its blocks. Returns its final output (the unfinished
        samples with finish_reason "abort"); None for an unknown or finished id."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self._unforked_samples -= len(request.unforked)
        request.unforked = []
        self._finished_requests["abort"] += 1
        now = time.perf_counter()
        for sample in request.samples:
            if not sample.seq.status.finished:
                sample.seq.times.finished = now
                self.scheduler.finish(sample.seq, SequenceStatus.FINISHED_ABORTED)
            sample.seq.grammar = None
            sample.delta_text, sample.delta_token_ids = "", []
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_queued_samples(self) -> int:
        """Samples not yet running: the scheduler's waiting queue, and the samples 1..n-1 of
        requests whose prompt is not computed yet. Safe to read from another thread."""
        return len(self.scheduler.waiting) + self._unforked_samples

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.allocator.num_blocks * self.scheduler.config.block_size

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.num_queued_samples)
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self._requests:  # the scheduler guarantees a lone request progresses: this is a bug
                self._step_failures += 1
                pending = list(self._requests)
                logger.error("kvflow: the scheduler made no progress; %d pending requests were aborted", len(pending))
                for request_id in pending:  # else they would wait forever, and every step fail again
                    self.abort_request(request_id)
                raise RuntimeError(f"the scheduler made no progress with {len(pending)} requests pending")
            return []
        now = time.perf_counter()
        batch = []
        for s in plan.scheduled:
            seq = s.seq
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
                if seq.index == 0:
                    self._requests[seq.request_id].num_cached_prompt_tokens = seq.num_computed_tokens
                    self._prompt_tokens += len(seq.prompt_token_ids)
                    self._cached_prompt_tokens += seq.num_computed_tokens
            start = seq.num_computed_tokens
            drafts = seq.draft_token_ids if s.num_draft_tokens else []
            tokens = seq.tokens(start, s.num_new_tokens - len(drafts))
            batch.append(ScheduledRequest(tokens + drafts if drafts else tokens, start, seq.block_table,
                                          seq.params if s.samples else None, seq.seed, seq.prompt_token_ids,
                                          seq.output_token_ids, seq.grammar if s.samples else None, drafts))
        steps = self._decode_steps(plan)
        governor = self.cpu_threads
        one_thread = governor is not None and governor.begin_step()
        try:
            ran = self.runner.execute_steps(batch, steps, self._stop_token_ids(plan)) if steps > 1 else None
            if ran is None:
                sampled, seconds_before_last = self.runner.execute(batch, plan.copies), None
            else:
                sampled, seconds_before_last = ran
            for s in plan.scheduled:  # the steps that ran (their blocks stay reserved)
                s.num_steps = 1 if ran is None else len(seconds_before_last)
        except BaseException as error:
            # Every request's input was checked when it was added, so this is the engine's own
            # fault (a kernel error, or an interrupt). The step's keys and values are half
            # written, yet its full blocks are already in the prefix cache: end its requests and
            # drop those entries before anyone reuses them.
            if isinstance(error, Exception):
                self._step_failures += 1
                logger.error("kvflow: a model step of %d requests failed and they were aborted: %s: %s",
                             len({s.seq.request_id for s in plan.scheduled}), type(error).__name__, error)
            for s in plan.scheduled:
                self.abort_request(s.seq.request_id)
            self.allocator.reset_prefix_cache()
            if isinstance(error, TensorParallelError):  # no rank can trust the others' state any more
                self._die(str(error))
                raise EngineDeadError(self.dead) from error
            raise
        finally:
            if governor is not None:
                governor.end_step(one_thread)
        now = time.perf_counter()
        # Each token's time: the end of the step that drew it.
        token_times = None if seconds_before_last is None else [now - before for before in seconds_before_last]
        advanced = []
        for s, tokens in zip(plan.scheduled, sampled):
            if tokens is None:
                continue
            seq = s.seq
            if s.num_draft_tokens:
                s.num_accepted_tokens = len(tokens) - 1
                self.speculator.record(seq, s.num_draft_tokens, s.num_accepted_tokens)
            if seq.times.first_token is None:
                seq.times.first_token = now if token_times is None else token_times[0]
            advanced.append((self._requests[seq.request_id].samples[seq.index], tokens))
        self.scheduler.on_step_done(plan.scheduled)
        touched: dict[str, _Request] = {}
        for sample, tokens in advanced:
            request = self._requests[sample.seq.request_id]
            if sample.seq.index == 0 and request.unforked:
                self._fork(request)
            self._advance(sample, now, tokens, token_times)
            touched[request.request_id] = request
        outputs = [self._output(request) for request in touched.values()
                   if request.finished or request.samples[0].seq.params.output_kind == "cumulative"]
        for request in touched.values():
            for sample in request.samples:
                sample.delta_text, sample.delta_token_ids = "", []
            if request.finished:
                del self._requests[request.request_id]
                self._finished_requests[request.samples[0].seq.status.value] += 1
        return outputs

    def _decode_steps(self, plan) -> int:
        """How many decode steps the plan runs back to back (num_scheduler_steps; their blocks
        reserved now): 1 unless the runner has a CPU program for the batch, every scheduled
        sequence decodes one token it samples, nobody waits to be admitted, and no row needs a
        step of its own (drafts, block copies, log-probabilities, penalties, a grammar); never
        past a request's max_tokens or the context. Tokens drawn after one that ends a request are
        dropped."""
        steps = self.config.num_scheduler_steps
        if steps < 2 or not self.runner.runs_several_steps(len(plan.scheduled)) or self.speculator is not None \
                or self.num_queued_samples or plan.copies or plan.preempted:
            return 1
        for s in plan.scheduled:
            seq = s.seq
            if s.num_new_tokens != 1 or s.num_draft_tokens or not s.samples or seq.grammar is not None \
                    or seq.params.needs_logits:
                return 1
            steps = min(steps, seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        return steps if steps > 1 and self.scheduler.reserve_steps(plan, steps) else 1

    def _stop_token_ids(self, plan) -> list[int]:
        """The tokens that would end some scheduled request: once every request has drawn one,
        the rest of a multi-step run would be dropped."""
        ids = set()
        for s in plan.scheduled:
            params = s.seq.params
            ids.update(params.stop_token_ids)
            if not params.ignore_eos:
                ids.update(self.tokenizer.stop_token_ids)
        return sorted(ids)

    def _die(self, reason: str) -> None:
        """After a rank failed: every request in flight ends (finish_reason "abort"), the other
        ranks are stopped, and every later call fails with EngineDeadError naming the reason."""
        self.dead = reason
        for request_id in list(self._requests):
            self.abort_request(request_id)
        if self.ranks is not None:
            self.ranks = None
            self._stop_ranks()  # the group failed: no stop message, spawned workers are ended

    def _fork(self, request: _Request) -> None:
        """Samples 1..n-1 join the batch now that sample 0 has computed the prompt (see
        Scheduler.fork)."""
        self.scheduler.fork(request.samples[0].seq, [sample.seq for sample in request.unforked],
                            len(request.prompt_token_ids))
        self._unforked_samples -= len(request.unforked)
        request.unforked = []

    def _advance(self, sample: _Sample, now: float, tokens: list[SampledToken],
                 token_times: list[float] | None = None) -> None:
        """Appends the sample's new tokens one by one, detokenizing each and applying the stop
        conditions after it; the tokens after one that ends the sample are dropped. token_times:
        each token's own time, where the step ran several decode steps (else all are now)."""
        seq = sample.seq
        for j, token in enumerate(tokens):
            seq.output_token_ids.append(token.token_id)
            seq.times.token_times.append(now if token_times is None else token_times[j])
            if sample.logprobs is not None:
                entry = {token.token_id: token.logprob}
                entry.update({t: lp for t, lp in token.top_logprobs or []})
                sample.logprobs.append(entry)
            self._generated_tokens += 1
            self._advance_one(sample, now)
            if seq.status.finished:
                break

    def _advance_one(self, sample: _Sample, now: float) -> None:
        """Detokenizes the sample's last token and applies the stop conditions."""
        seq, params = sample.seq, sample.seq.params
        token = seq.output_token_ids[-1]
        grammar_done = False
        if seq.grammar is not None:
            if not seq.grammar.accept(token):  # the mask allowed it: a grammar engine fault
                logger.error("kvflow: request %s: the grammar refused token %d that its own mask allowed; the "
                             "sample is aborted", seq.request_id, token)
                seq.times.finished = now
                seq.grammar = None
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                return
            grammar_done = seq.grammar.finished  # it accepted a stop token: the output is complete
        if ((not params.ignore_eos and token in self.tokenizer.stop_token_ids) or token in params.stop_token_ids
                or grammar_done):
            # An end token ends the text before it, as in vLLM: its own text is not returned.
            finish = SequenceStatus.FINISHED_STOPPED
            delta, stopped = sample.stops.feed(sample.detokenizer.flush())
            delta += "" if stopped else sample.stops.flush()
        else:
            delta, stopped = sample.stops.feed(sample.detokenizer.step([token]))
            finish = None
            if stopped:
                finish = SequenceStatus.FINISHED_STOPPED
            elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                finish = SequenceStatus.FINISHED_LENGTH
                tail, stopped_at_end = sample.stops.feed(sample.detokenizer.flush())
                delta += tail + ("" if stopped_at_end else sample.stops.flush())
                if stopped_at_end:
                    finish = SequenceStatus.FINISHED_STOPPED
        sample.text += delta
        sample.delta_text += delta
        sample.delta_token_ids.append(token)
        if finish is not None:
            seq.times.finished = now
            seq.grammar = None
            self.scheduler.finish(seq, finish)

    def _output(self, request: _Request) -> RequestOutput:
        completions = []
        for sample in request.samples:
            status = sample.seq.status
            completions.append(CompletionOutput(
                index=sample.seq.index, text=sample.text, token_ids=list(sample.seq.output_token_ids),
                finish_reason=status.value if status.finished else None,
                logprobs=None if sample.logprobs is None else list(sample.logprobs),
                delta_text=sample.delta_text, delta_token_ids=list(sample.delta_token_ids)))
        first = request.samples[0].seq
        t = first.times
        finished_times = [s.seq.times.finished for s in request.samples]
        seqs = [sample.seq for sample in request.samples]
        metrics = RequestMetrics(t.arrival, t.first_scheduled, t.first_token, list(t.token_times),
                                 max(finished_times) if all(f is not None for f in finished_times) else None,
                                 sum(q.num_preemptions for q in seqs), request.num_cached_prompt_tokens,
                                 sum(q.num_verifications for q in seqs), sum(q.num_draft_tokens for q in seqs),
                                 sum(q.num_accepted_tokens for q in seqs))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, metrics)

    # ------------------------------------------------------------------ engine metrics

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": self.allocator.num_used_blocks / self.allocator.num_blocks,
            # of the prompt tokens admitted, the share the prefix cache served
            "prefix_cache_hit_rate": self._cached_prompt_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            "preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self._prompt_tokens,
            "generated_tokens": self._generated_tokens,
            "cached_prompt_tokens": self._cached_prompt_tokens,
            "finished_requests": dict(self._finished_requests),
            "step_failures": self._step_failures,
            "spec_decode": None if self.speculator is None else self.speculator.stats(),
            "tensor_parallel": None if self.ranks is None else self.ranks.stats(),
            "dead": self.dead,
        }
