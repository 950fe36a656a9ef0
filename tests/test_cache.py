"""reshape_and_cache and copy_blocks against plain indexing."""

import pytest
import torch

from conftest import DTYPES
from kvflow import ops

NUM_TOKENS = [1, 7, 83, 513]


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(device, num_tokens, head_dim, block_size, dtype):
    torch.manual_seed(num_tokens * head_dim + block_size)
    num_q, num_kv = 9, 3
    num_blocks = (num_tokens + block_size - 1) // block_size + 3
    # Key and value as views of the merged QKV output (token stride = whole row).
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype, device=device)
    key = qkv[:, num_q * head_dim : (num_q + num_kv) * head_dim].view(num_tokens, num_kv, head_dim)
    value = qkv[:, (num_q + num_kv) * head_dim :].view(num_tokens, num_kv, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1  # padding tokens
    shape = (num_blocks, block_size, num_kv, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    valid = slots >= 0
    expected_k.view(-1, num_kv, head_dim)[slots[valid]] = key[valid]
    expected_v.view(-1, num_kv, head_dim)[slots[valid]] = value[valid]
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_copy_blocks(device, dtype, num_layers):
    shape = (12, 16, 3, 64)
    key_caches = [torch.randn(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    value_caches = [torch.randn(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    mapping = torch.tensor([[0, 5], [3, 7], [0, 11]], dtype=torch.int64, device=device)
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    for src, dst in mapping.tolist():
        for layer in range(num_layers):
            expected_k[layer][dst] = expected_k[layer][src]
            expected_v[layer][dst] = expected_v[layer][src]
    ops.copy_blocks(key_caches, value_caches, mapping)
    for layer in range(num_layers):
        assert torch.equal(key_caches[layer], expected_k[layer])
        assert torch.equal(value_caches[layer], expected_v[layer])


def test_cache_ops_reject_bad_input_and_leave_cache_untouched():
    key = torch.randn(4, 3, 64)
    cache = torch.randn(2, 16, 3, 64)
    value_cache = torch.randn(2, 16, 3, 64)
    before = cache.clone()
    slots = torch.tensor([0, 1, 2, 32])
    with pytest.raises(RuntimeError, match=r"slot_mapping\[3\] = 32 is outside \[-1, 32\)"):
        ops.reshape_and_cache(key, key, cache, value_cache, slots)
    assert torch.equal(cache, before)
    with pytest.raises(RuntimeError, match="slot_mapping holds slot 2 more than once"):
        ops.reshape_and_cache(key, key, cache, value_cache, torch.tensor([2, -1, 2, -1]))
    assert torch.equal(cache, before)
    with pytest.raises(RuntimeError, match="slot_mapping must be Long"):
        ops.reshape_and_cache(key, key, cache, value_cache, slots.int())
    with pytest.raises(RuntimeError, match="key's head_dim 128 differs from key_cache's head_dim 64"):
        ops.reshape_and_cache(torch.randn(4, 3, 128), torch.randn(4, 3, 128), cache, value_cache, slots)
    with pytest.raises(RuntimeError, match="key has 2 kv heads but key_cache has 3"):
        ops.reshape_and_cache(key[:, :2], key[:, :2], cache, value_cache, slots)
    with pytest.raises(RuntimeError, match="key_cache has dtype"):
        ops.reshape_and_cache(key, key, cache.half(), value_cache, slots)
    with pytest.raises(RuntimeError, match=r"slot_mapping must be \[4\]"):
        ops.reshape_and_cache(key, key, cache, value_cache, slots[:3])
    with pytest.raises(RuntimeError, match=r"block_mapping\[1\]\[1\] = 2 is not a block id"):
        ops.copy_blocks([cache], [value_cache], torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(RuntimeError, match="destination block 1 is also a source"):
        ops.copy_blocks([cache], [value_cache], torch.tensor([[0, 1], [1, 0]]))
    with pytest.raises(RuntimeError, match=r"block_mapping must be \[num_pairs, 2\]"):
        ops.copy_blocks([cache], [value_cache], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="key_caches has 1 layers but value_caches has 2"):
        ops.copy_blocks([cache], [value_cache, value_cache], torch.tensor([[0, 1]]))
    assert torch.equal(cache, before)
