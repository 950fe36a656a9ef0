"""Writes into the paged KV cache, and block copies for copy-on-write."""

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key_cache[s // block_size, s % block_size] = key[t] (and value alike) for s = slot_mapping[t].

    key, value [num_tokens, num_kv_heads, head_dim] (each token's heads packed; a token-strided
    view of the QKV output is fine); caches [num_blocks, block_size, num_kv_heads, head_dim] of
    key's dtype; slot_mapping [num_tokens] int64, where -1 skips the token (padding).
    """
    torch.ops.kvflow.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every row (src, dst) of block_mapping [num_pairs, 2] int64, in every layer's key and
    value cache: cache[dst] = cache[src]. A destination may not be any pair's source or appear twice.
    """
    torch.ops.kvflow.copy_blocks(key_caches, value_caches, block_mapping)


@torch.library.register_fake("kvflow::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping):
    return None


@torch.library.register_fake("kvflow::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping):
    return None
