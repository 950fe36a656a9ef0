"""small_linear, packed_linear and packed_silu_and_mul (and the layers that route to them) against
float32 PyTorch.
Both are CPU ops (on CUDA torch's matmul serves every batch size), run here on every
instruction set."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, TOLERANCES
from kvflow import ops


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("in_features,out_features", [(111, 97), (117, 37), (576, 1536), (769, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear(rows, in_features, out_features, dtype, with_bias, cpu_isa):
    torch.manual_seed(rows * in_features + out_features)
    x = torch.randn(rows, in_features, dtype=dtype)
    w = torch.randn(out_features, in_features, dtype=dtype) / in_features**0.5
    b = torch.randn(out_features, dtype=dtype) if with_bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    # Dot products of hundreds of terms, accumulated in another order than torch's: allow a few
    # float32 ulps of the sum on top of the output rounding.
    tol = dict(TOLERANCES[dtype])
    tol["atol"] = max(tol["atol"], 1e-4)
    torch.testing.assert_close(ops.small_linear(x, w, b).float(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
def test_small_linear_float32_out_keeps_the_unrounded_sums(dtype, rows, cpu_isa):
    # An LM head writes float32 logits: the sums must not pass through the weights' dtype, whose
    # rounding (0.125 at 25 in bfloat16) would create ties between the top tokens.
    torch.manual_seed(rows)
    x = torch.randn(rows, 576, dtype=dtype)
    w = torch.randn(1001, 576, dtype=dtype)
    out = torch.empty(rows, 1001, dtype=torch.float32)
    ops.small_linear(x, w, out=out)
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)
    assert (out - expected).abs().max() < (expected.to(dtype).float() - expected).abs().max()


def test_linear_routes_few_rows_and_matches_torch():
    torch.manual_seed(0)
    w = torch.randn(300, 64, dtype=torch.bfloat16)
    for shape in [(1, 64), (2, 4, 64), (9, 64)]:  # 1 and 8 rows take small_linear, 9 torch's matmul
        x = torch.randn(shape, dtype=torch.bfloat16)
        out = ops.linear(x, w)
        assert out.shape == (*shape[:-1], 300)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), **TOLERANCES[torch.bfloat16])


def test_small_linear_rejects_bad_input():
    w = torch.randn(10, 16)
    with pytest.raises(RuntimeError, match=r"input must be \[rows, 16\]"):
        ops.small_linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="input has dtype"):
        ops.small_linear(torch.randn(2, 16, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match=r"bias must be \[10\]"):
        ops.small_linear(torch.randn(2, 16), w, torch.randn(9))
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        ops.small_linear(torch.randn(2, 10), w.t())
    with pytest.raises(RuntimeError, match="out has dtype"):
        ops.small_linear(torch.randn(2, 16), w, out=torch.empty(2, 10, dtype=torch.bfloat16))


def test_small_linear_of_no_rows_writes_nothing(cpu_isa):
    """An empty batch is a no-op: the kernels' tiles assume at least one row, and must not touch
    the memory around out (here, the rest of the tensor it is a view of)."""
    guard = torch.full((4, 10), 7.0)
    ops.small_linear(torch.randn(4, 16)[:0], torch.randn(10, 16), torch.randn(10), out=guard[:0])
    assert torch.equal(guard, torch.full((4, 10), 7.0))


def packed_reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# 1-8 rows take the few-row passes (1, 2, 3 and 4 at a time), more the many-row tiles.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 64, 300])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (577, 49), (1, 1), (7, 100), (1536, 97)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear(rows, in_features, out_features, with_bias, cpu_isa):
    # Odd in_features end on half a pair and out_features off a 48-feature panel: both edges are padding.
    torch.manual_seed(rows * in_features + out_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    w = (torch.randn(out_features, in_features) / in_features**0.5).to(torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    packed = ops.pack_linear_weight(w)
    assert packed.shape == (-(-out_features // 48), -(-in_features // 2), 48, 2)
    expected = packed_reference(x, w, b)
    out = ops.packed_linear(x, packed, out_features, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected, rtol=8e-3, atol=1e-2)
    # float32 out (an LM head's logits): the float32 sums themselves, not a bfloat16 rounding of them.
    logits = ops.packed_linear(x, packed, out_features, b, out_dtype=torch.float32)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("in_features", [576, 577])
def test_packed_linear_row_does_not_depend_on_the_rows_beside_it(in_features, cpu_isa):
    # Few-row passes and many-row tiles sum each feature in one order: a row's result is the same
    # bits at any row count (what batch-invariant mode and speculative verification rely on).
    torch.manual_seed(in_features)
    x = torch.randn(40, in_features, dtype=torch.bfloat16)
    w = (torch.randn(200, in_features) / in_features**0.5).to(torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    alone = ops.packed_linear(x[:1], packed, 200, out_dtype=torch.float32)
    for rows in (2, 3, 4, 5, 8, 9, 40):
        beside = ops.packed_linear(x[:rows], packed, 200, out_dtype=torch.float32)
        assert torch.equal(beside[:1], alone), f"row 0 differs at {rows} rows"


def test_packed_linear_reads_and_writes_strided_rows(cpu_isa):
    torch.manual_seed(0)
    wide = torch.randn(70, 300, dtype=torch.bfloat16)
    x = wide[:, 13:13 + 200]  # rows 300 apart
    w = torch.randn(100, 200, dtype=torch.bfloat16) / 15
    out_wide = torch.full((70, 256), 7.0, dtype=torch.bfloat16)
    out = out_wide[:, 50:150]
    torch.ops.kvflow.packed_linear(out, x, ops.pack_linear_weight(w), None)
    torch.testing.assert_close(out.double(), packed_reference(x, w), rtol=8e-3, atol=1e-2)
    assert (out_wide[:, :50] == 7).all() and (out_wide[:, 150:] == 7).all(), "nothing written outside out"


def test_packed_linear_of_no_rows_is_empty():
    packed = ops.pack_linear_weight(torch.randn(10, 16, dtype=torch.bfloat16))
    assert ops.packed_linear(torch.empty(0, 16, dtype=torch.bfloat16), packed, 10).shape == (0, 10)


def test_packed_linear_rejects_bad_input():
    w = torch.randn(100, 64, dtype=torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"):
        ops.pack_linear_weight(w.float())
    with pytest.raises(RuntimeError, match="weight must be a non-empty"):
        ops.pack_linear_weight(torch.randn(64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="input must be bfloat16"):
        ops.packed_linear(x.float(), packed, 100)
    with pytest.raises(RuntimeError, match=r"input must be \[rows, in_features\] with in_features 63 or 64"):
        ops.packed_linear(torch.randn(3, 66, dtype=torch.bfloat16), packed, 100)
    with pytest.raises(RuntimeError, match=r"out_features in \[97, 144\]"):
        ops.packed_linear(x, packed, 50)
    with pytest.raises(RuntimeError, match="packed_weight must be pack_linear_weight's"):
        ops.packed_linear(x, w, 100)
    with pytest.raises(RuntimeError, match=r"bias must be \[100\]"):
        ops.packed_linear(x, packed, 100, torch.randn(99, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out must be bfloat16 or float32"):
        ops.packed_linear(x, packed, 100, out_dtype=torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8, 9, 64, 300])
@pytest.mark.parametrize("in_features,d", [(576, 1536), (33, 40), (64, 24), (7, 25)])
def test_packed_silu_and_mul(rows, in_features, d, cpu_isa):
    # d off the 24-feature half panel (25, 40) pads both halves of the last panel.
    torch.manual_seed(rows * in_features + d)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    w = (torch.randn(2 * d, in_features) / in_features**0.5).to(torch.bfloat16)
    packed = ops.pack_linear_weight(w, gate_up=True)
    assert packed.shape == (-(-d // 24), -(-in_features // 2), 48, 2)
    gate_up = packed_reference(x, w)
    expected = F.silu(gate_up[:, :d]) * gate_up[:, d:]
    out = ops.packed_silu_and_mul(x, packed, d)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, d)
    torch.testing.assert_close(out.double(), expected, rtol=8e-3, atol=1e-2)


def test_packed_silu_and_mul_writes_only_its_rows_and_rejects_bad_input():
    torch.manual_seed(0)
    w = torch.randn(50, 64, dtype=torch.bfloat16) / 8
    packed = ops.pack_linear_weight(w, gate_up=True)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    out_wide = torch.full((5, 40), 7.0, dtype=torch.bfloat16)
    out = out_wide[:, 10:35]
    torch.ops.kvflow.packed_silu_and_mul(out, x, packed)
    gate_up = packed_reference(x, w)
    torch.testing.assert_close(out.double(), F.silu(gate_up[:, :25]) * gate_up[:, 25:], rtol=8e-3, atol=1e-2)
    assert (out_wide[:, :10] == 7).all() and (out_wide[:, 35:] == 7).all(), "nothing written outside out"
    with pytest.raises(RuntimeError, match="out_features must be even"):
        ops.pack_linear_weight(torch.randn(51, 64, dtype=torch.bfloat16), gate_up=True)
    with pytest.raises(RuntimeError, match=r"out_features in \[25, 48\]"):
        ops.packed_silu_and_mul(x, packed, 50)  # the plain product's width, not d
    with pytest.raises(RuntimeError, match="out must be bfloat16"):
        torch.ops.kvflow.packed_silu_and_mul(torch.empty(5, 25), x, packed)
    with pytest.raises(RuntimeError, match=r"input must be \[rows, in_features\]"):
        ops.packed_silu_and_mul(torch.randn(5, 66, dtype=torch.bfloat16), packed, 25)


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_gate_up_layer_gives_silu_and_mul_packed_or_not(rows, cpu_isa):
    from kvflow.layers import GateUpLinear

    torch.manual_seed(rows)
    layer = GateUpLinear(576, 1536, dtype=torch.bfloat16)
    layer.weight.normal_(std=0.05)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    gate_up = F.linear(x.float(), layer.weight.float())
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    # Unpacked, gate and up are rounded to bfloat16 before the product is (three roundings).
    plain = layer.activated(x)
    torch.testing.assert_close(plain.float(), expected, rtol=2e-2, atol=2e-2)
    assert layer.prepack()
    assert layer.packed_weight.gate_up, "every instruction set runs the activation in the packed product"
    torch.testing.assert_close(layer.activated(x).float(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer(x).float(), gate_up, **TOLERANCES[torch.bfloat16])  # the plain product still


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 64, 300])
def test_prepacked_linear_layer_matches_the_plain_one(rows, cpu_isa):
    # kvflow's panels on every instruction set: vdpbf16ps on AVX-512 BF16, widened to float32 elsewhere.
    from kvflow.layers import LMHead, Linear, VocabEmbedding

    torch.manual_seed(rows)
    layer = Linear(576, 960, bias=True, dtype=torch.bfloat16)
    layer.weight.normal_(std=0.05)
    layer.bias.normal_()
    weight = layer.weight.detach().clone()
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    plain = layer(x)
    torch.testing.assert_close(plain.float(), F.linear(x.float(), weight.float(), layer.bias.float()),
                               **TOLERANCES[torch.bfloat16])
    assert layer.prepack(), "bf16 CPU weights must pack on every CPU"
    assert layer.weight is None, "the packed copy replaces the plain weight"
    torch.testing.assert_close(layer(x).float(), plain.float(), **TOLERANCES[torch.bfloat16])
    head = LMHead(1001, 576, dtype=torch.bfloat16)
    head.weight.normal_(std=0.05)
    logits = head(x)
    assert head.prepack() and head.weight is None
    torch.testing.assert_close(head(x), logits, **TOLERANCES[torch.bfloat16])
    # A head tied to the embedding packs a copy and leaves the table, whose rows the lookups read.
    embedding = VocabEmbedding(1001, 576, dtype=torch.bfloat16)
    embedding.weight.normal_(std=0.05)
    tied = LMHead(1001, 576, dtype=torch.bfloat16, tied_to=embedding)
    logits = tied(x)
    assert tied.prepack() and embedding.weight is not None
    torch.testing.assert_close(tied(x), logits, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("rows", [1, 9])
def test_gate_up_packed_layer_still_gives_the_plain_product_off_the_panel_edge(rows, cpu_isa):
    # d = 25: the last panel holds one gate and one up feature, the rest padding.
    from kvflow.layers import GateUpLinear

    torch.manual_seed(rows)
    layer = GateUpLinear(33, 25, dtype=torch.bfloat16)
    layer.weight.normal_(std=0.2)
    weight = layer.weight.detach().clone()
    x = torch.randn(rows, 33, dtype=torch.bfloat16)
    assert layer.prepack() and layer.packed_weight.gate_up
    torch.testing.assert_close(layer(x).double(), packed_reference(x, weight), rtol=8e-3, atol=1e-2)
