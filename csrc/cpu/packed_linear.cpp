// pack_linear_weight and packed_linear on the CPU: the weight is reordered once, at load, into
// panels (see kernel_table.h), and each product splits the panels across threads.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include <memory>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

constexpr int64_t kPanel = kPackedLinearPanel;

void check_bfloat16(const at::Tensor& t, const char* name) {
  check_device_type(t, name, c10::DeviceType::CPU);
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight, bool gate_up) {
  check_bfloat16(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0,
              "weight must be a non-empty [out_features, in_features] tensor, got shape ", weight.sizes());
  TORCH_CHECK(!gate_up || weight.size(0) % 2 == 0, "a gate_up weight stacks gate and up rows, so out_features must "
              "be even, got shape ", weight.sizes());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t half = out_features / 2;
  const int64_t panels = gate_up ? (half + kGateUpHalfPanel - 1) / kGateUpHalfPanel : (out_features + kPanel - 1) / kPanel;
  const int64_t pairs = (in_features + 1) / 2;
  // The weight row behind feature j of panel p, or -1 for the zeros past an edge.
  auto source_row = [&](int64_t p, int64_t j) -> int64_t {
    if (!gate_up) return p * kPanel + j < out_features ? p * kPanel + j : -1;
    const int64_t feature = p * kGateUpHalfPanel + j % kGateUpHalfPanel;
    return feature < half ? feature + (j < kGateUpHalfPanel ? 0 : half) : -1;
  };
  at::Tensor packed = at::zeros({panels, pairs, kPanel, 2}, weight.options());
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const bfloat16*>(w.data_ptr());
  auto* dst = reinterpret_cast<bfloat16*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t o = source_row(p, j);
        if (o < 0) continue;
        const bfloat16* row = src + o * in_features;
        for (int64_t k = 0; k < in_features; ++k) dst[((p * pairs + k / 2) * kPanel + j) * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

namespace {

// The checks packed_linear and packed_silu_and_mul share: input, packed weight, and out's shape for
// features_per_panel output features per panel.
void check_packed_product(const at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                          int64_t features_per_panel, const char* packed_by) {
  check_bfloat16(input, "input");
  check_bfloat16(packed_weight, "packed_weight");
  check_device_type(out, "out", c10::DeviceType::CPU);
  TORCH_CHECK(packed_weight.dim() == 4 && packed_weight.size(2) == kPanel && packed_weight.size(3) == 2 &&
                  packed_weight.is_contiguous(),
              "packed_weight must be ", packed_by, "'s contiguous [panels, in_features / 2, ", kPanel,
              ", 2] tensor, got shape ", packed_weight.sizes());
  const int64_t panels = packed_weight.size(0), pairs = packed_weight.size(1);
  TORCH_CHECK(input.dim() == 2 && (input.size(1) + 1) / 2 == pairs && input.size(1) > 0,
              "input must be [rows, in_features] with in_features ", 2 * pairs - 1, " or ", 2 * pairs,
              " (the weight packed_weight was made from), got shape ", input.sizes());
  TORCH_CHECK(input.stride(1) == 1 || input.size(1) == 1, "input must have unit stride in its last dimension, got "
              "strides ", input.strides());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == input.size(0) && out.size(1) > (panels - 1) * features_per_panel &&
                  out.size(1) <= panels * features_per_panel,
              "out must be [", input.size(0), ", out_features] with out_features in [",
              (panels - 1) * features_per_panel + 1, ", ", panels * features_per_panel,
              "] (the weight packed_weight was made from), got shape ", out.sizes());
  TORCH_CHECK(out.stride(1) == 1, "out must have unit stride in its last dimension, got strides ", out.strides());
}

// Threads get whole panels; a panel is too little work to hand out below ~256K multiply-adds.
int64_t panels_per_task(int64_t rows, int64_t in_features) {
  return std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, rows * kPanel * in_features));
}

void run_packed_product(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                        const bfloat16* bias, bool silu_and_mul) {
  const int64_t rows = input.size(0), in_features = input.size(1), panels = packed_weight.size(0);
  if (rows == 0) return;
  const PackedLinearFn kernel = active_kernels().packed_linear;
  void* out_ptr = out.data_ptr();
  const bool out_is_float32 = out.scalar_type() == at::kFloat;
  const auto* x = reinterpret_cast<const bfloat16*>(input.data_ptr());
  const auto* w = reinterpret_cast<const bfloat16*>(packed_weight.data_ptr());
  const int64_t grain = panels_per_task(rows, in_features);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    kernel(out_ptr, out.stride(0), out_is_float32, silu_and_mul, x, input.stride(0), w, bias, rows, in_features,
           out.size(1), begin, end);
  });
}

}  // namespace

