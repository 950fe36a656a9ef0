// Rotary position embedding on the GPU, in place: one thread block per token, its threads over
// the (head, pair) rotations of the query and then of the key. Torch-free.
//
// positions are not range-checked here (that would need a host sync): a position outside
// [0, max_position) reads outside cos_sin. The CPU path checks them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvflow/cuda_utils.cuh"
#include "kvflow/numeric.h"

namespace kvflow::cuda_kernels {

constexpr int kRotaryMaxThreads = 512;

// Rotates the first rotary_dim features of num_heads packed heads of one token by the angles
// whose cos and sin are cos[i], sin[i], i < half. NeoX pairs x[i] with x[i + half], GPT-J
// pairs x[2i] with x[2i + 1]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
template <typename T, typename C, bool kNeox>
__device__ __forceinline__ void rotate_token(T* token,  // [num_heads, head_size]
                                             int64_t num_heads, int64_t head_size,
                                             const C* cos,  // [half]
                                             const C* sin,  // [half]
                                             int64_t half) {
  // 32-bit (head, pair) arithmetic: the launcher checks num_heads * half fits.
  const int pairs = int(num_heads * half);
  const int half32 = int(half);
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half32;
    const int i = p - head * half32;
    T* x = token + head * head_size;
    const int i1 = kNeox ? i : 2 * i;
    const int i2 = kNeox ? i + half32 : 2 * i + 1;
    const float c = load_float(cos[i]);
    const float s = load_float(sin[i]);
    const float x1 = load_float(x[i1]);
    const float x2 = load_float(x[i2]);
    x[i1] = store_float<T>(x1 * c - x2 * s);
    x[i2] = store_float<T>(x2 * c + x1 * s);
  }
}

template <typename T, typename C, bool kNeox>
__global__ void __launch_bounds__(kRotaryMaxThreads)
    rotary_embedding_kernel(const int64_t* positions,  // [num_tokens]
                            T* query,                  // [num_tokens, num_q_heads, head_size], token stride q_stride
                            int64_t q_stride, int64_t num_q_heads,
                            T* key,  // [num_tokens, num_kv_heads, head_size] or null, token stride k_stride
                            int64_t k_stride, int64_t num_kv_heads, int64_t head_size,
                            const C* cos_sin,  // [max_position, rotary_dim]: cos half, then sin half
                            int64_t rotary_dim) {
  const int64_t t = blockIdx.x;
  const int64_t half = rotary_dim / 2;
  const C* cos = cos_sin + positions[t] * rotary_dim;
  const C* sin = cos + half;
  rotate_token<T, C, kNeox>(query + t * q_stride, num_q_heads, head_size, cos, sin, half);
  if (key != nullptr) rotate_token<T, C, kNeox>(key + t * k_stride, num_kv_heads, head_size, cos, sin, half);
}

// C is float or T. key may be null (then num_kv_heads is ignored).
template <typename T, typename C>
cudaError_t rotary_embedding(const int64_t* positions,  // [num_tokens]
                             T* query,  // [num_tokens, num_q_heads, head_size], token stride q_stride
                             int64_t q_stride, int64_t num_q_heads,
                             T* key,    // [num_tokens, num_kv_heads, head_size] or null, token stride k_stride
                             int64_t k_stride, int64_t num_kv_heads, int64_t head_size,
                             const C* cos_sin,  // [max_position, rotary_dim]
                             int64_t rotary_dim, bool is_neox, int64_t num_tokens, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t heads = key != nullptr && num_kv_heads > num_q_heads ? num_kv_heads : num_q_heads;
  if (num_tokens > INT32_MAX || rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_size ||
      heads * (rotary_dim / 2) > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const unsigned threads = threads_for(heads * (rotary_dim / 2), kRotaryMaxThreads);
  if (key == nullptr) num_kv_heads = 0;
  if (is_neox) {
    rotary_embedding_kernel<T, C, true><<<unsigned(num_tokens), threads, 0, stream>>>(
        positions, query, q_stride, num_q_heads, key, k_stride, num_kv_heads, head_size, cos_sin, rotary_dim);
  } else {
    rotary_embedding_kernel<T, C, false><<<unsigned(num_tokens), threads, 0, stream>>>(
        positions, query, q_stride, num_q_heads, key, k_stride, num_kv_heads, head_size, cos_sin, rotary_dim);
  }
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
