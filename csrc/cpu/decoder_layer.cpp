// One Llama-family decoder layer on the CPU, as one op. At batch-1 decode the weights stream at
// memory speed through small_linear, and what remains is the cost of calling a dozen ops per
// layer from Python through the dispatcher (about 2 us each, some 0.5 ms per step of a 30-layer
// model). With the layer's packed weights it serves many rows too (batched decode), through
// packed_linear and packed_silu_and_mul. This op makes those calls in C++: the same kernels, in
// the same order, so its result is bit for bit the one of the layer-by-layer path.
#include <ATen/ops/empty.h>

#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {

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
  check_device_type(hidden, "hidden", c10::DeviceType::CPU);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [num_tokens, hidden_size] "
              "tensor, got shape ", hidden.sizes());
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              key_cache.sizes());
  const int64_t tokens = hidden.size(0), head_dim = key_cache.size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv_weight.dim() == 2 && qkv_weight.size(0) == q_size + 2 * kv_size,
              "qkv_weight must have num_heads * head_dim + 2 * num_kv_heads * head_dim = ", q_size + 2 * kv_size,
              " rows, got shape ", qkv_weight.sizes());
  TORCH_CHECK(gate_up_weight.dim() == 2 && gate_up_weight.size(0) % 2 == 0,
              "gate_up_weight must stack gate and up rows, got shape ", gate_up_weight.sizes());
  const bool packed = qkv_packed.has_value();
  TORCH_CHECK(o_packed.has_value() == packed && gate_up_packed.has_value() == packed &&
                  down_packed.has_value() == packed,
              "qkv_packed, o_packed, gate_up_packed and down_packed come together (all four, or none)");
  const auto options = hidden.options();
  // Products through packed_linear where the layer's weights were packed (many rows), else
  // small_linear (a few rows, reading the plain weights once).
  auto project = [&](at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& packed_weight, const std::optional<at::Tensor>& bias) {
    if (packed_weight.has_value()) {
      packed_linear(out, x, *packed_weight, bias);
    } else {
      small_linear(out, x, weight, bias);
    }
  };

  fused_add_rms_norm(hidden, residual, input_norm_weight, epsilon, 0.0);
  at::Tensor qkv = at::empty({tokens, q_size + 2 * kv_size}, options);
  project(qkv, hidden, qkv_weight, qkv_packed, qkv_bias);
  at::Tensor query = qkv.narrow(1, 0, q_size);
  const at::Tensor key = qkv.narrow(1, q_size, kv_size);
  const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size);
  rotary_embedding(positions, query, key, head_dim, cos_sin_cache, /*is_neox=*/true);
  reshape_and_cache(key.view({tokens, num_kv_heads, head_dim}), value.view({tokens, num_kv_heads, head_dim}),
                    key_cache, value_cache, slot_mapping);
  at::Tensor attention = at::empty({tokens, num_heads, head_dim}, options);
  paged_attention(attention, query.view({tokens, num_heads, head_dim}), key_cache, value_cache, block_tables,
                  cu_seqlens_q, seq_lens, scale, max_query_len, max_seq_len, sliding_window, 0.0, std::nullopt);

  at::Tensor projected = at::empty({tokens, hidden.size(1)}, options);
  project(projected, attention.view({tokens, q_size}), o_weight, o_packed, std::nullopt);
  fused_add_rms_norm(projected, residual, post_norm_weight, epsilon, 0.0);
  at::Tensor activated = at::empty({tokens, gate_up_weight.size(0) / 2}, options);
  if (packed) {  // gate_up_packed is pack_linear_weight(gate_up_weight, gate_up=true)
    packed_silu_and_mul(activated, projected, *gate_up_packed);
  } else {
    at::Tensor gate_up = at::empty({tokens, gate_up_weight.size(0)}, options);
    small_linear(gate_up, projected, gate_up_weight, std::nullopt);
    silu_and_mul(activated, gate_up);
  }
  project(hidden, activated, down_weight, down_packed, std::nullopt);
}

}  // namespace kvflow::cpu
