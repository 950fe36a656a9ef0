// small_linear on the CPU: out = input @ weight^T (+ bias) for a handful of rows, where the
// cost is reading the weights once. Output features are split into one contiguous part per
// thread, so each thread streams its part of the weight matrix front to back, and a thread
// done early takes cells from the ends of the others' (product_cells.h).
#include <ATen/Parallel.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"
#include "kvflow/cpu/product_cells.h"

namespace kvflow::cpu {

namespace {

struct SmallLinearGeometry {
  DType dtype;
  bool out_is_float32;
  int64_t rows, in_features, out_features;
};

SmallLinearGeometry check_small_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias) {
  check_device_type(input, "input", c10::DeviceType::CPU);
  const DType dtype = kernel_dtype(weight, "weight");
  check_like(input, "input", weight, "weight");
  const bool out_is_float32 = out.scalar_type() == at::kFloat;
  if (!out_is_float32) check_like(out, "out", weight, "weight");
  check_device_type(out, "out", c10::DeviceType::CPU);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [out_features, in_features] "
              "tensor, got shape ", weight.sizes());
  TORCH_CHECK(input.dim() == 2 && input.size(1) == weight.size(1), "input must be [rows, ", weight.size(1),
              "] (in_features of weight), got shape ", input.sizes());
  const int64_t rows = input.size(0), in_features = weight.size(1), out_features = weight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == out_features && out.is_contiguous(),
              "out must be a contiguous [", rows, ", ", out_features, "] tensor, got shape ", out.sizes());
  if (bias.has_value()) {
    check_like(*bias, "bias", weight, "weight");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(), "bias must be [",
                out_features, "], got shape ", bias->sizes());
  }
  return {dtype, out_is_float32, rows, in_features, out_features};
}

// The product's cells stay from step to step, a round a step; all threads take part.
class SmallLinearNode final : public OpNode {
 public:
  explicit SmallLinearNode(const NodeArgs& args)
      : out_(args.tensor(0)), input_(args.tensor(1)), weight_(args.tensor(2)), bias_(args.optional_tensor(3)) {
    geometry_ = check_small_linear(out_, input_, weight_, bias_);
    TORCH_CHECK(input_.is_contiguous(), "small_linear in a program needs a contiguous input, got strides ",
                input_.strides());
  }

  void configure(int64_t threads) override {
    kernel_ = active_kernels().small_linear[int(geometry_.dtype)];
    if (cells_ == nullptr || cells_->parts() != threads) {
      cells_ = std::make_unique<ProductCells>(weight_.data_ptr(), geometry_.out_features,
                                              geometry_.in_features * weight_.element_size(), threads);
    }
  }

  int64_t units(int) const override { return kShared; }

  void run(int, const Turn& turn) override {
    if (geometry_.rows == 0) return;
    void* out = out_.data_ptr();
    const void* x = input_.data_ptr();
    const void* bias = bias_.has_value() ? bias_->data_ptr() : nullptr;
    const SmallLinearGeometry& g = geometry_;
    cells_->run(
        turn.tid,
        [&](int64_t begin, int64_t end) {
          kernel_(out, g.out_is_float32, x, cells_->weight(), bias, g.rows, g.in_features, g.out_features, begin,
                  end);
        },
        turn.round);
  }

  const char* first_read(int, int64_t tid) const override {
    return cells_ != nullptr ? cells_->first_read(tid) : nullptr;
  }

 private:
  at::Tensor out_, input_, weight_;
  std::optional<at::Tensor> bias_;
  SmallLinearGeometry geometry_{};
  std::unique_ptr<ProductCells> cells_;
  SmallLinearFn kernel_ = nullptr;
};

}  // namespace

std::unique_ptr<OpNode> make_small_linear_node(const NodeArgs& args) {
  return std::make_unique<SmallLinearNode>(args);
}

void small_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  const SmallLinearGeometry g = check_small_linear(out, input, weight, bias);
  const int64_t rows = g.rows, in_features = g.in_features, out_features = g.out_features;
  const bool out_is_float32 = g.out_is_float32;
  if (rows == 0) return;  // the kernels' tiles assume at least one row
  const at::Tensor x = input.contiguous();
  const SmallLinearFn kernel = active_kernels().small_linear[int(g.dtype)];
  void* out_ptr = out.data_ptr();
  const void* x_ptr = x.data_ptr();
  const void* w_ptr = weight.data_ptr();
  const void* b_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  auto run = [&](int64_t begin, int64_t end) {
    kernel(out_ptr, out_is_float32, x_ptr, w_ptr, b_ptr, rows, in_features, out_features, begin, end);
  };
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || out_features <= ProductCells::kGrain || at::in_parallel_region()) {
    run(0, out_features);
    return;
  }
  ProductCells cells(w_ptr, out_features, in_features * weight.element_size(), threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tid = begin; tid < end; ++tid) cells.run(tid, run);
  });
}

}  // namespace kvflow::cpu
