"""Linear layers: kvflow's few-row CPU kernel for decode, torch's matmul for everything else."""

import torch

# Up to this many rows the product is bound by reading the weights, which small_linear does at
# the machine's read bandwidth; beyond it torch's blocked matmul reuses each weight more.
SMALL_LINEAR_MAX_ROWS = 8


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


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, with few-row CPU products routed to small_linear.

    input [..., in_features] -> [..., out_features].
    """
    rows = input.numel() // input.shape[-1] if input.shape[-1] else 0
    if input.device.type == "cpu" and 0 < rows <= SMALL_LINEAR_MAX_ROWS and weight.is_contiguous():
        flat = input.reshape(rows, input.shape[-1])
        return small_linear(flat, weight, bias).reshape(*input.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(input, weight, bias)


@torch.library.register_fake("kvflow::small_linear")
def _small_linear_fake(out, input, weight, bias=None):
    return None
