// scale_logits on CUDA: checks, device guard, current stream, then kvflow/logits.cuh.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/logits.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void scale_logits(at::Tensor& logits, double divisor, double soft_cap) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  check_scale_logits_args(logits, divisor, soft_cap);
  TORCH_CHECK(logits.size(0) <= 65535, "scale_logits: at most 65535 rows on CUDA, got ", logits.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err =
      cuda_kernels::scale_logits(logits.data_ptr<float>(), logits.stride(0), logits.size(0), logits.size(1),
                                 float(1.0 / divisor), float(soft_cap), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "scale_logits: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
