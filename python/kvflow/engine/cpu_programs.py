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

A program covers the model's forward and its LM head (`model.lm_head`); the model's
`adjust_logits` (a family's soft cap or scaling of the logits, plain torch) runs after each
replay.

Classes: batch sizes 1 to 8 each, then multiples of 8; a step of n requests fills the first n
rows, and the padding rows write no cache slot (-1) and attend over one cached token. A program
holds the tensors it was captured with: a model changed afterwards (weights replaced, repacked)
needs new programs."""

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvflow import _C
from kvflow.attention_metadata import AttentionMetadata, HostMetadata

aten = torch.ops.aten

# What a captured step may call besides kvflow ops: allocations and views, which compute nothing.
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided}
_VIEWS = {aten.view, aten._unsafe_view, aten.split, aten.split_with_sizes, aten.slice, aten.narrow, aten.select,
          aten.t, aten.transpose, aten.unsqueeze, aten.squeeze, aten.as_strided, aten.detach, aten.alias,
          aten.permute, aten.expand, aten.unbind}

ARENA_ALIGNMENT = 64


def program_batch_size(n: int) -> int:
    """The class a decode step of n requests runs in: n up to 8, else the next multiple of 8."""
    return n if n <= 8 else -(-n // 8) * 8


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
    output: torch.Tensor  # the captured function's result, in the arena
    arena: torch.Tensor


def capture(fn) -> tuple[torch.Tensor, CapturedStep | None, str | None]:
    """Runs fn() (which returns one tensor) op by op while recording it. Returns its result, and
    the program that replays it (None where it cannot be captured, with the reason)."""
    recorder = _StepRecorder()
    with recorder:
        result = fn()
    if recorder.refusal is not None:
        return result, None, recorder.refusal
    try:
        return result, _build(recorder.calls, recorder.allocations, result), None
    except (RuntimeError, ValueError) as error:
        return result, None, str(error)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _build(calls: list[_Call], allocations: list[torch.Tensor], output: torch.Tensor) -> CapturedStep:
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
    return CapturedStep(program, placed(output), arena)


class CpuDecodePrograms:
    """The decode programs of one model and KV cache, captured lazily, one per batch-size class."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_seq_len: int):
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = max_seq_len
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.programs: dict[int, CapturedStep | None] = {}
        self.refusals: dict[int, str] = {}
        self.buffers: dict[int, _StaticInputs] = {}

    def can_run(self, metadata: HostMetadata) -> bool:
        """Decode only (one new token per request), contexts within the bound, and a class that
        has a program or has not been tried."""
        batch = metadata.batch
        return (0 < batch and len(metadata.positions) == batch and metadata.max_query_len == 1
                and metadata.max_seq_len <= self.max_seq_len and metadata.table_width <= self.max_blocks_per_seq
                and self.programs.get(program_batch_size(batch), True) is not None)

    def _static_inputs(self, rows: int) -> "_StaticInputs":
        if rows not in self.buffers:
            self.buffers[rows] = _StaticInputs(rows, self.max_blocks_per_seq, self.max_seq_len)
        return self.buffers[rows]

    @torch.inference_mode()
    def capture_idle(self, rows: int) -> bool:
        """Captures class `rows` from a step of padding rows only, which writes no cache slot
        (before any request arrives). Returns whether the class has a program."""
        static = self._static_inputs(rows)
        static.fill([], HostMetadata([], [], [], [0], [], 1, 1))
        self._capture(rows, static)
        return self.programs[rows] is not None

    def _capture(self, rows: int, static: "_StaticInputs") -> torch.Tensor:
        model, kv_caches = self.model, self.kv_caches
        logits, captured, refusal = capture(lambda: model.lm_head(model(static.token_ids, static.metadata, kv_caches)))
        self.programs[rows] = captured
        if captured is None:
            self.refusals[rows] = refusal
        return logits

    def run(self, token_ids: list[int], metadata: HostMetadata) -> torch.Tensor:
        """A decode step's token ids and metadata (checked by can_run) -> float32 logits
        [n, vocab_size]: a view of the program's output, valid until its next run."""
        n = len(token_ids)
        rows = program_batch_size(n)
        static = self._static_inputs(rows)
        static.fill(token_ids, metadata)
        captured = self.programs.get(rows)
        with torch.inference_mode():
            if captured is None:
                return self.model.adjust_logits(self._capture(rows, static)[:n])
            captured.program.run(1, metadata.max_seq_len)
            return self.model.adjust_logits(captured.output if n == rows else captured.output[:n])

    @property
    def replays(self) -> int:
        return sum(c.program.replays for c in self.programs.values() if c is not None)


class _StaticInputs:
    """A class's input buffers, which its program reads: a step writes its first n rows through
    numpy views of them (no tensor is built per step); the padding rows after them write no cache
    slot (-1) and attend over one cached token."""

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
        self._ids, self._positions, self._slots = self.token_ids.numpy(), m.positions.numpy(), m.slot_mapping.numpy()
        self._tables, self._seq_lens = m.block_tables.numpy(), m.seq_lens.numpy()

    def fill(self, token_ids: list[int], metadata: HostMetadata) -> None:
        n = len(token_ids)
        self._ids[:n] = token_ids
        self._positions[:n] = metadata.positions
        self._slots[:n] = metadata.slot_mapping
        self._seq_lens[:n] = metadata.seq_lens
        if n:
            self._tables[:n, :metadata.table_width] = metadata.block_tables
        if n < self.rows:
            self._ids[n:] = 0
            self._positions[n:] = 0
            self._slots[n:] = -1
            self._seq_lens[n:] = 1
