// rms_norm and fused_add_rms_norm on the CPU: checks, then rows split across threads.
#include <ATen/Parallel.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

// Enough elements per task that the thread hand-off is noise against the row work.
int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon,
              double weight_offset) {
  check_device_type(input, "input", c10::DeviceType::CPU);
  const NormGeometry g = check_norm_args(input, "input", out, "out", weight, epsilon);
  const RmsNormFn kernel = active_kernels().rms_norm[int(g.dtype)];
  void* out_ptr = out.data_ptr();
  const void* in_ptr = input.data_ptr();
  const void* w_ptr = weight.data_ptr();
  at::parallel_for(0, g.x.rows, rows_per_task(g.x.width), [&](int64_t begin, int64_t end) {
    kernel(out_ptr, g.y.stride, in_ptr, g.x.stride, w_ptr, g.x.width, float(epsilon), float(weight_offset), begin,
           end);
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon,
                        double weight_offset) {
  check_device_type(input, "input", c10::DeviceType::CPU);
  const NormGeometry g = check_norm_args(input, "input", residual, "residual", weight, epsilon);
  const FusedAddRmsNormFn kernel = active_kernels().fused_add_rms_norm[int(g.dtype)];
  void* in_ptr = input.data_ptr();
  void* res_ptr = residual.data_ptr();
  const void* w_ptr = weight.data_ptr();
  at::parallel_for(0, g.x.rows, rows_per_task(g.x.width), [&](int64_t begin, int64_t end) {
    kernel(in_ptr, g.x.stride, res_ptr, g.y.stride, w_ptr, g.x.width, float(epsilon), float(weight_offset), begin,
           end);
  });
}

}  // namespace kvflow::cpu