namespace {

// packed_linear or packed_silu_and_mul as a program node: the panels cut into one part per thread
// as at::parallel_for would cut them, each part handed out a panel at a time (ProductCells), so
// that a thread done with its part takes panels from the back of a slower one's.
class PackedProductNode final : public OpNode {
 public:
  explicit PackedProductNode(const NodeArgs& args)
      : out_(args.tensor(0)), input_(args.tensor(1)), packed_(args.tensor(2)), silu_and_mul_(args.op != "packed_linear") {
    if (silu_and_mul_) {
      check_packed_product(out_, input_, packed_, kGateUpHalfPanel, "pack_linear_weight(gate_up=True)");
      check_bfloat16(out_, "out");
    } else {
      check_packed_product(out_, input_, packed_, kPanel, "pack_linear_weight");
      TORCH_CHECK(out_.scalar_type() == at::kBFloat16 || out_.scalar_type() == at::kFloat,
                  "out must be bfloat16 or float32, got ", out_.scalar_type());
      bias_ = args.optional_tensor(3);
      if (bias_.has_value()) {
        check_bfloat16(*bias_, "bias");
        TORCH_CHECK(bias_->dim() == 1 && bias_->size(0) == out_.size(1) && bias_->is_contiguous(), "bias must be [",
                    out_.size(1), "], got shape ", bias_->sizes());
      }
    }
  }

  void configure(int64_t threads) override {
    kernel_ = active_kernels().packed_linear;
    if (cells_ == nullptr || cells_->parts() != threads) {
      // Four panels a cell past the few rows: the AVX2 kernel widens the input rows once per
      // call, which would otherwise take a part of each cell.
      cells_ = std::make_unique<ProductCells>(packed_.data_ptr(), packed_.size(0),
                                              packed_.stride(0) * packed_.element_size(), threads,
                                              panels_per_task(input_.size(0), input_.size(1)),
                                              /*tile=*/input_.size(0) <= kPackedLinearFewRows ? 1 : 4);
    }
  }

  int64_t units(int) const override { return kShared; }

  void run(int, const Turn& turn) override {
    if (input_.size(0) == 0) return;
    cells_->run(
        turn.tid,
        [&](int64_t begin, int64_t end) {
          kernel_(out_.data_ptr(), out_.stride(0), out_.scalar_type() == at::kFloat, silu_and_mul_,
                  reinterpret_cast<const bfloat16*>(input_.data_ptr()), input_.stride(0),
                  reinterpret_cast<const bfloat16*>(packed_.data_ptr()),
                  bias_.has_value() ? reinterpret_cast<const bfloat16*>(bias_->data_ptr()) : nullptr,
                  input_.size(0), input_.size(1), out_.size(1), begin, end);
        },
        turn.round);
  }

  const char* first_read(int, int64_t tid) const override {
    return cells_ != nullptr && input_.size(0) > 0 ? cells_->first_read(tid) : nullptr;
  }

 private:
  at::Tensor out_, input_, packed_;
  std::optional<at::Tensor> bias_;
  bool silu_and_mul_;
  PackedLinearFn kernel_ = nullptr;
  std::unique_ptr<ProductCells> cells_;
};

}  // namespace

std::unique_ptr<OpNode> make_packed_linear_node(const NodeArgs& args) {
  return std::make_unique<PackedProductNode>(args);
}

void packed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                   const std::optional<at::Tensor>& bias) {
  check_packed_product(out, input, packed_weight, kPanel, "pack_linear_weight");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat,
              "out must be bfloat16 or float32, got ", out.scalar_type());
  const int64_t out_features = out.size(1);
  if (bias.has_value()) {
    check_bfloat16(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(), "bias must be [",
                out_features, "], got shape ", bias->sizes());
  }
  run_packed_product(out, input, packed_weight,
                     bias.has_value() ? reinterpret_cast<const bfloat16*>(bias->data_ptr()) : nullptr, false);
}

void packed_silu_and_mul(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_gate_up) {
  check_packed_product(out, input, packed_gate_up, kGateUpHalfPanel, "pack_linear_weight(gate_up=True)");
  check_bfloat16(out, "out");
  run_packed_product(out, input, packed_gate_up, nullptr, true);
}

}  // namespace kvflow::cpu
