"""What every benchmark here shares: the one timing rule (warm up, then the median of several
runs, synchronising around each run on CUDA), the machine's read bandwidth, the bytes of weights
and of KV cache a decode step reads, and the --markdown copy of a report."""

import statistics
import time

import torch


def timed(fn, device: str, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds per call of fn()."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def read_bandwidth(device: str = "cpu", nbytes: int = 512 << 20) -> float:
    """The best GB/s of a sum over a float32 tensor of nbytes (reads only) over 10 tries: the limit
    a memory-bound kernel is compared with, so fractions reported against it are conservative.
    512 MB reads memory on any CPU here; a tensor the size of a model's weights reads from the
    last-level cache where they fit in it, as the weights do then."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = min(timed(lambda: x.sum(), device, 1 if i else 2, 1) for i in range(10))
    return x.numel() * 4 / best / 1e9


def weights_read_per_token(model) -> int:
    """The bytes of the weights a decode step reads: the parameters, and the packed weights that
    replaced theirs (a build that keeps plain weights beside packed copies reads the plain ones
    at one row). A model's parameters alone leave out every packed bf16 weight."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if "weight" in module._parameters and module.weight is None and packed is not None:
            total += packed.data.nbytes
    return total


def kv_read_per_token(llm, prompt_tokens: int, new_tokens: int) -> int:
    """The bytes of K and V a greedy decode step reads, averaged over the steps TPOT covers (the
    2nd to the new_tokens-th output token of a prompt_tokens prompt): a step attends over every
    position before it and its own, in every layer's cache. Models with a sliding window read
    less; the benchmarks that count this run models without one, and refuse others."""
    config = llm.engine.model_config
    if config.sliding_window or config.layer_sliding_windows:
        raise ValueError("kv_read_per_token counts whole contexts; this model has a sliding window")
    per_position = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in llm.engine.runner.kv_caches)
    contexts = [prompt_tokens + i for i in range(1, new_tokens)]
    return round(per_position * statistics.mean(contexts))


def write_markdown(path: str | None, lines: list[str]) -> None:
    """The report's lines to `path` (a --markdown argument), if one was given."""
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def tpot_ms(outputs) -> float:
    """Each request's mean time between its output tokens (its first excluded), in ms, averaged
    over the requests of RequestOutputs that have two tokens or more."""
    per_request = []
    for out in outputs:
        times = out.metrics.token_times
        if len(times) > 1:
            per_request.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
    return statistics.mean(per_request)
