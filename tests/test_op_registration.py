"""Every op passes torch.library.opcheck (schema, fake impl, autograd registration, AOT
dispatch), and a function chaining the ops compiles with torch.compile(fullgraph=True) to the
same result as eager."""

import pytest
import torch

from kvflow import ops


def op_cases():
    x = torch.randn(7, 111)
    w = torch.randn(111)
    qkv = torch.randn(5, 15 * 64)
    cache = torch.randn(4, 16, 3, 64)
    bf16_cache = torch.randn(2, 16, 1, 64, dtype=torch.bfloat16)

    def bf16(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16)

    return {
        "embedding": (torch.ops.kvflow.embedding, (torch.empty(3, 111), torch.tensor([0, 6, 2]), x, 1.5)),
        "rms_norm": (torch.ops.kvflow.rms_norm, (torch.empty(7, 111), x, w, 1e-6, 0.0)),
        "fused_add_rms_norm": (torch.ops.kvflow.fused_add_rms_norm, (x.clone(), torch.randn(7, 111), w, 1e-6, 1.0)),
        "rotary_embedding": (
            torch.ops.kvflow.rotary_embedding,
            (torch.arange(5), qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64], 64, ops.compute_cos_sin_cache(64, 32), True),
        ),
        "silu_and_mul": (torch.ops.kvflow.silu_and_mul, (torch.empty(7, 55), torch.randn(7, 110))),
        "gelu_tanh_and_mul": (torch.ops.kvflow.gelu_tanh_and_mul, (torch.empty(7, 55), torch.randn(7, 110))),
        "gelu_and_mul": (torch.ops.kvflow.gelu_and_mul, (torch.empty(7, 55), torch.randn(7, 110))),
        "reshape_and_cache": (
            torch.ops.kvflow.reshape_and_cache,
            (torch.randn(5, 3, 64), torch.randn(5, 3, 64), cache.clone(), cache.clone(), torch.tensor([0, 3, -1, 17, 63])),
        ),
        "paged_attention": (
            torch.ops.kvflow.paged_attention,
            (torch.empty(5, 9, 64), qkv[:, : 9 * 64].view(5, 9, 64), cache, cache.clone(),
             torch.tensor([[3, 1], [0, 2]], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32),
             torch.tensor([20, 4], dtype=torch.int32), 0.125, 4, 20, -1, 0.0, None),
        ),
        "sample": (
            torch.ops.kvflow.sample,
            (torch.empty(4, dtype=torch.int64), torch.randn(4, 300), torch.tensor([0.0, 1.0, 0.5, 1.0]), torch.tensor([0, 10, 0, 1], dtype=torch.int32),
             torch.tensor([1.0, 0.9, 0.5, 1.0]), torch.tensor([0.0, 0.0, 0.1, 0.0]), torch.arange(4),
             torch.zeros(4, dtype=torch.int64)),
        ),
        "scale_logits": (torch.ops.kvflow.scale_logits, (torch.randn(3, 100) * 40, 2.0, 30.0)),
        "apply_sampling_filters": (
            torch.ops.kvflow.apply_sampling_filters,
            (torch.randn(2, 300), torch.tensor([0.7, 0.0]), torch.tensor([10, 0], dtype=torch.int32),
             torch.tensor([0.9, 1.0]), torch.tensor([0.0, 0.0])),
        ),
        "apply_penalties": (
            torch.ops.kvflow.apply_penalties,
            (torch.randn(2, 50), torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]), torch.tensor([4, 4]),
             torch.tensor([0, 0, 2]), torch.tensor([1.2, 1.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1])),
        ),
        "compute_logprobs": (torch.ops.kvflow.compute_logprobs, (torch.randn(3, 100), torch.tensor([1, 50, 99]), 5)),
        "small_linear": (torch.ops.kvflow.small_linear,
                         (torch.empty(3, 40), torch.randn(3, 33), torch.randn(40, 33), torch.randn(40))),
        "pack_linear_weight": (torch.ops.kvflow.pack_linear_weight, (torch.randn(50, 33, dtype=torch.bfloat16),)),
        "packed_linear": (torch.ops.kvflow.packed_linear,
                          (torch.empty(3, 50, dtype=torch.bfloat16), torch.randn(3, 33, dtype=torch.bfloat16),
                           torch.ops.kvflow.pack_linear_weight(torch.randn(50, 33, dtype=torch.bfloat16)),
                           torch.randn(50, dtype=torch.bfloat16))),
        "packed_silu_and_mul": (torch.ops.kvflow.packed_silu_and_mul,
                                (torch.empty(3, 25, dtype=torch.bfloat16), torch.randn(3, 33, dtype=torch.bfloat16),
                                 torch.ops.kvflow.pack_linear_weight(torch.randn(50, 33, dtype=torch.bfloat16),
                                                                     True))),
        "quantized_linear": (torch.ops.kvflow.quantized_linear,
                             (torch.empty(3, 5), torch.randn(3, 64), torch.randint(0, 256, (5, 40), dtype=torch.uint8),
                              3, torch.randn(5))),
        "quantized_embedding": (torch.ops.kvflow.quantized_embedding,
                                (torch.empty(3, 64, dtype=torch.bfloat16), torch.tensor([0, 4, 2]),
                                 torch.randint(0, 256, (5, 68), dtype=torch.uint8), 8, 1.5)),
        "copy_blocks": (
            torch.ops.kvflow.copy_blocks,
            ([cache.clone(), cache.clone()], [cache.clone(), cache.clone()], torch.tensor([[0, 2], [1, 3]])),
        ),
    }


