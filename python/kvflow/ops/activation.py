"""Gated activations of the MLP: act(gate) * up."""

import torch


def _gated_out(input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty((*input.shape[:-1], input.shape[-1] // 2), dtype=input.dtype, device=input.device)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(gate) * up, where input [..., 2 * d] = [gate | up] and out is [..., d].

    silu(x) = x / (1 + exp(-x)), computed in float32.
    """
    out = _gated_out(input, out)
    torch.ops.kvflow.silu_and_mul(out, input)
    return out


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = gelu_tanh(gate) * up, where input [..., 2 * d] = [gate | up] and out is [..., d].

    gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), computed in float32.
    """
    out = _gated_out(input, out)
    torch.ops.kvflow.gelu_tanh_and_mul(out, input)
    return out


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = gelu(gate) * up, where input [..., 2 * d] = [gate | up] and out is [..., d].

    gelu(x) = 0.5 x (1 + erf(x / sqrt(2))), computed in float32 (on the CPU with an erf accurate
    to 1.5e-7).
    """
    out = _gated_out(input, out)
    torch.ops.kvflow.gelu_and_mul(out, input)
    return out


@torch.library.register_fake("kvflow::silu_and_mul")
def _silu_and_mul_fake(out, input):
    return None


@torch.library.register_fake("kvflow::gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(out, input):
    return None


@torch.library.register_fake("kvflow::gelu_and_mul")
def _gelu_and_mul_fake(out, input):
    return None
