"""Token embedding: rows of the embedding table gathered by token id."""

import torch


def embedding(token_ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
              scale: float = 1.0) -> torch.Tensor:
    """out[t] = weight[token_ids[t]] * scale (rounded once; Gemma scales by sqrt(hidden_size)):
    token_ids [num_tokens] int64, weight [vocab_size, hidden] (contiguous) -> out [num_tokens,
    hidden] of weight's dtype. On the CPU every id is checked
    against the vocabulary before anything is written (IndexError-like RuntimeError naming it);
    on CUDA an id out of range gives a row of zeros (ids are not read on the host)."""
    if out is None:
        out = weight.new_empty((token_ids.shape[0], weight.shape[1]))
    torch.ops.kvflow.embedding(out, token_ids, weight, scale)
    return out


@torch.library.register_fake("kvflow::embedding")
def _embedding_fake(out, token_ids, weight, scale=1.0):
    return None
