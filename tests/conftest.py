"""Shared fixtures: where the ops run (each CPU instruction set, and CUDA when present), the
tolerances per dtype, an ASGI app served on loopback for the HTTP tests, random GGUF weight
blocks, and Hugging Face's tokenizer of the embedded model."""

import gc
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import kvflow
import kvflow.platform
from kvflow.loader.model_loader import resolve_model_path
from kvflow.ops.quantized import BLOCK_BYTES, BLOCK_VALUES, GGML_Q4_1, GGML_Q4_K, GGML_Q5_1, GGML_Q5_K, GGML_Q6_K

_EMBEDDED_MODEL = Path(resolve_model_path(None))
SMOLLM2_DIR, SMOLLM2_GGUF = _EMBEDDED_MODEL.parent, _EMBEDDED_MODEL.name

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


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """Hugging Face's tokenizer read from the embedded model's GGUF file, built once per session
    (about 10 s: transformers converts the GGUF vocabulary in Python). Tests only read it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2_GGUF)


@pytest.fixture(autouse=True)
def batch_invariant_mode_off_once_its_engines_are_gone():
    """Batch-invariant mode is process-wide and set by the engine that asks for it: each test
    starts with it off unless an engine that turned it on still lives (a module's shared engine
    is gone by the next module's first test)."""
    if kvflow.platform.batch_invariant():
        forget_last_failure()
        try:
            kvflow.platform.set_batch_invariant(False)
        except ValueError:
            pass  # an engine of this module runs in the mode
    yield


@pytest.fixture
def batch_invariant_mode_off_after():
    """Turns the process-wide batch-invariant mode off after the test, once its engines are gone
    (the mode cannot change while one lives)."""
    yield
    forget_last_failure()
    gc.collect()
    kvflow.platform.set_batch_invariant(False)


def forget_last_failure():
    """Drops the last failed test's traceback, which pytest keeps in sys.last_* for post-mortem
    debugging: it holds the test's frames and any engine in them, and the instruction set and
    batch-invariant mode cannot change while an engine lives, so one failure beside an engine
    would otherwise fail every later test that switches them."""
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None


def _switch_isa(isa: str):
    forget_last_failure()
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
    """uint8 [out_features, row bytes]: blocks of random bytes (codes over each format's whole
    range, Q8_0's -128 included, and the K-quants' 6-bit scales and mins or int8 scales) with
    random float16 scales in place: d of either sign, offsets m of the 32-weight formats in
    [-0.4, 0.1], the K-quants' d and dmin sized so that weights stay within a few units."""
    blocks = out_features * in_features // BLOCK_VALUES[ggml_type]
    data = rng.integers(0, 256, (blocks, BLOCK_BYTES[ggml_type]), dtype=np.uint8)

    def halves(low: float, high: float, signed: bool) -> np.ndarray:
        values = rng.uniform(low, high, blocks) * (rng.choice([-1, 1], blocks) if signed else 1)
        return values.astype(np.float16).view(np.uint8).reshape(blocks, 2)

    if ggml_type == GGML_Q6_K:
        data[:, 208:210] = halves(0.0002, 0.002, True)
    elif ggml_type in (GGML_Q4_K, GGML_Q5_K):
        data[:, 0:2] = halves(0.0005, 0.004, False)
        data[:, 2:4] = halves(0.0005, 0.004, False)
    else:
        data[:, 0:2] = halves(0.002, 0.05, True)
        if ggml_type in (GGML_Q4_1, GGML_Q5_1):
            data[:, 2:4] = rng.uniform(-0.4, 0.1, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return data.reshape(out_features, -1)
