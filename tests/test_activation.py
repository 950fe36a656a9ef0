"""silu_and_mul, gelu_and_mul and gelu_tanh_and_mul against float32 PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, assert_close
from kvflow import ops

NUM_TOKENS = [1, 7, 83, 513]
D = [111, 769, 5125]

REFERENCES = {
    "silu": (ops.silu_and_mul, lambda g, u: F.silu(g) * u),
    "gelu_tanh": (ops.gelu_tanh_and_mul, lambda g, u: F.gelu(g, approximate="tanh") * u),
    "gelu": (ops.gelu_and_mul, lambda g, u: F.gelu(g) * u),
}


@pytest.mark.parametrize("activation", REFERENCES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("d", D)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation(device, activation, num_tokens, d, dtype):
    op, reference = REFERENCES[activation]
    torch.manual_seed(num_tokens * d)
    x = torch.randn(num_tokens, 2 * d, dtype=dtype, device=device) * 3
    expected = reference(x[:, :d].float(), x[:, d:].float())
    assert_close(op(x), expected, dtype)


@pytest.mark.parametrize("activation", REFERENCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation_strided_and_extreme(device, activation, dtype):
    op, reference = REFERENCES[activation]
    d = 769
    wide = torch.randn(2, 41, 2 * d + 9, dtype=dtype, device=device) * 4
    x = wide[..., 9:]
    # Gates far into both saturated tails; their "up" factor small so float16 cannot overflow.
    x[0, 0, :32] = torch.tensor([-1e4, -100.0, -30.0, 30.0, 100.0, 1e4, 0.0, -0.0] * 4, dtype=dtype)
    x[0, 0, d : d + 32] = 0.5
    expected = reference(x[..., :d].float(), x[..., d:].float())
    out = op(x)
    assert out.shape == (2, 41, d)
    assert torch.isfinite(out).all()
    assert_close(out, expected, dtype)


def test_gated_activation_rejects_bad_input():
    with pytest.raises(RuntimeError, match=r"input's last dimension must be 2 \* d"):
        ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="out must have shape"):
        ops.silu_and_mul(torch.randn(4, 8), out=torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="out has dtype"):
        ops.gelu_tanh_and_mul(torch.randn(4, 8), out=torch.empty(4, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="input must be float32, float16 or bfloat16"):
        ops.silu_and_mul(torch.ones(4, 8, dtype=torch.int64))
