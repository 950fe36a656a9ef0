// Llama-family decoder layers on the CPU, as one op per layer (llama_decoder_layer) or one op for
// the whole stack (llama_decoder_layers). At batch-1 decode the weights stream at memory speed
// through small_linear, and what remains is the cost of calling ops from Python through the
// dispatcher: a dozen per layer op by op (about 2 us each), and still some 20 us per layer for
// one call with 28 arguments. The stack op pays that once per step and allocates the layers'
// scratch tensors once. With the layers' packed weights it serves many rows too (batched decode,
// prefill), through packed_linear and packed_silu_and_mul. Both make the same kernel calls in the
// same order as the layer-by-layer path, so their result is bit for bit that path's. A few rows
// on the plain weights with two or more threads run inside one parallel region instead
// (decode_region.cpp), with the same result.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "decoder_layer.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

// The shapes, dtypes and devices of one layer's weights and caches (the kernels check the rest).
void check_layer(const at::Tensor& hidden, const LayerWeights& w, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const StepArgs& s, const std::string& where) {
  const int64_t hidden_size = hidden.size(1), q_size = s.num_heads * s.head_dim;
  const int64_t qkv_rows = q_size + 2 * s.num_kv_heads * s.head_dim;
  auto check_weight = [&](const at::Tensor& t, const char* name, c10::IntArrayRef shape) {
    check_like(t, (where + name).c_str(), hidden, "hidden");
    TORCH_CHECK(t.sizes() == shape, where, name, " must have shape ", shape, ", got ", t.sizes());
  };
  check_weight(w.input_norm, "input_norm_weight", {hidden_size});
  check_weight(w.qkv, "qkv_weight", {qkv_rows, hidden_size});
  if (w.qkv_bias.has_value()) check_weight(*w.qkv_bias, "qkv_bias", {qkv_rows});
  check_weight(w.o, "o_weight", {hidden_size, q_size});
  check_weight(w.post_norm, "post_norm_weight", {hidden_size});
  TORCH_CHECK(w.gate_up.dim() == 2 && w.gate_up.size(0) % 2 == 0, where,
              "gate_up_weight must stack gate and up rows, got shape ", w.gate_up.sizes());
  check_weight(w.gate_up, "gate_up_weight", {w.gate_up.size(0), hidden_size});
  check_weight(w.down, "down_weight", {hidden_size, w.gate_up.size(0) / 2});
  const std::vector<int64_t> cache_shape{key_cache.dim() == 4 ? key_cache.size(0) : -1,
                                         key_cache.dim() == 4 ? key_cache.size(1) : -1, s.num_kv_heads, s.head_dim};
  check_weight(key_cache, "key_cache", cache_shape);
  check_weight(value_cache, "value_cache", cache_shape);
}

// residual += hidden, then the layer; its output goes to hidden.
void run_layer(at::Tensor& hidden, at::Tensor& residual, const LayerWeights& w, at::Tensor& key_cache,
               at::Tensor& value_cache, const StepArgs& s, Scratch& scratch) {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  // Products through packed_linear where the layer's weights were packed (many rows), else
  // small_linear (a few rows, reading the plain weights once).
  auto project = [&](at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor* packed,
                     const std::optional<at::Tensor>& bias) {
    if (packed != nullptr) {
      packed_linear(out, x, *packed, bias);
    } else {
      small_linear(out, x, weight, bias);
    }
  };

  fused_add_rms_norm(hidden, residual, w.input_norm, s.epsilon, 0.0);
  project(scratch.qkv, hidden, w.qkv, w.qkv_packed, w.qkv_bias);
  at::Tensor query = scratch.qkv.narrow(1, 0, q_size);
  const at::Tensor key = scratch.qkv.narrow(1, q_size, kv_size);
  const at::Tensor value = scratch.qkv.narrow(1, q_size + kv_size, kv_size);
  rotary_embedding(s.positions, query, key, s.head_dim, s.cos_sin_cache, /*is_neox=*/true);
  reshape_and_cache(key.view({tokens, s.num_kv_heads, s.head_dim}), value.view({tokens, s.num_kv_heads, s.head_dim}),
                    key_cache, value_cache, s.slot_mapping);
  paged_attention(scratch.attention, query.view({tokens, s.num_heads, s.head_dim}), key_cache, value_cache,
                  s.block_tables, s.cu_seqlens_q, s.seq_lens, s.scale, s.max_query_len, s.max_seq_len,
                  s.sliding_window, 0.0, std::nullopt);

  project(scratch.projected, scratch.attention.view({tokens, q_size}), w.o, w.o_packed, std::nullopt);
  fused_add_rms_norm(scratch.projected, residual, w.post_norm, s.epsilon, 0.0);
  if (w.gate_up_packed != nullptr) {
    packed_silu_and_mul(scratch.activated, scratch.projected, *w.gate_up_packed);
  } else {
    small_linear(scratch.gate_up, scratch.projected, w.gate_up, std::nullopt);
    silu_and_mul(scratch.activated, scratch.gate_up);
  }
  project(hidden, scratch.activated, w.down, w.down_packed, std::nullopt);
}

