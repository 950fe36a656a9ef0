// The CPU kernels, as a table of function pointers per instruction set.
//
// Each instruction set (scalar, AVX2, AVX-512, AVX-512 with BF16) compiles the same templates in kernels.h in its
// own translation unit under `#pragma GCC target`, so the default build runs on any x86-64 CPU
// and the widest path this CPU supports is chosen at run time (or forced with KVFLOW_CPU_ISA=scalar|avx2|avx512|avx512_bf16).
// Every entry processes the rows (or tokens) in [begin, end); the caller splits the range
// across threads. Pointers are raw element pointers of the entry's dtype (see DType).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {

// out[r, :] = input[r, :] * rsqrt(mean(input[r, :]^2) + eps) * (weight + weight_offset)
using RmsNormFn = void (*)(void* out,          // [rows, hidden], row stride out_stride
                           int64_t out_stride,
                           const void* input,  // [rows, hidden], row stride in_stride
                           int64_t in_stride,
                           const void* weight,  // [hidden]
                           int64_t hidden, float eps, float weight_offset, int64_t begin, int64_t end);

// residual[r, :] += input[r, :]; input[r, :] = rms_norm(residual[r, :]) * (weight + weight_offset)
using FusedAddRmsNormFn = void (*)(void* input,  // [rows, hidden], row stride in_stride
                                   int64_t in_stride,
                                   void* residual,  // [rows, hidden], row stride res_stride
                                   int64_t res_stride,
                                   const void* weight,  // [hidden]
                                   int64_t hidden, float eps, float weight_offset, int64_t begin,
                                   int64_t end);

// Rotates, in place, the first rotary_dim features of every head of query and key (key may be
// null) by the angle table row cos_sin[positions[t]] = [cos(rotary_dim/2) | sin(rotary_dim/2)].
struct RotaryArgs {
  const int64_t* positions;  // [num_tokens]
  void* query;               // [num_tokens, num_q_heads, head_size], token stride q_stride
  int64_t q_stride;
  int64_t num_q_heads;
  void* key;                 // [num_tokens, num_kv_heads, head_size] or null, token stride k_stride
  int64_t k_stride;
  int64_t num_kv_heads;
  int64_t head_size;
  const void* cos_sin;       // [max_position, rotary_dim], float32 or the query dtype
  int64_t rotary_dim;
  bool is_neox;              // NeoX halves (x[i], x[i + d/2]) vs GPT-J pairs (x[2i], x[2i + 1])
};
using RotaryFn = void (*)(const RotaryArgs& args, int64_t begin, int64_t end);

// out[r, i] = act(input[r, i]) * input[r, d + i] for i < d (gate first, then up).
using GatedActivationFn = void (*)(void* out,  // [rows, d], row stride out_stride
                                   int64_t out_stride,
                                   const void* input,  // [rows, 2 * d], row stride in_stride
                                   int64_t in_stride, int64_t d, int64_t begin, int64_t end);

// Paged attention over a flattened batch: request b owns query tokens
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and a context of seq_lens[b] cached tokens that ends
// with them; query i of b sits at position seq_lens[b] - q_len + i and attends causally (and to
// the last sliding_window positions only, when sliding_window > 0).
struct PagedAttentionArgs {
  void* out;                    // [num_tokens, num_q_heads, head_dim]
  const void* query;            // [num_tokens, num_q_heads, head_dim], token stride q_stride
  int64_t q_stride;
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_dim]
  const int32_t* block_tables;  // [batch, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* cu_seqlens_q;  // [batch + 1]
  const int32_t* seq_lens;      // [batch]
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;           // a multiple of 16
  float scale;
  float soft_cap;               // logits = soft_cap * tanh(logits / soft_cap) when > 0
  int64_t sliding_window;       // <= 0: off
  float* partials;              // [num_splits, num_tokens, num_q_heads, head_dim + 2] when splitting
  int64_t num_tokens;
};

// One unit of attention work: a tile of a request's queries for the query heads of kv heads
// [kv_head, kv_head + kv_count), over keys [key_begin, key_end) of its context. split < 0: the item covers every key its
// queries see and writes the output; otherwise it writes unnormalised partial results to
// partials[split] (running max, sum, accumulator) for merge_attention_splits.
struct AttentionWorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t kv_count;
  int32_t q_begin;  // first query token of the tile, relative to the request
  int32_t q_count;
  int32_t key_begin;
  int32_t key_end;
  int32_t split;
};

using PagedAttentionFn = void (*)(const PagedAttentionArgs& args, const AttentionWorkItem* items, int64_t begin,
                                  int64_t end);
// The head sizes paged attention is compiled for: 64, 80, 96, 128, 256.
constexpr int kNumAttentionHeadDims = 5;

