"""Float weights into GGUF's Q4_K, Q5_K and Q6_K blocks, for test checkpoints: the gguf package
reads these types but does not write them. A plain min/max quantizer, not llama-quantize's
search: the tests compare kvflow with the same blocks dequantized by the gguf package, so what
matters is the layout, which quantize_k's caller checks against gguf's dequantize."""

import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _six_bits(values: np.ndarray, top: np.ndarray) -> np.ndarray:
    """values [blocks, 8] >= 0 as codes of top / 63, 0..63."""
    return np.clip(np.rint(np.divide(values, top[:, None], out=np.zeros_like(values), where=top[:, None] > 0)), 0, 63)


def _quantize_q4_q5_k(x: np.ndarray, bits: int) -> np.ndarray:
    blocks = x.reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=2), 0)
    high = blocks.max(axis=2)
    steps = (high - low) / (2**bits - 1)                     # [blocks, 8]
    d = (steps.max(axis=1) / 63).astype(np.float16).astype(np.float64)
    dmin = ((-low).max(axis=1) / 63).astype(np.float16).astype(np.float64)
    sc, m = _six_bits(steps, d).astype(np.uint8), _six_bits(-low, dmin).astype(np.uint8)
    step = d[:, None] * sc                                   # what the blocks will say
    offset = dmin[:, None] * m
    q = np.divide(blocks + offset[:, :, None], step[:, :, None], out=np.zeros_like(blocks), where=step[:, :, None] > 0)
    q = np.clip(np.rint(q), 0, 2**bits - 1).astype(np.uint8)  # [blocks, 8, 32]
    scales = np.zeros((len(blocks), 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    nibbles = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)  # [blocks, 4, 32]
    parts = [_half(d), _half(dmin), scales]
    if bits == 5:  # bit c of high byte l: the fifth bit of chunk c's weight l
        parts.append(sum(((q[:, c] >> 4) & 1) << c for c in range(8)).astype(np.uint8))
    parts.append(nibbles.reshape(len(blocks), 128))
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 16, 16)
    steps = np.abs(blocks).max(axis=2) / 31                  # [blocks, 16]
    d = (steps.max(axis=1) / 127).astype(np.float16).astype(np.float64)
    sc = np.clip(np.rint(np.divide(steps, d[:, None], out=np.zeros_like(steps), where=d[:, None] > 0)), 0, 127)
    step = d[:, None] * sc
    q = np.divide(blocks, step[:, :, None], out=np.zeros_like(blocks), where=step[:, :, None] > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, half, k, l]
    low = np.zeros((len(blocks), 2, 64), dtype=np.uint8)
    low[:, :, 0:32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    low[:, :, 32:64] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    high = sum((q[:, :, k] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)     # [blocks, 2, 32]
    return np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _half(d)],
                          axis=1)


def quantize_k(weight: np.ndarray, type_name: str) -> np.ndarray:
    """weight [rows, in_features] (in_features a multiple of 256) as uint8 [rows, row bytes] of
    type_name's blocks."""
    rows = weight.shape[0]
    x = weight.astype(np.float64).reshape(-1, 256)
    blocks = {"Q4_K": lambda: _quantize_q4_q5_k(x, 4), "Q5_K": lambda: _quantize_q4_q5_k(x, 5),
              "Q6_K": lambda: _quantize_q6_k(x)}[type_name]()
    return blocks.reshape(rows, -1)
