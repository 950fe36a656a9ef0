"""Turns one scheduled step (which requests, which new tokens) into tensors once, runs the model
over all of them as one flattened batch, and samples the requests that are due a token."""

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.attention_metadata import HostMetadata
from kvflow.engine.cpu_programs import CpuDecodePrograms
from kvflow.engine.cuda_graphs import DecodeCudaGraphs
from kvflow.engine.distributed.rank_group import TensorParallelError
from kvflow.engine.distributed.step_plan import StepPlan
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.engine.sampling_params import SamplingParams
from kvflow.engine.structured_output import GrammarMatcher
from kvflow.models.config import ModelConfig
from kvflow.ops.cache import copy_blocks
from kvflow.ops.sampling import apply_penalties, apply_token_bitmask, compute_logprobs, rejection_sample, sample


@dataclass
class ScheduledRequest:
    """One request's share of a step."""
    token_ids: list[int]               # the new tokens: a prompt chunk, or the last sampled token
    num_computed_tokens: int           # tokens of this request already in the KV cache
    block_table: list[int]             # covers num_computed_tokens + len(token_ids) tokens
    sampling: SamplingParams | None    # None: no token is due this step (a prompt chunk that is not the last)
    seed: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)  # read for penalties
    output_token_ids: list[int] = field(default_factory=list)  # the tokens sampled so far
    grammar: GrammarMatcher | None = None  # structured output: the tokens allowed next
    draft_token_ids: list[int] = field(default_factory=list)  # speculative: the last of token_ids, to verify

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits this step samples: the last token's, and one per draft before it."""
        return 1 + len(self.draft_token_ids)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def accept_drafts(requests: list[ScheduledRequest], drawn: list[SampledToken]) -> list[list[SampledToken]]:
    """Each request's rows drawn one by one (drawn, request after request), kept up to the first
    draw that is not the row's draft: rejection_sample's rule, where the program drew each row as
    sample() does at its own output index."""
    results, row = [], 0
    for r in requests:
        tokens = []
        for j in range(r.num_sampled_rows):
            tokens.append(drawn[row + j])
            if j == len(r.draft_token_ids) or drawn[row + j].token_id != r.draft_token_ids[j]:
                break
        results.append(tokens)
        row += r.num_sampled_rows
    return results


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 device: torch.device | str = "cpu", cpu_programs: bool = True, ranks=None):
        """cpu_programs: on the CPU, decode steps replay captured programs (cpu_programs.py);
        False runs every step op by op. ranks: tensor parallelism, this runner rank 0's, which
        sends each step's plan (run_plan) to the other ranks of the RankGroup first."""
        self.model = model
        self.ranks = ranks
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, model.dtype, self.device)
        self.decode_graphs: DecodeCudaGraphs | None = None
        self.cpu_programs: CpuDecodePrograms | None = None
        self._last_sampling_rows: tuple | None = None
        self._offsets: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # batch size -> (tensor, its numpy view)
        if self.device.type == "cpu" and cpu_programs:
            self.cpu_programs = CpuDecodePrograms(model, self.kv_caches, block_size, config.max_position_embeddings)

    def capture_decode_graphs(self, max_batch: int, max_seq_len: int) -> list[int]:
        """On CUDA: captures the decode graphs (see cuda_graphs.py); returns the batch sizes."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {self.device}")
        self.decode_graphs = DecodeCudaGraphs(self.model, self.kv_caches, self.block_size, max_seq_len, max_batch,
                                              self.device)
        return self.decode_graphs.sizes

    def execute(self, requests: list[ScheduledRequest],
                block_copies: list[tuple[int, int]] | None = None) -> list[list[SampledToken] | None]:
        """Runs one step, after copying each (source, destination) block of block_copies in every
        layer's cache (blocks about to be written that other requests share); returns, per
        request, its new tokens (one, or with drafts the accepted ones and the token after them),
        or None where none was due."""
        if self.ranks is not None:
            return self._execute_on_every_rank(requests, block_copies)
        self._copy_blocks(block_copies)
        if not requests:
            return []
        step = None if self.cpu_programs is None else self.cpu_programs.run(requests)
        if step is not None:
            if any(r.draft_token_ids for r in requests):
                if not step.needs_logits:
                    return accept_drafts(requests, [SampledToken(t) for t in step.token_ids])
                with torch.inference_mode():
                    return self._verify(step.logits, requests)
            if not step.needs_logits:
                return [[SampledToken(t)] for t in step.token_ids]
            with torch.inference_mode():  # a program's outputs are inference tensors
                return [[t] for t in self._sample(step.logits, requests, step.token_ids)]
        with torch.inference_mode():
            return self._execute_op_by_op(requests)

    def runs_several_steps(self, num_requests: int) -> bool:
        """Whether execute_steps can run a decode of num_requests here: CPU programs, one
        process, and the batch's class already captured (its first step captures it)."""
        return self.ranks is None and self.cpu_programs is not None and self.cpu_programs.has_program(num_requests)

    def execute_steps(self, requests: list[ScheduledRequest], steps: int,
                      stop_token_ids: list[int]) -> tuple[list[list[SampledToken]], list[float]] | None:
        """Runs up to `steps` decode steps back to back on a CPU program (cpu_programs.run_steps),
        for requests that each bring one token, no drafts and no block copies, with blocks for
        every step's position; fewer once every request has drawn one of stop_token_ids. Returns
        each request's tokens, one a step run, and each step's end in seconds before the last
        one's; None where no program can run them (nothing was run)."""
        if not self.runs_several_steps(len(requests)):
            return None
        result = self.cpu_programs.run_steps(requests, steps, stop_token_ids)
        if result is None:
            return None
        return [[SampledToken(t) for t in tokens] for tokens in result.token_ids], result.seconds_before_last

    def _execute_op_by_op(self, requests: list[ScheduledRequest]) -> list[list[SampledToken] | None]:
        """A step the model runs op by op (or a CUDA graph replays)."""
        self._check(requests)
        return self._sample_due(requests, self.run_plan(StepPlan.of(requests, None)))

    def _execute_on_every_rank(self, requests: list[ScheduledRequest],
                               block_copies: list[tuple[int, int]] | None) -> list[list[SampledToken] | None]:
        """Tensor parallelism: the step's plan to every rank, then rank 0's share of it, then the
        sampling (here only: the LM head gathered the whole logits rows)."""
        self._check(requests)
        plan = StepPlan.of(requests, block_copies)
        self.ranks.broadcast(plan)
        try:
            logits = self.run_plan(plan)
        except BaseException as error:  # the other ranks are inside this step's collectives: out of step now
            self.ranks.fail(f"tensor parallel rank 0 failed within a step: {type(error).__name__}: {error}")
            raise TensorParallelError(self.ranks.failure) from error
        with torch.inference_mode():
            return self._sample_due(requests, logits)

    def _check(self, requests: list[ScheduledRequest]) -> None:
        for r in requests:
            if not r.token_ids:
                raise ValueError("a scheduled request must bring at least one new token")
            if r.seq_len > self.config.max_position_embeddings:
                raise ValueError(f"a request of {r.seq_len} tokens exceeds the model's context of "
                                 f"{self.config.max_position_embeddings}")

    def _copy_blocks(self, block_copies: list[tuple[int, int]] | None) -> None:
        if block_copies:
            copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches],
                        torch.tensor(block_copies, dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> torch.Tensor | None:
        """Copies the plan's blocks, runs the model over its tokens op by op (or a CUDA graph
        replays them), and returns the float32 logits of its sampled rows, request after request
        (None where no request samples)."""
        self._copy_blocks(plan.block_copies)
        if not plan.token_ids:
            return None
        graphs = self.decode_graphs
        host = HostMetadata.of([len(t) for t in plan.token_ids], plan.seq_lens, plan.block_tables, self.block_size,
                               self.num_blocks)
        # With CUDA graphs the metadata stays on the host until it is known whether it is copied
        # into the graphs' static buffers or uploaded for an eager step.
        metadata = host.to_tensors(self.device if graphs is None else "cpu")
        input_ids = torch.tensor([t for tokens in plan.token_ids for t in tokens], dtype=torch.int64)
        if graphs is not None and graphs.can_run(metadata):
            hidden = graphs.run(input_ids, metadata)
        else:
            hidden = self.model(input_ids.to(self.device), metadata.to(self.device), self.kv_caches)
        rows, end = [], 0
        for tokens, sampled in zip(plan.token_ids, plan.num_sampled_rows):
            end += len(tokens)
            rows.extend(range(end - sampled, end))
        if not rows:
            return None
        sampled_hidden = hidden if len(rows) == hidden.shape[0] else hidden[self._tensor(rows, torch.int64)]
        return self.model.compute_logits(sampled_hidden)

    def _sample_due(self, requests: list[ScheduledRequest],
                    logits: torch.Tensor | None) -> list[list[SampledToken] | None]:
        """Each due request's new tokens from its rows of logits (see run_plan); None for the others."""
        due = [i for i, r in enumerate(requests) if r.sampling is not None]
        results: list[list[SampledToken] | None] = [None] * len(requests)
        if not due:
            return results
        due_requests = [requests[i] for i in due]
        if any(r.draft_token_ids for r in due_requests):
            for i, tokens in zip(due, self._verify(logits, due_requests)):
                results[i] = tokens
        else:
            for i, sampled in zip(due, self._sample(logits, due_requests)):
                results[i] = [sampled]
        return results

    def _verify(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> list[list[SampledToken]]:
        """Speculative decoding: each request's rows (one per draft, then the last) verified by
        rejection_sample; grammar masks and penalties first, each row's mask and penalties
        counting the drafts before it as output. Returns each request's accepted drafts and the token after."""
        params = [r.sampling for r in requests]
        cu_rows = [0]
        for r in requests:
            cu_rows.append(cu_rows[-1] + r.num_sampled_rows)
        raw_logits = logits
        wants_logprobs = any(p.logprobs is not None for p in params)
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if (constrained or penalized) and wants_logprobs:
            raw_logits = logits.clone()
        if constrained:
            self._apply_grammar_masks(logits, requests, constrained, [cu_rows[i] for i in constrained])
        if penalized:
            row_requests, row_outputs = [], []
            for r in requests:
                for j in range(r.num_sampled_rows):
                    row_requests.append(r)
                    row_outputs.append(r.output_token_ids + r.draft_token_ids[:j] if j else r.output_token_ids)
            self._apply_penalties(logits, row_requests, row_outputs)
        drafts = [t for r in requests for t in r.draft_token_ids + [-1]]
        temperature, top_k, top_p, min_p, seeds = self._sampling_rows(params, [r.seed for r in requests])
        out, num_emitted = rejection_sample(logits, self._tensor(drafts, torch.int64), self._tensor(cu_rows, torch.int64),
                                            temperature, top_k, top_p, min_p, seeds, self._output_offsets(requests))
        out, num_emitted = out.tolist(), num_emitted.tolist()
        results = [[SampledToken(t) for t in out[cu_rows[b]:cu_rows[b] + num_emitted[b]]] for b in range(len(requests))]
        if wants_logprobs:
            num_top = max(p.logprobs or 0 for p in params)
            emitted_rows = [row for b in range(len(requests)) for row in range(cu_rows[b], cu_rows[b] + num_emitted[b])]
            tokens = [t.token_id for tokens in results for t in tokens]
            chosen, top_ids, top_values = compute_logprobs(raw_logits[self._tensor(emitted_rows, torch.int64)],
                                                           self._tensor(tokens, torch.int64), num_top)
            chosen, top_ids, top_values = chosen.tolist(), top_ids.tolist(), top_values.tolist()
            row = 0
            for p, tokens in zip(params, results):
                for token in tokens:
                    if p.logprobs is not None:
                        token.logprob = chosen[row]
                        token.top_logprobs = list(zip(top_ids[row][: p.logprobs], top_values[row][: p.logprobs]))
                    row += 1
        return results

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                token_ids: list[int] | None = None) -> list[SampledToken]:
        """Grammar masks, then penalties, then the draw (again, where they changed the logits
        that a CPU program drew token_ids from), then log-probabilities of the raw logits."""
        params = [r.sampling for r in requests]
        raw_logits = logits
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        penalized = any(p.has_penalties for p in params)
        if constrained or penalized:
            if any(p.logprobs is not None for p in params):
                raw_logits = logits.clone()
            if constrained:
                self._apply_grammar_masks(logits, requests, constrained, constrained)
            if penalized:
                self._apply_penalties(logits, requests, [r.output_token_ids for r in requests])
            token_ids = None
        if token_ids is None:
            tokens = sample(logits, *self._sampling_rows(params, [r.seed for r in requests]),
                            self._output_offsets(requests))
            token_ids = tokens.tolist()
        else:
            tokens = self._tensor(token_ids, torch.int64)
        results = [SampledToken(t) for t in token_ids]
        if any(p.logprobs is not None for p in params):
            num_top = max(p.logprobs or 0 for p in params)
            chosen, top_ids, top_values = compute_logprobs(raw_logits, tokens, num_top)
            chosen, top_ids, top_values = chosen.tolist(), top_ids.tolist(), top_values.tolist()
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    results[i].logprob = chosen[i]
                    results[i].top_logprobs = list(zip(top_ids[i][: p.logprobs], top_values[i][: p.logprobs]))
        return results

    def _apply_grammar_masks(self, logits: torch.Tensor, requests: list[ScheduledRequest], constrained: list[int],
                             first_rows: list[int]) -> None:
        """Each constrained request's allowed tokens, from its grammar matcher on the host, as
        -inf elsewhere in its logits rows: request constrained[m]'s rows start at first_rows[m],
        one per draft and the last, row j allowing what its grammar allows after its first j
        drafts (a request without drafts has the one row)."""
        rows = [first + j for i, first in zip(constrained, first_rows) for j in range(requests[i].num_sampled_rows)]
        bitmask = torch.full((len(rows), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
        mask_row = 0
        for i in constrained:
            requests[i].grammar.fill_bitmasks_along(requests[i].draft_token_ids, bitmask, mask_row)
            mask_row += requests[i].num_sampled_rows
        apply_token_bitmask(logits, bitmask.to(logits.device), rows)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                         outputs: list[list[int]]) -> None:
        """Row i's penalties: requests[i]'s parameters and prompt, and outputs[i] as its output."""
        def packed(lists):
            offsets = [0]
            for values in lists:
                offsets.append(offsets[-1] + len(values))
            flat = [t for values in lists for t in values]
            return self._tensor(flat, torch.int64), self._tensor(offsets, torch.int64)

        prompt, prompt_offsets = packed([r.prompt_token_ids for r in requests])
        output, output_offsets = packed(outputs)

        def column(name):
            return self._tensor([getattr(r.sampling, name) for r in requests], torch.float32)

        apply_penalties(logits, prompt, prompt_offsets, output, output_offsets, column("repetition_penalty"),
                        column("frequency_penalty"), column("presence_penalty"))

    def _sampling_rows(self, params: list[SamplingParams], seeds: list[int]) -> tuple[torch.Tensor, ...]:
        """temperature, top_k, top_p, min_p and seeds as tensors; the last step's again while the
        same requests decode (it keeps their SamplingParams alive, so their ids stay theirs)."""
        key = ([id(p) for p in params], seeds)
        cached = self._last_sampling_rows
        if cached is not None and cached[0] == key:
            return cached[2]
        rows = (self._tensor([p.temperature for p in params], torch.float32),
                self._tensor([p.top_k for p in params], torch.int32),
                self._tensor([p.top_p for p in params], torch.float32),
                self._tensor([p.min_p for p in params], torch.float32),
                self._tensor(seeds, torch.int64))
        self._last_sampling_rows = (key, params, rows)
        return rows

    def _output_offsets(self, requests: list[ScheduledRequest]) -> torch.Tensor:
        """Each request's output length (its sampling offset), written into a tensor kept per batch
        size: after the decode region the caches are cold, and building a new tensor from a list
        then costs about 0.1 ms."""
        n = len(requests)
        if n not in self._offsets:
            tensor = torch.zeros(n, dtype=torch.int64)
            self._offsets[n] = (tensor, tensor.numpy())
        tensor, view = self._offsets[n]
        view[:] = [len(r.output_token_ids) for r in requests]
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the runner's device."""
        t = torch.tensor(values, dtype=dtype)
        return t if self.device.type == "cpu" else t.to(self.device)
