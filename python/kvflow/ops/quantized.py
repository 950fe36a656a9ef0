"""Products with weights kept in GGUF's quantized blocks, on the CPU: the weight stays as the
file stores it (a quarter of bfloat16's bytes at 4 bits), and decode reads each of its bytes once."""

import torch

# The GGML types quantized_linear runs, by id: the weights in one block, and its bytes.
GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
BLOCK_VALUES = {GGML_Q4_0: 32, GGML_Q4_1: 32, GGML_Q5_0: 32, GGML_Q5_1: 32, GGML_Q8_0: 32,
                GGML_Q4_K: 256, GGML_Q5_K: 256, GGML_Q6_K: 256}
BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q5_0: 22, GGML_Q5_1: 24, GGML_Q8_0: 34,
               GGML_Q4_K: 144, GGML_Q5_K: 176, GGML_Q6_K: 210}
GGML_TYPE_NAMES = {GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1", GGML_Q5_0: "Q5_0", GGML_Q5_1: "Q5_1", GGML_Q8_0: "Q8_0",
                   GGML_Q4_K: "Q4_K", GGML_Q5_K: "Q5_K", GGML_Q6_K: "Q6_K"}


# kvflow's interleaved layout of every quantized type's weights on the CPU (csrc's
# gguf_blocks.h): rows in groups of INTERLEAVED_ROWS, each group's blocks stored together so that
# the few-row kernel multiplies 8 rows at once. Same bytes as the file's rows; made at load by
# interleave_rows.
INTERLEAVED_ROWS = 8
GGML_Q4_0_INTERLEAVED, GGML_Q4_1_INTERLEAVED, GGML_Q8_0_INTERLEAVED = 1000 + GGML_Q4_0, 1000 + GGML_Q4_1, 1000 + GGML_Q8_0
GGML_Q5_0_INTERLEAVED, GGML_Q5_1_INTERLEAVED = 1000 + GGML_Q5_0, 1000 + GGML_Q5_1
GGML_Q4_K_INTERLEAVED, GGML_Q5_K_INTERLEAVED, GGML_Q6_K_INTERLEAVED = 1000 + GGML_Q4_K, 1000 + GGML_Q5_K, 1000 + GGML_Q6_K
INTERLEAVED_TYPES = {GGML_Q4_0: GGML_Q4_0_INTERLEAVED, GGML_Q4_1: GGML_Q4_1_INTERLEAVED,
                     GGML_Q5_0: GGML_Q5_0_INTERLEAVED, GGML_Q5_1: GGML_Q5_1_INTERLEAVED,
                     GGML_Q8_0: GGML_Q8_0_INTERLEAVED, GGML_Q4_K: GGML_Q4_K_INTERLEAVED,
                     GGML_Q5_K: GGML_Q5_K_INTERLEAVED, GGML_Q6_K: GGML_Q6_K_INTERLEAVED}
# The bytes of each field of a block's header: d; m (Q4_1, Q5_1); the 32 fifth bits (Q5_0,
# Q5_1); Q4_K: d, dmin, then each of its 12 scale bytes as a field of its own; Q5_K: the same,
# then its 32 bytes of fifth bits as 8 fields of 4; Q6_K: each of its 16 scales, then d. The
# header starts the block, but Q6_K's ends it (after 192 bytes of codes).
_INTERLEAVED_HEADER_FIELDS = {GGML_Q4_0: (2,), GGML_Q4_1: (2, 2), GGML_Q5_0: (2, 4), GGML_Q5_1: (2, 2, 4),
                              GGML_Q8_0: (2,), GGML_Q4_K: (2, 2) + (1,) * 12, GGML_Q5_K: (2, 2) + (1,) * 12 + (4,) * 8,
                              GGML_Q6_K: (1,) * 16 + (2,)}
_INTERLEAVED_HEADER_START = {GGML_Q6_K: 192}


def type_name(ggml_type: int) -> str:
    """"Q4_1", or for an interleaved type "Q4_1 (rows interleaved)"."""
    base = {v: k for k, v in INTERLEAVED_TYPES.items()}.get(ggml_type)
    if base is not None:
        return f"{GGML_TYPE_NAMES[base]} (rows interleaved)"
    return GGML_TYPE_NAMES.get(ggml_type, str(ggml_type))


def _interleaved_header_fields(ggml_type: int) -> tuple[int, ...]:
    """The bytes of each header field of a block of an interleaving type (_INTERLEAVED_HEADER_FIELDS);
    a ValueError for any other type."""
    if ggml_type not in INTERLEAVED_TYPES:
        raise ValueError(f"only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights interleave, got GGML "
                         f"type {ggml_type}")
    return _INTERLEAVED_HEADER_FIELDS[ggml_type]


