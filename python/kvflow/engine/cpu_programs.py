"""Decode steps on the CPU replay a captured program of the model's own kvflow op calls.

The model graph is written once, in Python, on torch.ops.kvflow ops. The first decode step of
each batch-size class runs that graph op by op under a recorder that keeps every kvflow call
(op, tensors, scalars) and lets through only allocations and views; any other computation (a
torch matmul, an index) means the class has no program and keeps running op by op. The calls
become a kvflow._C.CpuProgram: the C++ executor replays them inside one parallel region, the
threads meeting at a spin barrier between dependent nodes, with the result bit for bit that of
the op-by-op run (csrc/cpu/executor.h).

A program reads its inputs from static buffers (token ids, positions, slots, block tables,
lengths) that each step fills. The intermediates of the captured run are laid out again in one
arena, a buffer reusing the bytes of one no longer read, but only past a node that a barrier
always precedes, so that no thread of the region can still be reading them.

A program covers the whole decode step: the model's forward, its logits (`compute_logits`: the LM
head and a family's scaling or soft cap) and the sampler, which reads each row's sampling
parameters, seed and output offset from static buffers too. It returns the logits and the
tokens; a step with penalties applies them to those logits and samples again outside the
program.

Classes: batch sizes 1 to 8 each, then multiples of 8; a step of n requests fills the first n
rows, and the padding rows write no cache slot (-1) and attend over one cached token. A program
holds the tensors it was captured with: a model changed afterwards (weights replaced, repacked)
needs new programs."""

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvflow import _C
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.sampling_params import SamplingParams
from kvflow.ops.linear import SMALL_LINEAR_MAX_ROWS
from kvflow.ops.sampling import sample

aten = torch.ops.aten

# What a captured step may call besides kvflow ops: allocations and views, which compute nothing.
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided}
_VIEWS = {aten.view, aten._unsafe_view, aten.split, aten.split_with_sizes, aten.slice, aten.narrow, aten.select,
          aten.t, aten.transpose, aten.unsqueeze, aten.squeeze, aten.as_strided, aten.detach, aten.alias,
          aten.permute, aten.expand, aten.unbind}

ARENA_ALIGNMENT = 64


# Above the small-row threshold, decode steps share a class per this many requests (padded).
BATCH_CLASS_STEP = 8


