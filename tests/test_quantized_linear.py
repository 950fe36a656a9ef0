"""quantized_linear (weights in GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks)
against float64 products of the weights dequantized by the gguf package (llama.cpp's own Python
reader), on every instruction set.

Few rows:
The op quantizes each block of 32 input values to int8 with scale s = max|x| / 127, so each value
moves by at most s / 2. The product of output o and row r may then differ from the exact one by at
most sum over blocks b of (s_b / 2) * sum_i |W[o, 32b + i]|; the tests allow that bound, plus
float32 accumulation (1e-5 of sum |x| |W|) and the rounding of a bfloat16 output.

Many bfloat16 rows (32 and more) multiply the weights dequantized to bfloat16 instead, and the
input as it is: each weight moves by at most 2^-8 of itself (bfloat16 keeps 8 significant bits),
so a product by at most 2^-8 sum |x| |W|, plus the same accumulation and output rounding."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from conftest import CPU_ISAS, random_blocks
from kvflow import ops
from kvflow.ops.quantized import (BLOCK_BYTES, BLOCK_VALUES, GGML_Q4_0, GGML_Q4_1, GGML_Q4_1_INTERLEAVED, GGML_Q4_K,
                                  GGML_Q5_0, GGML_Q5_1, GGML_Q5_K, GGML_Q6_K, GGML_Q8_0, GGML_TYPE_NAMES, INTERLEAVED_TYPES, deinterleave_rows,
                                  interleave_rows)

ALL_TYPES = list(GGML_TYPE_NAMES)


def dequantized(weight: np.ndarray, ggml_type: int) -> np.ndarray:
    return quants.dequantize(weight, GGMLQuantizationType[GGML_TYPE_NAMES[ggml_type]]).astype(np.float64)


def shape(ggml_type: int, blocks: int | str) -> int:
    """in_features of `blocks` blocks of ggml_type, or of a model's row ("model": SmolLM2-135M's
    576 for the 32-weight blocks, 1536 as Qwen2.5-1.5B's for the K-quants' 256)."""
    if blocks == "model":
        return 576 if BLOCK_VALUES[ggml_type] == 32 else 1536
    return blocks * BLOCK_VALUES[ggml_type]


def quantized_input(x: np.ndarray) -> np.ndarray:
    """x as the op sees it: each block of 32 quantized in float32 as the op does (scale
    max|x| / 127, codes 127 x / max|x| rounded to nearest even), back in float64."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    scale = amax / np.float32(127)
    codes = np.divide(blocks * np.float32(127), amax, out=np.zeros_like(blocks), where=amax > 0)
    codes = np.clip(np.rint(codes), -127, 127)
    return (codes.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


def allowed_error(x: np.ndarray, w: np.ndarray, out_dtype: torch.dtype, expected: np.ndarray) -> np.ndarray:
    """[rows, out_features]: the bound of the module docstring."""
    rows, in_features = x.shape
    half_steps = np.abs(x).reshape(rows, -1, 32).max(axis=2) / 127 / 2         # [rows, blocks]
    weight_mass = np.abs(w).reshape(w.shape[0], -1, 32).sum(axis=2)            # [out, blocks]
    bound = half_steps @ weight_mass.T
    bound += 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6
    if out_dtype == torch.bfloat16:  # half a bfloat16 step of the float32 sum, which lies within bound
        bound += (np.abs(expected) + bound) * 2.0**-8
    return bound * 1.001


@pytest.mark.parametrize("ggml_type", ALL_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("blocks,out_features", [(1, 1), (3, 7), ("model", 130)])
def test_quantized_linear_matches_dequantized_product(ggml_type, rows, blocks, out_features, cpu_isa):
    in_features = shape(ggml_type, blocks)
    rng = np.random.default_rng(ggml_type * 1000 + rows * 10 + in_features)
    weight = random_blocks(ggml_type, out_features, in_features, rng)
    x = rng.standard_normal((rows, in_features))
    x[:, :32] *= 0.01  # blocks of very different magnitudes in one row
    w = dequantized(weight, ggml_type)
    expected = x @ w.T
    actual = ops.quantized_linear(torch.from_numpy(x).float(), torch.from_numpy(weight), ggml_type).double().numpy()
    error = np.abs(actual - expected)
    bound = allowed_error(x, w, torch.float32, expected)
    assert (error <= bound).all(), f"worst error / bound {np.max(error / bound):.3f}"
    # On the input as quantized, the products are exact up to float32 accumulation: one weight
    # code or one activation code off would show.
    xq = quantized_input(x)
    exact = xq @ w.T
    accumulation = 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6
    assert (np.abs(actual - exact) <= accumulation).all(), f"worst {np.max(np.abs(actual - exact) / accumulation):.3f}"


@pytest.mark.parametrize("ggml_type", ALL_TYPES)
@pytest.mark.parametrize("input_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.bfloat16)])
def test_quantized_linear_dtypes_and_bias(ggml_type, input_dtype, out_dtype, cpu_isa):
    rng = np.random.default_rng(ggml_type)
    in_features = shape(ggml_type, 2)
    weight = random_blocks(ggml_type, 75, in_features, rng)
    x = torch.randn(4, in_features, dtype=torch.float64).to(input_dtype)
    bias = torch.randn(75, dtype=torch.float64).to(input_dtype)
    x64, w = x.double().numpy(), dequantized(weight, ggml_type)
    expected = x64 @ w.T + bias.double().numpy()
    actual = ops.quantized_linear(x, torch.from_numpy(weight), ggml_type, bias=bias, out_dtype=out_dtype)
    assert actual.dtype == out_dtype and actual.shape == (4, 75)
    error = np.abs(actual.double().numpy() - expected)
    assert (error <= allowed_error(x64, w, out_dtype, expected)).all()


@pytest.mark.parametrize("ggml_type", ALL_TYPES)
@pytest.mark.parametrize("rows", [32, 45])
@pytest.mark.parametrize("blocks,out_features", [(1, 1), (3, 47), ("model", 130)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_many_bfloat16_rows_multiply_dequantized_weights(ggml_type, rows, blocks, out_features, out_dtype, cpu_isa):
    in_features = shape(ggml_type, blocks)
    rng = np.random.default_rng(ggml_type * 1000 + rows * 10 + in_features)
    weight = random_blocks(ggml_type, out_features, in_features, rng)
    x = torch.randn(rows, in_features, dtype=torch.float64).bfloat16()
    bias = torch.randn(out_features, dtype=torch.float64).bfloat16()
    x64, w = x.double().numpy(), dequantized(weight, ggml_type)
    expected = x64 @ w.T + bias.double().numpy()
    actual = ops.quantized_linear(x, torch.from_numpy(weight), ggml_type, bias=bias, out_dtype=out_dtype)
    bound = (2.0**-8 + 1e-5) * (np.abs(x64) @ np.abs(w).T) + 1e-6
    if out_dtype == torch.bfloat16:  # half a bfloat16 step of the float32 sum, which lies within bound
        bound += (np.abs(expected) + bound) * 2.0**-8
    error = np.abs(actual.double().numpy() - expected)
    assert (error <= bound * 1.001).all(), f"worst error / bound {np.max(error / bound):.3f}"


INTERLEAVED = [GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K]


def test_interleave_rows_rearranges_each_group_of_8_rows_block_by_block():
    """The layout written out by hand for one group, one Q4_1 block: the 8 rows' d, their m, then
    nibble bytes 4k..4k+3 of each row for k = 0..3; one Q8_0 block: the 8 rows' d, then code
    bytes 4k..4k+3 of each row for k = 0..7; one Q5_1 and one Q5_0 block; one Q4_K block: the 8
    rows' d, their dmin, each of the 12 scale bytes of the 8 rows, then nibble bytes 4k..4k+3 of
    each row for k = 0..31; one Q5_K block: as Q4_K's, with its 32 bytes of fifth bits after the
    scales, 4 bytes of each row in turn; one Q6_K block, whose header ends it: each of the 16 scales of the 8
    rows, their d, then bytes 4k..4k+3 of each row's 192 code bytes for k = 0..47."""
    weight = torch.arange(8 * 20, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(8, 20)
    expected = [weight[r, start + i] for start in (0, 2) for r in range(8) for i in (0, 1)]  # d, then m
    expected += [weight[r, 4 + 4 * k + j] for k in range(4) for r in range(8) for j in range(4)]
    assert interleave_rows(weight, GGML_Q4_1).flatten().tolist() == [int(v) for v in expected]
    assert interleave_rows(weight[:, :18].contiguous(), GGML_Q4_0).flatten()[:16].tolist() == \
        [int(weight[r, i]) for r in range(8) for i in (0, 1)]
    q8 = torch.arange(8 * 34, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(8, 34)
    expected = [q8[r, i] for r in range(8) for i in (0, 1)] + \
               [q8[r, 2 + 4 * k + j] for k in range(8) for r in range(8) for j in range(4)]
    assert interleave_rows(q8, GGML_Q8_0).flatten().tolist() == [int(v) for v in expected]
    # One Q5_1 block: the 8 rows' d, their m, their 4 bytes of fifth bits, then nibble bytes; Q5_0
    # the same without m.
    q5 = torch.arange(8 * 24, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(8, 24)
    expected = [q5[r, start + i] for start, size in ((0, 2), (2, 2), (4, 4)) for r in range(8) for i in range(size)]
    expected += [q5[r, 8 + 4 * k + j] for k in range(4) for r in range(8) for j in range(4)]
    assert interleave_rows(q5, GGML_Q5_1).flatten().tolist() == [int(v) for v in expected]
    q5 = q5[:, :22].contiguous()
    expected = [q5[r, start + i] for start, size in ((0, 2), (2, 4)) for r in range(8) for i in range(size)]
    expected += [q5[r, 6 + 4 * k + j] for k in range(4) for r in range(8) for j in range(4)]
    assert interleave_rows(q5, GGML_Q5_0).flatten().tolist() == [int(v) for v in expected]
    q4k = torch.arange(8 * 144, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 144)
    fields = [(0, 2), (2, 2)] + [(4 + t, 1) for t in range(12)]
    expected = [q4k[r, start + i] for start, size in fields for r in range(8) for i in range(size)]
    expected += [q4k[r, 16 + 4 * k + j] for k in range(32) for r in range(8) for j in range(4)]
    assert interleave_rows(q4k, GGML_Q4_K).flatten().tolist() == [int(v) for v in expected]
    q5k = torch.arange(8 * 176, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 176)
    fields = [(0, 2), (2, 2)] + [(4 + t, 1) for t in range(12)] + [(16 + 4 * t, 4) for t in range(8)]
    expected = [q5k[r, start + i] for start, size in fields for r in range(8) for i in range(size)]
    expected += [q5k[r, 48 + 4 * k + j] for k in range(32) for r in range(8) for j in range(4)]
    assert interleave_rows(q5k, GGML_Q5_K).flatten().tolist() == [int(v) for v in expected]
    q6k = torch.arange(8 * 210, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 210)
    fields = [(192 + t, 1) for t in range(16)] + [(208, 2)]
    expected = [q6k[r, start + i] for start, size in fields for r in range(8) for i in range(size)]
    expected += [q6k[r, 4 * k + j] for k in range(48) for r in range(8) for j in range(4)]
    assert interleave_rows(q6k, GGML_Q6_K).flatten().tolist() == [int(v) for v in expected]
    rng = np.random.default_rng(3)
    for ggml_type in INTERLEAVED:
        blocks = torch.from_numpy(random_blocks(ggml_type, 24, 3 * BLOCK_VALUES[ggml_type], rng))
        assert torch.equal(deinterleave_rows(interleave_rows(blocks, ggml_type), ggml_type), blocks)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        interleave_rows(weight[:7], GGML_Q4_1)
    with pytest.raises(ValueError, match="whole 144-byte blocks, got 54 bytes a row"):
        interleave_rows(torch.zeros(8, 54, dtype=torch.uint8), GGML_Q4_K)
    with pytest.raises(ValueError, match="only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K"):
        interleave_rows(torch.zeros(8, 64, dtype=torch.uint8), 1)  # F16


@pytest.mark.parametrize("ggml_type", INTERLEAVED)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 31, 32, 45])
@pytest.mark.parametrize("blocks,out_features", [(1, 8), (3, 24), ("model", 136)])
def test_interleaved_weights_match_dequantized_product(ggml_type, rows, blocks, out_features, cpu_isa):
    """The interleaved layout gives the product of the weights as the file stores them, within
    the bound of the GGUF layout's test, and exact up to float32 accumulation on the input as
    quantized: at every row count, since its int8 kernel takes many bfloat16 rows too (float32
    input below 32 rows, bfloat16 from 32)."""
    in_features = shape(ggml_type, blocks)
    rng = np.random.default_rng(ggml_type * 1000 + rows * 10 + in_features)
    weight = random_blocks(ggml_type, out_features, in_features, rng)
    interleaved = interleave_rows(torch.from_numpy(weight), ggml_type)
    layout = INTERLEAVED_TYPES[ggml_type]
    w = dequantized(weight, ggml_type)
    bias = torch.randn(out_features)
    x = rng.standard_normal((rows, in_features))
    x[:, :32] *= 0.01
    x_in = torch.from_numpy(x).to(torch.float32 if rows < 32 else torch.bfloat16)
    x = x_in.double().numpy()
    expected = x @ w.T + bias.double().numpy()
    actual = ops.quantized_linear(x_in, interleaved, layout, bias=bias, out_dtype=torch.float32).double().numpy()
    error = np.abs(actual - expected)
    bound = allowed_error(x, w, torch.float32, expected)
    assert (error <= bound).all(), f"worst error / bound {np.max(error / bound):.3f}"
    xq = quantized_input(x)
    exact = xq @ w.T + bias.double().numpy()
    accumulation = 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6
    assert (np.abs(actual - exact) <= accumulation).all()


@pytest.mark.parametrize("ggml_type", INTERLEAVED)
@pytest.mark.parametrize("rows", [40, 300, 1100])
@pytest.mark.parametrize("blocks,out_features", [(3, 24), ("model", 136)])
def test_interleaved_weights_many_bfloat16_rows(ggml_type, rows, blocks, out_features, cpu_isa):
    """Many bfloat16 rows on an interleaved weight: from a row count that depends on the format
    and the instruction set (where the dequantized panels were measured faster), the rows are
    gathered back into GGUF's layout and go through the panels, within the panels' bound of the
    GGUF test above; below it the int8 kernel gives the product of the input as quantized, exact up
    to float32 accumulation. The product is one of the two, whichever the instruction set chose."""
    in_features = shape(ggml_type, blocks)
    rng = np.random.default_rng(ggml_type * 1000 + rows * 10 + in_features)
    weight = random_blocks(ggml_type, out_features, in_features, rng)
    w = dequantized(weight, ggml_type)
    x_in = torch.randn(rows, in_features, dtype=torch.float64).bfloat16()
    bias = torch.randn(out_features, dtype=torch.float64).bfloat16()
    x = x_in.double().numpy()
    actual = ops.quantized_linear(x_in, interleave_rows(torch.from_numpy(weight), ggml_type), INTERLEAVED_TYPES[ggml_type],
                                  bias=bias, out_dtype=torch.float32).double().numpy()
    expected = x @ w.T + bias.double().numpy()
    panels_bound = (2.0**-8 + 1e-5) * (np.abs(x) @ np.abs(w).T) + 1e-6
    xq = quantized_input(x)
    int8_exact = xq @ w.T + bias.double().numpy()
    accumulation = 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6
    panels_ok = (np.abs(actual - expected) <= panels_bound).all()
    int8_ok = (np.abs(actual - int8_exact) <= accumulation).all()
    assert panels_ok or int8_ok, (f"worst error / panels' bound {np.max(np.abs(actual - expected) / panels_bound):.3f}, "
                                  f"/ int8 accumulation {np.max(np.abs(actual - int8_exact) / accumulation):.3f}")


SIMD_ISAS = [isa for isa in CPU_ISAS if isa != "scalar"]


@pytest.mark.skipif(len(SIMD_ISAS) < 2, reason="this CPU runs one SIMD instruction set only")
@pytest.mark.parametrize("ggml_type", INTERLEAVED)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_interleaved_int8_products_give_the_same_bits_under_every_instruction_set(ggml_type, out_dtype):
    """The int8 kernels' sums are exact and their float steps are the same, so a machine with
    AVX-512 and one with AVX2 only give the same logits: from two input rows the AVX-512 kernels
    take two groups of 8 weight rows at once (136 output features: 8 pairs and a last group
    alone), AVX2 one."""
    rng = np.random.default_rng(ggml_type)
    in_features = shape(ggml_type, "model")
    weight = interleave_rows(torch.from_numpy(random_blocks(ggml_type, 136, in_features, rng)), ggml_type)
    bias = torch.randn(136)
    previous = ops.cpu_isa()
    try:
        for rows in (1, 2, 3, 5, 9):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            outputs = {}
            for isa in SIMD_ISAS:
                ops.set_cpu_isa(isa)
                outputs[isa] = ops.quantized_linear(x, weight, INTERLEAVED_TYPES[ggml_type], bias=bias,
                                                    out_dtype=out_dtype)
            for isa in SIMD_ISAS[1:]:
                assert torch.equal(outputs[isa], outputs[SIMD_ISAS[0]]), f"{isa} against {SIMD_ISAS[0]} at {rows} rows"
    finally:
        ops.set_cpu_isa(previous)


def test_interleaved_weights_are_refused_where_they_cannot_run():
    weight = torch.zeros(12, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 8 rows, got 12"):
        ops.quantized_linear(torch.randn(1, 32), weight, GGML_Q4_1_INTERLEAVED)
    with pytest.raises(RuntimeError, match="multiple of 8 rows, got 12"):
        ops.quantized_embedding(torch.tensor([0]), weight, GGML_Q4_1_INTERLEAVED)


def test_quantized_linear_rows_do_not_interfere(cpu_isa):
    """A row's output does not depend on the other rows of the call (each is quantized alone)."""
    rng = np.random.default_rng(5)
    weight = torch.from_numpy(random_blocks(GGML_Q4_1, 200, 256, rng))
    x = torch.randn(7, 256)
    together = ops.quantized_linear(x, weight, GGML_Q4_1)
    for r in range(7):
        torch.testing.assert_close(ops.quantized_linear(x[r:r + 1], weight, GGML_Q4_1), together[r:r + 1],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("ggml_type,interleaved", [(GGML_Q4_1, False), (GGML_Q4_1, True), (GGML_Q6_K, True),
                                                  (GGML_Q8_0, True)])
@pytest.mark.parametrize("rows", [1, 3, 5, 40, 300])
def test_quantized_linear_writes_into_a_column_slice(ggml_type, interleaved, rows, cpu_isa):
    """out may be a column slice of a wider tensor, as a merged q|k|v of mixed types uses it: the
    slice gets the bits a contiguous out gets, on the few-row kernels and on the many-row panels,
    and the columns around it stay as they were."""
    in_features, out_features = shape(ggml_type, 2), 24
    rng = np.random.default_rng(rows)
    weight = torch.from_numpy(random_blocks(ggml_type, out_features, in_features, rng))
    layout = ggml_type
    if interleaved:
        weight, layout = interleave_rows(weight, ggml_type), INTERLEAVED_TYPES[ggml_type]
    x = torch.randn(rows, in_features).bfloat16()
    bias = torch.randn(out_features)
    alone = ops.quantized_linear(x, weight, layout, bias=bias, out_dtype=torch.float32)
    wide = torch.full((rows, out_features + 40), 7.0)
    ops.quantized_linear(x, weight, layout, bias=bias, out=wide[:, 16:16 + out_features])
    torch.testing.assert_close(wide[:, 16:16 + out_features], alone, rtol=0, atol=0)
    assert (wide[:, :16] == 7).all() and (wide[:, 16 + out_features:] == 7).all()


def test_quantized_linear_rejects_bad_input():
    weight = torch.zeros(4, 2 * BLOCK_BYTES[GGML_Q4_1], dtype=torch.uint8)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"GGML types Q4_0 \(2\), .* and Q6_K \(14\), got type 10"):
        ops.quantized_linear(x, weight, 10)  # Q2_K
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        ops.quantized_linear(x, weight.float(), GGML_Q4_1)
    with pytest.raises(RuntimeError, match="whole 20-byte blocks, got 39 bytes a row"):
        ops.quantized_linear(x, weight[:, :39].contiguous(), GGML_Q4_1)
    with pytest.raises(RuntimeError, match=r"input must be \[rows, 64\]"):
        ops.quantized_linear(torch.randn(2, 65), weight, GGML_Q4_1)
    with pytest.raises(RuntimeError, match="input must be float32 or bfloat16"):
        ops.quantized_linear(x.half(), weight, GGML_Q4_1)
    with pytest.raises(RuntimeError, match=r"out must be \[2, 4\]"):
        ops.quantized_linear(x, weight, GGML_Q4_1, out=torch.empty(2, 5))
    with pytest.raises(RuntimeError, match=r"out must have contiguous rows .* got strides \[1, 2\]"):
        ops.quantized_linear(x, weight, GGML_Q4_1, out=torch.empty(4, 2).t())
    with pytest.raises(RuntimeError, match=r"out must have contiguous rows .* got strides \[8, 2\]"):
        ops.quantized_linear(x, weight, GGML_Q4_1, out=torch.empty(2, 8)[:, ::2])
    with pytest.raises(RuntimeError, match=r"bias must be \[4\]"):
        ops.quantized_linear(x, weight, GGML_Q4_1, bias=torch.zeros(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_quantized_linear_matches_dequantized_product():
    """On CUDA, every type, up to 8 rows multiply the weights dequantized in registers in float32;
    more rows multiply a dequantized copy in out's dtype (bfloat16: each weight rounded, and the
    bias added in bfloat16, a second rounding)."""
    for ggml_type in ALL_TYPES:
        for rows in (1, 3, 8, 40):
            for out_dtype in (torch.float32, torch.bfloat16):
                rng = np.random.default_rng(ggml_type * 100 + rows)
                in_features, out_features = shape(ggml_type, "model"), 130
                weight = random_blocks(ggml_type, out_features, in_features, rng)
                x = torch.randn(rows, in_features, dtype=torch.float64).bfloat16()
                bias = torch.randn(out_features, dtype=torch.float64).bfloat16()
                x64, w = x.double().numpy(), dequantized(weight, ggml_type)
                expected = x64 @ w.T + bias.double().numpy()
                actual = ops.quantized_linear(x.cuda(), torch.from_numpy(weight).cuda(), ggml_type, bias=bias.cuda(),
                                              out_dtype=out_dtype).cpu()
                assert actual.dtype == out_dtype and actual.shape == (rows, out_features)
                mass = np.abs(x64) @ np.abs(w).T
                rounded_weights = rows > 8 and out_dtype == torch.bfloat16
                bound = ((2.0**-8 if rounded_weights else 0) + 1e-5) * mass + 1e-6
                if out_dtype == torch.bfloat16:
                    bound += (np.abs(expected) + bound) * 2.0**-8 * (2 if rounded_weights else 1)
                error = np.abs(actual.double().numpy() - expected)
                assert (error <= bound * 1.001).all(), (ggml_type, rows, out_dtype, np.max(error / bound))
                # A column slice as out (a merged q|k|v of mixed types): the same bits in it.
                columns = torch.zeros(rows, out_features + 9, dtype=out_dtype, device="cuda")
                ops.quantized_linear(x.cuda(), torch.from_numpy(weight).cuda(), ggml_type, bias=bias.cuda(),
                                     out=columns[:, 5:5 + out_features])
                torch.testing.assert_close(columns[:, 5:5 + out_features].cpu(), actual, rtol=0, atol=0)
                if rows > 8:
                    continue
                # The same rows in a view whose rows start off the 16-byte alignment of the vector
                # loads of the few-row kernel: copied to aligned rows, the same result.
                wide = torch.zeros(rows, in_features + 3, dtype=x.dtype, device="cuda")
                wide[:, 3:] = x.cuda()
                shifted = ops.quantized_linear(wide[:, 3:], torch.from_numpy(weight).cuda(), ggml_type,
                                               bias=bias.cuda(), out_dtype=out_dtype).cpu()
                assert torch.equal(shifted, actual), (ggml_type, rows, out_dtype)
