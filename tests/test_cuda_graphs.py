"""CUDA graphs for decode steps, and the KV pool sized from free GPU memory. The bucket choice
runs everywhere; the rest needs a GPU (scripts/gpu_check.sh selects these by "cuda")."""

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.config import EngineConfig
from kvflow.engine.cuda_graphs import capture_sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    for largest in (1, 3, 16, 50, 256):
        sizes = capture_sizes(largest)
        assert sizes[-1] == largest and sizes == sorted(set(sizes))
        assert all(any(size >= n for size in sizes) for n in range(1, largest + 1))
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_gpu_memory_utilization_is_checked():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


@needs_cuda
def test_cuda_graph_decode_matches_eager_decode():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(dtype="float32", device="cuda", enforce_eager=True, kv_cache_memory=256 << 20, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    del eager
    graphed = LLM(dtype="float32", device="cuda", kv_cache_memory=256 << 20, max_num_seqs=8)
    graphs = graphed.engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    replays = []
    original_run = graphs.run
    graphs.run = lambda input_ids, metadata: replays.append(input_ids.shape[0]) or original_run(input_ids, metadata)
    got = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert replays and set(replays) == {len(PROMPTS)}, "every decode step of the batch should replay a graph"
    # A batch that is not a bucket (3 requests in the 4-row graph) pads the fourth row; the padding
    # writes nothing and the three requests continue as they would eagerly. (Matmuls of 3 and 4
    # rows may round differently, so only the first tokens are compared.)
    replays.clear()
    three = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert set(replays) == {3}
    assert [t[:4] for t in three] == [t[:4] for t in expected[:3]]


@needs_cuda
def test_cuda_kv_pool_is_sized_from_free_gpu_memory():
    llm = LLM(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.5, enforce_eager=True)
    engine = llm.engine
    free, total = torch.cuda.mem_get_info()
    assert engine.allocator.num_blocks > 0
    assert torch.cuda.memory_allocated() <= 0.5 * total
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in out)
