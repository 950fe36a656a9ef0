"""quantized_embedding (a table in GGUF blocks of each type quantized_linear runs, and in the
interleaved layout of every quantized type, which a tied LM head keeps) against the rows the gguf
package dequantizes, scaled and rounded once to the output dtype; bad ids and arguments get clear
errors."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from conftest import random_blocks
from kvflow import ops
from kvflow.ops.quantized import (BLOCK_BYTES, BLOCK_VALUES, GGML_Q4_1, GGML_Q8_0, GGML_TYPE_NAMES, INTERLEAVED_TYPES,
                                  interleave_rows)


@pytest.mark.parametrize("ggml_type", list(GGML_TYPE_NAMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,scale", [(1, 1.0), (9, 1.0), (40, 24.0), (0, 1.0)])
def test_quantized_embedding_dequantizes_the_rows(ggml_type, dtype, num_tokens, scale):
    rng = np.random.default_rng(ggml_type * 10 + num_tokens)
    hidden = 576 if BLOCK_VALUES[ggml_type] == 32 else 768
    table = random_blocks(ggml_type, 500, hidden, rng)
    ids = torch.from_numpy(rng.integers(0, 500, num_tokens))
    ids[: num_tokens // 2] = 499  # repeats and the last row
    rows = quants.dequantize(table, GGMLQuantizationType[GGML_TYPE_NAMES[ggml_type]])[ids.numpy()]
    expected = (torch.from_numpy(rows).float() * scale).to(dtype)
    actual = ops.quantized_embedding(ids, torch.from_numpy(table), ggml_type, scale=scale, out_dtype=dtype)
    assert actual.dtype == dtype and actual.shape == (num_tokens, hidden)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("ggml_type", list(INTERLEAVED_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_interleaved_table_gives_the_rows_of_the_file(ggml_type, dtype, cpu_isa):
    """Every row of each group of 8 (the ids cover all 8 lanes, repeats, the first and the last
    row), as the gguf package dequantizes the file's own rows."""
    rng = np.random.default_rng(ggml_type)
    table = random_blocks(ggml_type, 64, 576 if BLOCK_VALUES[ggml_type] == 32 else 768, rng)
    ids = torch.tensor(list(range(16)) + [63, 0, 37, 37, 8, 55])
    rows = quants.dequantize(table, GGMLQuantizationType[GGML_TYPE_NAMES[ggml_type]])[ids.numpy()]
    expected = (torch.from_numpy(rows).float() * 3.0).to(dtype)
    interleaved = interleave_rows(torch.from_numpy(table), ggml_type)
    actual = ops.quantized_embedding(ids, interleaved, INTERLEAVED_TYPES[ggml_type], scale=3.0, out_dtype=dtype)
    assert torch.equal(actual, expected)


def test_an_id_outside_the_table_is_refused_before_any_row_is_written():
    table = torch.from_numpy(random_blocks(GGML_Q4_1, 50, 64, np.random.default_rng(0)))
    out = torch.full((3, 64), 7.0)
    for bad in (50, -1):
        with pytest.raises(RuntimeError, match=rf"token_ids\[2\] = {bad} is not a token id in \[0, 50\)"):
            ops.quantized_embedding(torch.tensor([1, 2, bad]), table, GGML_Q4_1, out=out)
        assert torch.all(out == 7.0)


def test_bad_arguments_are_named():
    table = torch.zeros(5, 2 * BLOCK_BYTES[GGML_Q8_0], dtype=torch.uint8)
    ids = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"GGML types Q4_0 \(2\), .* and Q6_K \(14\), got type 11"):
        ops.quantized_embedding(ids, table, 11)  # Q3_K
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        ops.quantized_embedding(ids, table.float(), GGML_Q8_0)
    with pytest.raises(RuntimeError, match="whole 34-byte blocks, got 67 bytes a row"):
        ops.quantized_embedding(ids, table[:, :67].contiguous(), GGML_Q8_0)
    with pytest.raises(RuntimeError, match="token_ids must be Long"):
        ops.quantized_embedding(ids.int(), table, GGML_Q8_0)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[2, 64\] tensor"):
        ops.quantized_embedding(ids, table, GGML_Q8_0, out=torch.empty(2, 65))
    with pytest.raises(RuntimeError, match="out must be float32, float16 or bfloat16"):
        ops.quantized_embedding(ids, table, GGML_Q8_0, out=torch.empty(2, 64, dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_quantized_embedding_dequantizes_the_rows():
    """On CUDA the rows of every type are the gguf package's, scaled and rounded once; an id
    outside the table gives a row of zeros (the engine checks ids on the host before they reach a
    device)."""
    for ggml_type in GGML_TYPE_NAMES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            rng = np.random.default_rng(ggml_type)
            hidden = 576 if BLOCK_VALUES[ggml_type] == 32 else 768
            table = random_blocks(ggml_type, 300, hidden, rng)
            ids = torch.tensor([5, 299, 0, 5, 300])
            rows = quants.dequantize(table, GGMLQuantizationType[GGML_TYPE_NAMES[ggml_type]])[ids[:4].numpy()]
            expected = (torch.from_numpy(rows).float() * 3.0).to(dtype)
            actual = ops.quantized_embedding(ids.cuda(), torch.from_numpy(table).cuda(), ggml_type, scale=3.0,
                                             out_dtype=dtype).cpu()
            assert actual.dtype == dtype and actual.shape == (5, hidden)
            assert torch.equal(actual[:4], expected), (ggml_type, dtype)
            assert torch.all(actual[4] == 0)
