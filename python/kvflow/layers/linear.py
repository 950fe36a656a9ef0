"""Linear layers. Merged projections (q|k|v, gate|up) hold their parts in one weight so that one
matmul reads them all; the loader writes each checkpoint tensor into its slice."""

import torch
from torch import nn

from kvflow import ops
from kvflow.layers.activation import GatedActivation
from kvflow.layers.tensor_parallel import SINGLE_RANK, Shard, TensorParallel
from kvflow.ops.linear import takes_small_linear
from kvflow.ops.quantized import BLOCK_VALUES, INTERLEAVED_ROWS, INTERLEAVED_TYPES, interleave_rows, quantized_row_bytes


def quantized_parameter(weight: torch.Tensor, ggml_type: int) -> nn.Parameter | None:
    """An empty uint8 parameter [rows, row bytes], on the weight's device, for a float weight
    [rows, in_features] in the GGUF blocks of ggml_type, or None where quantized_linear cannot run
    it (another type, rows of part blocks, a device other than the CPU or CUDA, activations of a
    dtype it does not take)."""
    if not (ggml_type in BLOCK_VALUES and weight.device.type in ("cpu", "cuda") and weight.dim() == 2
            and weight.shape[1] % BLOCK_VALUES[ggml_type] == 0 and weight.dtype in (torch.float32, torch.bfloat16)):
        return None
    return nn.Parameter(torch.empty(weight.shape[0], quantized_row_bytes(weight.shape[1], ggml_type),
                                    dtype=torch.uint8, device=weight.device), requires_grad=False)


def interleaved_parameter(weight: torch.Tensor, ggml_type: int | None) -> tuple[nn.Parameter, int] | None:
    """A CPU weight in the GGUF blocks of a type that interleaves (INTERLEAVED_TYPES: every
    quantized type), of whole groups of rows, in kvflow's interleaved layout
    (kvflow.ops.quantized.interleave_rows: same bytes, 8 rows multiplied at once by the few-row
    kernel), with its type id; None for any other weight."""
    if not (ggml_type in INTERLEAVED_TYPES and weight.is_cpu and weight.shape[0] % INTERLEAVED_ROWS == 0):
        return None
    return (nn.Parameter(interleave_rows(weight.data, ggml_type), requires_grad=False),
            INTERLEAVED_TYPES[ggml_type])


