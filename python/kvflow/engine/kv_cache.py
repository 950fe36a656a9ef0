"""The paged KV cache tensors of every layer, and how many blocks fit in a memory budget."""

import torch

from kvflow.loader.huge_pages import empty_in_huge_pages
from kvflow.models.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_local_kv_heads * config.head_dim * element


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
    shape = (num_blocks, block_size, config.num_local_kv_heads, config.head_dim)
    if torch.device(device).type == "cpu":  # attention reads blocks all over the pool: spare the TLB
        tensors = empty_in_huge_pages([shape] * (2 * config.num_layers), dtype)
        return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(config.num_layers)]
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]


@torch.inference_mode()
def cuda_kv_cache_budget(model: torch.nn.Module, config: ModelConfig, block_size: int, max_num_batched_tokens: int,
                         max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float,
                         device: torch.device | str) -> int:
    """Bytes of KV cache that fit on the GPU: utilization x total memory, less what is already in
    use (the weights, the CUDA context, other processes), less the activations' peak. The peak is
    measured with one forward pass over the largest step the scheduler can make
    (max_num_batched_tokens new tokens, in requests of at most max_model_len), plus what the
    sampler holds for max_num_seqs rows (float32 logits, a copy for logprobs, and the sort)."""
    from kvflow.attention_metadata import AttentionMetadata

    device = torch.device(device)
    lengths = [max_model_len] * (max_num_batched_tokens // max_model_len)
    if max_num_batched_tokens % max_model_len:
        lengths.append(max_num_batched_tokens % max_model_len)
    tables, next_block = [], 0
    for length in lengths:
        blocks = -(-length // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    caches = allocate_kv_caches(config, next_block, block_size, model.dtype, device)
    metadata = AttentionMetadata.build(lengths, lengths, tables, block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    hidden = model(torch.zeros(sum(lengths), dtype=torch.int64, device=device), metadata, caches)
    model.compute_logits(hidden[-min(max_num_seqs, len(hidden)):])
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline
    del caches, hidden, metadata
    torch.cuda.empty_cache()
    sampler = 4 * max_num_seqs * config.vocab_size * 4  # logits, their logprobs copy, sorted values and ids
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization) - (total - free) - activation_peak - sampler
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB, less "
            f"{(total - free) / 2**30:.1f} GiB in use and {(activation_peak + sampler) / 2**30:.2f} GiB of "
            "activations; raise gpu_memory_utilization, lower max_num_batched_tokens, or give kv_cache_memory")
    return budget
