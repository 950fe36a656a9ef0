// silu_and_mul, gelu_and_mul and gelu_tanh_and_mul on the CPU: checks, then rows split across threads.
#include <ATen/Parallel.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
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

GatedActivationFn const (&gated_kernels(const KernelTable& table, const std::string& op))[kNumDTypes] {
  if (op == "silu_and_mul") return table.silu_and_mul;
  if (op == "gelu_and_mul") return table.gelu_and_mul;
  TORCH_CHECK(op == "gelu_tanh_and_mul", "no gated activation kernel for the op ", op);
  return table.gelu_tanh_and_mul;
}

class GatedActivationNode final : public OpNode {
 public:
  explicit GatedActivationNode(const NodeArgs& args) : op_(args.op), out_(args.tensor(0)), input_(args.tensor(1)) {
    check_device_type(input_, "input", c10::DeviceType::CPU);
    geometry_ = check_gated_args(out_, input_);
    gated_kernels(active_kernels(), op_);  // an unknown op fails here, at capture
    share_ = RowShare::of(input_, geometry_.in.rows);
  }

  void configure(int64_t) override { kernel_ = gated_kernels(active_kernels(), op_)[int(geometry_.dtype)]; }

  int64_t units(int) const override { return share_.units; }

  // The output rows it overwrites (its input is the product just made).
  void warm(int, const Turn& turn) const override {
    const int64_t element = out_.element_size();
    warm_rows(out_.data_ptr(), geometry_.out.stride * element, geometry_.out.width * element,
              share_.rows(turn.tid, turn.team), true);
  }

  void run(int, const Turn& turn) override {
    const Range rows = share_.rows(turn.tid, turn.team);
    if (rows.begin < rows.end) {
      kernel_(out_.data_ptr(), geometry_.out.stride, input_.data_ptr(), geometry_.in.stride, geometry_.out.width,
              rows.begin, rows.end);
    }
  }

 private:
  std::string op_;
  at::Tensor out_, input_;
  GatedGeometry geometry_{};
  RowShare share_;
  GatedActivationFn kernel_ = nullptr;
};

}  // namespace

std::unique_ptr<OpNode> make_gated_activation_node(const NodeArgs& args) {
  return std::make_unique<GatedActivationNode>(args);
}

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