def interleave_rows(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A weight of an interleaving type (INTERLEAVED_TYPES: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    Q6_K), uint8 [rows, row bytes] (rows a multiple of INTERLEAVED_ROWS), in the interleaved layout
    of type INTERLEAVED_TYPES[ggml_type]: for each group of 8 rows and each block, each header
    field of the 8 rows in turn (_INTERLEAVED_HEADER_FIELDS), then pieces of 32 bytes (4 of
    nibbles, 8 of Q8_0's codes, 32 of Q4_K's and Q5_K's nibbles, 48 of Q6_K's low and high bits),
    piece k holding code bytes 4k..4k+3 of each row in turn. Same shape and bytes, rearranged."""
    fields = _interleaved_header_fields(ggml_type)
    rows, row_bytes = weight.shape
    if rows % INTERLEAVED_ROWS:
        raise ValueError(f"interleaving takes a multiple of {INTERLEAVED_ROWS} rows, got {rows}")
    block_bytes, header = BLOCK_BYTES[ggml_type], sum(fields)
    if row_bytes % block_bytes:
        raise ValueError(f"interleaving takes rows of whole {block_bytes}-byte blocks, got {row_bytes} bytes a row")
    blocks = weight.reshape(rows // INTERLEAVED_ROWS, INTERLEAVED_ROWS, row_bytes // block_bytes, block_bytes)
    first = _INTERLEAVED_HEADER_START.get(ggml_type, 0)
    starts = [first + sum(fields[:i]) for i in range(len(fields))]
    headers = [blocks[..., start:start + size].transpose(1, 2).flatten(2)  # [groups, blocks, 8 * size]
               for start, size in zip(starts, fields)]
    pieces = (block_bytes - header) // 4
    code_bytes = torch.cat([blocks[..., :first], blocks[..., first + header:]], dim=-1)
    codes = code_bytes.unflatten(-1, (pieces, 4)).permute(0, 2, 3, 1, 4).flatten(2)  # [groups, blocks, 32 pieces]
    return torch.cat(headers + [codes], dim=-1).reshape(rows, row_bytes).contiguous()


def deinterleave_rows(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The inverse of interleave_rows: a weight in the interleaved layout of an interleaving type
    (ggml_type the GGML type) back in the GGUF file's rows."""
    fields = _interleaved_header_fields(ggml_type)
    rows, row_bytes = weight.shape
    block_bytes, header = BLOCK_BYTES[ggml_type], sum(fields)
    groups = weight.reshape(rows // INTERLEAVED_ROWS, row_bytes // block_bytes, INTERLEAVED_ROWS * block_bytes)
    starts = [INTERLEAVED_ROWS * sum(fields[:i]) for i in range(len(fields))]
    headers = [groups[..., start:start + INTERLEAVED_ROWS * size].unflatten(-1, (INTERLEAVED_ROWS, size)).transpose(1, 2)
               for start, size in zip(starts, fields)]  # [groups, 8, blocks, size]
    pieces = (block_bytes - header) // 4
    codes = groups[..., INTERLEAVED_ROWS * header:].unflatten(-1, (pieces, INTERLEAVED_ROWS, 4)).permute(0, 3, 1, 2, 4).flatten(3)
    first = _INTERLEAVED_HEADER_START.get(ggml_type, 0)
    return torch.cat([codes[..., :first]] + headers + [codes[..., first:]], dim=-1).reshape(rows, row_bytes).contiguous()


def quantized_row_bytes(in_features: int, ggml_type: int) -> int:
    """The bytes of one weight row of in_features (a multiple of BLOCK_VALUES[ggml_type]) in
    ggml_type's blocks."""
    return in_features // BLOCK_VALUES[ggml_type] * BLOCK_BYTES[ggml_type]


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out = input @ W.T (+ bias) for W given in GGUF blocks of GGML type ggml_type (any of
    BLOCK_BYTES: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): weight is uint8
    [out_features, in_features / BLOCK_VALUES * BLOCK_BYTES], each row its blocks in order, as a
    GGUF file stores the tensor. Up to 31 rows, input [rows, in_features] float32 or bfloat16 is
    quantized to int8 per 32 values (scale max|x| / 127) on the way in, as llama.cpp does; from 32
    bfloat16 rows the weights are dequantized to bfloat16 panels instead. The products accumulate
    in float32. out float32 or bfloat16 (default: input's dtype)."""
    if out is None:
        out = torch.empty((input.shape[0], weight.shape[0]), dtype=out_dtype or input.dtype, device=input.device)
    torch.ops.kvflow.quantized_linear(out, input, weight, ggml_type, bias)
    return out


def quantized_embedding(token_ids: torch.Tensor, weight: torch.Tensor, ggml_type: int, scale: float = 1.0,
                        out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows token_ids names of a table kept in GGUF blocks (weight uint8 [vocab_size, row bytes]
    of GGML type ggml_type, as for quantized_linear; on the CPU also in the interleaved layout of
    INTERLEAVED_TYPES, as a tied LM head keeps it), dequantized into out_dtype and times scale:
    [num_tokens, hidden]. An id outside the table raises before any row is written."""
    if out is None:
        base = {v: k for k, v in INTERLEAVED_TYPES.items()}.get(ggml_type, ggml_type)
        hidden = weight.shape[1] // BLOCK_BYTES.get(base, 1) * BLOCK_VALUES.get(base, 1)
        out = torch.empty((token_ids.shape[0], hidden), dtype=out_dtype, device=weight.device)
    torch.ops.kvflow.quantized_embedding(out, token_ids, weight, ggml_type, scale)
    return out


@torch.library.register_fake("kvflow::quantized_embedding")
def _quantized_embedding_fake(out, token_ids, weight, ggml_type, scale=1.0):
    return None


@torch.library.register_fake("kvflow::quantized_linear")
def _quantized_linear_fake(out, input, weight, ggml_type, bias=None):
    return None
