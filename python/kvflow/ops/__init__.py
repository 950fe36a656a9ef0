"""Python wrappers over torch.ops.kvflow, one module per topic (mirroring csrc/)."""

from kvflow import _C
from kvflow.ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from kvflow.ops.attention import paged_attention
from kvflow.ops.cache import copy_blocks, reshape_and_cache
from kvflow.ops.embedding import embedding
from kvflow.ops.linear import linear, pack_linear_weight, packed_linear, packed_silu_and_mul, small_linear
from kvflow.ops.quantized import quantized_embedding, quantized_linear
from kvflow.ops.norm import fused_add_rms_norm, rms_norm, rms_norm_add
from kvflow.ops.rope import compute_cos_sin_cache, rotary_embedding
from kvflow.ops.sampling import (apply_penalties, apply_sampling_filters, apply_token_bitmask, compute_logprobs,
                                 rejection_sample, sample, scale_logits)


def supported_cpu_isas() -> list[str]:
    """Instruction sets the CPU kernels can use on this machine, narrowest first."""
    return _C.supported_cpu_isas()


def cpu_isa() -> str:
    """The instruction set the CPU kernels use now (KVFLOW_CPU_ISA picks it at start-up)."""
    return _C.cpu_isa()


def set_cpu_isa(name: str) -> None:
    """Switch the CPU kernels to 'scalar', 'avx2', 'avx512' or 'avx512_bf16' (kvflow.platform.force_isa):
    raises ValueError if this CPU cannot run it, or while an engine exists."""
    from kvflow import platform

    platform.force_isa(name)


__all__ = [
    "apply_penalties",
    "apply_sampling_filters",
    "compute_logprobs",
    "rejection_sample",
    "sample",
    "scale_logits",
    "apply_token_bitmask",
    "compute_cos_sin_cache",
    "copy_blocks",
    "cpu_isa",
    "embedding",
    "fused_add_rms_norm",
    "rms_norm_add",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "linear",
    "pack_linear_weight",
    "packed_linear",
    "packed_silu_and_mul",
    "paged_attention",
    "quantized_embedding",
    "quantized_linear",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_cpu_isa",
    "silu_and_mul",
    "small_linear",
    "supported_cpu_isas",
]
