// rotary_embedding on the CPU: checks (positions read and range-checked here, since this path
// can afford it), then tokens split across threads.
#include <ATen/Parallel.h>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "ops.h"
#include "prepared_ops.h"

namespace kvflow::cpu {

RotaryPlan plan_rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                                 int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  check_device_type(query, "query", c10::DeviceType::CPU);
  const RotaryGeometry g = check_rotary_args(positions, query, key, head_size, cos_sin_cache);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < g.max_position, "positions[", t, "] = ", pos[t],
                " is outside the cos_sin_cache range [0, ", g.max_position, ")");
  }
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
  plan.kernel = active_kernels().rotary_embedding[int(g.dtype)][g.cache_is_float32 ? 0 : 1];
  plan.num_tokens = g.num_tokens;
  return plan;
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const RotaryPlan plan = plan_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox);
  const RotaryArgs& args = plan.args;
  const int64_t work_per_token = (args.num_q_heads + args.num_kv_heads) * args.rotary_dim;
  const int64_t tokens_per_task = std::max<int64_t>(1, 16384 / std::max<int64_t>(work_per_token, 1));
  at::parallel_for(0, plan.num_tokens, tokens_per_task,
                   [&](int64_t begin, int64_t end) { plan.kernel(args, begin, end); });
}

}  // namespace kvflow::cpu
