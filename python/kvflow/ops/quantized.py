"""Products with weights kept in GGUF's quantized blocks, on the CPU: the weight stays as the
file stores it (a quarter of bfloat16's bytes at 4 bits), and decode reads each of its bytes once."""

import torch

# The GGML types quantized_linear runs, by id, with the bytes of one block of 32 weights.
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8
QUANT_BLOCK = 32
BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q8_0: 34}
GGML_TYPE_NAMES = {GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0"}


def quantized_row_bytes(in_features: int, ggml_type: int) -> int:
    """The bytes of one weight row of in_features (a multiple of 32) in ggml_type's blocks."""
    return in_features // QUANT_BLOCK * BLOCK_BYTES[ggml_type]


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out = input @ W.T (+ bias) for W given in GGUF blocks of GGML type ggml_type (Q4_0, Q4_1 or
    Q8_0): weight is uint8 [out_features, in_features / 32 * block bytes], each row its blocks in
    order, as a GGUF file stores the tensor. input [rows, in_features] float32 or bfloat16 is
    quantized to int8 per block of 32 (scale max|x| / 127) on the way in, as llama.cpp does; the
    products accumulate in float32. out float32 or bfloat16 (default: input's dtype)."""
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
        hidden = weight.shape[1] // BLOCK_BYTES.get(ggml_type, 1) * QUANT_BLOCK
        out = torch.empty((token_ids.shape[0], hidden), dtype=out_dtype, device=weight.device)
    torch.ops.kvflow.quantized_embedding(out, token_ids, weight, ggml_type, scale)
    return out


@torch.library.register_fake("kvflow::quantized_embedding")
def _quantized_embedding_fake(out, token_ids, weight, ggml_type, scale=1.0):
    return None


@torch.library.register_fake("kvflow::quantized_linear")
def _quantized_linear_fake(out, input, weight, ggml_type, bias=None):
    return None
