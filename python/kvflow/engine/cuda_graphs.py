"""Decode steps on CUDA replay captured CUDA graphs instead of launching ~400 kernels one by one.

One graph per batch-size bucket (1, 2, 4, 8, then every 16 up to the largest), all captured at
start over the same static input buffers and one shared memory pool. A decode step of n requests
copies its tokens and attention metadata into the first n rows of the buffers, marks the rows up
to the bucket as padding (cache slot -1: nothing is written; context length 1), replays the
bucket's graph, and reads the first n rows of its output. Only the model's forward pass is
captured; the LM head and the sampler run eagerly on the rows that sample.

The graphs bake in every tensor address and the launch grids, which the paged-attention launcher
sizes from host integers (max_query_len 1, max_seq_len the longest context the engine allows);
nothing in the forward pass reads device memory on the host, so capture is legal."""

import torch

from kvflow.attention_metadata import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    """The batch-size buckets: 1, 2, 4, 8, 16, 32, 48, ... up to and including max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeCudaGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_seq_len: int,
                 max_batch: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = max_seq_len
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        rows = self.max_batch
        with torch.inference_mode():
            self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
            self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
            self.block_tables = torch.zeros((rows, self.max_blocks_per_seq), dtype=torch.int32, device=device)
            self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.device = torch.device(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        with torch.cuda.device(self.device):  # capture streams belong to the current device
            self._capture()

    def _metadata(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(positions=self.positions[:rows], slot_mapping=self.slot_mapping[:rows],
                                 block_tables=self.block_tables[:rows], cu_seqlens_q=self.cu_seqlens_q[:rows + 1],
                                 seq_lens=self.seq_lens[:rows], max_query_len=1, max_seq_len=self.max_seq_len)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs fit in the memory the largest already reserved.
        for rows in reversed(self.sizes):
            metadata = self._metadata(rows)
            self.model(self.input_ids[:rows], metadata, self.kv_caches)  # warm-up: lazy inits, workspace
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = self.model(self.input_ids[:rows], metadata, self.kv_caches)
            pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether a step fits the graphs: decode only (one new token per request), at most the
        largest bucket, contexts within the captured bound."""
        batch = metadata.seq_lens.shape[0]
        return (0 < batch <= self.max_batch and metadata.num_tokens == batch and metadata.max_query_len == 1
                and metadata.max_seq_len <= self.max_seq_len
                and metadata.block_tables.shape[1] <= self.max_blocks_per_seq)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [n] and the step's metadata, both on the host (validated there), -> final hidden
        states [n, hidden_size] on the device: a view of the graph's output, valid until the next run."""
        n = input_ids.shape[0]
        rows = next(size for size in self.sizes if size >= n)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(metadata.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        if rows > n:  # padding rows write nothing and attend over one cached token
            self.slot_mapping[n:rows].fill_(-1)
            self.seq_lens[n:rows].fill_(1)
        with torch.cuda.device(self.device):
            self.graphs[rows].replay()
        return self.outputs[rows][:n]
