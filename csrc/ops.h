// Declarations of every op implementation, once per device: kvflow::cpu (cpu/*.cpp) and
// kvflow::cuda (cuda/*.cu) implement the same list, op_list.inc. torch_bindings.cpp registers
// them; the schemas there are the public contract.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace kvflow::cpu {
#include "op_list.inc"

// CPU only: on CUDA, torch's matmul serves every batch size well.
void small_linear(at::Tensor& out,                     // [rows, out_features]
                  const at::Tensor& input,             // [rows, in_features]
                  const at::Tensor& weight,            // [out_features, in_features]
                  const std::optional<at::Tensor>& bias);  // [out_features]

// CPU only: a bfloat16 weight [out_features, in_features] reordered into packed_linear's panels,
// [ceil(out_features / 48), ceil(in_features / 2), 48, 2] (see kernel_table.h). With gate_up, the
// [gate; up] weight of a gated MLP for packed_silu_and_mul: [ceil(out_features / 48), ...] too.
at::Tensor pack_linear_weight(const at::Tensor& weight, bool gate_up);

// CPU only: out = input @ weight^T (+ bias) for many rows (prefill, batched decode), weight
// given as pack_linear_weight made it; out bfloat16 or float32.
void packed_linear(at::Tensor& out,                        // [rows, out_features]
                   const at::Tensor& input,                // [rows, in_features] bfloat16
                   const at::Tensor& packed_weight,        // pack_linear_weight(weight)
                   const std::optional<at::Tensor>& bias);  // [out_features] bfloat16

// CPU only: out = silu(input @ gate^T) * (input @ up^T) for many rows, the gate|up weight given
// as pack_linear_weight(weight, gate_up=True) made it: the gated MLP's activation in the
// product's epilogue.
void packed_silu_and_mul(at::Tensor& out,                    // [rows, d] bfloat16
                         const at::Tensor& input,            // [rows, in_features] bfloat16
                         const at::Tensor& packed_gate_up);  // pack_linear_weight(weight [2d, in_features], true)

// CPU only (for now): out = input @ weight^T (+ bias) for a weight kept in GGUF blocks,
// weight [out_features, in_features / 32 * block bytes] uint8 as the file stores it, of GGML type
// ggml_type (Q4_0 2, Q4_1 3, Q8_0 8); input float32 or bfloat16, quantized to int8 per
// 32-block on the way in; out float32 or bfloat16.
void quantized_linear(at::Tensor& out,                        // [rows, out_features]
                      const at::Tensor& input,                // [rows, in_features]
                      const at::Tensor& weight,               // [out_features, row bytes] uint8
                      int64_t ggml_type,
                      const std::optional<at::Tensor>& bias);  // [out_features]

// CPU only (for now): the embedding lookup on a table kept in GGUF blocks (types as for
// quantized_linear), each row dequantized into out's dtype and times scale.
void quantized_embedding(at::Tensor& out,              // [num_tokens, hidden]
                         const at::Tensor& token_ids,  // [num_tokens] int64
                         const at::Tensor& weight,     // [vocab_size, row bytes] uint8
                         int64_t ggml_type, double scale);
}  // namespace kvflow::cpu

#ifdef KVFLOW_WITH_CUDA
namespace kvflow::cuda {
#include "op_list.inc"
}  // namespace kvflow::cuda
#endif
