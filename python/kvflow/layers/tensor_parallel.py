"""How one rank's model is cut from the whole (Megatron-style tensor parallelism): which heads,
features and vocabulary rows it holds, and the collectives that put the partial results back
together. The layers read it from ModelConfig.parallel; the engine makes the communicator
(kvflow.engine.distributed)."""

from dataclasses import dataclass
from typing import Protocol

import torch


class Communicator(Protocol):
    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sums the tensor over the ranks, in place."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors [rows, n] side by side: [rows, ranks * n]."""


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a dimension of `total`."""
    start: int
    size: int
    total: int

    @property
    def held(self) -> int:
        """The shard's rows within the total (fewer than size where a last shard is padded)."""
        return min(self.size, self.total - self.start)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    communicator: Communicator | None = None

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of {self.size} ranks")
        if self.size > 1 and self.communicator is None:
            raise ValueError("tensor parallelism over several ranks needs a communicator")

    def split(self, total: int, what: str) -> Shard:
        """This rank's equal share of `total` (heads, features); a ValueError naming `what` when
        the ranks cannot share it equally."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        size = total // self.size
        return Shard(self.rank * size, size, total)

    def kv_heads(self, num_kv_heads: int) -> Shard:
        """This rank's KV heads: an equal share, or, with fewer KV heads than ranks, the one head
        its query heads read (replicated on size / num_kv_heads ranks, as vLLM does)."""
        if num_kv_heads >= self.size or self.size % num_kv_heads:
            return self.split(num_kv_heads, "num_key_value_heads")
        return Shard(self.rank * num_kv_heads // self.size, 1, num_kv_heads)

    def vocab(self, vocab_size: int) -> Shard:
        """This rank's rows of the vocabulary: ceil(vocab_size / size) each (the last rank's table
        padded with zero rows)."""
        size = -(-vocab_size // self.size)
        start = min(self.rank * size, vocab_size)
        return Shard(start, size, vocab_size)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.communicator.all_reduce_(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.size == 1 else self.communicator.all_gather(tensor)


SINGLE_RANK = TensorParallel()
