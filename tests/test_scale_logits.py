"""scale_logits, a family's last step on the LM head's logits (Granite's logits_scaling, Gemma 2's
final soft cap), against plain PyTorch written from the formula, on every CPU instruction set and
CUDA; rows of any length (vector tails), strided rows; bad input refused by name."""

import pytest
import torch

from kvflow import ops


def reference(logits, divisor, soft_cap):
    x = logits.double() / divisor
    if soft_cap:
        x = soft_cap * torch.tanh(x / soft_cap)
    return x.float()


@pytest.mark.parametrize("divisor,soft_cap", [(1.0, 30.0), (2.5, None), (8.0, 5.0), (1.0, None)])
@pytest.mark.parametrize("shape", [(1, 49152), (3, 97), (5, 7), (2, 1)])
def test_scale_logits_matches_the_formula(device, divisor, soft_cap, shape):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(shape, generator=g) * 40).to(device)  # well into the cap's flat tails too
    expected = reference(logits.cpu(), divisor, soft_cap)
    out = ops.scale_logits(logits, divisor, soft_cap)
    assert out is logits
    torch.testing.assert_close(logits.cpu(), expected, rtol=2e-6, atol=2e-5)


def test_strided_rows_leave_the_gaps_alone(device):
    storage = torch.randn(4, 40).to(device)
    before = storage.clone()
    view = storage[:, :33]
    ops.scale_logits(view, 2.0, 3.0)
    torch.testing.assert_close(view.cpu(), reference(before[:, :33].cpu(), 2.0, 3.0), rtol=2e-6, atol=2e-5)
    assert torch.equal(storage[:, 33:], before[:, 33:])


def test_bad_input_is_rejected_clearly():
    with pytest.raises(RuntimeError, match="scale_logits needs float32 logits, got BFloat16"):
        ops.scale_logits(torch.randn(2, 8, dtype=torch.bfloat16), 2.0)
    with pytest.raises(RuntimeError, match=r"divisor = 0 must be finite and > 0"):
        ops.scale_logits(torch.randn(2, 8), 0.0)
    with pytest.raises(RuntimeError, match=r"soft_cap = -1 must be finite and >= 0"):
        ops.scale_logits(torch.randn(2, 8), 1.0, -1.0)
    with pytest.raises(RuntimeError, match=r"logits must be \[batch, vocab\]"):
        ops.scale_logits(torch.randn(8), 1.0, 2.0)
