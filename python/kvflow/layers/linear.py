"""Linear layers. Merged projections (q|k|v, gate|up) hold their parts in one weight so that one
matmul reads them all; the loader writes each checkpoint tensor into its slice."""

import torch
from torch import nn

from kvflow.ops.linear import SMALL_LINEAR_MAX_ROWS


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None  # oneDNN's blocked copy, see prepack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]. Few rows on the CPU (decode) go to
        small_linear, which reads the weight once at memory speed; more go to torch's matmul."""
        rows = x.shape[0]
        if x.is_cpu and 0 < rows <= SMALL_LINEAR_MAX_ROWS and x.dim() == 2:
            out = x.new_empty((rows, self.out_features))
            torch.ops.kvflow.small_linear(out, x, self.weight, self.bias)
            return out
        if self.packed_weight is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def prepack(self, batch_hint: int = 64) -> bool:
        """Keeps a copy of the weight in oneDNN's blocked layout for many-row products on the
        CPU (prefill, large decode batches): torch's matmul reorders the weight on every call,
        which costs a third of a 64-row product of SmolLM2's narrow projections. The plain
        weight stays for small_linear, so this doubles the weight's memory. False where oneDNN
        cannot take it."""
        self.packed_weight = onednn_packed(self.weight, batch_hint)
        return self.packed_weight is not None

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class MergedLinear(Linear):
    """Several projections of the same input, stacked along the output: part i owns rows
    [offsets[i], offsets[i + 1]) of the weight."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(part_sizes), bias, dtype)
        self.part_sizes = list(part_sizes)
        self.offsets = [0]
        for size in part_sizes:
            self.offsets.append(self.offsets[-1] + size)

    def load_part(self, part: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        rows = slice(self.offsets[part], self.offsets[part + 1])
        copy_checked(self.weight[rows], weight, f"part {part} weight")
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"checkpoint has a bias for part {part} of a merged linear without one")
            copy_checked(self.bias[rows], bias, f"part {part} bias")


def onednn_packed(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """weight [out, in] in oneDNN's blocked layout for torch.ops.mkldnn._linear_pointwise, or None
    where oneDNN cannot take it (not a CPU bfloat16 weight, or a torch without oneDNN)."""
    packable = (weight.is_cpu and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if packable else None


def copy_checked(destination: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """destination.copy_(source), or a ValueError naming what when their shapes differ."""
    if tuple(source.shape) != tuple(destination.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(source.shape)} does not match the model's "
                         f"{tuple(destination.shape)}")
    destination.copy_(source)