class PackedWeight:
    """A bfloat16 CPU weight [out_features, in_features] reordered once, at load, into the panels of
    kvflow's packed_linear kernel, which multiplies any number of rows: few rows (decode) stream
    each panel at the speed small_linear reads a plain weight, many rows (prefill, batched decode)
    run tiles at the machine's matmul rate. torch's matmul would reorder the weight on every call,
    and its bf16 matmul needs AVX-512 to be fast. The kernel runs on every CPU (kvflow.platform
    says how: vdpbf16ps, or bf16 widened to float32 FMAs); see docs/benchmarks.md for its rates.
    gate_up: a gated MLP's [gate; up] weight, packed so that silu(gate) * up comes out of the
    product's epilogue (silu_and_mul)."""

    def __init__(self, weight: torch.Tensor, gate_up: bool = False):
        self.out_features = weight.shape[0]
        self.gate_up = gate_up
        self.data = ops.pack_linear_weight(weight, gate_up)

    @classmethod
    def of(cls, weight: torch.Tensor | None, gate_up: bool = False) -> "PackedWeight | None":
        """The packed copy of `weight`, or None where it cannot be packed (another dtype or device,
        or no weight: a merged projection whose parts hold their own)."""
        if weight is None or not (weight.is_cpu and weight.dtype == torch.bfloat16 and weight.dim() == 2
                                  and weight.numel() > 0):
            return None
        if gate_up and weight.shape[0] % 2:
            return None
        return cls(weight, gate_up)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [rows, in_features] bfloat16 -> [rows, out_features] of out_dtype (bfloat16 or
        float32, written straight from the float32 accumulators)."""
        if not self.gate_up:
            return ops.packed_linear(x, self.data, self.out_features, bias, out_dtype=out_dtype)
        # Each panel holds 24 gate features, then the same 24 up features: the plain product of
        # all panels, put back in the weight's [gate; up] order.
        if bias is not None:
            raise ValueError("a weight packed with gate_up has no bias")
        panels, panel, d = self.data.shape[0], self.data.shape[2], self.out_features // 2
        half = panel // 2
        by_panel = ops.packed_linear(x, self.data, panels * panel, out_dtype=out_dtype)
        halves = by_panel.view(x.shape[0], panels, 2, half).transpose(1, 2).reshape(x.shape[0], 2, panels * half)
        return halves[:, :, :d].reshape(x.shape[0], 2 * d)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] bfloat16 -> silu(x @ gate.T) * (x @ up.T), [rows, out_features / 2],
        for a weight packed with gate_up."""
        return ops.packed_silu_and_mul(x, self.data, self.out_features // 2)


def release_plain_weight(module: nn.Module) -> None:
    """Once a packed copy serves every product of module.weight, the plain weight's memory is
    returned: the parameter becomes None, so that nothing can read a weight that is gone."""
    module.weight = None


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features], or, after
    hold_quantized(ggml_type), that weight as a GGUF file stores it: uint8 [out_features, row
    bytes] of ggml_type's blocks, multiplied by quantized_linear without being dequantized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed_weight: PackedWeight | None = None  # see prepack()
        self.ggml_type: int | None = None  # see hold_quantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]. Few rows on the CPU (decode) go to
        small_linear, which reads the weight once at memory speed; more go to torch's matmul."""
        return self.product(x, x.dtype, self.bias)

    def product(self, x: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias) as out_dtype: x's, or float32 straight from the kernels'
        accumulators (torch's matmul rounds to x's dtype first)."""
        rows = x.shape[0]
        if self.ggml_type is not None:
            out = x.new_empty((rows, self.out_features), dtype=out_dtype)
            torch.ops.kvflow.quantized_linear(out, x, self.weight, self.ggml_type, bias)
            return out
        if self.packed_weight is not None:
            return self.packed_weight.matmul(x, bias, out_dtype=out_dtype)
        if x.is_cpu and takes_small_linear(rows) and x.dim() == 2:
            out = x.new_empty((rows, self.out_features), dtype=out_dtype)
            torch.ops.kvflow.small_linear(out, x, self.weight, bias)
            return out
        return torch.nn.functional.linear(x, self.weight, bias).to(out_dtype)

    def checkpoint_shard(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of checkpoint tensor `kind` ("weight" or "bias") this layer holds: all of it
        here; a tensor-parallel layer's own rows or columns in its subclasses."""
        return tensor

    def prepack(self) -> bool:
        """Reorders a bfloat16 CPU weight into a PackedWeight, which then serves every product,
        and releases the plain weight (release_plain_weight): the weight's memory stays what it
        was. False, changing nothing, where the weight cannot be packed (another dtype or device,
        or a quantized weight)."""
        return self._pack(gate_up=False)

    def _pack(self, gate_up: bool) -> bool:
        self.packed_weight = PackedWeight.of(self.weight, gate_up)
        if self.packed_weight is None:
            return False
        release_plain_weight(self)
        return True

    def hold_quantized(self, ggml_type: int) -> bool:
        """Makes the weight a uint8 parameter for GGUF blocks of ggml_type, for the loader to fill
        with the file's bytes (load_part's slices are whole rows, so merged parts fill alike).
        False, changing nothing, where quantized_linear cannot run it (see quantized_parameter)."""
        parameter = quantized_parameter(self.weight, ggml_type)
        if parameter is None:
            return False
        self.weight, self.ggml_type = parameter, ggml_type
        return True

    def interleave_rows(self) -> bool:
        """Puts the weight into kvflow's interleaved layout where it can (interleaved_parameter).
        False, changing nothing, for any other weight. Call after loading."""
        parameter = interleaved_parameter(self.weight, self.ggml_type)
        if parameter is None:
            return False
        self.weight, self.ggml_type = parameter
        return True

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class MergedLinear(Linear):
    """Several projections of the same input, stacked along the output: part i owns rows
    [offsets[i], offsets[i + 1]) of the weight. Column-parallel (tensor parallelism): part i
    holds rows shards[i] of its checkpoint tensor (a rank's heads or features), each part_sizes[i]
    = shards[i].size rows. Parts stored in different GGUF types (hold_quantized_parts) keep a
    weight each, and each part's product goes into its columns of the one output."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None,
                 shards: list[Shard] | None = None):
        super().__init__(in_features, sum(part_sizes), bias, dtype)
        self.part_sizes = list(part_sizes)
        self.shards = shards
        if shards is not None and [shard.size for shard in shards] != self.part_sizes:
            raise ValueError(f"merged linear: shards {shards} do not match part sizes {part_sizes}")
        self.offsets = [0]
        for size in part_sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.quantized_parts: nn.ModuleList | None = None  # see hold_quantized_parts()

    def hold_quantized_parts(self, ggml_types: list[int]) -> bool:
        """For parts stored in different GGUF types (a Q4_K_M file's q and k in Q4_K, its v in
        Q6_K in some layers): each part becomes a Linear holding its own type's blocks
        (Linear.hold_quantized), and the merged weight is released. False, changing nothing,
        where some part's type cannot be held that way."""
        with torch.device(self.weight.device):
            parts = [Linear(self.in_features, size, dtype=self.weight.dtype) for size in self.part_sizes]
        if not all(part.hold_quantized(ggml_type) for part, ggml_type in zip(parts, ggml_types)):
            return False
        self.quantized_parts = nn.ModuleList(parts)
        release_plain_weight(self)
        return True

    def product(self, x: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized_parts is None:
            return super().product(x, out_dtype, bias)
        out = x.new_empty((x.shape[0], self.out_features), dtype=out_dtype)
        for part, start, end in zip(self.quantized_parts, self.offsets, self.offsets[1:]):
            torch.ops.kvflow.quantized_linear(out[:, start:end], x, part.weight, part.ggml_type,
                                              None if bias is None else bias[start:end])
        return out

    def load_part(self, part: int, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> None:
        """Part `part`'s weight and/or bias (a checkpoint stores them as separate tensors)."""
        rows = slice(self.offsets[part], self.offsets[part + 1])
        if weight is not None and self.quantized_parts is not None:
            copy_checked(self.quantized_parts[part].weight, self._part_rows(part, weight, "weight"),
                         f"part {part} weight")
        elif weight is not None:
            copy_checked(self.weight[rows], self._part_rows(part, weight, "weight"), f"part {part} weight")
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"checkpoint has a bias for part {part} of a merged linear without one")
            copy_checked(self.bias[rows], self._part_rows(part, bias, "bias"), f"part {part} bias")

    def checkpoint_shard(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint's fused tensor (Phi-3's qkv_proj): each part's shard of it, stacked."""
        if self.shards is None or all(shard.size == shard.total for shard in self.shards):
            return tensor
        if tensor.shape[0] != sum(shard.total for shard in self.shards):
            raise ValueError(f"fused {kind}: checkpoint has {tensor.shape[0]} rows, the model "
                             f"{sum(shard.total for shard in self.shards)}")
        parts, start = [], 0
        for part, shard in enumerate(self.shards):
            parts.append(self._part_rows(part, tensor.narrow(0, start, shard.total), kind))
            start += shard.total
        return torch.cat(parts)

    def _part_rows(self, part: int, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        shard = None if self.shards is None else self.shards[part]
        if shard is None or tensor.shape[0] == shard.size == shard.total:
            return tensor
        if tensor.shape[0] != shard.total:
            raise ValueError(f"part {part} {kind}: checkpoint has {tensor.shape[0]} rows, the model {shard.total}")
        return tensor.narrow(0, shard.start, shard.size)


class GateUpLinear(MergedLinear):
    """The gate|up projection of a gated MLP, [gate; up] in one weight (and bias, where the model
    has one). activated(x) gives act(x @ gate.T + b_gate) * (x @ up.T + b_up), act named as in a
    Hugging Face config. Prepacked with SiLU and no bias, the activation runs in the product's
    epilogue, so the [rows, 2d] product is never written out and read back."""

    def __init__(self, in_features: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu",
                 dtype: torch.dtype | None = None, shard: Shard | None = None):
        """shard: this rank's features of the checkpoint's gate and up (tensor parallelism)."""
        super().__init__(in_features, [intermediate_size] * 2, bias=bias, dtype=dtype,
                         shards=None if shard is None else [shard, shard])
        self.intermediate_size = intermediate_size
        self.act = GatedActivation(hidden_act)

    @property
    def plain_silu(self) -> bool:
        """SiLU with no bias: what the fused CPU paths and the packed epilogue compute."""
        return self.act.is_silu and self.bias is None

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, intermediate_size]."""
        if self.packed_weight is not None and self.packed_weight.gate_up:
            return self.packed_weight.silu_and_mul(x)
        return self.act(self(x))

    def prepack(self) -> bool:
        """As Linear.prepack; packed for the SiLU epilogue where that is the whole computation."""
        return self._pack(gate_up=self.plain_silu)


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (o_proj, down_proj under tensor
    parallelism): each rank multiplies its columns, shard, of the weight by its part of the input,
    and one all-reduce sums the partial products. The partial sums stay in float32 through the
    reduction, whatever the activations' dtype, and the bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 shard: Shard | None = None, parallel: TensorParallel = SINGLE_RANK):
        super().__init__(in_features, out_features, bias, dtype)
        self.shard = shard
        self.parallel = parallel
        if shard is not None and shard.size != in_features:
            raise ValueError(f"row-parallel linear: shard {shard} for {in_features} input features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return super().forward(x)
        partial = self.product(x, torch.float32, None)
        self.parallel.all_reduce_(partial)
        if self.bias is not None:
            partial.add_(self.bias)
        return partial if partial.dtype == x.dtype else partial.to(x.dtype)

    __call__ = forward

    def checkpoint_shard(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """The weight's columns of this rank's input features (whole blocks of a quantized one);
        the bias whole."""
        if kind != "weight" or self.shard is None or self.shard.size == self.shard.total:
            return tensor
        if tensor.dtype == torch.uint8:  # GGUF blocks: the shard starts and ends on block boundaries
            start = quantized_row_bytes(self.shard.start, self.ggml_type)
            return tensor.narrow(1, start, quantized_row_bytes(self.shard.size, self.ggml_type))
        if tensor.shape[1] != self.shard.total:
            raise ValueError(f"checkpoint weight has {tensor.shape[1]} input features, the model {self.shard.total}")
        return tensor.narrow(1, self.shard.start, self.shard.size)


def copy_checked(destination: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """destination.copy_(source), or a ValueError naming what when their shapes differ."""
    if tuple(source.shape) != tuple(destination.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(source.shape)} does not match the model's "
                         f"{tuple(destination.shape)}")
    if (source.dtype == torch.uint8) != (destination.dtype == torch.uint8):
        raise ValueError(f"{what}: checkpoint {'quantized blocks' if source.dtype == torch.uint8 else 'float values'} "
                         f"for a {'quantized' if destination.dtype == torch.uint8 else 'float'} weight")
    destination.copy_(source)