// Passes over one row of logits [n] (the sampler's vectorised parts; selection logic is in
// cpu/sampling.cpp).
// The largest value; *non_finite is set when the row holds a NaN or a +inf (-inf is a masked
// token, which is legal).
using RowMaxFn = float (*)(const void* x, int64_t n, bool* non_finite);
// p[i] = exp((x[i] - max) * inv_temperature); returns the sum of p.
using ExpSumFn = double (*)(const void* x, int64_t n, float max, float inv_temperature, float* p);
// Appends to out the indices i in [begin, end) with x[i] > threshold, in increasing order; returns
// how many. out must have room for end - begin.
using CollectGreaterFn = int64_t (*)(const void* x, int64_t begin, int64_t end, float threshold, int32_t* out);

// x[i] = x[i] * inv_divisor, then soft_cap * tanh(x[i] / soft_cap) where soft_cap > 0, for i in [0, n):
// float32 logits, in place.
using ScaleLogitsFn = void (*)(float* x, int64_t n, float inv_divisor, float soft_cap);

// out[r, o] = sum_k x[r, k] * weight[o, k] (+ bias[o]) for output features o in [begin, end):
// the few-row matmul of decode, bound by reading the weights once. x, weight and bias are of the
// table entry's dtype, out too unless out_is_float32 (an LM head's logits); float32 accumulation.
using SmallLinearFn = void (*)(void* out,           // [rows, out_features]
                               bool out_is_float32,
                               const void* x,       // [rows, in_features]
                               const void* weight,  // [out_features, in_features]
                               const void* bias,    // [out_features] or null
                               int64_t rows, int64_t in_features, int64_t out_features, int64_t begin,
                               int64_t end);

// pack_linear_weight's layout of a bfloat16 weight [out_features, in_features]: panels of
// kPackedLinearPanel output features; within a panel, the input features in pairs, and for each
// pair the panel's features side by side:
//   packed[o / kPanel][k / 2][o % kPanel][k % 2] = weight[o][k]   (zero past either edge).
// Reading a panel is one sequential stream, and 32 consecutive values are the pair (k, k + 1)
// of 16 features: the operand vdpbf16ps multiplies by a broadcast pair of input values.
constexpr int64_t kPackedLinearPanel = 48;
// The gate|up weight [2d, in_features] of a gated MLP, packed with gate_up: panel p holds gate
// features [24p, 24p + 24) in its first half and the matching up features in its second, so
// that silu(gate) * up comes out of one panel's accumulators (packed_silu_and_mul).
constexpr int64_t kGateUpHalfPanel = kPackedLinearPanel / 2;
// Up to this many rows, packed_linear's kernels read each panel as one sequential stream a few
// rows at a time, so a call of any size up to it takes one panel at a time just as cheaply.
constexpr int64_t kPackedLinearFewRows = 8;

// out[r, o] = sum_k x[r, k] * weight[o, k] (+ bias[o]) for the output features of panels
// [begin, end) of a weight in pack_linear_weight's layout: the many-row matmul of prefill and
// batched decode. float32 accumulation; out bfloat16, or float32 (an LM head's logits). With
// silu_and_mul, the weight is packed with gate_up and out[r, o] = silu(gate) * up for the
// out_features = d features of each half (bfloat16 out, no bias).
using PackedLinearFn = void (*)(void* out,  // [rows, out_features], row stride out_stride
                                int64_t out_stride, bool out_is_float32, bool silu_and_mul,
                                const bfloat16* x,  // [rows, in_features], row stride x_stride
                                int64_t x_stride,
                                const bfloat16* packed,  // [ceil(out / kPanel), ceil(in / 2), kPanel, 2]
                                const bfloat16* bias,    // [out_features] or null
                                int64_t rows, int64_t in_features, int64_t out_features, int64_t begin,
                                int64_t end);

// out[r, o] = input row r . weight row o (+ bias[o]) for output features o in [begin, end), the
// weight in GGUF blocks of the entry's format (gguf_blocks.h), rows [out_features, row_bytes],
// the input rows quantized per block (QuantizedRows). float32 accumulation; out float32, or
// bfloat16 unless out_is_float32.
using QuantizedLinearFn = void (*)(void* out,  // [rows, out_features], rows out_stride elements apart
                                   bool out_is_float32, const QuantizedRows& x, const uint8_t* weight,
                                   int64_t row_bytes, const float* bias,  // [out_features] or null
                                   int64_t rows, int64_t out_stride, int64_t begin, int64_t end);

