"""kvflow: an LLM inference engine built as a C++/CUDA PyTorch extension.

Importing kvflow loads kvflow._C, which registers the ops under torch.ops.kvflow.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links against it)

from kvflow import _C  # noqa: F401
from kvflow import ops
from kvflow._C import BlockAllocator, OutOfBlocksError
from kvflow.attention_metadata import AttentionMetadata

__version__ = "0.1.0"

__all__ = ["LLM", "AttentionMetadata", "BlockAllocator", "OutOfBlocksError", "SamplingParams", "StructuredOutputsParams",
           "ops", "__version__"]


def __getattr__(name):
    # The engine pulls in the model loader and tokenizers; load them only when asked for.
    if name == "LLM":
        from kvflow.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from kvflow.engine import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
