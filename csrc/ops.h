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

}  // namespace kvflow::cpu

#ifdef KVFLOW_WITH_CUDA
namespace kvflow::cuda {
#include "op_list.inc"
}  // namespace kvflow::cuda
#endif
