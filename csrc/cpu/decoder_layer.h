// What the CPU decoder-layer ops share between their two ways of running a stack of layers:
// one kernel call per op with the threads splitting each (decoder_layer.cpp), or, for a few rows,
// every layer inside one parallel region (decode_region.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <functional>
#include <optional>

#include "op_checks.h"
#include "prepared_ops.h"

namespace kvflow::cpu {

struct LayerWeights {
  const at::Tensor& input_norm;
  const at::Tensor& qkv;
  const at::Tensor& o;
  const at::Tensor& post_norm;
  const at::Tensor& gate_up;
  const at::Tensor& down;
  const std::optional<at::Tensor>& qkv_bias;
  // All four or none: pack_linear_weight of qkv, o and down, and of gate_up with gate_up=true.
  const at::Tensor* qkv_packed;
  const at::Tensor* o_packed;
  const at::Tensor* gate_up_packed;
  const at::Tensor* down_packed;
};

// What every layer of one step shares: the batch's attention metadata and the model's shape.
struct StepArgs {
  const at::Tensor& positions;
  const at::Tensor& cos_sin_cache;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& seq_lens;
  int64_t num_heads, num_kv_heads, head_dim;
  double epsilon, scale;
  int64_t max_query_len, max_seq_len, sliding_window;
};

// The intermediate tensors of one layer, reused by every layer of a stack.
struct Scratch {
  at::Tensor qkv, attention, projected, activated, gate_up;

  Scratch(const at::Tensor& hidden, const StepArgs& s, int64_t intermediate, bool packed) {
    const int64_t tokens = hidden.size(0);
    const auto options = hidden.options();
    qkv = at::empty({tokens, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim}, options);
    attention = at::empty({tokens, s.num_heads, s.head_dim}, options);
    projected = at::empty({tokens, hidden.size(1)}, options);
    activated = at::empty({tokens, intermediate}, options);
    if (!packed) gate_up = at::empty({tokens, 2 * intermediate}, options);
  }
};

// The step's metadata (positions, slots, block tables, lengths) checked against the scratch and
// layer 0's caches, once for every layer, and ready to run.
struct StepPlans {
  NormGeometry norm;  // hidden and residual
  RotaryPlan rope;
  CacheWritePlan cache_write;
  PagedAttentionPlan attention;
};

StepPlans plan_step(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& input_norm_weight, Scratch& scratch,
                    const StepArgs& s, const at::Tensor& key_cache, const at::Tensor& value_cache);

// Few rows on the plain weights (small_linear), at least two threads: runs every layer inside one
// parallel region (decode_region.cpp) and returns true; returns false, having done nothing, with
// one thread or inside another parallel region. The layers (caches all of layer 0's shape,
// contiguous) and the step must have been checked: nothing inside the region may throw.
bool run_layers_in_one_region(at::Tensor& hidden, at::Tensor& residual,
                              const std::function<LayerWeights(size_t)>& layer_weights, size_t layers,
                              at::TensorList key_caches, at::TensorList value_caches, const StepArgs& s,
                              Scratch& scratch, const StepPlans& plans);

// What the one-region steps cost so far, summed over every step since the process started: how
// many, their wall time, and the time their threads spent waiting at the barriers between
// kernels (thread-seconds, summed over the threads). Waits are a few percent of the threads' time
// when they have the cores to themselves; far more when another process takes one of them.
struct RegionStats {
  int64_t steps;
  double wall_seconds;
  double thread_seconds;
  double wait_thread_seconds;
};
RegionStats decode_region_stats();

}  // namespace kvflow::cpu
