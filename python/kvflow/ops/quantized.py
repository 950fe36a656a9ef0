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
    of GGML type ggml_type, as for quantized_linear), dequantized into out_dtype and times scale:
    [num_tokens, hidden]. An id outside the table raises before any row is written."""
    if out is None:
        hidden = weight.shape[1] // BLOCK_BYTES.get(ggml_type, 1) * BLOCK_VALUES.get(ggml_type, 1)
        out = torch.empty((token_ids.shape[0], hidden), dtype=out_dtype, device=weight.device)
    torch.ops.kvflow.quantized_embedding(out, token_ids, weight, ggml_type, scale)
    return out


@torch.library.register_fake("kvflow::quantized_embedding")
def _quantized_embedding_fake(out, token_ids, weight, ggml_type, scale=1.0):
    return None


@torch.library.register_fake("kvflow::quantized_linear")
def _quantized_linear_fake(out, input, weight, ggml_type, bias=None):
    return None
