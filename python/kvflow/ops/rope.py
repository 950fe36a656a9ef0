"""Rotary position embedding: the angle table and the in-place rotation op."""

import math

import torch


# the rope_scaling types compute_cos_sin_cache implements
SUPPORTED_ROPE_SCALING = ("llama3", "linear", "yarn", "dynamic", "longrope")
_REQUIRED_FIELDS = {"llama3": ("factor", "original_max_position_embeddings"), "linear": ("factor",),
                    "yarn": ("factor", "original_max_position_embeddings"),
                    "dynamic": ("factor", "original_max_position_embeddings"),
                    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}


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


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by `factor`, those that turn more than beta_fast times are kept, with a linear ramp
    between; cos and sin are then multiplied by the attention factor (0.1 ln(factor) + 1 by
    default). Returns (inv_freq, attention_factor)."""
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def mscale(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def dimension_turning(rotations: float) -> float:  # the dimension whose frequency turns this often
        return rotary_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), attention_factor


def _dynamic_ntk_base(rotary_dim: int, base: float, scaling: dict) -> float:
    """Dynamic NTK as vLLM applies it: one base for the whole scaled context (the original context
    times factor), the base transformers uses once a sequence reaches that length (transformers
    changes the base with the length; within the original context it keeps the original one)."""
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]
    scaled_context = old_context * factor
    return base * (factor * scaled_context / old_context - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def _longrope_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, the long factors when the table
    covers more than the original context and the short ones otherwise (llama.cpp's rule: one
    rotation for the whole context; transformers switches with each sequence's length and agrees
    within the original context). cos and sin are multiplied by sqrt(1 + ln(factor) / ln(original
    context)), factor being the released context over the original one. Returns (inv_freq,
    attention_factor)."""
    old_context = scaling["original_max_position_embeddings"]
    which = "long_factor" if max_position > old_context else "short_factor"
    factors = torch.tensor(scaling[which], dtype=torch.float64)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope_scaling {which} has {factors.numel()} entries; rotary_dim / 2 is {inv_freq.numel()}")
    factor = scaling.get("factor") or 1.0
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_context))
    return inv_freq / factors, attention_factor


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
    "original_max_position_embeddings"}, {"rope_type": "linear", "factor"}, {"rope_type": "yarn",
    "factor", "original_max_position_embeddings", optional "beta_fast", "beta_slow",
    "attention_factor", "mscale", "mscale_all_dim", "truncate"}, {"rope_type": "dynamic",
    "factor", "original_max_position_embeddings"} or {"rope_type": "longrope", "short_factor",
    "long_factor", "original_max_position_embeddings", optional "factor", "attention_factor"}
    (the long factors when max_position exceeds the original context).
    freq_factors [rotary_dim / 2]: divisors of each frequency, as GGUF files store Llama 3 scaling.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    rope_type = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in (None, "default", *SUPPORTED_ROPE_SCALING):
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
    missing = [field for field in _REQUIRED_FIELDS.get(rope_type, ()) if rope_scaling.get(field) is None]
    if missing:
        raise ValueError(f"rope_scaling type {rope_type!r} needs {', '.join(map(repr, missing))}")
    if rope_type == "dynamic":
        base = _dynamic_ntk_base(rotary_dim, base, rope_scaling)
    inv_freq = base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    positions = torch.arange(max_position, dtype=torch.float64)
    if freq_factors is not None:
        if freq_factors.shape != inv_freq.shape:
            raise ValueError(f"freq_factors must have shape {tuple(inv_freq.shape)}, got {tuple(freq_factors.shape)}")
        inv_freq = inv_freq / freq_factors.to(inv_freq)
    magnitude = 1.0  # YaRN's attention factor, on cos and sin
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type == "linear":
        positions = positions / rope_scaling["factor"]
    elif rope_type == "yarn":
        inv_freq, magnitude = _yarn_inv_freq(inv_freq, rotary_dim, base, rope_scaling)
    elif rope_type == "longrope":
        inv_freq, magnitude = _longrope_inv_freq(inv_freq, rope_scaling, max_position)
    angles = torch.outer(positions, inv_freq)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude).to(dtype=dtype, device=device)


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
