// Declarations of every op implementation, once per device: kvflow::cpu (cpu/*.cpp) and
// kvflow::cuda (cuda/*.cu) implement the same list, op_list.inc. torch_bindings.cpp registers
// them; the schemas there are the public contract.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace kvflow::cpu {
#include "op_list.inc"

// CPU only: on CUDA, torch's matmul serves every batch size well.
void small_linear(at::Tensor& out,                     // [rows, out_features]
                  const at::Tensor& input,             // [rows, in_features]
                  const at::Tensor& weight,            // [out_features, in_features]
                  const std::optional<at::Tensor>& bias);  // [out_features]

// CPU only: a bfloat16 weight [out_features, in_features] reordered into packed_linear's panels,
// [ceil(out_features / 48), ceil(in_features / 2), 48, 2] (see kernel_table.h). With gate_up, the
// [gate; up] weight of a gated MLP for packed_silu_and_mul: [ceil(out_features / 48), ...] too.
at::Tensor pack_linear_weight(const at::Tensor& weight, bool gate_up);

// CPU only: out = input @ weight^T (+ bias) for many rows (prefill, batched decode), weight
// given as pack_linear_weight made it; out bfloat16 or float32.
void packed_linear(at::Tensor& out,                        // [rows, out_features]
                   const at::Tensor& input,                // [rows, in_features] bfloat16
                   const at::Tensor& packed_weight,        // pack_linear_weight(weight)
                   const std::optional<at::Tensor>& bias);  // [out_features] bfloat16

// CPU only: out = silu(input @ gate^T) * (input @ up^T) for many rows, the gate|up weight given
// as pack_linear_weight(weight, gate_up=True) made it: the gated MLP's activation in the
// product's epilogue.
void packed_silu_and_mul(at::Tensor& out,                    // [rows, d] bfloat16
                         const at::Tensor& input,            // [rows, in_features] bfloat16
                         const at::Tensor& packed_gate_up);  // pack_linear_weight(weight [2d, in_features], true)

// CPU only: a whole Llama decoder layer, in place on hidden and residual: for a few tokens
// (decode) on the plain weights, or for many on packed ones.
void llama_decoder_layer(at::Tensor& hidden,                  // [num_tokens, hidden_size]: in, then the layer's output
                         at::Tensor& residual,                // [num_tokens, hidden_size]
                         const at::Tensor& positions,         // [num_tokens] int64
                         const at::Tensor& input_norm_weight,  // [hidden_size]
                         const at::Tensor& qkv_weight,        // [(num_heads + 2 * num_kv_heads) * head_dim, hidden_size]
                         const std::optional<at::Tensor>& qkv_bias,  // [(num_heads + 2 * num_kv_heads) * head_dim]
                         const at::Tensor& o_weight,          // [hidden_size, num_heads * head_dim]
                         const at::Tensor& post_norm_weight,  // [hidden_size]
                         const at::Tensor& gate_up_weight,    // [2 * intermediate, hidden_size]
                         const at::Tensor& down_weight,       // [hidden_size, intermediate]
                         const at::Tensor& cos_sin_cache,     // [max_position, head_dim]
                         at::Tensor& key_cache,               // [num_blocks, block_size, num_kv_heads, head_dim]
                         at::Tensor& value_cache,             // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& slot_mapping,      // [num_tokens] int64
                         const at::Tensor& block_tables,      // [batch, max_blocks_per_seq] int32
                         const at::Tensor& cu_seqlens_q,      // [batch + 1] int32
                         const at::Tensor& seq_lens,          // [batch] int32
                         int64_t num_heads, int64_t num_kv_heads, double epsilon, double scale,
                         int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                         // All four or none: the weights as pack_linear_weight made them (gate_up for
                         // gate_up_packed), for many rows; without them, small_linear on the weights.
                         const std::optional<at::Tensor>& qkv_packed, const std::optional<at::Tensor>& o_packed,
                         const std::optional<at::Tensor>& gate_up_packed,
                         const std::optional<at::Tensor>& down_packed);

// CPU only: llama_decoder_layer for every layer of a model in one call, layer i reading entry i of
// each list (qkv_biases entries may be None; the four packed lists are all empty or all full).
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
                          at::TensorList down_packed);
}  // namespace kvflow::cpu

#ifdef KVFLOW_WITH_CUDA
namespace kvflow::cuda {
#include "op_list.inc"
}  // namespace kvflow::cuda
#endif
