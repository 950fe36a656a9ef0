"""Paged attention: one op for decode, prefill, chunked prefill and prefix-cache hits."""

import torch


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
    workspace: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = softmax(scale * q . K^T) V over each request's paged context, causal.

    query [num_tokens, num_q_heads, head_dim]: the new tokens of every request, request after
    request (a token-strided view of the QKV output is fine); cu_seqlens_q [batch + 1] int32
    delimits them. key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim] already
    hold every context token, the new ones included (reshape_and_cache). block_tables
    [batch, max_blocks_per_seq] int32; seq_lens [batch] int32 is each context's length.

    Query i of request b sits at position seq_lens[b] - q_len_b + i and sees cached positions
    <= its own; with sliding_window > 0 only the last sliding_window of them. Query head h reads
    kv head h // (num_q_heads // num_kv_heads). logits_soft_cap > 0 applies cap * tanh(x / cap)
    to the scaled logits. max_query_len / max_seq_len are host integers at least the true maxima
    (the CUDA launcher sizes its grid from them without reading device memory). workspace is
    optional float32 scratch for split-KV partial results. head_dim: 64, 80, 96, 128 or 256.
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    torch.ops.kvflow.paged_attention(
        out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
        max_query_len, max_seq_len, sliding_window, logits_soft_cap, workspace,
    )
    return out


@torch.library.register_fake("kvflow::paged_attention")
def _paged_attention_fake(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                          max_query_len, max_seq_len, sliding_window=-1, logits_soft_cap=0.0, workspace=None):
    return None
