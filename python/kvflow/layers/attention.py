"""Attention over the paged KV cache: write the new keys and values, then attend."""

import torch
from torch import nn

from kvflow.attention_metadata import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        """logits_soft_cap: cap * tanh(logit / cap) on the scaled logits (Gemma 2); None: none."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window or -1
        self.logits_soft_cap = logits_soft_cap or 0.0

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """query [tokens, heads * head_dim], key/value [tokens, kv_heads * head_dim] (token-strided
        views of the qkv output); kv_cache: this layer's (key_cache, value_cache), each
        [num_blocks, block_size, kv_heads, head_dim]. Returns [tokens, heads * head_dim]."""
        tokens = query.shape[0]
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.view(tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        torch.ops.kvflow.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty((tokens, self.num_heads, self.head_dim), dtype=query.dtype, device=query.device)
        torch.ops.kvflow.paged_attention(
            out, query, key_cache, value_cache, metadata.block_tables, metadata.cu_seqlens_q, metadata.seq_lens,
            self.scale, metadata.max_query_len, metadata.max_seq_len, self.sliding_window, self.logits_soft_cap,
            metadata.workspace,
        )
        return out.view(tokens, self.num_heads * self.head_dim)

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path