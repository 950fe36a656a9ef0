"""RMSNorm, optionally fused with the residual add that precedes it or follows it."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """weight_offset 1.0: Gemma's norms, which multiply by (1 + weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: rms_norm(x). With it, in place: residual += x, x = rms_norm(residual);
        returns (x, residual)."""
        if residual is None:
            out = torch.empty_like(x)
            torch.ops.kvflow.rms_norm(out, x, self.weight, self.eps, self.weight_offset)
            return out
        torch.ops.kvflow.fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        return x, residual

    def normalize_(self, x: torch.Tensor) -> torch.Tensor:
        """x = rms_norm(x), in place; x may be a [tokens, heads, head_dim] view of a wider product
        (QK-norm over the heads of q|k|v)."""
        torch.ops.kvflow.rms_norm(x, x, self.weight, self.eps, self.weight_offset)
        return x

    def add_to_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += rms_norm(x), in place (a post-norm and its residual add: OLMo 2)."""
        torch.ops.kvflow.rms_norm_add(residual, x, self.weight, self.eps, self.weight_offset)
        return residual

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path