constexpr int64_t kMinTokensPerPart = 16;

// Request boundaries [0, b1, ..., batch] cutting the batch into one part per thread with about
// the same number of tokens, or nothing where no cut comes within 10% of even (a long prompt
// chunk among decodes) or a part would get too few rows to run its products well. A decreasing
// cu_seqlens_q is declined here and rejected by paged_attention on the whole batch.
std::vector<int64_t> split_requests(const at::Tensor& cu_seqlens_q, int64_t tokens, int64_t parts) {
  check_device_type(cu_seqlens_q, "cu_seqlens_q", c10::DeviceType::CPU);
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) > 0 && cu_seqlens_q.scalar_type() == at::kInt &&
                  cu_seqlens_q.is_contiguous(),
              "cu_seqlens_q must be a contiguous int32 [batch + 1] tensor, got ", cu_seqlens_q.scalar_type(),
              " of shape ", cu_seqlens_q.sizes());
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == tokens, "cu_seqlens_q must run from 0 to the number of tokens ", tokens,
              ", got ", cu[0], " to ", cu[batch]);
  if (parts < 2 || batch < parts || tokens < parts * kMinTokensPerPart) return {};
  for (int64_t b = 0; b < batch; ++b) {
    if (cu[b + 1] < cu[b]) return {};
  }
  std::vector<int64_t> bounds{0};
  for (int64_t b = 1; b < batch && int64_t(bounds.size()) < parts; ++b) {
    const int64_t target = tokens * int64_t(bounds.size()) / parts;
    if (cu[b] < target) continue;
    // The cut nearest the target: before request b, or before request b - 1.
    const bool earlier = b - 1 > bounds.back() && target - cu[b - 1] < cu[b] - target;
    bounds.push_back(earlier ? b - 1 : b);
    if (earlier) --b;  // b may still be the next cut
  }
  bounds.push_back(batch);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t share = cu[bounds[i + 1]] - cu[bounds[i]];
    if (share * parts * 10 > tokens * 11 || share < kMinTokensPerPart) return {};
  }
  return bounds;
}

void check_hidden(const at::Tensor& hidden) {
  check_device_type(hidden, "hidden", c10::DeviceType::CPU);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [num_tokens, hidden_size] "
              "tensor, got shape ", hidden.sizes());
}

int64_t head_dim_of(const at::Tensor& key_cache) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              key_cache.sizes());
  return key_cache.size(3);
}

}  // namespace

StepPlans plan_step(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& input_norm_weight, Scratch& scratch,
                    const StepArgs& s, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  at::Tensor query = scratch.qkv.narrow(1, 0, q_size);
  const at::Tensor key = scratch.qkv.narrow(1, q_size, kv_size);
  const at::Tensor value = scratch.qkv.narrow(1, q_size + kv_size, kv_size);
  return StepPlans{
      check_norm_args(hidden, "hidden", residual, "residual", input_norm_weight, s.epsilon),
      plan_rotary_embedding(s.positions, query, key, s.head_dim, s.cos_sin_cache, /*is_neox=*/true),
      plan_reshape_and_cache(key.view({tokens, s.num_kv_heads, s.head_dim}),
                             value.view({tokens, s.num_kv_heads, s.head_dim}), key_cache, value_cache, s.slot_mapping),
      plan_paged_attention(scratch.attention, query.view({tokens, s.num_heads, s.head_dim}), key_cache, value_cache,
                           s.block_tables, s.cu_seqlens_q, s.seq_lens, s.scale, s.max_query_len, s.max_seq_len,
                           s.sliding_window, 0.0, std::nullopt, at::get_num_threads())};
}

