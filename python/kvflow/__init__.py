"""kvflow: an LLM inference engine built as a C++/CUDA PyTorch extension.

Importing kvflow loads kvflow._C, which registers the ops under torch.ops.kvflow.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links against it)

from kvflow import _C  # noqa: F401
from kvflow import ops
from kvflow._C import BlockAllocator, OutOfBlocksError
from kvflow.attention_metadata import AttentionMetadata

__version__ = "0.1.0"

__all__ = ["AttentionMetadata", "BlockAllocator", "OutOfBlocksError", "ops", "__version__"]
