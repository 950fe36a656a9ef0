// pack_linear_weight and packed_linear on the CPU: the weight is reordered once, at load, into
// panels (see kernel_table.h), and each many-row product splits the panels across threads.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

constexpr int64_t kPanel = kPackedLinearPanel;

void check_bfloat16(const at::Tensor& t, const char* name) {
  check_device_type(t, name, c10::DeviceType::CPU);
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_bfloat16(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0,
              "weight must be a non-empty [out_features, in_features] tensor, got shape ", weight.sizes());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel, pairs = (in_features + 1) / 2;
  at::Tensor packed = at::zeros({panels, pairs, kPanel, 2}, weight.options());
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const bfloat16*>(w.data_ptr());
  auto* dst = reinterpret_cast<bfloat16*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < out_features; ++j) {
        const bfloat16* row = src + (p * kPanel + j) * in_features;
        for (int64_t k = 0; k < in_features; ++k) dst[((p * pairs + k / 2) * kPanel + j) * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

void packed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                   const std::optional<at::Tensor>& bias) {
  check_bfloat16(input, "input");
  check_bfloat16(packed_weight, "packed_weight");
  check_device_type(out, "out", c10::DeviceType::CPU);
  TORCH_CHECK(packed_weight.dim() == 4 && packed_weight.size(2) == kPanel && packed_weight.size(3) == 2 &&
                  packed_weight.is_contiguous(),
              "packed_weight must be pack_linear_weight's contiguous [panels, in_features / 2, ", kPanel,
              ", 2] tensor, got shape ", packed_weight.sizes());
  const int64_t panels = packed_weight.size(0), pairs = packed_weight.size(1);
  TORCH_CHECK(input.dim() == 2 && (input.size(1) + 1) / 2 == pairs && input.size(1) > 0,
              "input must be [rows, in_features] with in_features ", 2 * pairs - 1, " or ", 2 * pairs,
              " (the weight packed_weight was made from), got shape ", input.sizes());
  TORCH_CHECK(input.stride(1) == 1 || input.size(1) == 1, "input must have unit stride in its last dimension, got "
              "strides ", input.strides());
  const int64_t rows = input.size(0), in_features = input.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat,
              "out must be bfloat16 or float32, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) > (panels - 1) * kPanel &&
                  out.size(1) <= panels * kPanel,
              "out must be [", rows, ", out_features] with out_features in [", (panels - 1) * kPanel + 1, ", ",
              panels * kPanel, "] (the weight packed_weight was made from), got shape ", out.sizes());
  TORCH_CHECK(out.stride(1) == 1, "out must have unit stride in its last dimension, got strides ", out.strides());
  const int64_t out_features = out.size(1);
  if (bias.has_value()) {
    check_bfloat16(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(), "bias must be [",
                out_features, "], got shape ", bias->sizes());
  }
  if (rows == 0) return;

  const PackedLinearFn kernel = active_kernels().packed_linear;
  void* out_ptr = out.data_ptr();
  const bool out_is_float32 = out.scalar_type() == at::kFloat;
  const auto* x = reinterpret_cast<const bfloat16*>(input.data_ptr());
  const auto* w = reinterpret_cast<const bfloat16*>(packed_weight.data_ptr());
  const auto* b = bias.has_value() ? reinterpret_cast<const bfloat16*>(bias->data_ptr()) : nullptr;
  // Threads get whole panels; a panel is too little work to hand out below ~256K multiply-adds.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / (rows * kPanel * in_features));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    kernel(out_ptr, out.stride(0), out_is_float32, x, input.stride(0), w, b, rows, in_features, out_features, begin,
           end);
  });
}

}  // namespace kvflow::cpu
