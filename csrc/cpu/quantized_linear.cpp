// quantized_linear on the CPU: the input rows are quantized to int8 per 32-block once, then each
// thread takes a contiguous part of the output features and streams its weight rows, in their
// GGUF blocks, front to back.
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {

namespace {

// Output features a thread takes at least: fewer would not pay for the hand-off.
constexpr int64_t kFeaturesPerTask = 64;

void check_float_or_bfloat16(const at::Tensor& t, const char* name) {
  check_device_type(t, name, c10::DeviceType::CPU);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// The input's rows as float32, quantized block by block (quantize_activation_block).
struct QuantizedInput {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;

  QuantizedInput(const at::Tensor& input, int64_t blocks) {
    const int64_t rows = input.size(0), in_features = input.size(1);
    q.resize(size_t(rows * in_features));
    scale.resize(size_t(rows * blocks));
    sum.resize(size_t(rows * blocks));
    const at::Tensor x = input.to(at::kFloat).contiguous();
    const float* values = x.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t i = r * blocks + b;
          quantize_activation_block(values + i * kQuantBlock, q.data() + i * kQuantBlock, &scale[size_t(i)],
                                    &sum[size_t(i)]);
        }
      }
    });
  }

  QuantizedRows rows(int64_t blocks) const { return {q.data(), scale.data(), sum.data(), blocks}; }
};

}  // namespace

void quantized_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t ggml_type,
                      const std::optional<at::Tensor>& bias) {
  const int format = quant_format_of(ggml_type);
  TORCH_CHECK(format >= 0, "quantized_linear runs GGML types Q4_0 (2), Q4_1 (3) and Q8_0 (8), got type ", ggml_type);
  check_device_type(weight, "weight", c10::DeviceType::CPU);
  TORCH_CHECK(weight.scalar_type() == at::kByte, "weight must be uint8 (the GGUF blocks' bytes), got ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [out_features, row bytes] "
              "tensor, got shape ", weight.sizes());
  check_float_or_bfloat16(input, "input");
  check_float_or_bfloat16(out, "out");
  const int64_t block_bytes = quant_block_bytes(QuantFormat(format));
  const int64_t out_features = weight.size(0), row_bytes = weight.size(1);
  TORCH_CHECK(row_bytes % block_bytes == 0, "weight rows of GGML type ", ggml_type, " are whole ", block_bytes,
              "-byte blocks, got ", row_bytes, " bytes a row");
  const int64_t blocks = row_bytes / block_bytes, in_features = blocks * kQuantBlock;
  TORCH_CHECK(input.dim() == 2 && input.size(1) == in_features, "input must be [rows, ", in_features,
              "] (the weight's ", blocks, " blocks of ", kQuantBlock, " a row), got shape ", input.sizes());
  const int64_t rows = input.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == out_features && out.is_contiguous(),
              "out must be a contiguous [", rows, ", ", out_features, "] tensor, got shape ", out.sizes());
  std::vector<float> bias_values;
  if (bias.has_value()) {
    check_float_or_bfloat16(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [", out_features, "], got shape ",
                bias->sizes());
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_values.assign(b.data_ptr<float>(), b.data_ptr<float>() + out_features);
  }
  if (rows == 0 || out_features == 0) return;
  const QuantizedInput x(input, blocks);
  const QuantizedRows quantized = x.rows(blocks);
  const QuantizedLinearFn kernel = active_kernels().quantized_linear[format];
  void* out_ptr = out.data_ptr();
  const bool out_is_float32 = out.scalar_type() == at::kFloat;
  const auto* w = weight.data_ptr<uint8_t>();
  const float* b = bias_values.empty() ? nullptr : bias_values.data();
  at::parallel_for(0, out_features, kFeaturesPerTask, [&](int64_t begin, int64_t end) {
    kernel(out_ptr, out_is_float32, quantized, w, row_bytes, b, rows, out_features, begin, end);
  });
}

}  // namespace kvflow::cpu
