// rms_norm, fused_add_rms_norm and rms_norm_add on the CPU: checks, then rows split across threads.
#include <ATen/Parallel.h>

#include <algorithm>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

// Enough elements per task that the thread hand-off is noise against the row work.
int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// Calls fn(x byte offset, y byte offset, count) over rows [begin, end) of two views of the same
// rows, one run of evenly strided rows at a time (a group, where rows come in groups).
template <class Fn>
void for_each_run(const RowView& x, const RowView& y, int64_t element_size, int64_t begin, int64_t end,
                  const Fn& fn) {
  const int64_t group = std::min(x.group_rows, y.group_rows);
  while (begin < end) {
    const int64_t run_end = std::min(end, (begin / group + 1) * group);
    fn(x.offset(begin) * element_size, y.offset(begin) * element_size, run_end - begin);
    begin = run_end;
  }
}

// The three norm ops as a program node. Tensors 0 and 1 are rms_norm's (out, input),
// fused_add_rms_norm's (input, residual) and rms_norm_add's (residual, input).
enum class NormKind { kNorm, kFusedAdd, kNormAdd };

class NormNode final : public OpNode {
 public:
  NormNode(const NodeArgs& args, NormKind kind)
      : a_(args.tensor(0)), b_(args.tensor(1)), weight_(args.tensor(2)), kind_(kind) {
    epsilon_ = float(args.real(0));
    weight_offset_ = float(args.real(1));
    // check_norm_args takes the tensor the rows are read from first
    switch (kind) {
      case NormKind::kNorm:
        check_device_type(a_, "out", c10::DeviceType::CPU);
        geometry_ = check_norm_args(b_, "input", a_, "out", weight_, args.real(0), /*grouped=*/true);
        break;
      case NormKind::kFusedAdd:
        check_device_type(a_, "input", c10::DeviceType::CPU);
        geometry_ = check_norm_args(a_, "input", b_, "residual", weight_, args.real(0));
        break;
      case NormKind::kNormAdd:
        check_device_type(a_, "residual", c10::DeviceType::CPU);
        geometry_ = check_norm_args(b_, "input", a_, "residual", weight_, args.real(0));
        break;
    }
    share_ = RowShare::of(a_, geometry_.x.rows);
  }

  void configure(int64_t) override {
    const KernelTable& kernels = active_kernels();
    rms_norm_ = kernels.rms_norm[int(geometry_.dtype)];
    fused_add_ = kernels.fused_add_rms_norm[int(geometry_.dtype)];
    norm_add_ = kernels.rms_norm_add[int(geometry_.dtype)];
  }

  int64_t units(int) const override { return share_.units; }

  // The weight, and the residual rows it updates (fused_add_rms_norm, rms_norm_add).
  // fused_add_rms_norm's input is the product just made, in both threads' caches.
  void warm(int, const Turn& turn) const override {
    const Range rows = share_.rows(turn.tid, turn.team);
    if (rows.begin >= rows.end) return;
    const int64_t element = weight_.element_size(), row_bytes = geometry_.x.width * element;
    warm_rows(weight_.data_ptr(), 0, row_bytes, {0, 1}, false);
    switch (kind_) {
      case NormKind::kFusedAdd: warm_rows(b_.data_ptr(), geometry_.y.stride * element, row_bytes, rows, true); break;
      case NormKind::kNormAdd: warm_rows(a_.data_ptr(), geometry_.y.stride * element, row_bytes, rows, true); break;
      case NormKind::kNorm: break;  // its rows may be grouped (for_each_run): left to the kernel
    }
  }

