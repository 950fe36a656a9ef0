"""Gated activations over a merged gate|up projection."""

import torch
from torch import nn

# Hugging Face's hidden_act names -> the kvflow op computing act(gate) * up
GATED_ACTIVATION_OPS = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu": "gelu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_new": "gelu_tanh_and_mul",
    "gelu_fast": "gelu_tanh_and_mul",
}


class GatedActivation(nn.Module):
    """[..., 2 * d] -> [..., d]: act(gate) * up, act named as in a Hugging Face config."""

    def __init__(self, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act not in GATED_ACTIVATION_OPS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(GATED_ACTIVATION_OPS)})")
        self.hidden_act = hidden_act
        self.op = getattr(torch.ops.kvflow, GATED_ACTIVATION_OPS[hidden_act])

    @property
    def is_silu(self) -> bool:
        return GATED_ACTIVATION_OPS[self.hidden_act] == "silu_and_mul"

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)
        self.op(out, gate_up)
        return out

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class SiluAndMul(GatedActivation):
    """[..., 2 * d] -> [..., d]: silu(gate) * up."""

    def __init__(self):
        super().__init__("silu")
