// silu_and_mul, gelu_and_mul and gelu_tanh_and_mul on CUDA: checks, device guard, current stream, dtype
// dispatch, then kvflow/activation.cuh.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/activation.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {
namespace {

template <class Act>
void gated_activation(at::Tensor& out, const at::Tensor& input, const char* op) {
  check_device_type(input, "input", c10::DeviceType::CUDA);
  const GatedGeometry g = check_gated_args(out, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::gated_activation<Act>(static_cast<T*>(out.data_ptr()), g.out.stride,
                                               static_cast<const T*>(input.data_ptr()), g.in.stride, g.in.rows,
                                               g.out.width, stream);
  });
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  gated_activation<cuda_kernels::Silu>(out, input, "silu_and_mul");
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  gated_activation<cuda_kernels::GeluTanh>(out, input, "gelu_tanh_and_mul");
}

void gelu_and_mul(at::Tensor& out, const at::Tensor& input) {
  gated_activation<cuda_kernels::Gelu>(out, input, "gelu_and_mul");
}

}  // namespace kvflow::cuda