def program_batch_size(n: int) -> int:
    """The class a decode step of n requests runs in: n itself up to SMALL_LINEAR_MAX_ROWS (each
    row costs a weight read there, so no padding), else the next multiple of BATCH_CLASS_STEP,
    which stays on the many-row side of the threshold."""
    return n if n <= SMALL_LINEAR_MAX_ROWS else -(-n // BATCH_CLASS_STEP) * BATCH_CLASS_STEP


@dataclass
class _Call:
    op: str
    tensors: list
    ints: list[int]
    floats: list[float]


def _flatten(func, args: tuple, kwargs: dict) -> _Call:
    """A kvflow op call's arguments in schema order, by kind; ValueError for a kind a node cannot take."""
    call = _Call(func._schema.name.split("::")[-1], [], [], [])
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            raise ValueError(f"{call.op}: argument {argument.name!r} is missing")
        kind = argument.type.kind()
        if kind == "OptionalType":
            kind = argument.type.getElementType().kind()
        if kind == "TensorType":
            call.tensors.append(value)
        elif kind in ("IntType", "BoolType", "SymIntType"):
            call.ints.append(int(value))
        elif kind == "FloatType":
            call.floats.append(float(value))
        else:
            raise ValueError(f"{call.op}: argument {argument.name!r} of type {argument.type} cannot be captured")
    return call


class _StepRecorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No capture is ever compiled: without this, torch wraps __torch_dispatch__ to keep
        # dynamo out, and the first call imports torch._dynamo (over a second).
        return False

    def __init__(self):
        super().__init__()
        self.calls: list[_Call] = []
        self.allocations: list[torch.Tensor] = []
        self.refusal: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.namespace == "kvflow":
            try:
                self.calls.append(_flatten(func, args, kwargs))
            except ValueError as error:
                self.refusal = self.refusal or str(error)
        elif func.overloadpacket in _ALLOCATIONS:
            self.allocations.append(result)
        elif func.overloadpacket not in _VIEWS:
            self.refusal = self.refusal or f"{func} computes outside the kvflow ops"
        return result


@dataclass
class CapturedStep:
    program: "_C.CpuProgram"
    outputs: tuple[torch.Tensor, ...]  # the captured function's results, in the arena
    arena: torch.Tensor


@dataclass
class DecodeStepResult:
    logits: torch.Tensor    # float32 [n, vocab_size], a view of the program's arena until its next run
    token_ids: list[int]    # sampled from those logits
    needs_logits: bool      # some request asks for log-probabilities, penalties or a grammar mask


@dataclass
class DecodeStepsResult:
    token_ids: list[list[int]]  # per request, one token a step run
    seconds_before_last: list[float]  # each step's end, before the last one's


def capture(fn) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], CapturedStep | None, str | None]:
    """Runs fn() (which returns a tensor or a tuple of them) op by op while recording it. Returns
    its result, and the program that replays it (None where it cannot be captured, with the
    reason)."""
    recorder = _StepRecorder()
    with recorder:
        result = fn()
    if recorder.refusal is not None:
        return result, None, recorder.refusal
    try:
        outputs = result if isinstance(result, tuple) else (result,)
        return result, _build(recorder.calls, recorder.allocations, outputs), None
    except (RuntimeError, ValueError) as error:
        return result, None, str(error)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _build(calls: list[_Call], allocations: list[torch.Tensor], outputs: tuple[torch.Tensor, ...]) -> CapturedStep:
    probe = _C.CpuProgram()  # checks every node's arguments, and says where barriers always are
    for call in calls:
        probe.add(call.op, call.tensors, call.ints, call.floats)
    sizes = {_storage_key(t): t.untyped_storage().nbytes() for t in allocations}
    first, last = {}, {}
    for i, call in enumerate(calls):
        for t in call.tensors:
            if t is not None and _storage_key(t) in sizes:
                first.setdefault(_storage_key(t), i)
                last[_storage_key(t)] = i
    for output in outputs:
        if _storage_key(output) not in sizes:
            raise ValueError("the captured step's output is not one of its own tensors")
        last[_storage_key(output)] = len(calls)
        first.setdefault(_storage_key(output), len(calls))
    barrier_nodes = [i for i in range(len(calls)) if probe.starts_shared(i)]

    def reusable_from(key: int) -> float:
        return next((i for i in barrier_nodes if i > last[key]), float("inf"))

    slots: list[list] = []  # [size, reusable from node]
    slot_of = {}
    for key in sorted(first, key=first.get):
        need = -(-sizes[key] // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
        free = [s for s in slots if s[1] <= first[key]]
        fitting = [s for s in free if s[0] >= need]
        if fitting:
            slot = min(fitting, key=lambda s: s[0])
        elif free:
            slot = max(free, key=lambda s: s[0])
            slot[0] = need
        else:
            slot = [need, 0]
            slots.append(slot)
        slot[1] = reusable_from(key)
        slot_of[key] = slot
    offsets, total = {}, 0
    for slot in slots:
        offsets[id(slot)] = total
        total += slot[0]
    arena = torch.empty(total, dtype=torch.uint8)
    storage = arena.untyped_storage()

    def placed(t):
        if t is None or _storage_key(t) not in slot_of:
            return t
        offset = offsets[id(slot_of[_storage_key(t)])]
        return torch.empty(0, dtype=t.dtype).set_(storage, offset // t.element_size() + t.storage_offset(),
                                                  t.shape, t.stride())

    program = _C.CpuProgram()
    for call in calls:
        program.add(call.op, [placed(t) for t in call.tensors], call.ints, call.floats)
    return CapturedStep(program, tuple(placed(t) for t in outputs), arena)


class CpuDecodePrograms:
    """The decode programs of one model and KV cache, captured lazily, one per batch-size class."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_seq_len: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.programs: dict[int, CapturedStep | None] = {}
        self.refusals: dict[int, str] = {}
        self.buffers: dict[int, _StaticInputs] = {}
        self.token_views: dict[int, np.ndarray] = {}  # each program's tokens, read as a list each step

    def _static_inputs(self, rows: int) -> "_StaticInputs":
        if rows not in self.buffers:
            self.buffers[rows] = _StaticInputs(rows, self.max_blocks_per_seq, self.max_seq_len)
        return self.buffers[rows]

    @torch.inference_mode()
    def capture_idle(self, rows: int) -> bool:
        """Captures class `rows` from a step of padding rows only, which writes no cache slot
        (before any request arrives). Returns whether the class has a program."""
        self._capture(rows, self._static_inputs(rows))
        return self.programs[rows] is not None

    def _capture(self, rows: int, static: "_StaticInputs") -> tuple[torch.Tensor, torch.Tensor]:
        model, kv_caches, s = self.model, self.kv_caches, static

        def step():
            logits = model.compute_logits(model(s.token_ids, s.metadata, kv_caches))
            return logits, sample(logits, s.temperature, s.top_k, s.top_p, s.min_p, s.seeds, s.offsets)

        outputs, captured, refusal = capture(step)
        self.programs[rows] = captured
        if captured is None:
            self.refusals[rows] = refusal
        else:
            self.token_views[rows] = captured.outputs[1].numpy()
        return outputs

    def run(self, requests: list) -> "DecodeStepResult | None":
        """A decode step of the runner's ScheduledRequests, or None where it is not one that a
        program runs (a request with new tokens other than its last and its drafts, or none due,
        or a class that cannot be captured) and nothing was run. A request with drafts takes one
        row per new token, each a decode row of its own (see _StaticInputs.fill). ValueError for a
        request the step cannot hold."""
        n = sum(1 + len(r.draft_token_ids) for r in requests)
        rows = program_batch_size(n)
        if n == 0 or self.programs.get(rows, True) is None:
            return None
        static = self._static_inputs(rows)
        max_seq_len = static.fill(requests, self.block_size, self.max_seq_len)
        if max_seq_len is None:
            return None
        captured = self.programs.get(rows)
        if captured is None:
            with torch.inference_mode():
                logits, tokens = self._capture(rows, static)
            token_ids = tokens[:n].tolist()
        else:
            captured.program.run(1, max_seq_len)
            logits = captured.outputs[0]
            token_ids = self.token_views[rows][:n].tolist()
        return DecodeStepResult(logits if n == rows else logits[:n], token_ids, static.needs_logits)

    def has_program(self, num_requests: int) -> bool:
        """Whether a decode of num_requests has its class's program captured (and not refused)."""
        return self.programs.get(program_batch_size(num_requests)) is not None

    def run_steps(self, requests: list, steps: int, stop_token_ids: list[int]) -> "DecodeStepsResult | None":
        """Up to `steps` decode steps of requests that each bring one token and no drafts, run
        back to back in C++ (kvflow._C.run_decode_steps): each step's sampled tokens are the next
        step's input; they end early once every request has drawn one of stop_token_ids. Their
        block tables must hold blocks for every step's position. None where the batch's class has
        no program yet, or some row asks for logits (log-probabilities, penalties, a grammar):
        nothing was run then."""
        rows = program_batch_size(len(requests))
        captured = self.programs.get(rows)
        if captured is None or steps < 2:
            return None
        static = self._static_inputs(rows)
        max_seq_len = static.fill(requests, self.block_size, self.max_seq_len, steps)
        if max_seq_len is None or static.needs_logits:
            return None
        n = len(requests)
        tokens = torch.empty((steps, n), dtype=torch.int64)
        m = static.metadata
        before_last = _C.run_decode_steps(captured.program, static.token_ids, m.positions, m.slot_mapping, m.seq_lens,
                                          m.block_tables, static.offsets, captured.outputs[1], n, steps,
                                          self.block_size, self.max_seq_len,
                                          torch.tensor(stop_token_ids, dtype=torch.int64), tokens)
        return DecodeStepsResult(tokens[:len(before_last)].t().tolist(), before_last)

    @property
    def replays(self) -> int:
        return sum(c.program.replays for c in self.programs.values() if c is not None)


class _StaticInputs:
    """A class's input buffers, which its program reads: a step writes its first n rows through
    numpy views of them (no tensor is built per step); the padding rows after them write no cache
    slot (-1), attend over one cached token and sample greedily."""

    def __init__(self, rows: int, max_blocks_per_seq: int, max_seq_len: int):
        self.rows = rows
        self.token_ids = torch.zeros(rows, dtype=torch.int64)
        self.metadata = AttentionMetadata(
            positions=torch.zeros(rows, dtype=torch.int64),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int64),
            block_tables=torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32),
            cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
            seq_lens=torch.ones(rows, dtype=torch.int32),
            max_query_len=1, max_seq_len=max_seq_len)
        m = self.metadata
        self.temperature = torch.zeros(rows, dtype=torch.float32)
        self.top_k = torch.zeros(rows, dtype=torch.int32)
        self.top_p = torch.ones(rows, dtype=torch.float32)
        self.min_p = torch.zeros(rows, dtype=torch.float32)
        self.seeds = torch.zeros(rows, dtype=torch.int64)
        self.offsets = torch.zeros(rows, dtype=torch.int64)
        self._columns = {name: t.numpy() for name, t in (
            ("ids", self.token_ids), ("positions", m.positions), ("slots", m.slot_mapping), ("tables", m.block_tables),
            ("seq_lens", m.seq_lens), ("temperature", self.temperature), ("top_k", self.top_k),
            ("top_p", self.top_p), ("min_p", self.min_p), ("seeds", self.seeds), ("offsets", self.offsets))}
        self._filled = 0            # rows written by the last step (the rest hold padding)
        self._sampling_of: list = []  # (SamplingParams, seed, needs logits) of each of those rows
        self.needs_logits = False     # of the last step filled

    def fill(self, requests: list, block_size: int, max_seq_len: int, steps: int = 1) -> int | None:
        """Writes the step's rows (padding after them) and returns its longest context, or None
        where a request is not decoding (one new token and its drafts, a token due). With steps
        above 1 (requests without drafts), each row's block table is written for the positions of
        all those steps (see run_steps). A request
        with drafts takes a row per new token: row j at position computed + j attends over the
        keys up to its own, which every layer has written before any attention reads them, and
        draws at output index len(output) + j: its own decode step, in effect. Each row's sampling
        parameters and seed are written only when another request, or another seed, holds the
        row than last step; needs_logits then says whether some row asks for log-probabilities or
        penalties. The program's nodes check every index again before any of them writes."""
        c = self._columns
        ids, positions, slots, tables, seq_lens, offsets = (c["ids"], c["positions"], c["slots"], c["tables"],
                                                            c["seq_lens"], c["offsets"])
        longest = 1
        sampling_of = self._sampling_of
        needs_logits = False
        try:
            i = 0
            for index, r in enumerate(requests):
                table, new_tokens = r.block_table, r.token_ids
                if len(new_tokens) != 1 + len(r.draft_token_ids) or r.sampling is None:
                    self._filled = self.rows
                    return None
                for j, token in enumerate(new_tokens):
                    position = r.num_computed_tokens + j
                    last = position + steps - 1  # the position of the row's last step
                    blocks = last // block_size + 1
                    if last >= max_seq_len:
                        raise ValueError(f"a request of {last + 1} tokens exceeds the model's context of "
                                         f"{max_seq_len}")
                    if blocks > len(table):
                        raise ValueError(f"request {index}: seq_len {last + 1} needs {blocks} blocks, its block "
                                         f"table has {len(table)}")
                    ids[i] = token
                    positions[i] = position
                    slots[i] = table[position // block_size] * block_size + position % block_size
                    seq_lens[i] = position + 1
                    tables[i, :blocks] = table if blocks == len(table) else table[:blocks]
                    offsets[i] = len(r.output_token_ids) + j
                    longest = max(longest, position + 1)
                    if i >= len(sampling_of) or sampling_of[i][0] is not r.sampling or sampling_of[i][1] != r.seed:
                        self._write_sampling(i, r.sampling, r.seed)
                    needs_logits = needs_logits or sampling_of[i][2] or r.grammar is not None
                    i += 1
        except BaseException:
            self._filled = self.rows  # every row after the good ones padded again next step
            raise
        n = i
        if n < self._filled or not self._filled:
            self._pad(n)
        self._filled = n
        self.needs_logits = needs_logits
        return longest

    def _write_sampling(self, row: int, params: SamplingParams, seed: int) -> None:
        c = self._columns
        c["temperature"][row], c["top_k"][row] = params.temperature, params.top_k
        c["top_p"][row], c["min_p"][row], c["seeds"][row] = params.top_p, params.min_p, seed
        del self._sampling_of[row:]
        # params held, so that no other request reuses its id
        self._sampling_of.append((params, seed, params.needs_logits))

    def _pad(self, n: int) -> None:
        c = self._columns
        for name, value in (("ids", 0), ("positions", 0), ("slots", -1), ("seq_lens", 1), ("temperature", 0.0),
                            ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("seeds", 0), ("offsets", 0)):
            c[name][n:] = value
        del self._sampling_of[n:]
