"""rms_norm, fused_add_rms_norm and rms_norm_add against a few lines of float32 PyTorch."""

import pytest
import torch

from conftest import DTYPES, assert_close
from kvflow import ops

NUM_TOKENS = [1, 7, 83, 513]
HIDDEN = [111, 769, 5125]


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device, num_tokens, hidden, dtype):
    torch.manual_seed(num_tokens * hidden)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, dtype=dtype, device=device)
    assert_close(ops.rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows_and_3d(device, dtype):
    # A slice of the columns of a wider tensor (e.g. part of a merged projection) and a
    # [batch, seq, hidden] input.
    wide = torch.randn(83, 2 * 769 + 5, dtype=dtype, device=device)
    x = wide[:, 3 : 3 + 769]
    w = torch.randn(769, dtype=dtype, device=device)
    assert not x.is_contiguous()
    assert_close(ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5), dtype)
    x3 = torch.randn(4, 7, 769, dtype=dtype, device=device)
    assert_close(ops.rms_norm(x3, w, 1e-5), reference_rms_norm(x3, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 130])
def test_rms_norm_over_the_heads_of_a_merged_qkv_output(device, dtype, tokens):
    """QK-norm (Qwen3, OLMo 2, Gemma 3): one norm per head of the q and k parts of the qkv
    product, a [tokens, heads, head_dim] view whose token stride is the whole qkv row, so its
    rows do not collapse into one stride; out of place and in place."""
    heads, kv_heads, d = 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
    w = torch.randn(d, dtype=dtype, device=device)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d: (heads + kv_heads) * d].view(tokens, kv_heads, d)
    expected_q, expected_k = reference_rms_norm(q, w, 1e-6), reference_rms_norm(k, w, 1e-6)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    assert_close(ops.rms_norm(q, w, 1e-6), expected_q, dtype)
    torch.ops.kvflow.rms_norm(k, k, w, 1e-6, 0.0)  # in place, in the qkv buffer
    assert_close(k, expected_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)
    if tokens > 1:  # one token's heads are evenly strided; more are not, which only rms_norm takes
        with pytest.raises(RuntimeError, match="leading dimensions must collapse"):
            ops.fused_add_rms_norm(q, q.clone(), w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gemma_offset(device, dtype):
    x = torch.randn(7, 769, dtype=dtype, device=device)
    w = torch.randn(769, dtype=dtype, device=device) * 0.1
    assert_close(ops.rms_norm(x, w, 1e-6, weight_offset=1.0), reference_rms_norm(x, w, 1e-6, 1.0), dtype)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device, num_tokens, hidden, dtype):
    torch.manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, dtype=dtype, device=device)
    expected_residual = (x.float() + residual.float()).to(dtype)
    expected_out = reference_rms_norm(expected_residual, w, 1e-6)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    # The sum of two values of one dtype is exact in float32 and rounded once: bit-exact.
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(x, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_strided_input(device, dtype):
    wide = torch.randn(83, 1000, dtype=dtype, device=device)
    x = wide[:, 100:869]
    residual = torch.randn(83, 769, dtype=dtype, device=device)
    w = torch.randn(769, dtype=dtype, device=device)
    untouched = wide[:, :100].clone()
    expected_residual = (x.float() + residual.float()).to(dtype)
    expected_out = reference_rms_norm(expected_residual, w, 1e-6)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    assert_close(residual, expected_residual, dtype)
    assert_close(wide[:, 100:869], expected_out, dtype)
    assert torch.equal(wide[:, :100], untouched)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_add(device, num_tokens, hidden, dtype):
    """residual += rms_norm(x): the norm rounded to the dtype, then the sum rounded (an unfused
    rms_norm then add). Hidden sizes past the kernel's 256-wide chunks, with a ragged end."""
    torch.manual_seed(num_tokens * 3 + hidden)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, dtype=dtype, device=device)
    x_before, residual_before = x.clone(), residual.clone()
    normed = reference_rms_norm(x, w, 1e-6, 0.5).to(dtype)
    expected = (residual.float() + normed.float()).to(dtype)
    ops.rms_norm_add(residual, x, w, 1e-6, weight_offset=0.5)
    assert torch.equal(x, x_before)
    # Where the sum cancels, a norm that rounded the other way (float32 noise) moves it by an ulp
    # of the norm, not of the sum: the bound is relative to the terms.
    relative = {torch.float32: 1e-5, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}[dtype]
    bound = relative * (residual_before.float().abs() + normed.float().abs()) + 1e-6
    assert ((residual.float() - expected.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_add_strided_rows(device, dtype):
    wide = torch.randn(83, 1000, dtype=dtype, device=device)
    residual = wide[:, 100:869]
    x = torch.randn(83, 2000, dtype=dtype, device=device)[:, 7:776]
    w = torch.randn(769, dtype=dtype, device=device)
    untouched = wide[:, :100].clone()
    expected = (residual.float() + reference_rms_norm(x, w, 1e-6).to(dtype).float()).to(dtype)
    ops.rms_norm_add(residual, x, w, 1e-6)
    assert_close(wide[:, 100:869], expected, dtype)
    assert torch.equal(wide[:, :100], untouched)


def test_rms_norm_rejects_bad_input():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.rms_norm(x, torch.randn(63))
    with pytest.raises(RuntimeError, match="input must be float32, float16 or bfloat16"):
        ops.rms_norm(x.to(torch.int32), w)
    with pytest.raises(RuntimeError, match="weight has dtype"):
        ops.rms_norm(x, w.half())
    with pytest.raises(RuntimeError, match="out has shape"):
        ops.rms_norm(x, w, out=torch.empty(4, 65))
    with pytest.raises(RuntimeError, match="residual has shape"):
        ops.fused_add_rms_norm(x, torch.randn(3, 64), w)
    with pytest.raises(RuntimeError, match="epsilon must be positive"):
        ops.rms_norm(x, w, epsilon=0.0)
    with pytest.raises(RuntimeError, match="residual has shape"):
        ops.rms_norm_add(torch.randn(3, 64), x, w)
    with pytest.raises(RuntimeError, match="residual has dtype"):
        ops.rms_norm_add(x.half(), x, w)
    with pytest.raises(RuntimeError, match="input must have unit stride in its last dimension"):
        ops.rms_norm(torch.randn(64, 4).t(), w)