// Quantizes `chunks` chunks of 32 contiguous activations (float32, or bfloat16 for entry 1) as
// quantize_activation_block (gguf_blocks.h) does, bit for bit: codes q [chunks * 32],
// scale_sum [2 * chunks] and code_sum [chunks].
using QuantizeActivationsFn = void (*)(const void* x, int64_t chunks, int8_t* q, float* scale_sum, int32_t* code_sum);

// Panel `panel` of a weight in GGUF blocks of the entry's format (rows [out_features, row_bytes]),
// dequantized and rounded to bfloat16 into pack_linear_weight's layout (without gate_up), zero
// past the last feature: dst [row_bytes / block bytes * 16][kPackedLinearPanel][2]. quantized_linear
// multiplies many rows with PackedLinearFn on these panels, one at a time.
using DequantizePanelFn = void (*)(const uint8_t* weight, int64_t row_bytes, int64_t out_features, int64_t panel,
                                   bfloat16* dst);

struct KernelTable {
  const char* isa;
  RmsNormFn rms_norm[kNumDTypes];
  FusedAddRmsNormFn fused_add_rms_norm[kNumDTypes];
  RmsNormFn rms_norm_add[kNumDTypes];  // out += round(rms_norm(input)): out is the residual
  // [query dtype][cos_sin is float32 ? 0 : 1 (same dtype as the query)]
  RotaryFn rotary_embedding[kNumDTypes][2];
  GatedActivationFn silu_and_mul[kNumDTypes];
  GatedActivationFn gelu_tanh_and_mul[kNumDTypes];
  GatedActivationFn gelu_and_mul[kNumDTypes];
  // [dtype][head_dim 64, 80, 96, 128, 256, see attention_head_dim_index]: head sizes are
  // compile-time so accumulators stay in registers.
  PagedAttentionFn paged_attention[kNumDTypes][kNumAttentionHeadDims];
  RowMaxFn row_max[kNumDTypes];
  ExpSumFn exp_sum[kNumDTypes];
  CollectGreaterFn collect_greater[kNumDTypes];
  ScaleLogitsFn scale_logits;  // float32 logits only
  SmallLinearFn small_linear[kNumDTypes];
  PackedLinearFn packed_linear;  // bfloat16 weights only
  QuantizedLinearFn quantized_linear[kNumQuantFormats];  // [QuantFormat]
  DequantizePanelFn dequantize_panel[kNumQuantFormats];  // [QuantFormat]
  // The same products on the interleaved layout (gguf_blocks.h), [begin, end) whole groups of
  // kInterleavedRows; null where the instruction set has none (quantized_linear.cpp then
  // gathers the rows back into GGUF's layout for the entry above).
  QuantizedLinearFn quantized_linear_interleaved[kNumInterleavedFormats];  // [interleaved_index]
  // From how many bfloat16 rows an interleaved weight's product goes through dequantized panels
  // (its rows gathered back into GGUF's layout, dequantize_panel, packed_linear) instead of the
  // entry above; 0: never. Where the panels win depends on the format and on the instruction set
  // (docs/benchmarks.md).
  int64_t interleaved_panel_rows[kNumInterleavedFormats];  // [interleaved_index]
  QuantizeActivationsFn quantize_activations[2];         // [input is bfloat16]
};

// Index of a supported attention head_dim in KernelTable::paged_attention, or -1.
inline int attention_head_dim_index(int64_t head_dim) {
  switch (head_dim) {
    case 64:
      return 0;
    case 80:
      return 1;
    case 96:
      return 2;
    case 128:
      return 3;
    case 256:
      return 4;
    default:
      return -1;
  }
}

// Combines the partial results of the splits of each (token, query head) into out:
// num_splits[b] splits for the tokens of request b.
void merge_attention_splits(const PagedAttentionArgs& args, int64_t head_dim, DType dtype,
                            const int32_t* num_splits, int64_t token_begin, int64_t token_end);

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& avx512_bf16_kernels();

// Sets the GGUF block products of an AVX-512 table: AVX2's integer kernels, with the interleaved
// products in AVX-512 VNNI (vpdpbusd on 256-bit vectors) where this CPU has it.
void fill_avx512_quantized_entries(KernelTable& table);

// Replaces the AVX2 table's interleaved products with AVX-VNNI ones where this CPU has it.
void fill_avx_vnni_entries(KernelTable& table);

// Each x86 feature kvflow asks about, and whether this CPU (and OS) has it; empty elsewhere.
std::vector<std::pair<std::string, bool>> cpu_features();

// Names of the instruction sets this CPU (and OS) can run, narrowest first.
std::vector<std::string> supported_isas();

// The table in use: the widest supported, unless KVFLOW_CPU_ISA or set_isa chose another.
// Throws std::invalid_argument for an unknown or unsupported name.
const KernelTable& active_kernels();
void set_isa(const std::string& name);

}  // namespace kvflow::cpu
