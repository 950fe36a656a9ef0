"""Token embedding and the LM head (which may share the embedding's weight)."""

import torch
from torch import nn

from kvflow.layers.linear import PackedWeight
from kvflow.ops.linear import SMALL_LINEAR_MAX_ROWS


class VocabEmbedding(nn.Module):
    """scale: every embedding times this (Gemma's sqrt(hidden_size), Granite's embedding_multiplier)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None, scale: float = 1.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.scale = float(scale)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [num_tokens] int64 -> [num_tokens, hidden_size]."""
        out = self.weight.new_empty((token_ids.shape[0], self.weight.shape[1]))
        torch.ops.kvflow.embedding(out, token_ids, self.weight, self.scale)
        return out

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LMHead(nn.Module):
    """hidden [rows, hidden_size] -> float32 logits [rows, vocab_size]. On the CPU, up to
    SMALL_LINEAR_MAX_ROWS rows get their logits straight from the float32 accumulators, without
    a round trip through a bfloat16 that would tie tokens within 0.125 of each other."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied_to = tied_to
        self.packed_weight: PackedWeight | None = None  # as Linear.packed_weight
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        rows = hidden.shape[0]
        if hidden.is_cpu and 0 < rows <= SMALL_LINEAR_MAX_ROWS:
            logits = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
            torch.ops.kvflow.small_linear(logits, hidden, weight, None)
            return logits
        if self.packed_weight is not None:
            return self.packed_weight.matmul(hidden, out_dtype=torch.float32)
        return torch.nn.functional.linear(hidden, weight).float()

    def prepack(self) -> bool:
        """As Linear.prepack, for the (possibly tied) LM head weight."""
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        self.packed_weight = PackedWeight.of(weight)
        return self.packed_weight is not None

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path