"""RMSNorm, plain, fused with the residual add before it, and added into the residual after it."""

import torch


def rms_norm(
    input: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float = 1e-6,
    weight_offset: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = input * rsqrt(mean(input**2, dim=-1) + epsilon) * (weight + weight_offset).

    input [..., hidden] (rows may be strided, the last dim must be contiguous), weight [hidden],
    out like input. Accumulates in float32, rounds once. weight_offset=1.0 is Gemma's convention.
    """
    if out is None:
        out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    torch.ops.kvflow.rms_norm(out, input, weight, epsilon, weight_offset)
    return out


def fused_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float = 1e-6,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += input, then input = rms_norm(residual) * (weight + weight_offset).

    input, residual [..., hidden]; weight [hidden]. The sum is rounded to the residual's dtype
    before the norm, so the result equals the unfused add then rms_norm. Returns (input, residual).
    """
    torch.ops.kvflow.fused_add_rms_norm(input, residual, weight, epsilon, weight_offset)
    return input, residual


def rms_norm_add(
    residual: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float = 1e-6,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """In place: residual += rms_norm(input) * (weight + weight_offset), the norm rounded to the
    dtype first (an unfused rms_norm then add): a post-norm and its residual add (OLMo 2).

    residual, input [..., hidden], rows may be strided; weight [hidden]. Returns residual.
    """
    torch.ops.kvflow.rms_norm_add(residual, input, weight, epsilon, weight_offset)
    return residual


@torch.library.register_fake("kvflow::rms_norm")
def _rms_norm_fake(out, input, weight, epsilon, weight_offset=0.0):
    return None


@torch.library.register_fake("kvflow::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon, weight_offset=0.0):
    return None


@torch.library.register_fake("kvflow::rms_norm_add")
def _rms_norm_add_fake(residual, input, weight, epsilon, weight_offset=0.0):
    return None
