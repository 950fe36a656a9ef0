// Declarations of every op implementation, once per device: kvflow::cpu (cpu/*.cpp) and
// kvflow::cuda (cuda/*.cu) implement the same list, op_list.inc. torch_bindings.cpp registers
// them; the schemas there are the public contract.
#pragma once

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
}  // namespace kvflow::cpu

#ifdef KVFLOW_WITH_CUDA
namespace kvflow::cuda {
#include "op_list.inc"
}  // namespace kvflow::cuda
#endif
