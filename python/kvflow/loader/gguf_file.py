"""GGUF checkpoints: the model config from metadata, tensors renamed to Hugging Face names so
that one weight-loading path serves both formats, each either dequantized to float or, where the
model holds it quantized, as the file's raw blocks."""

import os
import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from kvflow.models.config import ModelConfig
from kvflow.models.registry import GGUF_ARCHITECTURES

# Tensor types kvflow loads: kept in their blocks where the model can hold them (see
# LlamaForCausalLM.hold_quantized_weights), dequantized otherwise.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp stores the q and k rows of these architectures permuted for its interleaved RoPE.
_PERMUTED_QK_ARCHITECTURES = ("llama", "mistral", "granite", "smollm3")
# Gemma's converter stores its (1 + w) norms with the 1 added, which kvflow's norms add themselves.
_NORMS_STORED_PLUS_ONE = ("gemma", "gemma2", "gemma3")
# llama.cpp fixes SmolLM3's layers without rope rather than storing them: every 4th.
_SMOLLM3_NO_ROPE_PERIOD = 4

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# gemma2 and gemma3 norm each sublayer's output too, and their ffn_norm is the MLP's own pre-norm.
_SANDWICH_NORM_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp fixes for these rather than storing: the period of full-attention layers (every
# 2nd, every 6th; the others windowed), and the layer count of the 27B model, whose attention
# scale is (hidden_size / heads) ** -0.5 rather than head_dim ** -0.5 (gemma_pytorch's
# query_pre_attn_scalar). Their converter also stores the (1 + weight) norms with the 1 added.
_GEMMA_GGUF = {"gemma2": (2, 46), "gemma3": (6, 62)}

# olmo2 norms each sublayer's output only.
_OLMO2_NORM_TENSORS = {"attn_post_norm": "post_attention_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}
# phi3 stores q|k|v and gate|up fused, as its Hugging Face checkpoints do.
_PHI3_FUSED_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors that are not parameters: Llama 3's frequency divisors, Phi-3's LongRoPE factors.
_ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def open_gguf(path: str):
    """A gguf.GGUFReader over the file; a clear error for a missing, truncated or foreign file."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:
        with open(path, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        # GGUFReader fails on a short file with whatever reshape or index error the cut produces.
        problem = (f"is a damaged GGUF file: is it truncated ({os.path.getsize(path)} bytes)?" if is_gguf
                   else "is not a GGUF file (it does not start with the GGUF magic)")
        raise ValueError(f"{path} {problem} ({type(error).__name__}: {error})") from error


def drop_metadata(reader) -> None:
    """Lets go of the reader's parsed metadata (the tokenizer's tokens and merges, one numpy array
    per entry) once the config and tokenizer are read from it: what the weights need is the
    architecture and the tensors. Without this the parsed fields stay in memory through the
    whole load, on top of the weights."""
    reader.fields = {key: entry for key, entry in reader.fields.items() if key == "general.architecture"}


def field(reader, key: str, default=None):
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})")

    def meta(key, default=None):
        return field(reader, f"{arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError("GGUF file has a different kv head count per layer, which kvflow does not support")
        num_kv_heads = num_kv_heads[0]
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab_size = meta("vocab_size") or (len(tokens) if tokens is not None else None)
    tensor_names = {t.name for t in reader.tensors}
    for tensor in reader.tensors:  # before anything is allocated
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which kvflow cannot "
                             f"load (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    if vocab_size is None:
        raise ValueError("GGUF file gives no vocabulary size")
    if "token_embd.weight" not in tensor_names:
        raise ValueError("GGUF file has no token_embd.weight tensor (is it truncated?)")

    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r} (supported: linear, llama3 rope_freqs)")
    freq_factors = None
    if "rope_freqs.weight" in tensor_names:
        freq_factors = _dequantize(next(t for t in reader.tensors if t.name == "rope_freqs.weight")).flatten()
    if "rope_factors_long.weight" in tensor_names:  # phi3's LongRoPE
        factors = {t.name: _dequantize(t).flatten().tolist() for t in reader.tensors if t.name.startswith("rope_factors")}
        rope_scaling = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                        "short_factor": factors.get("rope_factors_short.weight"),
                        "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
                        "attention_factor": meta("rope.scaling.attn_factor")}
        rope_scaling["factor"] = meta("context_length", 4096) / (rope_scaling["original_max_position_embeddings"] or 1)

    num_layers = meta("block_count")
    head_dim = meta("attention.key_length") or hidden_size // num_heads
    rotary_dim = meta("rope.dimension_count")
    family_fields = {}  # what a family's file implies beyond the common keys
    if arch in _GEMMA_GGUF:
        family_fields = _gemma_fields(arch, meta, num_layers, hidden_size // num_heads, head_dim)
    elif arch == "gemma":
        family_fields = {"hidden_act": "gelu_pytorch_tanh"}
    if arch == "olmo2" and meta("attention.sliding_window"):
        raise ValueError("GGUF file: olmo2.attention.sliding_window (OLMo 3's windowed layers) is not supported")
    if arch == "smollm3":
        family_fields = {"layer_uses_rope": [(i + 1) % _SMOLLM3_NO_ROPE_PERIOD != 0 for i in range(num_layers)]}
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=meta("context_length", 4096),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        rope_freq_factors=freq_factors,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        rotary_dim=rotary_dim if rotary_dim and rotary_dim != head_dim else None,
        sliding_window=meta("attention.sliding_window") or None,  # phi3 writes 0 for none
        attention_scale=meta("attention.scale") or None,  # llama.cpp writes 0 for the default
        embedding_multiplier=meta("embedding_scale", 1.0),
        residual_multiplier=meta("residual_scale", 1.0),
        logits_scaling=meta("logit_scale", 1.0),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
    )
    return ModelConfig(**fields | family_fields)


def _gemma_fields(arch: str, meta, num_layers: int, hidden_per_head: int, head_dim: int) -> dict:
    """The ModelConfig fields of a gemma2 or gemma3 file, read as llama.cpp reads them."""
    period, layers_of_27b = _GEMMA_GGUF[arch]
    window = meta("attention.sliding_window", 4096 if arch == "gemma2" else None)
    if window is None:
        raise ValueError(f"GGUF file of architecture {arch!r} gives no {arch}.attention.sliding_window")
    if arch == "gemma3" and meta("attn_logit_softcapping") is not None:
        raise ValueError("GGUF file: gemma3.attn_logit_softcapping is not supported (Gemma 3 has no attention cap)")
    return dict(
        hidden_act="gelu_pytorch_tanh",
        attention_scale=(hidden_per_head if num_layers == layers_of_27b else head_dim) ** -0.5,
        sliding_window=window,
        layer_sliding_windows=[None if (i + 1) % period == 0 else window for i in range(num_layers)],
        attention_logit_soft_cap=meta("attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
        final_logit_soft_cap=meta("final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        local_rope_theta=meta("rope.freq_base_swa", 10000.0) if arch == "gemma3" else None,
    )


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for tensors that are
    not parameters (rope_freqs, rope_factors_long/short)."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, tensor, kind = match.groups()
        names = {**_LAYER_TENSORS, **_SANDWICH_NORM_TENSORS} if arch in _GEMMA_GGUF else _LAYER_TENSORS
        if arch == "phi3":
            names = {**_LAYER_TENSORS, **_PHI3_FUSED_TENSORS}
        elif arch == "olmo2":
            names = {**_LAYER_TENSORS, **_OLMO2_NORM_TENSORS}
        if tensor not in names:
            raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in kvflow's model")
        return f"model.layers.{layer}.{names[tensor]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _ROPE_TENSORS:
        return None
    if base not in _GLOBAL_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in kvflow's model")
    return f"{_GLOBAL_TENSORS[base]}.{kind}"


def gguf_tensor_types(reader) -> dict[str, int]:
    """Hugging Face name (without "model.") -> GGML type id, for every parameter tensor."""
    arch = field(reader, "general.architecture")
    names = ((hf_name(tensor.name, arch), tensor) for tensor in reader.tensors)
    return {name.removeprefix("model."): int(tensor.tensor_type) for name, tensor in names if name is not None}


def gguf_weights(reader, config: ModelConfig, raw_names: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every parameter tensor in the file, with llama.cpp's q/k
    row permutation undone: the raw blocks (uint8 [rows, row bytes]) for the names in raw_names
    (without "model."), float values dequantized for the others."""
    arch = field(reader, "general.architecture")
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        weight = _raw_blocks(tensor) if name.removeprefix("model.") in raw_names else _dequantize(tensor)
        if arch in _NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - 1.0
        if arch in _PERMUTED_QK_ARCHITECTURES:
            if ".q_proj." in name:
                weight = _unpermute_rows(weight, config.num_heads)
            elif ".k_proj." in name:
                weight = _unpermute_rows(weight, config.num_kv_heads)
        yield name, weight


def _dequantize(tensor) -> torch.Tensor:
    import gguf

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {type_name}, which kvflow cannot load "
                         f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    shape = tuple(reversed([int(n) for n in tensor.shape]))  # GGUF lists the fastest dimension first
    if type_name in ("F32", "F16"):
        array = tensor.data
    else:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"GGUF tensor {tensor.name!r} holds {array.size} values, its shape {shape} needs "
                         f"{int(np.prod(shape))} (is the file truncated?)")
    with warnings.catch_warnings():  # the memory map is read-only, and kvflow only ever copies out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array).reshape(shape))


def _raw_blocks(tensor) -> torch.Tensor:
    """A quantized tensor's bytes as uint8 [rows, row bytes], rows in the file's order."""
    rows = int(np.prod([int(n) for n in tensor.shape[1:]]))
    array = np.asarray(tensor.data, dtype=np.uint8)
    if rows == 0 or array.size % rows:
        raise ValueError(f"GGUF tensor {tensor.name!r} holds {array.size} bytes, not whole rows of its "
                         f"{rows} (is the file truncated?)")
    with warnings.catch_warnings():  # the memory map is read-only, and kvflow only ever copies out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array.reshape(rows, -1))


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: within each head, rows (0, 2, 4, ..., 1, 3, 5, ...) were
    interleaved as (0, 1, 2, ...); restore the half-split (NeoX) order Hugging Face uses."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
