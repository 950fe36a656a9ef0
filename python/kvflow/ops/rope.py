"""Rotary position embedding: the angle table and the in-place rotation op."""

import math

import torch


SUPPORTED_ROPE_SCALING = ("llama3", "linear")  # rope_scaling types compute_cos_sin_cache implements


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def compute_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [max_position, rotary_dim] table rotary_embedding reads: cos(p * f_i) then sin(p * f_i),
    with f_i = base^(-2i / rotary_dim) for i < rotary_dim / 2. Computed in float64.

    rope_scaling: None, {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"} or {"rope_type": "linear", "factor"}.
    freq_factors [rotary_dim / 2]: divisors of each frequency, as GGUF files store Llama 3 scaling.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    inv_freq = base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    positions = torch.arange(max_position, dtype=torch.float64)
    if freq_factors is not None:
        if freq_factors.shape != inv_freq.shape:
            raise ValueError(f"freq_factors must have shape {tuple(inv_freq.shape)}, got {tuple(freq_factors.shape)}")
        inv_freq = inv_freq / freq_factors.to(inv_freq)
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            positions = positions / rope_scaling["factor"]
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotates, in place, the first rotary_dim features of every head of query and key.

    positions [num_tokens] int64; query [num_tokens, num_heads * head_size] (or
    [num_tokens, num_heads, head_size]) and key likewise, token-strided views allowed;
    cos_sin_cache [max_position, rotary_dim] from compute_cos_sin_cache, float32 or query's dtype.
    NeoX style (is_neox=True) pairs x[i] with x[i + rotary_dim/2]; GPT-J style pairs x[2i], x[2i+1]:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    torch.ops.kvflow.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


@torch.library.register_fake("kvflow::rotary_embedding")
def _rotary_embedding_fake(positions, query, key, head_size, cos_sin_cache, is_neox):
    return None
