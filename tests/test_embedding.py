"""The embedding op against indexing the table in PyTorch (an exact copy), on every CPU
instruction set and on CUDA when present; bad ids and shapes get clear errors."""

import pytest
import torch

from kvflow import ops
from conftest import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (7, 64), (300, 100), (0, 32)])
def test_embedding_gathers_the_rows(device, dtype, num_tokens, hidden):
    weight = torch.randn(1000, hidden, dtype=dtype, device=device)
    ids = torch.randint(0, 1000, (num_tokens,), device=device)
    ids[: num_tokens // 2] = 999  # repeats and the last row
    assert torch.equal(ops.embedding(ids, weight), weight[ids])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_scaled_embedding_is_rounded_once(device, dtype):
    """Gemma's embeddings times sqrt(hidden_size): the float32 product rounded to the dtype."""
    weight = torch.randn(100, 96, dtype=dtype, device=device)
    ids = torch.tensor([3, 0, 99, 3], device=device)
    scale = float(torch.tensor(96 ** 0.5, dtype=dtype))
    assert torch.equal(ops.embedding(ids, weight, scale=scale), (weight[ids].float() * scale).to(dtype))


def test_an_id_outside_the_vocabulary_is_refused_before_any_row_is_written():
    weight = torch.randn(50, 16)
    out = torch.full((3, 16), 7.0)
    for bad in (50, -1):
        with pytest.raises(RuntimeError, match=rf"token_ids\[2\] = {bad} is not a token id in \[0, 50\)"):
            ops.embedding(torch.tensor([1, 2, bad]), weight, out=out)
        assert torch.all(out == 7.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_an_id_outside_the_vocabulary_gives_a_row_of_zeros():
    weight = torch.randn(50, 16, device="cuda")
    out = ops.embedding(torch.tensor([1, 50, -3], device="cuda"), weight)
    assert torch.equal(out[0], weight[1]) and torch.all(out[1:] == 0)


@pytest.mark.parametrize("make,message", [
    (lambda: (torch.tensor([[1, 2]]), torch.randn(5, 4)), "token_ids must be 1-D"),
    (lambda: (torch.tensor([1, 2], dtype=torch.int32), torch.randn(5, 4)), "token_ids must be Long"),
    (lambda: (torch.tensor([1]), torch.randn(5, 4, 2)), "weight must be a contiguous"),
    (lambda: (torch.tensor([1]), torch.randn(4, 5).t()), "weight must be a contiguous"),
    (lambda: (torch.tensor([1]), torch.randint(0, 5, (5, 4))), "weight must be float32, float16 or bfloat16"),
])
def test_bad_arguments_are_named(make, message):
    ids, weight = make()
    with pytest.raises(RuntimeError, match=message):
        ops.embedding(ids, weight)


def test_a_wrong_out_is_named():
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[2, 4\] tensor"):
        ops.embedding(torch.tensor([1, 2]), torch.randn(5, 4), out=torch.empty(2, 5))