@pytest.mark.parametrize("name", list(op_cases()))
def test_opcheck(name):
    op, args = op_cases()[name]
    torch.library.opcheck(op, args)


def decoder_mlp_block(x, residual, norm_w, positions, qkv, cos_sin, gate_up, key_cache, value_cache, slots,
                      block_tables, cu_seqlens_q, seq_lens):
    ops.fused_add_rms_norm(x, residual, norm_w, 1e-5)
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]
    ops.rotary_embedding(positions, q, k, 64, cos_sin)
    ops.reshape_and_cache(k.view(-1, 3, 64), qkv[:, 12 * 64 :].view(-1, 3, 64), key_cache, value_cache, slots)
    attn = ops.paged_attention(q.view(-1, 9, 64), key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                               0.125, 11, 11)
    act = ops.silu_and_mul(gate_up * x.sum(-1, keepdim=True))
    return ops.rms_norm(act, norm_w[: act.shape[-1]], 1e-5) + attn.sum()


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    n = 11

    def make_inputs():
        g = torch.Generator().manual_seed(1)
        return (
            torch.randn(n, 96, generator=g),
            torch.randn(n, 96, generator=g),
            torch.randn(96, generator=g),
            torch.arange(n) * 3,
            torch.randn(n, 15 * 64, generator=g),
            ops.compute_cos_sin_cache(64, 64),
            torch.randn(n, 96, generator=g),
            torch.zeros(2, 16, 3, 64),
            torch.zeros(2, 16, 3, 64),
            torch.arange(n),  # one prefill of n tokens in blocks 0 and 1
            torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32),
        )

    eager_inputs, compiled_inputs = make_inputs(), make_inputs()
    expected = decoder_mlp_block(*eager_inputs)
    compiled = torch.compile(decoder_mlp_block, fullgraph=True)
    actual = compiled(*compiled_inputs)
    # Inductor writes its own kernels for the graph's plain torch reductions (x.sum, attn.sum), whose
    # float32 summation order follows the CPU's vector width and the thread count, not eager's: a
    # few float32 ulps of a sum of 6,336 values (seen: 3e-6 relative on AVX2), added to every element.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # The in-place writes (x, residual, qkv, caches) must happen under compilation too.
    for eager_t, compiled_t in zip(eager_inputs, compiled_inputs):
        torch.testing.assert_close(compiled_t, eager_t)
