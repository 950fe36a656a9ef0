"""A whole Llama-family decoder layer as one CPU op, for decode (few tokens)."""

import torch


def llama_decoder_layer(hidden, residual, positions, input_norm_weight, qkv_weight, qkv_bias, o_weight,
                        post_norm_weight, gate_up_weight, down_weight, cos_sin_cache, key_cache, value_cache,
                        slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads: int, num_kv_heads: int,
                        epsilon: float, scale: float, max_query_len: int, max_seq_len: int,
                        sliding_window: int = -1) -> None:
    """In place, for hidden, residual [num_tokens, hidden_size] (CPU):

        residual += hidden; x = rms_norm(residual) * input_norm_weight
        q|k|v = x @ qkv_weight.T (+ qkv_bias); NeoX rotary on q, k at positions
        k, v -> the paged cache at slot_mapping; a = paged_attention(q, ...)
        y = a @ o_weight.T; residual += y; y = rms_norm(residual) * post_norm_weight
        hidden = (silu(gate) * up)(y @ gate_up_weight.T) @ down_weight.T

    exactly as fused_add_rms_norm, small_linear, rotary_embedding, reshape_and_cache,
    paged_attention and silu_and_mul compute them one by one (same kernels, same order), without
    a dispatch per op. Attention arguments as in paged_attention.
    """
    torch.ops.kvflow.llama_decoder_layer(
        hidden, residual, positions, input_norm_weight, qkv_weight, qkv_bias, o_weight, post_norm_weight,
        gate_up_weight, down_weight, cos_sin_cache, key_cache, value_cache, slot_mapping, block_tables, cu_seqlens_q,
        seq_lens, num_heads, num_kv_heads, epsilon, scale, max_query_len, max_seq_len, sliding_window)


@torch.library.register_fake("kvflow::llama_decoder_layer")
def _llama_decoder_layer_fake(hidden, residual, positions, input_norm_weight, qkv_weight, qkv_bias, o_weight,
                              post_norm_weight, gate_up_weight, down_weight, cos_sin_cache, key_cache, value_cache,
                              slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads, num_kv_heads, epsilon,
                              scale, max_query_len, max_seq_len, sliding_window=-1):
    return None
