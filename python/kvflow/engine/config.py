"""One engine configuration for every entry point (offline API, CLI, server), with vLLM's names."""

from dataclasses import dataclass

import torch

from kvflow import platform
from kvflow.engine.speculative_config import SpeculativeConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
CPU_KV_CACHE_MEMORY = 1 << 30  # the CPU default when kv_cache_memory is not given


@dataclass
class EngineConfig:
    model: str | None = None              # GGUF file, HF directory, or None for the embedded default
    dtype: str | None = None              # None: bfloat16, or what kvflow.platform says fits this CPU best
    device: str = "cpu"
    max_model_len: int | None = None      # default: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None    # bytes of KV cache; None: 1 GiB on the CPU, and on CUDA what
                                          # gpu_memory_utilization leaves after weights and activations
    gpu_memory_utilization: float = 0.9   # CUDA: the share of the GPU's memory the engine may use
    enforce_eager: bool = False           # decode steps op by op: no CUDA graphs, no CPU programs
    block_size: int = 16
    enable_prefix_caching: bool = True
    threads: int | None = None            # CPU threads (default: torch's)
    seed: int = 0                         # seeds requests that bring none
    cpu_prepack_weights: bool = True      # bf16 on CPU: each projection's weight reordered at load into
                                          # packed_linear's panels, in place of the plain one (faster prefill
                                          # and large batches; a tied LM head's copy stays beside the table)
    dequantize_weights: bool = False      # a GGUF file's quantized weights in dtype instead of their
                                          # blocks (types kvflow has no kernels for are dequantized always)
    speculative_config: SpeculativeConfig | dict | str | None = None  # vLLM's spelling; see speculative_config.py
    tensor_parallel_size: int = 1         # ranks the model is split over (torchrun's, or spawned here)
    tensor_parallel_timeout: float = 60.0 # seconds a rank waits for the others inside a step before
                                          # the step fails and the engine stops (a rank died or hangs)
    batch_invariant: bool = False         # CPU: each row's logits bit-equal at any batch size, slower
                                          # (process-wide: kvflow.platform.set_batch_invariant)
    num_scheduler_steps: int = 1          # CPU: decode steps run back to back per schedule while every
                                          # request decodes and none waits (vLLM's multi-step); outputs
                                          # then come that many tokens at a time

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.dtype is None:
            self.dtype = "bfloat16" if self.on_cuda else platform.current().default_cpu_dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16 (the CPU attention kernel's), got {self.block_size}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be positive seconds, got {self.tensor_parallel_timeout}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int) \
                or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be a positive integer, got {self.num_scheduler_steps!r}")

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
