"""rotary_embedding against float32 PyTorch: Hugging Face's rotate_half formula for NeoX style,
and the interleaved-pairs formula for GPT-J style."""

import math

import pytest
import torch

from conftest import DTYPES, assert_close
from kvflow import ops

NUM_TOKENS = [1, 7, 83, 513]
HEAD_SIZES = [64, 128, 256]


def reference_rotary(x: torch.Tensor, positions, cache: torch.Tensor, rotary_dim: int, is_neox: bool):
    """x [num_tokens, num_heads, head_size] -> rotated copy in float32."""
    x = x.float()
    cos, sin = cache.float()[positions].chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:  # Hugging Face: x * cos + rotate_half(x) * sin, with cos/sin repeated twice
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * cos2 + torch.cat([-x2, x1], -1) * sin2
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rotated, rest], -1)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_views_of_qkv(device, num_tokens, head_size, dtype, is_neox):
    # Query and key are views into one merged QKV output (token stride = whole QKV row), as the
    # model passes them. 9 query heads, 3 kv heads (SmolLM2's GQA ratio).
    torch.manual_seed(num_tokens + head_size)
    num_q, num_kv, max_position = 9, 3, 4096
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * head_size, dtype=dtype, device=device)
    q = qkv[:, : num_q * head_size]
    k = qkv[:, num_q * head_size : (num_q + num_kv) * head_size]
    v_before = qkv[:, (num_q + num_kv) * head_size :].clone()
    positions = torch.randint(0, max_position, (num_tokens,), device=device)
    cache = ops.compute_cos_sin_cache(head_size, max_position, base=10000.0, device=device)
    expected_q = reference_rotary(q.view(num_tokens, num_q, head_size), positions, cache, head_size, is_neox)
    expected_k = reference_rotary(k.view(num_tokens, num_kv, head_size), positions, cache, head_size, is_neox)
    ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
    assert_close(q.view(num_tokens, num_q, head_size), expected_q, dtype)
    assert_close(k.view(num_tokens, num_kv, head_size), expected_k, dtype)
    assert torch.equal(qkv[:, (num_q + num_kv) * head_size :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_partial_rotary_dim_and_cache_dtype(device, dtype, is_neox):
    # rotary_dim < head_size (features past rotary_dim untouched), a cache in the query dtype,
    # 3-D query and no key.
    head_size, rotary_dim, num_tokens = 128, 48, 83
    q = torch.randn(num_tokens, 5, head_size, dtype=dtype, device=device)
    positions = torch.arange(num_tokens, device=device) * 7
    cache = ops.compute_cos_sin_cache(rotary_dim, 1024, base=500000.0, dtype=dtype, device=device)
    expected = reference_rotary(q, positions, cache, rotary_dim, is_neox)
    ops.rotary_embedding(positions, q, None, head_size, cache, is_neox)
    assert_close(q, expected, dtype)


def test_cos_sin_cache_matches_hugging_face_default_rope():
    # Hugging Face: inv_freq = 1 / base^(arange(0, dim, 2) / dim); emb = cat(freqs, freqs).
    dim, base = 64, 100000.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(2048).float(), inv_freq)
    cache = ops.compute_cos_sin_cache(dim, 2048, base=base)
    torch.testing.assert_close(cache[:, : dim // 2], freqs.cos(), rtol=0, atol=2e-4)
    torch.testing.assert_close(cache[:, dim // 2 :], freqs.sin(), rtol=0, atol=2e-4)


def test_llama3_rope_scaling_rule():
    # Llama 3.1: wavelengths shorter than old_context / high_freq_factor keep their frequency,
    # longer than old_context / low_freq_factor are slowed by `factor`, the band between blends.
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    dim, base = 128, 500000.0
    plain = ops.compute_cos_sin_cache(dim, 2, base=base, dtype=torch.float64)
    scaled = ops.compute_cos_sin_cache(dim, 2, base=base, rope_scaling=scaling, dtype=torch.float64)
    plain_freq = torch.atan2(plain[1, dim // 2 :], plain[1, : dim // 2])  # angle at position 1
    scaled_freq = torch.atan2(scaled[1, dim // 2 :], scaled[1, : dim // 2])
    wavelen = 2 * math.pi / plain_freq
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(scaled_freq[high], plain_freq[high])
    torch.testing.assert_close(scaled_freq[low], plain_freq[low] / 8)
    assert ((scaled_freq[mid] < plain_freq[mid]) & (scaled_freq[mid] > plain_freq[mid] / 8)).all()


def transformers_cos_sin(kind: str, parameters: dict, dim: int, max_position: int, seq_len: int | None = None):
    """cos and sin of position p by transformers' own rope functions: [positions, dim / 2] each."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, max_position_embeddings=max_position,
                         rope_parameters={"rope_type": kind, "rope_theta": 10000.0, **parameters})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    angles = torch.outer(torch.arange(seq_len or max_position).float(), inv_freq.float())
    return angles.cos() * attention_factor, angles.sin() * attention_factor


@pytest.mark.parametrize("parameters", [dict(factor=4.0, original_max_position_embeddings=512),
                                        dict(factor=8.0, original_max_position_embeddings=256, beta_fast=16, beta_slow=2),
                                        dict(factor=4.0, original_max_position_embeddings=512, attention_factor=1.3),
                                        dict(factor=4.0, original_max_position_embeddings=512, mscale=1.0,
                                             mscale_all_dim=0.5),
                                        dict(factor=4.0, original_max_position_embeddings=512, truncate=False)],
                         ids=["default", "betas", "attention_factor", "mscale", "no-truncate"])
def test_yarn_table_matches_transformers(parameters):
    """YaRN: the ramp between kept and divided frequencies, and cos and sin times the attention
    factor, as transformers computes them (over the whole scaled context)."""
    dim = 64
    context = int(parameters["original_max_position_embeddings"] * parameters["factor"])
    cos, sin = transformers_cos_sin("yarn", parameters, dim, context)
    cache = ops.compute_cos_sin_cache(dim, context, base=10000.0, rope_scaling={"rope_type": "yarn", **parameters})
    plain = ops.compute_cos_sin_cache(dim, context, base=10000.0)
    assert (cache - plain).abs().max() > 0.1  # the scaling changes the table
    torch.testing.assert_close(cache[:, : dim // 2], cos, rtol=0, atol=2e-4)
    torch.testing.assert_close(cache[:, dim // 2 :], sin, rtol=0, atol=2e-4)


def test_dynamic_ntk_table_is_transformers_at_the_scaled_context():
    """Dynamic NTK as vLLM does it: one base for the whole scaled context (the original one
    times factor), which is the base transformers computes once a sequence reaches that length.
    (Within the original context transformers keeps the unscaled base, so the two differ there.)"""
    dim, original, factor = 64, 256, 4.0
    cos, sin = transformers_cos_sin("dynamic", dict(factor=factor), dim, original, seq_len=int(original * factor))
    scaling = {"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": original}
    cache = ops.compute_cos_sin_cache(dim, int(original * factor), base=10000.0, rope_scaling=scaling)
    torch.testing.assert_close(cache[:, : dim // 2], cos, rtol=0, atol=2e-4)
    torch.testing.assert_close(cache[:, dim // 2 :], sin, rtol=0, atol=2e-4)
    base = 10000.0 * (factor * factor - (factor - 1)) ** (dim / (dim - 2))  # vLLM's formula, by hand
    assert abs(math.atan2(cache[1, dim // 2 + 1], cache[1, 1]) - base ** (-2 / dim)) < 1e-6


@pytest.mark.parametrize("attention_factor", [None, 1.1], ids=["derived", "given"])
@pytest.mark.parametrize("context", [256, 1024], ids=["short", "long"])
def test_longrope_table_matches_transformers(context, attention_factor):
    """LongRoPE: the short factors while the table fits the original context (256), the long ones
    beyond it (transformers at a sequence that long), cos and sin times the attention factor
    derived from the released context (1024) over the original one, or the one given."""
    dim, original, released = 48, 256, 1024
    generator = torch.Generator().manual_seed(0)
    parameters = {"short_factor": (1 + torch.rand(dim // 2, generator=generator)).tolist(),
                  "long_factor": (1 + 7 * torch.rand(dim // 2, generator=generator)).tolist(),
                  "original_max_position_embeddings": original}
    if attention_factor is not None:
        parameters["attention_factor"] = attention_factor
    cos, sin = transformers_cos_sin("longrope", parameters, dim, released, seq_len=context)
    scaling = {"rope_type": "longrope", **parameters, "factor": released / original}
    cache = ops.compute_cos_sin_cache(dim, context, base=10000.0, rope_scaling=scaling)
    torch.testing.assert_close(cache[:, : dim // 2], cos, rtol=0, atol=2e-4)
    torch.testing.assert_close(cache[:, dim // 2 :], sin, rtol=0, atol=2e-4)


def test_rotary_embedding_rejects_bad_input():
    q = torch.randn(4, 2 * 64)
    k = torch.randn(4, 64)
    cache = ops.compute_cos_sin_cache(64, 16)
    pos = torch.arange(4)
    q_before, k_before = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match=r"positions\[3\] = 16 is outside the cos_sin_cache range"):
        ops.rotary_embedding(pos + 13, q, k, 64, cache)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # nothing rotated before the error
    with pytest.raises(RuntimeError, match="positions must be Long"):
        ops.rotary_embedding(pos.int(), q, k, 64, cache)
    with pytest.raises(RuntimeError, match="query's 128 features are not a multiple of head_size 48"):
        ops.rotary_embedding(pos, q, None, 48, cache)
    with pytest.raises(RuntimeError, match="rotary_dim 128 must be even and at most head_size 64"):
        ops.rotary_embedding(pos, q, k, 64, ops.compute_cos_sin_cache(128, 16))
    with pytest.raises(RuntimeError, match="key has 3 tokens but positions has 4"):
        ops.rotary_embedding(pos, q, k[:3], 64, cache)
    with pytest.raises(RuntimeError, match="key has dtype"):
        ops.rotary_embedding(pos, q, k.half(), 64, cache)
    with pytest.raises(RuntimeError, match="cos_sin_cache must be float32 or query's dtype"):
        ops.rotary_embedding(pos, q, k, 64, cache.half())
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'mrope'"):
        ops.compute_cos_sin_cache(64, 16, rope_scaling={"rope_type": "mrope", "mrope_section": [16, 8, 8]})
    with pytest.raises(ValueError, match="rope_scaling type 'longrope' needs 'short_factor', 'long_factor'"):
        ops.compute_cos_sin_cache(64, 16, rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="rope_scaling short_factor has 3 entries; rotary_dim / 2 is 32"):
        ops.compute_cos_sin_cache(64, 16, rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                                                        "short_factor": [1.0] * 3, "long_factor": [1.0] * 3})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' needs 'original_max_position_embeddings'"):
        ops.compute_cos_sin_cache(64, 16, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling type 'linear' needs 'factor'"):
        ops.compute_cos_sin_cache(64, 16, rope_scaling={"rope_type": "linear"})
