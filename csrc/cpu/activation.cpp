// silu_and_mul, gelu_and_mul and gelu_tanh_and_mul on the CPU: checks, then rows split across threads.
#include <ATen/Parallel.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

void gated_activation(at::Tensor& out, const at::Tensor& input, GatedActivationFn const (&kernels)[kNumDTypes]) {
  check_device_type(input, "input", c10::DeviceType::CPU);
  const GatedGeometry g = check_gated_args(out, input);
  const GatedActivationFn kernel = kernels[int(g.dtype)];
  const int64_t d = g.out.width;
  void* out_ptr = out.data_ptr();
  const void* in_ptr = input.data_ptr();
  const int64_t rows_per_task = std::max<int64_t>(1, 8192 / std::max<int64_t>(d, 1));
  at::parallel_for(0, g.in.rows, rows_per_task, [&](int64_t begin, int64_t end) {
    kernel(out_ptr, g.out.stride, in_ptr, g.in.stride, d, begin, end);
  });
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  gated_activation(out, input, active_kernels().silu_and_mul);
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  gated_activation(out, input, active_kernels().gelu_tanh_and_mul);
}

void gelu_and_mul(at::Tensor& out, const at::Tensor& input) {
  gated_activation(out, input, active_kernels().gelu_and_mul);
}

}  // namespace kvflow::cpu