void llama_decoder_layer(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& input_norm_weight, const at::Tensor& qkv_weight,
                         const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                         const at::Tensor& post_norm_weight, const at::Tensor& gate_up_weight,
                         const at::Tensor& down_weight, const at::Tensor& cos_sin_cache, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, int64_t num_heads,
                         int64_t num_kv_heads, double epsilon, double scale, int64_t max_query_len,
                         int64_t max_seq_len, int64_t sliding_window, const std::optional<at::Tensor>& qkv_packed,
                         const std::optional<at::Tensor>& o_packed, const std::optional<at::Tensor>& gate_up_packed,
                         const std::optional<at::Tensor>& down_packed) {
  check_hidden(hidden);
  const bool packed = qkv_packed.has_value();
  TORCH_CHECK(o_packed.has_value() == packed && gate_up_packed.has_value() == packed &&
                  down_packed.has_value() == packed,
              "qkv_packed, o_packed, gate_up_packed and down_packed come together (all four, or none)");
  auto pointer = [](const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; };
  const LayerWeights w{input_norm_weight, qkv_weight,        o_weight,           post_norm_weight,
                       gate_up_weight,    down_weight,       qkv_bias,           pointer(qkv_packed),
                       pointer(o_packed), pointer(gate_up_packed), pointer(down_packed)};
  const StepArgs s{positions,  cos_sin_cache, slot_mapping,  block_tables, cu_seqlens_q,  seq_lens,
                   num_heads,  num_kv_heads,  head_dim_of(key_cache), epsilon, scale, max_query_len,
                   max_seq_len, sliding_window};
  check_layer(hidden, w, key_cache, value_cache, s, "");
  Scratch scratch(hidden, s, gate_up_weight.size(0) / 2, packed);
  run_layer(hidden, residual, w, key_cache, value_cache, s, scratch);
}

