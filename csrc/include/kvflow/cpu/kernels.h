// The CPU kernels' table for one instruction set. The kernels, one header per topic named like
// their CUDA twins (norm.h, rope.h, activation.h, attention.h, sampling.h, logits.h, small_linear.h,
// packed_linear.h), are written once over a vector type V (VecScalar, VecAvx2, VecAvx512) and an
// element type T (float, float16, bfloat16). Every load widens to float32 and every store
// rounds once, so all three instruction sets compute the same float32 math; only the order of
// the sum-of-squares reduction differs.
//
// Everything here sits in an unnamed namespace: each instruction-set translation unit gets its
// own private copies, compiled for its own target, so the linker can never substitute an
// AVX-512 body for a baseline one (which would crash older CPUs).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "kvflow/cpu/activation.h"
#include "kvflow/cpu/attention.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/logits.h"
#include "kvflow/cpu/norm.h"
#include "kvflow/cpu/packed_linear.h"
#include "kvflow/cpu/quantized_linear.h"
#include "kvflow/cpu/rope.h"
#include "kvflow/cpu/sampling.h"
#include "kvflow/cpu/small_linear.h"
#include "kvflow/cpu/vec_scalar.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

template <class V, typename T>
void fill_row_entries(KernelTable& t, DType dtype) {
  t.row_max[int(dtype)] = row_max<V, T>;
  t.exp_sum[int(dtype)] = exp_sum<V, T>;
  t.collect_greater[int(dtype)] = collect_greater<V, T>;
  t.small_linear[int(dtype)] = small_linear<V, T>;
}

template <class V, typename T>
void fill_attention_row(PagedAttentionFn (&row)[kNumAttentionHeadDims]) {
  row[attention_head_dim_index(64)] = paged_attention<V, T, 64>;
  row[attention_head_dim_index(80)] = paged_attention<V, T, 80>;
  row[attention_head_dim_index(96)] = paged_attention<V, T, 96>;
  row[attention_head_dim_index(128)] = paged_attention<V, T, 128>;
  row[attention_head_dim_index(256)] = paged_attention<V, T, 256>;
}

template <class V>
KernelTable make_kernel_table(const char* isa) {
  KernelTable t{};
  t.isa = isa;
  t.rms_norm[int(DType::kFloat32)] = rms_norm<V, float>;
  t.rms_norm[int(DType::kFloat16)] = rms_norm<V, float16>;
  t.rms_norm[int(DType::kBFloat16)] = rms_norm<V, bfloat16>;
  t.fused_add_rms_norm[int(DType::kFloat32)] = fused_add_rms_norm<V, float>;
  t.fused_add_rms_norm[int(DType::kFloat16)] = fused_add_rms_norm<V, float16>;
  t.fused_add_rms_norm[int(DType::kBFloat16)] = fused_add_rms_norm<V, bfloat16>;
  t.rms_norm_add[int(DType::kFloat32)] = rms_norm_add<V, float>;
  t.rms_norm_add[int(DType::kFloat16)] = rms_norm_add<V, float16>;
  t.rms_norm_add[int(DType::kBFloat16)] = rms_norm_add<V, bfloat16>;
  t.rotary_embedding[int(DType::kFloat32)][0] = rotary_embedding<V, float, float>;
  t.rotary_embedding[int(DType::kFloat32)][1] = rotary_embedding<V, float, float>;
  t.rotary_embedding[int(DType::kFloat16)][0] = rotary_embedding<V, float16, float>;
  t.rotary_embedding[int(DType::kFloat16)][1] = rotary_embedding<V, float16, float16>;
  t.rotary_embedding[int(DType::kBFloat16)][0] = rotary_embedding<V, bfloat16, float>;
  t.rotary_embedding[int(DType::kBFloat16)][1] = rotary_embedding<V, bfloat16, bfloat16>;
  t.silu_and_mul[int(DType::kFloat32)] = gated_activation<V, Silu, float>;
  t.silu_and_mul[int(DType::kFloat16)] = gated_activation<V, Silu, float16>;
  t.silu_and_mul[int(DType::kBFloat16)] = gated_activation<V, Silu, bfloat16>;
  t.gelu_tanh_and_mul[int(DType::kFloat32)] = gated_activation<V, GeluTanh, float>;
  t.gelu_tanh_and_mul[int(DType::kFloat16)] = gated_activation<V, GeluTanh, float16>;
  t.gelu_tanh_and_mul[int(DType::kBFloat16)] = gated_activation<V, GeluTanh, bfloat16>;
  t.gelu_and_mul[int(DType::kFloat32)] = gated_activation<V, Gelu, float>;
  t.gelu_and_mul[int(DType::kFloat16)] = gated_activation<V, Gelu, float16>;
  t.gelu_and_mul[int(DType::kBFloat16)] = gated_activation<V, Gelu, bfloat16>;
  fill_attention_row<V, float>(t.paged_attention[int(DType::kFloat32)]);
  fill_attention_row<V, float16>(t.paged_attention[int(DType::kFloat16)]);
  fill_attention_row<V, bfloat16>(t.paged_attention[int(DType::kBFloat16)]);
  fill_row_entries<V, float>(t, DType::kFloat32);
  fill_row_entries<V, float16>(t, DType::kFloat16);
  fill_row_entries<V, bfloat16>(t, DType::kBFloat16);
  t.scale_logits = scale_logits<V>;
  t.packed_linear = packed_linear_panels<PackedLinearGeneric>;
  fill_quantized_entries(t, std::make_integer_sequence<int, kNumQuantFormats>{});
  return t;
}

}  // namespace
}  // namespace kvflow::cpu
