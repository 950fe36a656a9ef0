"""paged_attention against a plain float32 PyTorch reference that gathers each request's K/V
through its block table and applies the causal and sliding-window masks explicitly."""

import math
import random

import pytest
import torch

from conftest import DTYPES, TOLERANCES
from kvflow import AttentionMetadata, ops, platform


def reference_attention(query, key_cache, value_cache, query_lens, seq_lens, tables, scale, window=-1, cap=0.0):
    """[num_tokens, num_q_heads, head_dim] float32, one request at a time."""
    block_size, num_kv, head_dim = key_cache.shape[1:]
    group = query.shape[1] // num_kv
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    start = 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables):
        blocks = torch.tensor(table[: -(-seq_len // block_size)], device=query.device)
        k = key_cache[blocks].reshape(-1, num_kv, head_dim)[:seq_len].float().repeat_interleave(group, dim=1)
        v = value_cache[blocks].reshape(-1, num_kv, head_dim)[:seq_len].float().repeat_interleave(group, dim=1)
        q = query[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap > 0:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if window > 0:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def run_case(device, query_lens, seq_lens, num_q=9, num_kv=3, head_dim=64, block_size=16, dtype=torch.bfloat16,
             window=-1, cap=0.0, strided_query=False, seed=0):
    gen = random.Random(seed)
    torch.manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    ids = list(range(num_blocks))
    gen.shuffle(ids)  # non-contiguous, out-of-order block tables
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(ids[used : used + n])
        used += n
    shape = (num_blocks, block_size, num_kv, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    num_tokens = sum(query_lens)
    if strided_query:  # a view of a merged QKV output: token stride > num_q * head_dim
        qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype, device=device)
        query = qkv[:, : num_q * head_dim].view(num_tokens, num_q, head_dim)
    else:
        query = torch.randn(num_tokens, num_q, head_dim, dtype=dtype, device=device)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    scale = 1.0 / math.sqrt(head_dim)
    out = ops.paged_attention(query, key_cache, value_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale,
                              md.max_query_len, md.max_seq_len, window, cap)
    expected = reference_attention(query, key_cache, value_cache, query_lens, seq_lens, tables, scale, window, cap)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_batch(device, dtype, head_dim):
    rng = random.Random(1)
    seq_lens = [rng.randint(1, 300) for _ in range(13)]
    run_case(device, [1] * 13, seq_lens, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill(device, dtype, block_size):
    run_case(device, [77, 1, 130], [77, 1, 130], block_size=block_size, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_with_chunks_after_prefix(device, dtype):
    # decode, full prefill, a chunk after a prefix-cache hit, a later chunk of a chunked prefill
    run_case(device, [1, 45, 20, 33, 1], [200, 45, 84, 129, 17], dtype=dtype, strided_query=True)


@pytest.mark.parametrize("block_size", [16, 32])
def test_contexts_on_and_just_past_block_boundaries(device, block_size):
    seq_lens = [block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 3 * block_size - 1]
    run_case(device, [1, 1, 5, block_size + 1, 3], seq_lens, block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q,num_kv", [(8, 8), (9, 3), (8, 2), (10, 2), (12, 2), (16, 2), (8, 1)])
def test_gqa_ratios_and_mqa(device, num_q, num_kv, dtype):
    """Every group size up to 8 query heads a kv head (the CPU reads a bf16 cache in place for a
    decode row's group, up to 4 rows at once: groups of 5 and 6 leave a remainder)."""
    run_case(device, [1, 1, 19, 6], [40, 130, 19, 70], num_q=num_q, num_kv=num_kv, dtype=dtype)


@pytest.mark.parametrize("window", [1, 17, 64])
def test_sliding_window(device, window):
    run_case(device, [1, 50, 9], [150, 120, 200], window=window, dtype=torch.float32)


def test_logits_soft_cap(device):
    run_case(device, [1, 31], [90, 64], cap=5.0, dtype=torch.float32, head_dim=128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_not_a_power_of_two(device, dtype, head_dim):
    # Phi-3's 96 and 80: a mixed batch of prefill chunks (CUDA's tensor-core kernel for 16-bit
    # types), then one long decode whose keys are split and merged.
    run_case(device, [1, 45, 20, 1], [200, 45, 84, 17], head_dim=head_dim, dtype=dtype, strided_query=True)
    run_case(device, [1], [1500], head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("num_q,num_kv", [(9, 3), (10, 2), (8, 1)])
def test_decode_over_a_few_hundred_keys_splits_them(device, dtype, head_dim, num_q, num_kv):
    """One request (or three) decoding over tens to hundreds of keys on two threads, as a small
    model's decode does: the CPU splits each request's keys in two and merges the halves.
    Contexts on and past the edges of a 16-key chunk, a sliding window that hides a whole split
    from the query, and a cap."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seq_len in [32, 33, 64, 65, 100, 191, 300]:
            run_case(device, [1], [seq_len], num_q=num_q, num_kv=num_kv, head_dim=head_dim, dtype=dtype)
        run_case(device, [1, 1, 1], [130, 77, 250], num_q=num_q, num_kv=num_kv, head_dim=head_dim, dtype=dtype,
                 window=50)
        run_case(device, [1], [150], num_q=num_q, num_kv=num_kv, head_dim=head_dim, dtype=dtype, cap=5.0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_small_batch_splits_keys(device, dtype):
    # One decode request with a long context: the CPU splits its keys across threads and merges.
    run_case(device, [1], [1500], dtype=dtype)
    run_case(device, [1, 3], [2049, 700], dtype=dtype, window=1000)


def test_batch_of_64(device):
    rng = random.Random(7)
    query_lens = [1] * 48 + [rng.randint(2, 40) for _ in range(16)]
    seq_lens = [q + rng.randint(0, 150) for q in query_lens]
    run_case(device, query_lens, seq_lens, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q,num_kv", [(9, 3), (16, 2)])
def test_a_row_is_bit_equal_alone_and_among_new_tokens(device, dtype, num_q, num_kv):
    """Batch-invariant mode: a query row gets the same bits when it is its request's only new
    token as when it is the last of 5 (a speculative verification), whose rows the CPU kernel
    reads the cache for in another way. Every context length up to 5 blocks, as a difference
    in float32 survives rounding to bfloat16 in only a few of a row's values."""
    torch.manual_seed(0)
    block_size, head_dim = 16, 64
    cache_shape = (8, block_size, num_kv, head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    value_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    queries = torch.randn(5, num_q, head_dim, dtype=dtype, device=device)
    table = [[3, 0, 6, 1, 5]]

    def attend(query, context):
        md = AttentionMetadata.build([query.shape[0]], [context], table, block_size, device)
        return ops.paged_attention(query, key_cache, value_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens,
                                   0.125, md.max_query_len, md.max_seq_len)

    platform.set_batch_invariant(True)
    try:
        for context in range(5, 5 * block_size + 1):
            among_five = attend(queries, context)[-1]
            alone = attend(queries[-1:], context)[0]
            assert torch.equal(alone, among_five), f"context {context}"
    finally:
        platform.set_batch_invariant(False)
    expected = reference_attention(queries[-1:], key_cache, value_cache, [1], [context], table, 0.125, -1, 0.0)
    torch.testing.assert_close(alone.float(), expected[0], **TOLERANCES[dtype])


def test_attention_metadata_build():
    md = AttentionMetadata.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    assert md.positions.tolist() == [3, 4, 2]
    assert md.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert md.cu_seqlens_q.tolist() == [0, 2, 3]
    assert md.block_tables.tolist() == [[7, 2], [4, 0]]
    assert (md.max_query_len, md.max_seq_len) == (2, 5)
    with pytest.raises(ValueError, match="seq_len 9 needs 3 blocks, its block table has 2"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)
    with pytest.raises(ValueError, match="query length 4 must be in"):
        AttentionMetadata.build([4], [3], [[0]], block_size=4)
    with pytest.raises(ValueError, match=r"block table \[7, 9\] holds ids outside \[0, 8\)"):
        AttentionMetadata.build([1], [5], [[7, 9]], block_size=4, num_blocks=8)


def test_caller_workspace_serves_the_key_splits(device):
    # A long single decode splits its keys; the partial results go to the caller's buffer.
    torch.manual_seed(8)
    block_size, seq_len = 16, 1500
    num_blocks = seq_len // block_size + 1
    key_cache = torch.randn(num_blocks, block_size, 3, 64, device=device)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(1, 9, 64, device=device)
    table = list(range(num_blocks))
    md = AttentionMetadata.build([1], [seq_len], [table], block_size, device, num_blocks=num_blocks,
                                 workspace=torch.full((1 << 20,), float("nan"), device=device))
    out = ops.paged_attention(query, key_cache, value_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, 0.125,
                              md.max_query_len, md.max_seq_len, workspace=md.workspace)
    expected = reference_attention(query, key_cache, value_cache, [1], [seq_len], [table], 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(md.workspace).any(), "the op did not use the workspace it was given"


def bad_call(**overrides):
    args = dict(
        query=torch.randn(3, 9, 64),
        key_cache=torch.randn(4, 16, 3, 64),
        value_cache=torch.randn(4, 16, 3, 64),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([20, 30], dtype=torch.int32),
        scale=0.125,
        max_query_len=2,
        max_seq_len=30,
    )
    args.update(overrides)
    return ops.paged_attention(**args)


def test_bad_input_is_rejected_clearly():
    bad_call()  # the baseline is valid
    with pytest.raises(RuntimeError, match="num_q_heads 9 is not a multiple of num_kv_heads 4"):
        bad_call(key_cache=torch.randn(4, 16, 4, 64), value_cache=torch.randn(4, 16, 4, 64))
    with pytest.raises(RuntimeError, match=r"head_dim 72 is not supported by paged_attention \(supported: 64, 80, 96, 128, 256\)"):
        bad_call(query=torch.randn(3, 9, 72), key_cache=torch.randn(4, 16, 3, 72), value_cache=torch.randn(4, 16, 3, 72))
    with pytest.raises(RuntimeError, match="key_cache's head_dim 128 differs from query's 64"):
        bad_call(key_cache=torch.randn(4, 16, 3, 128), value_cache=torch.randn(4, 16, 3, 128))
    # A context longer than its block table: the honest max_seq_len is already out of range.
    with pytest.raises(RuntimeError, match=r"max_seq_len 40 exceeds what block_tables can address \(2 blocks of 16\)"):
        bad_call(seq_lens=torch.tensor([20, 40], dtype=torch.int32), max_seq_len=40)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 30 exceeds max_seq_len 25"):
        bad_call(max_seq_len=25)
    with pytest.raises(RuntimeError, match="block_tables must be Int"):
        bad_call(block_tables=torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(RuntimeError, match="key_cache has dtype"):
        bad_call(key_cache=torch.randn(4, 16, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"block_tables\[1\]\[1\] = 9 is not a block id"):
        bad_call(block_tables=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 0 is shorter than its 1 query tokens"):
        bad_call(seq_lens=torch.tensor([0, 30], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="request 1 has 2 query tokens, more than max_query_len 1"):
        bad_call(max_query_len=1)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[2\] = 2 must equal the number of query tokens 3"):
        bad_call(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="block_size 8 is not supported on the CPU"):
        bad_call(key_cache=torch.randn(8, 8, 3, 64), value_cache=torch.randn(8, 8, 3, 64),
                 block_tables=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sliding_window must be -1"):
        bad_call(sliding_window=0)
