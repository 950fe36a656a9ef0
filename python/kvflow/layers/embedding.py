"""Token embedding and the LM head (which may share the embedding's weight)."""

import torch
from torch import nn

from kvflow.ops.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(token_ids, self.weight)


class LMHead(nn.Module):
    """hidden [rows, hidden_size] -> float32 logits [rows, vocab_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        return linear(hidden, weight).float()
