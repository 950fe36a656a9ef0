"""Rotary position embedding with a precomputed cos|sin table."""

import torch
from torch import nn

from kvflow.ops.rope import compute_cos_sin_cache


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 freq_factors: torch.Tensor | None = None, is_neox: bool = True, rotary_dim: int | None = None):
        """rotary_dim: the leading features of each head that rotate (Phi-3's partial rotary);
        None: all of them."""
        super().__init__()
        self.head_dim = head_dim
        self.is_neox = is_neox
        cache = compute_cos_sin_cache(rotary_dim or head_dim, max_position, base, rope_scaling,
                                      freq_factors=freq_factors)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # float32 [max_position, rotary_dim]

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """Rotates query [tokens, heads * head_dim] and key in place."""
        torch.ops.kvflow.rotary_embedding(positions, query, key, self.head_dim, self.cos_sin_cache, self.is_neox)

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path