"""The paged KV cache tensors of every layer, and how many blocks fit in a memory budget."""

import torch

from kvflow.models.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]
