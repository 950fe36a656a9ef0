// scale_logits on the CPU: float32 logits scaled and soft-capped in place (kvflow/cpu/logits.h),
// the elements of all rows split evenly across threads. Also a node of the CPU executor's programs.
#include <ATen/Parallel.h>

#include <algorithm>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

constexpr int64_t kGrain = 4096;  // elements

// Elements [begin, end) of logits [rows, vocab], counted row after row.
void scale_span(const KernelTable& kt, float* logits, int64_t row_stride, int64_t vocab, float inv_divisor,
                float soft_cap, int64_t begin, int64_t end) {
  while (begin < end) {
    const int64_t row = begin / vocab, column = begin % vocab;
    const int64_t n = std::min(vocab - column, end - begin);
    kt.scale_logits(logits + row * row_stride + column, n, inv_divisor, soft_cap);
    begin += n;
  }
}

class ScaleLogitsNode final : public OpNode {
 public:
  explicit ScaleLogitsNode(const NodeArgs& args)
      : logits_(args.tensor(0)), inv_divisor_(float(1.0 / args.real(0))), soft_cap_(float(args.real(1))) {
    check_device_type(logits_, "logits", c10::DeviceType::CPU);
    check_scale_logits_args(logits_, args.real(0), args.real(1));
  }

  void configure(int64_t) override { kernels_ = &active_kernels(); }

  int64_t units(int) const override { return kShared; }

  void run(int, const Turn& turn) override {
    const int64_t vocab = logits_.size(1);
    const Range share = share_of(logits_.size(0) * vocab, kGrain, turn.team, turn.tid);
    scale_span(*kernels_, logits_.data_ptr<float>(), logits_.stride(0), vocab, inv_divisor_, soft_cap_,
               share.begin, share.end);
  }

 private:
  at::Tensor logits_;
  float inv_divisor_, soft_cap_;
  const KernelTable* kernels_ = nullptr;
};

}  // namespace

std::unique_ptr<OpNode> make_scale_logits_node(const NodeArgs& args) {
  return std::make_unique<ScaleLogitsNode>(args);
}

void scale_logits(at::Tensor& logits, double divisor, double soft_cap) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  check_scale_logits_args(logits, divisor, soft_cap);
  const KernelTable& kt = active_kernels();
  const int64_t vocab = logits.size(1);
  float* base = logits.data_ptr<float>();
  at::parallel_for(0, logits.size(0) * vocab, kGrain, [&](int64_t begin, int64_t end) {
    scale_span(kt, base, logits.stride(0), vocab, float(1.0 / divisor), float(soft_cap), begin, end);
  });
}

}  // namespace kvflow::cpu