  void run(int, const Turn& turn) override {
    const Range rows = share_.rows(turn.tid, turn.team);
    if (rows.begin >= rows.end) return;
    const int64_t width = geometry_.x.width;
    switch (kind_) {
      case NormKind::kFusedAdd:
        fused_add_(a_.data_ptr(), geometry_.x.stride, b_.data_ptr(), geometry_.y.stride, weight_.data_ptr(), width,
                   epsilon_, weight_offset_, rows.begin, rows.end);
        break;
      case NormKind::kNormAdd:  // geometry_.x is the input's rows, geometry_.y the residual's
        norm_add_(a_.data_ptr(), geometry_.y.stride, b_.data_ptr(), geometry_.x.stride, weight_.data_ptr(), width,
                  epsilon_, weight_offset_, rows.begin, rows.end);
        break;
      case NormKind::kNorm: {  // geometry_.x is the input's rows, geometry_.y the output's
        char* out = static_cast<char*>(a_.data_ptr());
        const char* in = static_cast<const char*>(b_.data_ptr());
        for_each_run(geometry_.x, geometry_.y, a_.element_size(), rows.begin, rows.end,
                     [&](int64_t in_offset, int64_t out_offset, int64_t count) {
                       rms_norm_(out + out_offset, geometry_.y.stride, in + in_offset, geometry_.x.stride,
                                 weight_.data_ptr(), width, epsilon_, weight_offset_, 0, count);
                     });
        break;
      }
    }
  }

 private:
  at::Tensor a_, b_, weight_;
  NormKind kind_;
  float epsilon_ = 0, weight_offset_ = 0;
  NormGeometry geometry_{};
  RowShare share_;
  RmsNormFn rms_norm_ = nullptr;
  FusedAddRmsNormFn fused_add_ = nullptr;
  RmsNormFn norm_add_ = nullptr;
};

}  // namespace

std::unique_ptr<OpNode> make_rms_norm_node(const NodeArgs& args) {
  return std::make_unique<NormNode>(args, NormKind::kNorm);
}

std::unique_ptr<OpNode> make_fused_add_rms_norm_node(const NodeArgs& args) {
  return std::make_unique<NormNode>(args, NormKind::kFusedAdd);
}

std::unique_ptr<OpNode> make_rms_norm_add_node(const NodeArgs& args) {
  return std::make_unique<NormNode>(args, NormKind::kNormAdd);
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon,
              double weight_offset) {
  check_device_type(input, "input", c10::DeviceType::CPU);
  const NormGeometry g = check_norm_args(input, "input", out, "out", weight, epsilon, /*grouped=*/true);
  const RmsNormFn kernel = active_kernels().rms_norm[int(g.dtype)];
  char* out_ptr = static_cast<char*>(out.data_ptr());
  const char* in_ptr = static_cast<const char*>(input.data_ptr());
  const void* w_ptr = weight.data_ptr();
  at::parallel_for(0, g.x.rows, rows_per_task(g.x.width), [&](int64_t begin, int64_t end) {
    for_each_run(g.x, g.y, input.element_size(), begin, end, [&](int64_t in_offset, int64_t out_offset, int64_t n) {
      kernel(out_ptr + out_offset, g.y.stride, in_ptr + in_offset, g.x.stride, w_ptr, g.x.width, float(epsilon),
             float(weight_offset), 0, n);
    });
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

void rms_norm_add(at::Tensor& residual, const at::Tensor& input, const at::Tensor& weight, double epsilon,
                  double weight_offset) {
  check_device_type(residual, "residual", c10::DeviceType::CPU);
  const NormGeometry g = check_norm_args(input, "input", residual, "residual", weight, epsilon);
  const RmsNormFn kernel = active_kernels().rms_norm_add[int(g.dtype)];
  void* res_ptr = residual.data_ptr();
  const void* in_ptr = input.data_ptr();
  const void* w_ptr = weight.data_ptr();
  at::parallel_for(0, g.x.rows, rows_per_task(g.x.width), [&](int64_t begin, int64_t end) {
    kernel(res_ptr, g.y.stride, in_ptr, g.x.stride, w_ptr, g.x.width, float(epsilon), float(weight_offset), begin,
           end);
  });
}

}  // namespace kvflow::cpu
