// A few rows (decode) through every layer of the stack inside one parallel region. One op call
// per kernel starts and joins the threads a half-dozen times per layer: at batch 1 each start
// and join costs 1-3 us, during which the other threads and the memory bus wait. Here the
// threads start once per step and meet at a spin barrier between the kernels, each running a
// share of each: cells of a product's output features, attention items, rows of the norms.
// Every output is computed by the same kernel over the same inputs as in one call per kernel,
// so the result is bit for bit the same.
// Measured at batch-1 decode of the default model, one process, alternating, at 43-49 GB/s:
// 6.50-6.80 ms a token against 6.92-7.49 with one call per kernel; in slow phases (31-33 GB/s)
// the step is bound by the weights' bytes either way.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "decoder_layer.h"
#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "prepared_ops.h"
#include "product_cells.h"
#include "spin_barrier.h"

namespace kvflow::cpu {
namespace {

// What a thread asks for while it waits at a barrier: its first cell of the next product.
constexpr int64_t kAheadBytes = 32 << 10;

std::atomic<int64_t> region_steps{0}, region_wall_ns{0}, region_thread_ns{0}, region_wait_ns{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A layer's tensors other than its four products' weights (those are in ProductCells).
struct LayerPointers {
  const void *input_norm, *post_norm, *qkv_bias;
  void *key_cache, *value_cache;
};

}  // namespace

bool run_layers_in_one_region(at::Tensor& hidden, at::Tensor& residual,
                              const std::function<LayerWeights(size_t)>& layer_weights, size_t layers,
                              at::TensorList key_caches, at::TensorList value_caches, const StepArgs& s,
                              Scratch& scratch, const StepPlans& plans) {
#ifndef _OPENMP
  return false;
#else
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || at::in_parallel_region() || hidden.size(0) == 0) return false;
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t intermediate = scratch.activated.size(1);
  const int64_t q_size = s.num_heads * s.head_dim, qkv_size = scratch.qkv.size(1);
  const int64_t element = hidden.element_size();

  std::vector<LayerPointers> weights(layers);
  std::vector<ProductCells> products;  // per layer: qkv, o, gate_up, down
  products.reserve(4 * layers);
  for (size_t i = 0; i < layers; ++i) {
    const LayerWeights w = layer_weights(i);
    weights[i] = {w.input_norm.data_ptr(), w.post_norm.data_ptr(),
                  w.qkv_bias.has_value() ? w.qkv_bias->data_ptr() : nullptr,
                  key_caches[i].data_ptr(), value_caches[i].data_ptr()};
    products.emplace_back(w.qkv.data_ptr(), qkv_size, hidden_size * element, threads);
    products.emplace_back(w.o.data_ptr(), hidden_size, q_size * element, threads);
    products.emplace_back(w.gate_up.data_ptr(), 2 * intermediate, hidden_size * element, threads);
    products.emplace_back(w.down.data_ptr(), hidden_size, intermediate * element, threads);
  }
  const KernelTable& kernels = active_kernels();
  const DType dtype = plans.norm.dtype;
  const FusedAddRmsNormFn add_norm = kernels.fused_add_rms_norm[int(dtype)];
  const SmallLinearFn linear = kernels.small_linear[int(dtype)];
  const GatedActivationFn silu_and_mul = kernels.silu_and_mul[int(dtype)];
  const float eps = float(s.epsilon);
  const int64_t hidden_stride = plans.norm.x.stride, residual_stride = plans.norm.y.stride;
  void* h = hidden.data_ptr();
  void* r = residual.data_ptr();
  void* qkv = scratch.qkv.data_ptr();
  void* attended = scratch.attention.data_ptr();
  void* projected = scratch.projected.data_ptr();
  void* gate_up = scratch.gate_up.data_ptr();
  void* activated = scratch.activated.data_ptr();
  const PagedAttentionPlan& attention = plans.attention;
  std::unique_ptr<std::atomic<int64_t>[]> next_item(new std::atomic<int64_t>[layers]);
  for (size_t i = 0; i < layers; ++i) next_item[i].store(0, std::memory_order_relaxed);
  SpinBarrier barrier;
  const int64_t region_start = now_ns();

#pragma omp parallel
  {
    const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t thread_start = now_ns();
    int64_t waited = 0;
    const Range rows = share_of(tokens, 1, team, tid);
    // Each wait asks for the first cells this thread will read of the next product, so the
    // bus works while the serial pieces (a one-row norm, the merge) run on another thread.
    // Measured at batch 1, 43-49 GB/s, alternating: 6.50-6.80 ms a token against 6.63-7.01.
    auto wait_then = [&](size_t product) {
      const int64_t start = now_ns();
      barrier.wait(team, product < products.size() ? products[product].first_read(tid) : nullptr,
                   kAheadBytes);
      waited += now_ns() - start;
    };
    auto project = [&](size_t product, void* out, const void* x, const void* bias, int64_t in) {
      ProductCells& cells = products[product];
      cells.run(tid, [&](int64_t begin, int64_t end) {
        linear(out, false, x, cells.weight(), bias, tokens, in, cells.out_features(), begin, end);
      });
      wait_then(product + 1);
    };
    for (size_t i = 0; i < layers; ++i) {
      const LayerPointers& w = weights[i];
      const size_t first = 4 * i;  // this layer's qkv product
      add_norm(h, hidden_stride, r, residual_stride, w.input_norm, hidden_size, eps, 0.0f, rows.begin, rows.end);
      wait_then(first);
      project(first, qkv, h, w.qkv_bias, hidden_size);
      plans.rope.kernel(plans.rope.args, rows.begin, rows.end);
      write_cache_tokens(plans.cache_write, w.key_cache, w.value_cache, rows.begin, rows.end);
      wait_then(first + 1);
      PagedAttentionArgs args = attention.args;
      args.key_cache = w.key_cache;
      args.value_cache = w.value_cache;
      run_attention_items(attention, args, next_item[i]);
      wait_then(first + 1);
      if (attention.max_splits > 1) {
        merge_attention_tokens(attention, args, rows.begin, rows.end);
        wait_then(first + 1);
      }
      project(first + 1, projected, attended, nullptr, q_size);
      add_norm(projected, hidden_size, r, residual_stride, w.post_norm, hidden_size, eps, 0.0f, rows.begin,
               rows.end);
      wait_then(first + 2);
      project(first + 2, gate_up, projected, nullptr, hidden_size);
      silu_and_mul(activated, intermediate, gate_up, 2 * intermediate, intermediate, rows.begin, rows.end);
      wait_then(first + 3);
      project(first + 3, h, activated, nullptr, intermediate);
    }
    region_wait_ns.fetch_add(waited, std::memory_order_relaxed);
    region_thread_ns.fetch_add(now_ns() - thread_start, std::memory_order_relaxed);
  }
  region_wall_ns.fetch_add(now_ns() - region_start, std::memory_order_relaxed);
  region_steps.fetch_add(1, std::memory_order_relaxed);
  return true;
#endif
}

RegionStats decode_region_stats() {
  return {region_steps.load(std::memory_order_relaxed), region_wall_ns.load(std::memory_order_relaxed) * 1e-9,
          region_thread_ns.load(std::memory_order_relaxed) * 1e-9, region_wait_ns.load(std::memory_order_relaxed) * 1e-9};
}

}  // namespace kvflow::cpu
