"""OLMo 2: the Llama attention and MLP with norms after each sublayer instead of before it, the
sublayer's input being the residual stream itself (stream += norm(sublayer(stream))), and
QK-norm over all heads of q and of k together (one RMS norm over each token's whole q, and
its whole k, before rope)."""

import torch
from torch import nn

from kvflow.attention_metadata import AttentionMetadata
from kvflow.layers import RMSNorm, RotaryEmbedding
from kvflow.models.config import ModelConfig
from kvflow.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype,
                 sliding_window: int | None):
        super().__init__(config, rotary, dtype, sliding_window)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self.q_norm.normalize_(query)
        self.k_norm.normalize_(key)
        if self.rotary is not None:
            self.rotary(metadata.positions, query, key)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class Olmo2DecoderLayer(nn.Module):
    norm_weight_offset = 0.0  # the final norm's, as LlamaForCausalLM reads it
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, index: int = 0):
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary if config.uses_rope(index) else None, dtype,
                                        config.sliding_window_of(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, stream: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        """The residual stream [tokens, hidden_size], updated in place."""
        self.post_attention_layernorm.add_to_(stream, self.self_attn(stream, kv_cache, metadata))
        self.post_feedforward_layernorm.add_to_(stream, self.mlp(stream))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer
    supports_tensor_parallel = False
    supports_tensor_parallel_reason = "its q and k norms span all heads, which the ranks hold in parts"

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids [num_tokens] int64 -> final hidden states [num_tokens, hidden_size]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model of {len(self.layers)} layers")
        stream = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            layer(stream, kv_cache, metadata)
        return self.norm(stream)
