"""The one timing rule every benchmark here uses: warm up, then the median of several runs,
synchronising around each run on CUDA."""

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
