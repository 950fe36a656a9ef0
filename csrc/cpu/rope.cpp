// rotary_embedding on the CPU: checks (positions read and range-checked here, since this path
// can afford it), then tokens split across threads.
#include <ATen/Parallel.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"
#include "prepared_ops.h"

namespace kvflow::cpu {
namespace {

void check_positions(const int64_t* positions, int64_t num_tokens, int64_t max_position) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(positions[t] >= 0 && positions[t] < max_position, "positions[", t, "] = ", positions[t],
                " is outside the cos_sin_cache range [0, ", max_position, ")");
  }
}

// The positions are checked once a step for all the nodes that read them with one table size.
class RotaryNode final : public OpNode {
 public:
  explicit RotaryNode(const NodeArgs& args)
      : positions_(args.tensor(0)),
        query_(args.tensor(1)),
        key_(args.optional_tensor(2)),
        cos_sin_cache_(args.tensor(3)),
        head_size_(args.integer(0)),
        is_neox_(args.integer(1) != 0) {
    plan_ = plan_rotary_embedding(positions_, query_, key_, head_size_, cos_sin_cache_, is_neox_, false);
  }

  void configure(int64_t) override { plan_.kernel = rotary_kernel(plan_.geometry); }

  bool reads_step() const override { return true; }

  void prepare(StepContext& step) override {
    const RotaryGeometry& g = plan_.geometry;
    if (step.first_time({kCheckPositions, reinterpret_cast<int64_t>(plan_.args.positions), g.num_tokens,
                         g.max_position})) {
      check_positions(plan_.args.positions, g.num_tokens, g.max_position);
    }
  }

  int64_t units(int) const override { return plan_.geometry.num_tokens; }

  // The cos/sin rows of its tokens' positions (query and key are the product just made).
  void warm(int, const Turn& turn) const override {
    const Range tokens = share_of(plan_.geometry.num_tokens, 1, turn.team, turn.tid);
    const int64_t row_bytes = plan_.geometry.rotary_dim * cos_sin_cache_.element_size();
    for (int64_t t = tokens.begin; t < tokens.end && t < tokens.begin + kWarmTokens; ++t) {
      const int64_t position = plan_.args.positions[t];
      if (position >= 0 && position < plan_.geometry.max_position) {
        warm_rows(cos_sin_cache_.data_ptr(), row_bytes, row_bytes, {position, position + 1}, false);
      }
    }
  }

  void run(int, const Turn& turn) override {
    const Range tokens = share_of(plan_.geometry.num_tokens, 1, turn.team, turn.tid);
    if (tokens.begin < tokens.end) plan_.kernel(plan_.args, tokens.begin, tokens.end);
  }

 private:
  static constexpr int64_t kCheckPositions = 1;
  static constexpr int64_t kWarmTokens = 8;
  at::Tensor positions_, query_;
  std::optional<at::Tensor> key_;
  at::Tensor cos_sin_cache_;
  int64_t head_size_;
  bool is_neox_;
  RotaryPlan plan_;
};

}  // namespace

std::unique_ptr<OpNode> make_rotary_embedding_node(const NodeArgs& args) { return std::make_unique<RotaryNode>(args); }

RotaryPlan plan_rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                                 int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox,
                                 bool check_positions_in_range) {
  check_device_type(query, "query", c10::DeviceType::CPU);
  const RotaryGeometry g = check_rotary_args(positions, query, key, head_size, cos_sin_cache);
  const int64_t* pos = positions.data_ptr<int64_t>();
  if (check_positions_in_range) check_positions(pos, g.num_tokens, g.max_position);
  RotaryPlan plan;
  RotaryArgs& args = plan.args;
  args.positions = pos;
  args.query = query.data_ptr();
  args.q_stride = g.q_stride;
  args.num_q_heads = g.num_q_heads;
  args.key = key.has_value() ? key->data_ptr() : nullptr;
  args.k_stride = g.k_stride;
  args.num_kv_heads = g.num_kv_heads;
  args.head_size = head_size;
  args.cos_sin = cos_sin_cache.data_ptr();
  args.rotary_dim = g.rotary_dim;
  args.is_neox = is_neox;
  plan.kernel = rotary_kernel(g);
  plan.geometry = g;
  return plan;
}

RotaryFn rotary_kernel(const RotaryGeometry& geometry) {
  return active_kernels().rotary_embedding[int(geometry.dtype)][geometry.cache_is_float32 ? 0 : 1];
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const RotaryPlan plan = plan_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox);
  const RotaryArgs& args = plan.args;
  const int64_t work_per_token = (args.num_q_heads + args.num_kv_heads) * args.rotary_dim;
  const int64_t tokens_per_task = std::max<int64_t>(1, 16384 / std::max<int64_t>(work_per_token, 1));
  at::parallel_for(0, plan.geometry.num_tokens, tokens_per_task,
                   [&](int64_t begin, int64_t end) { plan.kernel(args, begin, end); });
}

}  // namespace kvflow::cpu
