"""The per-step attention metadata: built once per engine step from the scheduled requests,
validated on the host, then shared read-only by every layer of the model."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor      # [num_tokens] int64: position of each new token in its request
    slot_mapping: torch.Tensor   # [num_tokens] int64: cache slot (block * block_size + offset), -1 = skip
    block_tables: torch.Tensor   # [batch, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor   # [batch + 1] int32: new tokens of request b are [cu[b], cu[b + 1])
    seq_lens: torch.Tensor       # [batch] int32: context length of each request, new tokens included
    max_query_len: int
    max_seq_len: int
    workspace: torch.Tensor | None = None  # float32 scratch for split-KV attention

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        """The same metadata with its tensors on `device` (itself if they are there already)."""
        if self.positions.device == torch.device(device):
            return self

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return AttentionMetadata(move(self.positions), move(self.slot_mapping), move(self.block_tables),
                                 move(self.cu_seqlens_q), move(self.seq_lens), self.max_query_len, self.max_seq_len,
                                 self.workspace)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        workspace: torch.Tensor | None = None,
        num_blocks: int | None = None,
    ) -> "AttentionMetadata":
        """From per-request new-token counts, context lengths (new tokens included) and block
        tables (see HostMetadata.of, which checks them), as tensors on `device`."""
        return HostMetadata.of(query_lens, seq_lens, block_tables, block_size, num_blocks).to_tensors(device,
                                                                                                   workspace)


@dataclass(frozen=True)
class HostMetadata:
    """The step's metadata as host lists, checked: what AttentionMetadata holds as tensors."""
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # padded with 0 to the longest
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def table_width(self) -> int:
        return len(self.block_tables[0]) if self.block_tables else 0

    @classmethod
    def of(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
           num_blocks: int | None = None) -> "HostMetadata":
        """Raises ValueError for inconsistent input, before anything reaches a device: the CUDA
        kernels trust these indices. With num_blocks, every block id a context uses must be in
        [0, num_blocks)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
                f"({len(block_tables)}) must have one entry per request"
            )
        positions, slots = [], []
        for b, (q_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if not 0 <= q_len <= seq_len:
                raise ValueError(f"request {b}: query length {q_len} must be in [0, seq_len={seq_len}]")
            if seq_len > len(table) * block_size:
                raise ValueError(
                    f"request {b}: seq_len {seq_len} needs {-(-seq_len // block_size)} blocks, "
                    f"its block table has {len(table)}"
                )
            used = table[: -(-seq_len // block_size)]
            if num_blocks is not None and any(not 0 <= block < num_blocks for block in used):
                raise ValueError(f"request {b}: block table {used} holds ids outside [0, {num_blocks})")
            for pos in range(seq_len - q_len, seq_len):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) if len(t) < max_blocks else t for t in block_tables]
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        return cls(positions, slots, padded, cu, list(seq_lens), max(query_lens, default=0),
                   max(seq_lens, default=0))

    def to_tensors(self, device: torch.device | str = "cpu",
                   workspace: torch.Tensor | None = None) -> AttentionMetadata:
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return AttentionMetadata(
            positions=tensor(self.positions, torch.int64),
            slot_mapping=tensor(self.slot_mapping, torch.int64),
            block_tables=tensor(self.block_tables, torch.int32).reshape(self.batch, self.table_width),
            cu_seqlens_q=tensor(self.cu_seqlens_q, torch.int32),
            seq_lens=tensor(self.seq_lens, torch.int32),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            workspace=workspace,
        )
