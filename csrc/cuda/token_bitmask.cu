// apply_token_bitmask on CUDA: checks, device guard, current stream, then kvflow/token_bitmask.cuh.
// Rows out of range cannot be checked without a copy to the host; the Python wrapper checks them
// before the call (kvflow.ops.apply_token_bitmask).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/token_bitmask.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  check_token_bitmask_args(logits, bitmask, rows);
  TORCH_CHECK(bitmask.size(0) <= 65535, "apply_token_bitmask: at most 65535 mask rows on CUDA, got ",
              bitmask.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err = cuda_kernels::apply_token_bitmask(
      logits.data_ptr<float>(), logits.stride(0), logits.size(1), bitmask.data_ptr<int32_t>(), bitmask.size(0),
      bitmask.size(1), rows.has_value() ? rows->data_ptr<int64_t>() : nullptr, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "apply_token_bitmask: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
