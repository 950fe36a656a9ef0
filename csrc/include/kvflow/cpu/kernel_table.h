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
#include <vector>

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

struct KernelTable {
  const char* isa;
  RmsNormFn rms_norm[kNumDTypes];
  FusedAddRmsNormFn fused_add_rms_norm[kNumDTypes];
  // [query dtype][cos_sin is float32 ? 0 : 1 (same dtype as the query)]
  RotaryFn rotary_embedding[kNumDTypes][2];
  GatedActivationFn silu_and_mul[kNumDTypes];
  GatedActivationFn gelu_tanh_and_mul[kNumDTypes];
};

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& avx512_bf16_kernels();

// Names of the instruction sets this CPU (and OS) can run, narrowest first.
std::vector<std::string> supported_isas();

// The table in use: the widest supported, unless KVFLOW_CPU_ISA or set_isa chose another.
// Throws std::invalid_argument for an unknown or unsupported name.
const KernelTable& active_kernels();
void set_isa(const std::string& name);

}  // namespace kvflow::cpu
