"""The model's shape, read from a Hugging Face config.json or from GGUF metadata."""

from dataclasses import dataclass, field, replace

import torch

from kvflow.layers.activation import GATED_ACTIVATION_OPS
from kvflow.layers.tensor_parallel import SINGLE_RANK, TensorParallel
from kvflow.ops.rope import SUPPORTED_ROPE_SCALING

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)  # the paged attention kernels' compiled sizes


@dataclass
class ModelConfig:
    architecture: str            # registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_freq_factors: torch.Tensor | None = None  # GGUF's rope_freqs: inv_freq divisors (Llama 3 scaling)
    rotary_dim: int | None = None  # the leading features of each head that rotate (partial_rotary_factor); None: all
    attention_bias: bool = False   # biases on q, k, v (Qwen2, Llama's attention_bias)
    o_proj_bias: bool = False      # a bias on o_proj too (Llama's attention_bias)
    mlp_bias: bool = False         # biases on gate, up and down (Llama's mlp_bias)
    hidden_act: str = "silu"       # the MLP's gated activation, by Hugging Face's name
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Each layer's window where they differ (Qwen2's max_window_layers, HF's layer_types): an int
    # or None per layer. None here means `sliding_window` on every layer.
    layer_sliding_windows: list[int | None] | None = None
    # Whether each layer rotates q and k (SmolLM3's no_rope_layers: 1 = rope, 0 = none). None: all do.
    layer_uses_rope: list[bool] | None = None
    attention_scale: float | None = None  # q.k multiplier; None: head_dim ** -0.5 (Granite's attention_multiplier)
    embedding_multiplier: float = 1.0     # embeddings times this (Granite)
    residual_multiplier: float = 1.0      # each sublayer's output times this before the residual add (Granite)
    logits_scaling: float = 1.0           # logits divided by this (Granite)
    attention_logit_soft_cap: float | None = None  # cap * tanh(x / cap) on attention logits (Gemma 2)
    final_logit_soft_cap: float | None = None      # cap * tanh(x / cap) on the output logits (Gemma 2 and 3)
    # Gemma 3's second rotation: the layers with a window rotate with this base and no scaling, the
    # others with rope_theta and rope_scaling. None: every layer rotates with rope_theta.
    local_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    parallel: TensorParallel = SINGLE_RANK  # this rank's cut of the model (see with_tensor_parallel)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"model config: head_dim {self.head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"model config: rotary_dim {self.rotary_dim} must be even and within head_dim "
                             f"{self.head_dim} (partial_rotary_factor)")
        if self.layer_sliding_windows is not None and len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(f"model config: {len(self.layer_sliding_windows)} layer windows for "
                             f"{self.num_layers} layers")
        if not self.logits_scaling:
            raise ValueError("model config: logits_scaling must be nonzero (the logits are divided by it)")
        if self.layer_uses_rope is not None and len(self.layer_uses_rope) != self.num_layers:
            raise ValueError(f"model config: no_rope_layers has {len(self.layer_uses_rope)} entries for "
                             f"{self.num_layers} layers")
        for name in ("attention_logit_soft_cap", "final_logit_soft_cap"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive or None, got {getattr(self, name)}")

    def with_context(self, max_model_len: int | None) -> "ModelConfig":
        """This config for an engine that serves at most max_model_len tokens a sequence: the rope
        table covers that context (and LongRoPE picks its short factors when it fits the original
        one); None or more than the model's context keeps the model's."""
        if max_model_len is None or max_model_len >= self.max_position_embeddings:
            return self
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        return replace(self, max_position_embeddings=max_model_len)

    def with_tensor_parallel(self, parallel: TensorParallel) -> "ModelConfig":
        """This config for one rank of parallel.size: a ValueError naming the count when the
        ranks cannot share the attention heads, the KV heads (fewer KV heads than ranks are
        replicated when the ranks divide evenly among them) or the MLP's features."""
        if parallel.size > 1:
            parallel.split(self.num_heads, "num_attention_heads")
            parallel.kv_heads(self.num_kv_heads)
            parallel.split(self.intermediate_size, "intermediate_size")
        return replace(self, parallel=parallel)

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads this rank's cache holds."""
        return self.parallel.kv_heads(self.num_kv_heads).size

    def sliding_window_of(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: the whole context)."""
        if self.layer_sliding_windows is not None:
            return self.layer_sliding_windows[layer]
        return self.sliding_window

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates its queries and keys."""
        return self.layer_uses_rope is None or self.layer_uses_rope[layer]

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with local_rope_theta (Gemma 3's layers with a window)."""
        return self.local_rope_theta is not None and self.sliding_window_of(layer) is not None

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """From a Hugging Face config.json dict."""
        from kvflow.models.registry import MODEL_CLASSES  # the registry imports the models, which import this

        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("config.json names no architecture ('architectures' is missing or empty)")
        architecture = architectures[0]
        if architecture not in MODEL_CLASSES:  # before any field is read as this family's
            raise ValueError(f"unsupported model architecture {architecture!r} "
                             f"(supported: {', '.join(MODEL_CLASSES)})")
        if architecture == "GemmaForCausalLM":
            config = gemma_legacy_activation(config)
        if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            config = gemma2_and_3_defaults(config, architecture)
        reject_unsupported_fields(config)
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        rope_scaling = config.get("rope_scaling")
        rope_theta = config.get("rope_theta")
        parameters = config.get("rope_parameters")  # transformers >= 5 folds theta and scaling into this
        local_rope_theta = config.get("rope_local_base_freq")  # Gemma 3's windowed layers, before transformers 5
        if parameters and "full_attention" in parameters:  # one entry per layer type (Gemma 3)
            local = parameters.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"model config: rope scaling on the sliding-window layers "
                                 f"(rope_parameters.sliding_attention: {local}) is not supported")
            local_rope_theta = local.get("rope_theta", local_rope_theta)
            parameters = parameters["full_attention"]
        if parameters:
            rope_theta = parameters.get("rope_theta", rope_theta)
            if parameters.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in SUPPORTED_ROPE_SCALING:
                raise ValueError(f"model config: unsupported rope_scaling type {kind!r} "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
        max_position = config.get("max_position_embeddings", 4096)
        partial_rotary = (parameters or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        rotary_dim = None if partial_rotary == 1.0 else int(head_dim * partial_rotary)
        kind = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind == "longrope":
            # Its original context is its own field or the config's; its attention factor follows
            # the released context over that one unless the config gives a factor (transformers' rule).
            original = (rope_scaling.get("original_max_position_embeddings")
                        or config.get("original_max_position_embeddings") or max_position)
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": original,
                            "factor": rope_scaling.get("factor") or max_position / original}
        if kind in ("yarn", "dynamic"):
            if not rope_scaling.get("factor"):
                raise ValueError(f"model config: {kind} rope scaling needs a 'factor'")
            # YaRN's original context is its own field (max_position_embeddings when absent);
            # dynamic NTK's is max_position_embeddings (transformers' rule). The table covers the
            # scaled context, as vLLM sizes it: the original one times factor.
            original = rope_scaling.get("original_max_position_embeddings") if kind == "yarn" else None
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": original or max_position}
            max_position = max(max_position, int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"]))
        eos = config.get("eos_token_id")
        sliding_window = config.get("sliding_window")
        if config.get("use_sliding_window") is False:  # Qwen2 carries a window it does not use
            sliding_window = None
        layer_windows = None
        layer_types = config.get("layer_types")
        if layer_types is not None and set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"model config: layer_types {sorted(set(layer_types))} are not supported "
                             f"(supported: sliding_attention, full_attention)")
        if sliding_window is not None and layer_types is not None:
            layer_windows = [sliding_window if kind == "sliding_attention" else None for kind in layer_types]
        elif sliding_window is not None and architecture.startswith("Qwen2"):
            # Qwen2 windows only the layers from max_window_layers up (transformers' own rule).
            first = config.get("max_window_layers", config["num_hidden_layers"])
            layer_windows = [sliding_window if i >= first else None for i in range(config["num_hidden_layers"])]
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim,
            attention_bias=config.get("attention_bias", architecture.startswith("Qwen2")),
            o_proj_bias=bool(config.get("attention_bias")) and not architecture.startswith("Qwen2"),
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=config.get("hidden_act", "silu"),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            sliding_window=sliding_window,
            layer_sliding_windows=layer_windows,
            layer_uses_rope=None if config.get("no_rope_layers") is None else [bool(x) for x in config["no_rope_layers"]],
            attention_scale=(config["query_pre_attn_scalar"] ** -0.5 if config.get("query_pre_attn_scalar")
                             else config.get("attention_multiplier")),
            embedding_multiplier=config.get("embedding_multiplier", 1.0),
            residual_multiplier=config.get("residual_multiplier", 1.0),
            logits_scaling=config.get("logits_scaling", 1.0),
            attention_logit_soft_cap=config.get("attn_logit_softcapping"),
            final_logit_soft_cap=config.get("final_logit_softcapping"),
            local_rope_theta=local_rope_theta,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
        )


def gemma_legacy_activation(config: dict) -> dict:
    """Gemma's released configs say hidden_act "gelu" and mean the tanh approximation
    (transformers converts it the same way)."""
    config = dict(config)
    for key in ("hidden_act", "hidden_activation"):
        if config.get(key) == "gelu":
            config[key] = "gelu_pytorch_tanh"
    return config


def gemma2_and_3_defaults(config: dict, architecture: str) -> dict:
    """What transformers assumes where a Gemma 2 or 3 config.json is silent: the MLP's activation
    is hidden_activation (hidden_act is not read); configs saved before layer_types window every
    other layer (Gemma 2, from the first) or all but every sliding_window_pattern-th (Gemma 3);
    Gemma 2 caps its logits at 50 (attention) and 30 (output); Gemma 3 rotates with base 1e6 on
    its full-attention layers and 1e4 on its windowed ones."""
    config = dict(config)
    config["hidden_act"] = config.get("hidden_activation") or "gelu_pytorch_tanh"
    config["hidden_activation"] = config["hidden_act"]
    config.setdefault("query_pre_attn_scalar", 256)
    config.setdefault("sliding_window", 4096)
    layers = config["num_hidden_layers"]
    gemma3 = architecture == "Gemma3ForCausalLM"
    if config.get("layer_types") is None:
        pattern = config.get("sliding_window_pattern", 6) if gemma3 else 2
        config["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(layers)]
    if gemma3:
        config.setdefault("rope_theta", 1_000_000.0)
        config.setdefault("rope_local_base_freq", 10_000.0)
        if config.get("attn_logit_softcapping") is not None:  # Gemma 3 replaced it with QK-norm
            raise ValueError(f"model config: attn_logit_softcapping ({config['attn_logit_softcapping']}) is not "
                             f"supported for Gemma 3 (transformers does not apply it to Gemma 3 either)")
        if config["sliding_window"] is None:  # its local rope base would then have no layers to go to
            raise ValueError("model config: Gemma 3 needs a sliding_window")
    else:
        config.setdefault("attn_logit_softcapping", 50.0)
        config.setdefault("final_logit_softcapping", 30.0)
    return config


def reject_unsupported_fields(config: dict) -> None:
    """A clear error for each config field that would change the math in a way this graph does
    not implement, rather than a model that runs and answers wrongly."""
    act = config.get("hidden_act", "silu")
    if act not in GATED_ACTIVATION_OPS:
        raise ValueError(f"model config: hidden_act {act!r} is not supported "
                         f"(supported: {', '.join(GATED_ACTIVATION_OPS)})")
    if config.get("hidden_activation") not in (None, act):
        raise ValueError(f"model config: hidden_activation {config['hidden_activation']!r} differs from "
                         f"hidden_act {act!r}")
    if config.get("use_bidirectional_attention"):
        raise ValueError("model config: use_bidirectional_attention is not supported (attention is causal)")
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
        raise ValueError(f"model config: quantization_config (quant_method {method!r}) is not supported: kvflow "
                         "loads Hugging Face checkpoints in float32, float16 or bfloat16, and GGUF files")
