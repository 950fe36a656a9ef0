"""Qwen3 (dense): the Llama graph with an RMS norm over each head of q and k, applied in place in
the q|k|v product before rope (QK-norm). No q/k/v biases unless the config's attention_bias,
which puts one on o_proj too."""

import torch

from kvflow.attention_metadata import AttentionMetadata
from kvflow.layers import RMSNorm, RotaryEmbedding
from kvflow.models.config import ModelConfig
from kvflow.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm_weight_offset = 0.0  # Gemma 3's QK-norm multiplies by (1 + weight)

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype,
                 sliding_window: int | None):
        super().__init__(config, rotary, dtype, sliding_window)
        self.head_dim = config.head_dim  # num_heads and num_kv_heads: this rank's (LlamaAttention)
        offset = self.qk_norm_weight_offset
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, weight_offset=offset)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, weight_offset=offset)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        tokens = hidden.shape[0]
        self.q_norm.normalize_(query.view(tokens, self.num_heads, self.head_dim))
        self.k_norm.normalize_(key.view(tokens, self.num_kv_heads, self.head_dim))
        if self.rotary is not None:
            self.rotary(metadata.positions, query, key)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
