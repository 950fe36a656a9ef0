"""The Llama family: Llama 2/3/3.x (attention and MLP biases, GELU where the config says so),
Mistral, Qwen2/2.5 (q/k/v biases, a window on the upper layers), SmolLM/SmolLM2 (tied
embeddings), SmolLM3 (no rope on the layers its no_rope_layers says), Granite (embedding, attention, residual
and logit multipliers). One forward pass takes the new tokens of many requests flattened into one row each,
with no padding; the attention metadata says which request each row belongs to."""

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.attention_metadata import AttentionMetadata
from kvflow.layers import (GateUpLinear, LMHead, Linear, MergedLinear, PagedAttention, RMSNorm, RotaryEmbedding,
                           VocabEmbedding)
from kvflow.layers.linear import RowParallelLinear, copy_checked
from kvflow.layers.tensor_parallel import Shard
from kvflow.models.config import ModelConfig
from kvflow.ops.sampling import scale_logits

# The checkpoint tensors each merged projection holds, in the order of its parts.
_MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype,
                 sliding_window: int | None):
        super().__init__()
        parallel, head_dim = config.parallel, config.head_dim
        heads = parallel.split(config.num_heads, "num_attention_heads")  # this rank's (all of them at one rank)
        kv_heads = parallel.kv_heads(config.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.size, kv_heads.size
        self.q_size = heads.size * head_dim
        self.kv_size = kv_heads.size * head_dim
        q_rows, kv_rows = (Shard(s.start * head_dim, s.size * head_dim, s.total * head_dim) for s in (heads, kv_heads))
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     bias=config.attention_bias, dtype=dtype, shards=[q_rows, kv_rows, kv_rows])
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype,
                                        shard=q_rows, parallel=parallel)
        self.rotary = rotary
        self.attn = PagedAttention(heads.size, kv_heads.size, config.head_dim,
                                   scale=config.head_dim ** -0.5 if config.attention_scale is None else config.attention_scale,
                                   sliding_window=sliding_window, logits_soft_cap=config.attention_logit_soft_cap)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary is not None:  # None: a layer without positions in q and k (SmolLM3's NoPE layers)
            self.rotary(metadata.positions, query, key)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        features = config.parallel.split(config.intermediate_size, "intermediate_size")
        self.gate_up_proj = GateUpLinear(config.hidden_size, features.size, bias=config.mlp_bias,
                                         hidden_act=config.hidden_act, dtype=dtype, shard=features)
        self.down_proj = RowParallelLinear(features.size, config.hidden_size, bias=config.mlp_bias, dtype=dtype,
                                           shard=features, parallel=config.parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.activated(hidden))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # a family with another attention (Qwen3's QK-norm) names its own
    norm_weight_offset = 0.0  # Gemma's norms multiply by (1 + weight)

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, index: int = 0):
        super().__init__()
        offset = self.norm_weight_offset
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, weight_offset=offset)
        self.self_attn = self.attention_class(config, rotary if config.uses_rope(index) else None, dtype,
                                              config.sliding_window_of(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                weight_offset=offset)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += hidden (the first layer: residual = hidden), then the layer; returns (its
        output, the residual stream)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LlamaForCausalLM(nn.Module):
    layer_class = LlamaDecoderLayer
    scales_embedding = False  # Gemma multiplies the embeddings by sqrt(hidden_size)
    supports_tensor_parallel = True
    supports_tensor_parallel_reason = ""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config
        self.dtype = dtype
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling, config.rope_freq_factors, rotary_dim=config.rotary_dim)
        if config.parallel.size > 1 and not self.supports_tensor_parallel:
            raise ValueError(f"{config.architecture} has no tensor-parallel version in kvflow: "
                             f"{self.supports_tensor_parallel_reason}")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                           scale=self.embedding_scale(config, dtype), parallel=config.parallel)
        local_rotary = None if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.local_rope_theta, rotary_dim=config.rotary_dim)
        self.layers = nn.ModuleList(
            self.layer_class(config, local_rotary if config.uses_local_rope(i) else rotary, dtype, i)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                            weight_offset=self.layer_class.norm_weight_offset)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                              tied_to=self.embed_tokens if config.tie_word_embeddings else None,
                              parallel=config.parallel)

    def embedding_scale(self, config: ModelConfig, dtype: torch.dtype) -> float:
        if self.scales_embedding:  # rounded to the dtype first, as Gemma computes it
            return float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype))
        return config.embedding_multiplier

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids [num_tokens] int64 -> final hidden states [num_tokens, hidden_size]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model of {len(self.layers)} layers")
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden_size] (only the rows to sample) -> float32 logits [rows, vocab_size]."""
        return self.adjust_logits(self.lm_head(hidden))

    def adjust_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What a family does to the LM head's logits, in place (Granite divides them by
        logits_scaling, Gemma 2 caps them), as a kvflow op: the CPU programs capture it."""
        if self.config.logits_scaling != 1.0 or self.config.final_logit_soft_cap is not None:
            scale_logits(logits, self.config.logits_scaling, self.config.final_logit_soft_cap)
        return logits

    def linear_modules(self) -> list:
        """The projections and the LM head, in the order a forward reads them."""
        return [module for module in self.modules() if isinstance(module, (Linear, LMHead))]

    def prepack_linear_weights(self, budget_bytes: int | None = None) -> int:
        """Packs the bfloat16 projection weights and the LM head for the CPU (Linear.prepack);
        returns how many were packed. Packing replaces a weight, and needs room for its packed
        copy only while the plain one is released, except for an LM head tied to the embedding,
        whose copy stays beside the table. With budget_bytes, a weight whose copy needs more than
        what is left of it stays plain."""
        packed = 0
        for module in self.linear_modules():
            if module.ggml_type is not None or getattr(module, "quantized_parts", None) is not None:
                continue  # its blocks are what its products read
            tied = getattr(module, "tied_to", None)
            size = (tied.weight if tied is not None else module.weight).nbytes
            if budget_bytes is not None and size > budget_bytes:
                continue
            if module.prepack():
                packed += 1
                if budget_bytes is not None and tied is not None:
                    budget_bytes -= size
        return packed

    def hold_quantized_weights(self, tensor_types: dict[str, int]) -> set[str]:
        """Switches each projection, the LM head and the embedding to hold its checkpoint tensors'
        GGUF blocks where the quantized ops run their types; tensor_types maps checkpoint names
        (without "model.") to GGML type ids. The parts of a merged projection that share one type
        share one weight; parts of different types (a Q4_K_M file's v in Q6_K beside q and k in
        Q4_K) keep a weight each (MergedLinear.hold_quantized_parts). Returns the names the
        checkpoint must then give as raw blocks (uint8 [rows, row bytes]); the others load as
        floats. Granite's o_proj and down_proj stay float: their residual_multiplier is folded
        into the weights."""
        raw = set()
        folded = ("o_proj", "down_proj") if self.config.residual_multiplier != 1.0 else ()
        for module_name, module in list(self.named_modules()):
            if not isinstance(module, (Linear, LMHead, VocabEmbedding)):
                continue
            parent, _, leaf = module_name.rpartition(".")
            names = [f"{module_name}.weight"]
            if leaf in _MERGED_PARTS and names[0] not in tensor_types:
                names = [f"{parent}.{part}.weight" for part in _MERGED_PARTS[leaf]]
            types = [tensor_types.get(name) for name in names]
            if leaf in folded or None in types:
                continue
            if len(set(types)) == 1:
                held = module.hold_quantized(types[0])
            else:
                held = isinstance(module, MergedLinear) and module.hold_quantized_parts(types)
            if held:
                raw.update(names)
        return raw

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors, named as in Hugging Face checkpoints, into the parameters
        (converting dtype); q/k/v and gate/up go into their slices of the merged weights. Raises
        ValueError for an unknown name, a wrong shape, or a parameter the checkpoint lacks."""
        merged_parts = {part: (merged, i) for merged, parts in _MERGED_PARTS.items() for i, part in enumerate(parts)}
        expected = {name for name, _ in self.named_parameters()}
        loaded = set()
        modules = dict(self.named_modules())
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module_name, _, kind = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            with torch.no_grad():
                if leaf in merged_parts:
                    merged_name, part = merged_parts[leaf]
                    target = f"{parent}.{merged_name}"
                    merged = self._module(modules, target, name)
                    merged.load_part(part, tensor if kind == "weight" else None, tensor if kind == "bias" else None)
                    loaded.add(f"{target}.{kind}:{part}")
                    if kind == "weight" and merged.quantized_parts is not None:
                        loaded.add(f"{target}.quantized_parts.{part}.weight")
                else:
                    parameter = getattr(self._module(modules, module_name, name), kind, None)
                    if not isinstance(parameter, nn.Parameter):
                        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
                    shard = getattr(modules[module_name], "checkpoint_shard", None)
                    copy_checked(parameter, tensor if shard is None else shard(kind, tensor),
                                 f"checkpoint tensor {name!r}")
                    loaded.add(name)
                    module = modules[module_name]
                    if isinstance(module, MergedLinear):  # stored fused (Phi-3's qkv_proj, gate_up_proj)
                        loaded.update(f"{name}:{part}" for part in range(len(module.part_sizes)))
        missing = []
        for name in sorted(expected):
            module_name = name.rpartition(".")[0]
            module = modules[module_name]
            if isinstance(module, MergedLinear):
                parts = len(module.part_sizes)
                if any(f"{name}:{p}" not in loaded for p in range(parts)):
                    missing.append(name)
            elif name not in loaded:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint lacks weights for {len(missing)} parameter(s) of the model: {shown}")
        self._fold_residual_multiplier()

    def _fold_residual_multiplier(self) -> None:
        """Granite scales each sublayer's output by residual_multiplier before the residual add:
        that is o_proj and down_proj with their weights and biases scaled, at no cost per token."""
        factor = self.config.residual_multiplier
        if factor == 1.0:
            return
        with torch.no_grad():
            for layer in self.layers:
                for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    projection.weight.mul_(factor)
                    if projection.bias is not None:
                        projection.bias.mul_(factor)

    @staticmethod
    def _module(modules: dict, module_name: str, checkpoint_name: str) -> nn.Module:
        if module_name not in modules:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no module of the model")
        return modules[module_name]