void llama_decoder_layers(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                          at::TensorList input_norm_weights, at::TensorList qkv_weights,
                          const c10::List<std::optional<at::Tensor>>& qkv_biases, at::TensorList o_weights,
                          at::TensorList post_norm_weights, at::TensorList gate_up_weights,
                          at::TensorList down_weights, const at::Tensor& cos_sin_cache, at::TensorList key_caches,
                          at::TensorList value_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                          int64_t num_heads, int64_t num_kv_heads, double epsilon, double scale,
                          int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                          at::TensorList qkv_packed, at::TensorList o_packed, at::TensorList gate_up_packed,
                          at::TensorList down_packed) {
  check_hidden(hidden);
  const size_t layers = input_norm_weights.size();
  TORCH_CHECK(layers > 0, "llama_decoder_layers needs at least one layer, got empty weight lists");
  auto check_count = [&](size_t count, const char* name) {
    TORCH_CHECK(count == layers, name, " has ", count, " entries, but input_norm_weights has ", layers,
                " (one per layer)");
  };
  check_count(qkv_weights.size(), "qkv_weights");
  check_count(qkv_biases.size(), "qkv_biases");
  check_count(o_weights.size(), "o_weights");
  check_count(post_norm_weights.size(), "post_norm_weights");
  check_count(gate_up_weights.size(), "gate_up_weights");
  check_count(down_weights.size(), "down_weights");
  check_count(key_caches.size(), "key_caches");
  check_count(value_caches.size(), "value_caches");
  const bool packed = !qkv_packed.empty();
  TORCH_CHECK(o_packed.empty() != packed && gate_up_packed.empty() != packed && down_packed.empty() != packed,
              "qkv_packed, o_packed, gate_up_packed and down_packed come together (all four lists, or none)");
  if (packed) {
    check_count(qkv_packed.size(), "qkv_packed");
    check_count(o_packed.size(), "o_packed");
    check_count(gate_up_packed.size(), "gate_up_packed");
    check_count(down_packed.size(), "down_packed");
  }
  const StepArgs s{positions,  cos_sin_cache, slot_mapping,  block_tables, cu_seqlens_q,  seq_lens,
                   num_heads,  num_kv_heads,  head_dim_of(key_caches[0]), epsilon, scale, max_query_len,
                   max_seq_len, sliding_window};
  // Every layer's weights and caches are checked before the first layer runs: a mismatch deep in
  // the stack must not leave the layers before it applied to hidden, residual and the caches.
  std::vector<std::optional<at::Tensor>> biases(layers);
  for (size_t i = 0; i < layers; ++i) biases[i] = qkv_biases.get(i);
  auto layer_weights = [&](size_t i) {
    return LayerWeights{input_norm_weights[i],
                        qkv_weights[i],
                        o_weights[i],
                        post_norm_weights[i],
                        gate_up_weights[i],
                        down_weights[i],
                        biases[i],
                        packed ? &qkv_packed[i] : nullptr,
                        packed ? &o_packed[i] : nullptr,
                        packed ? &gate_up_packed[i] : nullptr,
                        packed ? &down_packed[i] : nullptr};
  };
  for (size_t i = 0; i < layers; ++i) {
    check_layer(hidden, layer_weights(i), key_caches[i], value_caches[i], s, "layer " + std::to_string(i) + ": ");
    TORCH_CHECK(gate_up_weights[i].sizes() == gate_up_weights[0].sizes(), "layer ", i, ": gate_up_weight has shape ",
                gate_up_weights[i].sizes(), ", layer 0's has ", gate_up_weights[0].sizes());
    for (const at::Tensor* cache : {&key_caches[i], &value_caches[i]}) {
      TORCH_CHECK(cache->sizes() == key_caches[0].sizes() && cache->is_contiguous(), "layer ", i,
                  ": every KV cache must be contiguous and of layer 0's shape ", key_caches[0].sizes(), ", got ",
                  cache->sizes());
    }
  }
  // The step's metadata too, for the whole batch, before anything is written.
  const int64_t intermediate = gate_up_weights[0].size(0) / 2;
  Scratch scratch(hidden, s, intermediate, packed);
  const StepPlans plans = plan_step(hidden, residual, input_norm_weights[0], scratch, s, key_caches[0], value_caches[0]);
  if (!packed &&
      run_layers_in_one_region(hidden, residual, layer_weights, layers, key_caches, value_caches, s, scratch, plans)) {
    return;
  }
  auto run_stack = [&](at::Tensor& h, at::Tensor& r, const StepArgs& step, Scratch& step_scratch) {
    for (size_t i = 0; i < layers; ++i) {
      at::Tensor key_cache = key_caches[i], value_cache = value_caches[i];
      run_layer(h, r, layer_weights(i), key_cache, value_cache, step, step_scratch);
    }
  };
  // Many rows: one part of the requests per thread, each run through every layer on its own (its
  // kernels single-threaded inside the parallel region), with no barrier between the layers'
  // steps. Measured on the offline benchmark's batched decode: 59.6-60.7 ms a step against
  // 61.3-61.4 with the threads sharing each product. A product row and a request's attention
  // do not depend on the other rows, so the result is bit for bit the same.
  const std::vector<int64_t> bounds =
      packed ? split_requests(cu_seqlens_q, hidden.size(0), at::get_num_threads()) : std::vector<int64_t>{};
  if (bounds.size() < 3) {
    run_stack(hidden, residual, s, scratch);
    return;
  }
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  at::parallel_for(0, int64_t(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t b0 = bounds[part], requests = bounds[part + 1] - b0;
      const int64_t t0 = cu[b0], tokens = cu[b0 + requests] - t0;
      at::Tensor h = hidden.narrow(0, t0, tokens), r = residual.narrow(0, t0, tokens);
      const at::Tensor positions_part = positions.narrow(0, t0, tokens);
      const at::Tensor slots_part = slot_mapping.narrow(0, t0, tokens);
      const at::Tensor tables_part = block_tables.narrow(0, b0, requests);
      const at::Tensor cu_part = at::empty({requests + 1}, cu_seqlens_q.options());
      for (int64_t i = 0; i <= requests; ++i) cu_part.data_ptr<int32_t>()[i] = int32_t(cu[b0 + i] - t0);
      const at::Tensor lens_part = seq_lens.narrow(0, b0, requests);
      const StepArgs step{positions_part, cos_sin_cache, slots_part, tables_part, cu_part, lens_part,
                          num_heads, num_kv_heads, s.head_dim, epsilon, scale, max_query_len, max_seq_len,
                          sliding_window};
      Scratch part_scratch(h, step, intermediate, packed);
      run_stack(h, r, step, part_scratch);
    }
  });
}

}  // namespace kvflow::cpu
