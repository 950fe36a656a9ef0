// rms_norm, fused_add_rms_norm and rms_norm_add on CUDA: checks, device guard, current stream, dtype dispatch,
// then the kernels of kvflow/norm.cuh.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/norm.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon,
              double weight_offset) {
  check_device_type(input, "input", c10::DeviceType::CUDA);
  const NormGeometry g = check_norm_args(input, "input", out, "out", weight, epsilon, /*grouped=*/true);
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cuda_kernels::RowGroups groups{g.x.group_rows, g.x.group_stride, g.y.group_rows, g.y.group_stride};
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::rms_norm(static_cast<T*>(out.data_ptr()), g.y.stride,
                                  static_cast<const T*>(input.data_ptr()), g.x.stride,
                                  static_cast<const T*>(weight.data_ptr()), g.x.rows, g.x.width, float(epsilon),
                                  float(weight_offset), stream, groups);
  });
  TORCH_CHECK(err == cudaSuccess, "rms_norm: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon,
                        double weight_offset) {
  check_device_type(input, "input", c10::DeviceType::CUDA);
  const NormGeometry g = check_norm_args(input, "input", residual, "residual", weight, epsilon);
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::fused_add_rms_norm(static_cast<T*>(input.data_ptr()), g.x.stride,
                                            static_cast<T*>(residual.data_ptr()), g.y.stride,
                                            static_cast<const T*>(weight.data_ptr()), g.x.rows, g.x.width,
                                            float(epsilon), float(weight_offset), stream);
  });
  TORCH_CHECK(err == cudaSuccess, "fused_add_rms_norm: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void rms_norm_add(at::Tensor& residual, const at::Tensor& input, const at::Tensor& weight, double epsilon,
                  double weight_offset) {
  check_device_type(residual, "residual", c10::DeviceType::CUDA);
  const NormGeometry g = check_norm_args(input, "input", residual, "residual", weight, epsilon);
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::rms_norm_add(static_cast<T*>(residual.data_ptr()), g.y.stride,
                                      static_cast<const T*>(input.data_ptr()), g.x.stride,
                                      static_cast<const T*>(weight.data_ptr()), g.x.rows, g.x.width, float(epsilon),
                                      float(weight_offset), stream);
  });
  TORCH_CHECK(err == cudaSuccess, "rms_norm_add: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
