"""Linear products on the CPU: small_linear for few rows (decode), packed_linear for many
(prefill, batched decode) from a weight reordered once by pack_linear_weight."""

import torch

from kvflow import _C

# Up to this many rows the product is bound by reading the weights, which small_linear does at
# the machine's read bandwidth; beyond it torch's blocked matmul reuses each weight more.
SMALL_LINEAR_MAX_ROWS = 8


def takes_small_linear(rows: int) -> bool:
    """Whether a CPU product of `rows` rows runs small_linear: up to SMALL_LINEAR_MAX_ROWS, and
    any number in batch-invariant mode (kvflow.platform.set_batch_invariant), where one kernel
    computes every row in one order."""
    return 0 < rows and (rows <= SMALL_LINEAR_MAX_ROWS or _C.batch_invariant())


def small_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out = input @ weight.T (+ bias) on the CPU, reading weight once for all rows.

    input [rows, in_features], weight [out_features, in_features] (contiguous, as nn.Linear
    stores it), bias [out_features]; all of one dtype (float32, float16 or bfloat16); float32
    accumulation. out is of that dtype too, or float32 (an LM head's logits, unrounded). Meant
    for rows <= SMALL_LINEAR_MAX_ROWS; correct for any.
    """
    if out is None:
        out = torch.empty((input.shape[0], weight.shape[0]), dtype=weight.dtype, device=weight.device)
    torch.ops.kvflow.small_linear(out, input, weight, bias)
    return out


def pack_linear_weight(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """A bfloat16 CPU weight [out_features, in_features] reordered into the panels packed_linear
    reads: [ceil(out_features / 48), ceil(in_features / 2), 48, 2], zero-padded. Done once, at load.

    With gate_up, weight is a gated MLP's [gate; up] stack [2d, in_features], packed for
    packed_silu_and_mul instead: each panel holds 24 gate features and the 24 matching up ones."""
    return torch.ops.kvflow.pack_linear_weight(weight, gate_up)


def packed_linear(input: torch.Tensor, packed_weight: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """out = input @ weight.T (+ bias) on the CPU for many rows, weight given as
    pack_linear_weight(weight) (out_features is its first dimension). input [rows, in_features]
    and bias [out_features] bfloat16; float32 accumulation; out of out_dtype, bfloat16 or
    float32 (logits). On CPUs with AVX-512 BF16 this runs at the machine's bf16 matmul peak."""
    if out is None:
        out = torch.empty((input.shape[0], out_features), dtype=out_dtype, device=input.device)
    torch.ops.kvflow.packed_linear(out, input, packed_weight, bias)
    return out


def packed_silu_and_mul(input: torch.Tensor, packed_gate_up: torch.Tensor, d: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(input @ gate.T) * (input @ up.T) on the CPU for many rows, the gate|up weight [2d,
    in_features] given as pack_linear_weight(weight, gate_up=True): the activation runs on the
    product's float32 accumulators, and the [rows, 2d] product is never written. input
    [rows, in_features] bfloat16; out [rows, d] bfloat16."""
    if out is None:
        out = torch.empty((input.shape[0], d), dtype=torch.bfloat16, device=input.device)
    torch.ops.kvflow.packed_silu_and_mul(out, input, packed_gate_up)
    return out


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, with few-row CPU products routed to small_linear.

    input [..., in_features] -> [..., out_features].
    """
    rows = input.numel() // input.shape[-1] if input.shape[-1] else 0
    if input.device.type == "cpu" and takes_small_linear(rows) and weight.is_contiguous():
        flat = input.reshape(rows, input.shape[-1])
        return small_linear(flat, weight, bias).reshape(*input.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(input, weight, bias)


@torch.library.register_fake("kvflow::small_linear")
def _small_linear_fake(out, input, weight, bias=None):
    return None


@torch.library.register_fake("kvflow::pack_linear_weight")
def _pack_linear_weight_fake(weight, gate_up=False):
    panel = 48
    return weight.new_empty(((weight.shape[0] + panel - 1) // panel, (weight.shape[1] + 1) // 2, panel, 2))


@torch.library.register_fake("kvflow::packed_silu_and_mul")
def _packed_silu_and_mul_fake(out, input, packed_gate_up):
    return None


@torch.library.register_fake("kvflow::packed_linear")
def _packed_linear_fake(out, input, packed_weight, bias=None):
    return None
