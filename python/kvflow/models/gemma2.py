"""Gemma 2: Gemma's (1 + weight) norms, sqrt(hidden_size) embedding scale and GELU-tanh MLP, with
sandwich norms: each sublayer's output is normed again before its residual add
(post_attention_layernorm, post_feedforward_layernorm), and the MLP's input has its own norm
(pre_feedforward_layernorm). Attention logits scaled by query_pre_attn_scalar ** -0.5 and capped
at attn_logit_softcapping, every other layer windowed (layer_types), the output logits capped at
final_logit_softcapping: the config carries these and the Llama graph applies them."""

import torch

from kvflow.attention_metadata import AttentionMetadata
from kvflow.layers import RMSNorm, RotaryEmbedding
from kvflow.models.config import ModelConfig
from kvflow.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM


class Gemma2DecoderLayer(LlamaDecoderLayer):
    norm_weight_offset = 1.0

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, index: int = 0):
        super().__init__(config, rotary, dtype, index)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                 weight_offset=self.norm_weight_offset)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                  weight_offset=self.norm_weight_offset)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += hidden (the first layer: residual = hidden), then the layer; returns (its
        output, the residual stream). Each post-norm runs in place on its sublayer's output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm.normalize_(self.self_attn(hidden, kv_cache, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm.normalize_(self.mlp(hidden)), residual

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma2DecoderLayer
    scales_embedding = True
