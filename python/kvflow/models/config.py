"""The model's shape, read from a Hugging Face config.json or from GGUF metadata."""

from dataclasses import dataclass, field

import torch

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the paged attention kernels' compiled sizes


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
    attention_bias: bool = False   # biases on q, k, v (Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

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

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """From a Hugging Face config.json dict."""
        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("config.json names no architecture ('architectures' is missing or empty)")
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        rope_scaling = config.get("rope_scaling")
        rope_theta = config.get("rope_theta")
        parameters = config.get("rope_parameters")  # transformers >= 5 folds theta and scaling into this
        if parameters:
            rope_theta = parameters.get("rope_theta", rope_theta)
            if parameters.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        eos = config.get("eos_token_id")
        sliding_window = config.get("sliding_window")
        if config.get("use_sliding_window") is False:  # Qwen2 carries a window it does not use
            sliding_window = None
        return cls(
            architecture=architectures[0],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            attention_bias=config.get("attention_bias", architectures[0].startswith("Qwen2")),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            sliding_window=sliding_window,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
        )
