"""Token embedding and the LM head (which may share the embedding's weight)."""

import torch
from torch import nn

from kvflow.layers.linear import PackedWeight, interleaved_parameter, quantized_parameter, release_plain_weight
from kvflow.layers.tensor_parallel import SINGLE_RANK, TensorParallel
from kvflow.ops.linear import takes_small_linear


class VocabEmbedding(nn.Module):
    """scale: every embedding times this (Gemma's sqrt(hidden_size), Granite's embedding_multiplier).
    After hold_quantized, the table stays in a GGUF file's blocks and each looked-up row is
    dequantized on the way out (quantized_embedding)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None, scale: float = 1.0,
                 parallel: TensorParallel = SINGLE_RANK):
        """parallel: over several ranks each holds its rows of the vocabulary (parallel.vocab), and
        a token's embedding comes from the rank that holds it, summed over the ranks."""
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.parallel = parallel
        self.shard = parallel.vocab(vocab_size)
        padded = self.shard.held < self.shard.size  # the last rank's table: zero rows past the vocabulary
        self.weight = nn.Parameter((torch.zeros if padded else torch.empty)(self.shard.size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.scale = float(scale)
        self.ggml_type: int | None = None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [num_tokens] int64 -> [num_tokens, hidden_size]."""
        if self.parallel.size == 1:
            return self._lookup(token_ids)
        local = token_ids - self.shard.start
        held = (local >= 0) & (local < self.shard.held)
        out = self._lookup(torch.where(held, local, 0))
        out.mul_(held.unsqueeze(1).to(out.dtype))
        return self.parallel.all_reduce_(out)

    def checkpoint_shard(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's table, padded with zero rows to the shard's size."""
        shard = self.shard
        if shard.size == shard.total:
            return tensor
        if tensor.shape[0] != shard.total:
            raise ValueError(f"checkpoint table has {tensor.shape[0]} rows, the model's vocabulary {shard.total}")
        rows = tensor.narrow(0, shard.start, shard.held)
        if rows.shape[0] == shard.size:
            return rows
        return torch.cat([rows, rows.new_zeros((shard.size - rows.shape[0], *rows.shape[1:]))])

    def _lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ggml_type is not None:
            out = torch.empty((token_ids.shape[0], self.hidden_size), dtype=self.dtype, device=self.weight.device)
            torch.ops.kvflow.quantized_embedding(out, token_ids, self.weight, self.ggml_type, self.scale)
            return out
        out = self.weight.new_empty((token_ids.shape[0], self.weight.shape[1]))
        torch.ops.kvflow.embedding(out, token_ids, self.weight, self.scale)
        return out

    def hold_quantized(self, ggml_type: int) -> bool:
        """As Linear.hold_quantized, for the table (and an LM head tied to it)."""
        parameter = quantized_parameter(self.weight, ggml_type)
        if parameter is None:
            return False
        self.weight, self.ggml_type = parameter, ggml_type
        return True

    def interleave_rows(self) -> bool:
        """As Linear.interleave_rows, for the table (and an LM head tied to it): the lookup
        gathers a row's blocks, the LM head's product multiplies 8 rows at once."""
        parameter = interleaved_parameter(self.weight, self.ggml_type)
        if parameter is None:
            return False
        self.weight, self.ggml_type = parameter
        return True

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path


class LMHead(nn.Module):
    """hidden [rows, hidden_size] -> float32 logits [rows, vocab_size]. On the CPU the logits come
    straight from the products' float32 accumulators (packed_linear after prepack, small_linear
    up to SMALL_LINEAR_MAX_ROWS rows otherwise), without a round trip through a bfloat16 that
    would tie tokens within 0.125 of each other. A weight in GGUF blocks (its own, or the tied
    embedding's) goes to quantized_linear at any row count."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied_to: VocabEmbedding | None = None, parallel: TensorParallel = SINGLE_RANK):
        """parallel: over several ranks each computes the logits of its rows of the vocabulary
        (as VocabEmbedding holds them), gathered into the whole row on every rank."""
        super().__init__()
        self.tied_to = tied_to
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.shard = parallel.vocab(vocab_size)
        self.packed_weight: PackedWeight | None = None  # as Linear.packed_weight
        self.own_ggml_type: int | None = None  # see hold_quantized()
        if tied_to is None:
            padded = self.shard.held < self.shard.size
            self.weight = nn.Parameter((torch.zeros if padded else torch.empty)(self.shard.size, hidden_size,
                                                                                dtype=dtype), requires_grad=False)

    checkpoint_shard = VocabEmbedding.checkpoint_shard

    @property
    def ggml_type(self) -> int | None:
        """The GGML type of the weight's blocks, or None for a float weight."""
        return self.tied_to.ggml_type if self.tied_to is not None else self.own_ggml_type

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return self._local_logits(hidden)
        logits = self.parallel.all_gather(self._local_logits(hidden))
        return logits if logits.shape[1] == self.vocab_size else logits[:, :self.vocab_size].contiguous()

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        rows = hidden.shape[0]
        ggml_type = self.ggml_type
        if ggml_type is not None:
            logits = torch.empty((rows, weight.shape[0]), dtype=torch.float32, device=weight.device)
            torch.ops.kvflow.quantized_linear(logits, hidden, weight, ggml_type, None)
            return logits
        if self.packed_weight is not None:
            return self.packed_weight.matmul(hidden, out_dtype=torch.float32)
        if hidden.is_cpu and takes_small_linear(rows):
            logits = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
            torch.ops.kvflow.small_linear(logits, hidden, weight, None)
            return logits
        return torch.nn.functional.linear(hidden, weight).float()

    def prepack(self) -> bool:
        """As Linear.prepack. A head tied to the embedding packs a copy of its table and leaves
        the table whole, since the embedding's lookups read its plain rows: the one weight that
        then takes its memory twice."""
        if self.ggml_type is not None:
            return False
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        self.packed_weight = PackedWeight.of(weight)
        if self.packed_weight is None:
            return False
        if self.tied_to is None:
            release_plain_weight(self)
        return True

    def hold_quantized(self, ggml_type: int) -> bool:
        """As Linear.hold_quantized, for an untied weight (a tied one follows the embedding's)."""
        parameter = None if self.tied_to is not None else quantized_parameter(self.weight, ggml_type)
        if parameter is None:
            return False
        self.weight, self.own_ggml_type = parameter, ggml_type
        return True

    def interleave_rows(self) -> bool:
        """As Linear.interleave_rows, for an untied weight (a tied one follows the embedding's)."""
        parameter = None if self.tied_to is not None else interleaved_parameter(self.weight, self.own_ggml_type)
        if parameter is None:
            return False
        self.weight, self.own_ggml_type = parameter
        return True

    __call__ = forward  # see kvflow.layers: no nn.Module hooks on the per-token path