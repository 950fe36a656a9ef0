"""Llama-family decoder layers as CPU ops: one layer per call (llama_decoder_layer), or every
layer of a model in one call (llama_decoder_layers); for decode on the plain weights (few tokens),
or on packed ones (many)."""

import torch


def llama_decoder_layer(hidden, residual, positions, input_norm_weight, qkv_weight, qkv_bias, o_weight,
                        post_norm_weight, gate_up_weight, down_weight, cos_sin_cache, key_cache, value_cache,
                        slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads: int, num_kv_heads: int,
                        epsilon: float, scale: float, max_query_len: int, max_seq_len: int,
                        sliding_window: int = -1, qkv_packed=None, o_packed=None, gate_up_packed=None,
                        down_packed=None) -> None:
    """In place, for hidden, residual [num_tokens, hidden_size] (CPU):

        residual += hidden; x = rms_norm(residual) * input_norm_weight
        q|k|v = x @ qkv_weight.T (+ qkv_bias); NeoX rotary on q, k at positions
        k, v -> the paged cache at slot_mapping; a = paged_attention(q, ...)
        y = a @ o_weight.T; residual += y; y = rms_norm(residual) * post_norm_weight
        hidden = (silu(gate) * up)(y @ gate_up_weight.T) @ down_weight.T

    exactly as fused_add_rms_norm, small_linear, rotary_embedding, reshape_and_cache,
    paged_attention and silu_and_mul compute them one by one (same kernels, same order), without
    a dispatch per op. Attention arguments as in paged_attention. With the four packed weights
    (pack_linear_weight of qkv, o and down, and of gate_up with gate_up=True), the products run
    through packed_linear and packed_silu_and_mul instead: the path for many rows.
    """
    torch.ops.kvflow.llama_decoder_layer(
        hidden, residual, positions, input_norm_weight, qkv_weight, qkv_bias, o_weight, post_norm_weight,
        gate_up_weight, down_weight, cos_sin_cache, key_cache, value_cache, slot_mapping, block_tables, cu_seqlens_q,
        seq_lens, num_heads, num_kv_heads, epsilon, scale, max_query_len, max_seq_len, sliding_window, qkv_packed,
        o_packed, gate_up_packed, down_packed)


@torch.library.register_fake("kvflow::llama_decoder_layer")
def _llama_decoder_layer_fake(hidden, residual, positions, input_norm_weight, qkv_weight, qkv_bias, o_weight,
                              post_norm_weight, gate_up_weight, down_weight, cos_sin_cache, key_cache, value_cache,
                              slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads, num_kv_heads, epsilon,
                              scale, max_query_len, max_seq_len, sliding_window=-1, qkv_packed=None, o_packed=None,
                              gate_up_packed=None, down_packed=None):
    return None


def llama_decoder_layers(hidden, residual, positions, input_norm_weights, qkv_weights, qkv_biases, o_weights,
                         post_norm_weights, gate_up_weights, down_weights, cos_sin_cache, key_caches, value_caches,
                         slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads: int, num_kv_heads: int,
                         epsilon: float, scale: float, max_query_len: int, max_seq_len: int,
                         sliding_window: int = -1, qkv_packed=(), o_packed=(), gate_up_packed=(),
                         down_packed=()) -> None:
    """llama_decoder_layer for layer 0, then layer 1, ... in one call: each list holds one entry
    per layer (qkv_biases entries may be None; the four packed lists are all empty or all full).
    Bit for bit the result of calling llama_decoder_layer once per layer; it saves the Python
    and dispatcher cost of those calls (about 20 us each) and reuses one set of scratch tensors.
    Every layer's weights and caches, and the step's metadata, are checked before the first layer
    runs. A few rows on the plain weights with two or more threads run every layer inside one
    parallel region, with the same result.
    """
    torch.ops.kvflow.llama_decoder_layers(
        hidden, residual, positions, list(input_norm_weights), list(qkv_weights), list(qkv_biases), list(o_weights),
        list(post_norm_weights), list(gate_up_weights), list(down_weights), cos_sin_cache, list(key_caches),
        list(value_caches), slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads, num_kv_heads, epsilon,
        scale, max_query_len, max_seq_len, sliding_window, list(qkv_packed), list(o_packed), list(gate_up_packed),
        list(down_packed))


@torch.library.register_fake("kvflow::llama_decoder_layers")
def _llama_decoder_layers_fake(hidden, residual, positions, input_norm_weights, qkv_weights, qkv_biases, o_weights,
                               post_norm_weights, gate_up_weights, down_weights, cos_sin_cache, key_caches,
                               value_caches, slot_mapping, block_tables, cu_seqlens_q, seq_lens, num_heads,
                               num_kv_heads, epsilon, scale, max_query_len, max_seq_len, sliding_window=-1,
                               qkv_packed=(), o_packed=(), gate_up_packed=(), down_packed=()):
    return None
