"""The Llama family: Llama 2/3/3.x (attention and MLP biases, GELU where the config says so),
Mistral, Qwen2/2.5 (q/k/v biases, a window on the upper layers), SmolLM/SmolLM2 (tied
embeddings). One forward pass takes the new tokens of many requests flattened into one row each,
with no padding; the attention metadata says which request each row belongs to."""

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.attention_metadata import AttentionMetadata
from kvflow.layers import (GateUpLinear, LMHead, Linear, MergedLinear, PagedAttention, RMSNorm, RotaryEmbedding,
                           VocabEmbedding)
from kvflow.layers.linear import copy_checked
from kvflow.models.config import ModelConfig
from kvflow.ops.linear import SMALL_LINEAR_MAX_ROWS

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, sliding_window: int | None):
        super().__init__()
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     bias=config.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype)
        self.rotary = rotary
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                   scale=config.head_dim ** -0.5, sliding_window=sliding_window)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self.rotary(metadata.positions, query, key)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                                         hidden_act=config.hidden_act, dtype=dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.activated(hidden))

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, rotary, dtype, config.sliding_window_of(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(config, dtype)
        # Whether llama_decoder_layer computes this layer: SiLU, and no bias on o_proj or the MLP.
        self.fusable = (self.mlp.gate_up_proj.plain_silu and self.mlp.down_proj.bias is None
                        and self.self_attn.o_proj.bias is None)
        self._fused_cpu_args: tuple | None = None  # see fused_cpu_args

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += hidden, then the layer; returns (its output, the residual stream)."""
        if hidden.is_cpu and self.fusable:
            args = self._fused_cpu_args or self.fused_cpu_args()
            if hidden.shape[0] <= SMALL_LINEAR_MAX_ROWS or args[-1] is not None:
                return self.forward_fused_cpu(hidden, residual, kv_cache, metadata)
        return self.forward_op_by_op(hidden, residual, kv_cache, metadata)

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path

    def forward_op_by_op(self, hidden, residual, kv_cache, metadata):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_fused_cpu(self, hidden, residual, kv_cache, metadata):
        """The same kernels in the same order as forward_op_by_op, called from C++ in one op
        (kvflow::llama_decoder_layer): at decode, per-op dispatch would otherwise cost more than
        several layers' attention. A few rows read the plain weights (small_linear), more read
        the packed ones. Writes the output into hidden."""
        (input_norm, qkv, qkv_bias, o_proj, post_norm, gate_up, down, cos_sin_cache, num_heads, num_kv_heads, eps,
         scale, sliding_window, packed) = self._fused_cpu_args or self.fused_cpu_args()
        if packed is not None and hidden.shape[0] > SMALL_LINEAR_MAX_ROWS:
            qkv_packed, o_packed, gate_up_packed, down_packed = (p.data for p in packed)
        else:
            qkv_packed = o_packed = gate_up_packed = down_packed = None
        torch.ops.kvflow.llama_decoder_layer(
            hidden, residual, metadata.positions, input_norm, qkv, qkv_bias, o_proj, post_norm, gate_up, down,
            cos_sin_cache, kv_cache[0], kv_cache[1], metadata.slot_mapping, metadata.block_tables,
            metadata.cu_seqlens_q, metadata.seq_lens, num_heads, num_kv_heads, eps, scale, metadata.max_query_len,
            metadata.max_seq_len, sliding_window, qkv_packed, o_packed, gate_up_packed, down_packed)
        return hidden, residual

    def fused_cpu_args(self) -> tuple:
        """The layer's weights and constants for llama_decoder_layer, gathered once: looking them
        up through nn.Module attributes on every call cost about 25 us a layer, some 0.8 ms of a
        10 ms batch-1 decode step. Last, the PackedWeights of its four projections where all four are
        packed (their .data read per call, so that moving them stays visible), else
        None. Dropped whenever the module's tensors are replaced (_apply) or repacked."""
        attn, mlp = self.self_attn, self.mlp
        packed = (attn.qkv_proj.packed_weight, attn.o_proj.packed_weight, mlp.gate_up_proj.packed_weight,
                  mlp.down_proj.packed_weight)
        native = all(p is not None for p in packed) and packed[2].gate_up
        self._fused_cpu_args = (
            self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            self.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            attn.rotary.cos_sin_cache, attn.attn.num_heads, attn.attn.num_kv_heads, self.input_layernorm.eps,
            attn.attn.scale, attn.attn.sliding_window, packed if native else None)
        return self._fused_cpu_args

    def _apply(self, fn, *args, **kwargs):
        self._fused_cpu_args = None  # .to() and friends may put new tensors in the buffers
        return super()._apply(fn, *args, **kwargs)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config
        self.dtype = dtype
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling, config.rope_freq_factors)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, dtype, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                              tied_to=self.embed_tokens if config.tie_word_embeddings else None)
        self._fused_cpu_stack: tuple | None = None  # see fused_cpu_stack_args

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids [num_tokens] int64 -> final hidden states [num_tokens, hidden_size]."""
        residual = self.embed_tokens(input_ids)
        hidden = torch.zeros_like(residual)  # each layer begins with residual += hidden: the first adds nothing
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model of {len(self.layers)} layers")
        if not (hidden.is_cpu and self.forward_fused_cpu(hidden, residual, metadata, kv_caches)):
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_fused_cpu(self, hidden: torch.Tensor, residual: torch.Tensor, metadata: AttentionMetadata,
                          kv_caches: list[KVCache]) -> bool:
        """Every layer in one kvflow::llama_decoder_layers call, the result bit for bit that of
        the layers' own fused calls; at batch-1 decode those 30 calls cost some 0.6 ms of a 7-9 ms
        step. Returns False, having done nothing, where the layers cannot all take the fused path
        with these rows (many rows without every layer's packed weights)."""
        stack = self.fused_cpu_stack_args()
        if stack is None:
            return False
        (input_norms, qkvs, qkv_biases, o_projs, post_norms, gate_ups, downs, cos_sin_cache, num_heads, num_kv_heads,
         eps, scale, sliding_window, packed) = stack
        packed_lists = ((), (), (), ())
        if hidden.shape[0] > SMALL_LINEAR_MAX_ROWS:
            if packed is None:
                return False
            packed_lists = tuple([p.data for p in weights] for weights in packed)
        torch.ops.kvflow.llama_decoder_layers(
            hidden, residual, metadata.positions, input_norms, qkvs, qkv_biases, o_projs, post_norms, gate_ups, downs,
            cos_sin_cache, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], metadata.slot_mapping,
            metadata.block_tables, metadata.cu_seqlens_q, metadata.seq_lens, num_heads, num_kv_heads, eps, scale,
            metadata.max_query_len, metadata.max_seq_len, sliding_window, *packed_lists)
        return True

    def fused_cpu_stack_args(self) -> tuple | None:
        """The layers' fused_cpu_args regrouped for llama_decoder_layers: one list per weight,
        the shared constants once, and the packed weights as four lists of PackedWeights (None
        unless every layer has them). Rebuilt whenever a layer has regathered its own arguments;
        None if the layers' constants differ (then each layer runs on its own)."""
        layer_args = [layer._fused_cpu_args or layer.fused_cpu_args() for layer in self.layers]
        cached = self._fused_cpu_stack
        if cached is not None and all(a is b for a, b in zip(cached[0], layer_args)):
            return cached[1]
        constants = layer_args[0][7:13]  # cos_sin_cache, heads, kv heads, eps, scale, sliding window
        if not all(layer.fusable for layer in self.layers) or any(
                args[7] is not constants[0] or args[8:13] != constants[1:] for args in layer_args):
            stack = None
        else:
            weights = tuple(list(column) for column in zip(*(args[:7] for args in layer_args)))
            packed = None
            if all(args[13] is not None for args in layer_args):
                packed = tuple(list(column) for column in zip(*(args[13] for args in layer_args)))
            stack = (*weights, *constants, packed)
        self._fused_cpu_stack = (layer_args, stack)
        return stack

    def _apply(self, fn, *args, **kwargs):
        self._fused_cpu_stack = None  # holds the layers' old tensors until the next forward otherwise
        return super()._apply(fn, *args, **kwargs)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden_size] (only the rows to sample) -> float32 logits [rows, vocab_size]."""
        return self.lm_head(hidden)

    def prepack_linear_weights(self) -> int:
        """Packed copies of the projection weights for many-row products on the CPU (see
        Linear.prepack); returns how many were packed."""
        packed = sum(module.prepack() for module in self.modules() if isinstance(module, (Linear, LMHead)))
        for layer in self.layers:
            layer._fused_cpu_args = None  # gathered again, with the new packed weights
        return packed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors, named as in Hugging Face checkpoints, into the parameters
        (converting dtype); q/k/v and gate/up go into their slices of the merged weights. Raises
        ValueError for an unknown name, a wrong shape, or a parameter the checkpoint lacks."""
        merged_parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
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
                    self._module(modules, target, name).load_part(
                        part, tensor if kind == "weight" else None, tensor if kind == "bias" else None)
                    loaded.add(f"{target}.{kind}:{part}")
                else:
                    parameter = getattr(self._module(modules, module_name, name), kind, None)
                    if not isinstance(parameter, nn.Parameter):
                        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
                    copy_checked(parameter, tensor, f"checkpoint tensor {name!r}")
                    loaded.add(name)
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

    @staticmethod
    def _module(modules: dict, module_name: str, checkpoint_name: str) -> nn.Module:
        if module_name not in modules:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no module of the model")
        return modules[module_name]
