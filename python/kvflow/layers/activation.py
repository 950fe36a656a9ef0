"""Gated activations over a merged gate|up projection."""

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)
        torch.ops.kvflow.silu_and_mul(out, gate_up)
        return out

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path