"""Shared fixtures: where the ops run (each CPU instruction set, and CUDA when present), the
tolerances per dtype, an ASGI app served on loopback for the HTTP tests, and random GGUF weight
blocks."""

import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import kvflow
from kvflow.ops.quantized import GGML_Q4_1, GGML_Q8_0

CPU_ISAS = kvflow.ops.supported_cpu_isas()
TARGETS = [f"cpu:{isa}" for isa in CPU_ISAS] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Outputs are rounded once from float32 math, so the error against a float32 reference is half
# an ulp of the dtype (2^-9 relative for bfloat16, 2^-12 for float16) plus float32 noise from a
# different summation order; the bounds leave a factor of about 2 on top.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
}


def _switch_isa(isa: str):
    previous = kvflow.ops.cpu_isa()
    kvflow.ops.set_cpu_isa(isa)
    return previous


@pytest.fixture(params=TARGETS)
def device(request):
    """The device to run on; for the CPU, the instruction set is switched for the test."""
    target = request.param
    if not target.startswith("cpu:"):
        yield target
        return
    previous = _switch_isa(target.split(":")[1])
    try:
        yield "cpu"
    finally:
        kvflow.ops.set_cpu_isa(previous)


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """For CPU-only ops: runs the test once per instruction set this CPU supports."""
    previous = _switch_isa(request.param)
    try:
        yield request.param
    finally:
        kvflow.ops.set_cpu_isa(previous)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None):
    tol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tol)


@contextmanager
def running_server(app):
    """Serves the ASGI `app` with uvicorn on a free loopback port, in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def random_blocks(ggml_type: int, out_features: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [out_features, row bytes]: blocks with random scales (and Q4_1 offsets) and codes over
    each format's whole range, Q8_0's -128 included."""
    blocks = out_features * in_features // 32
    scales = rng.uniform(0.002, 0.05, blocks).astype(np.float16) * rng.choice([-1, 1], blocks).astype(np.float16)
    parts = [scales.view(np.uint8).reshape(blocks, 2)]
    if ggml_type == GGML_Q4_1:
        parts.append(rng.uniform(-0.4, 0.1, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2))
    if ggml_type == GGML_Q8_0:
        parts.append(rng.integers(-128, 128, (blocks, 32)).astype(np.int8).view(np.uint8))
    else:
        codes = rng.integers(0, 16, (blocks, 32)).astype(np.uint8)
        parts.append(codes[:, :16] | (codes[:, 16:] << 4))
    return np.concatenate(parts, axis=1).reshape(out_features, -1)
