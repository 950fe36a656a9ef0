// Writes into the paged KV cache and block copies, on the GPU. Both are plain byte copies, so
// the kernels are templated on the copy unit, not on the element type: the widest of 16, 8, 4
// or 2 bytes that divides every pointer, stride and length involved. Elements are 2 or 4
// bytes, so a 2-byte unit always fits; these four are the only instantiations.
//
// Slot and block indices are read on the device only, never range-checked (that would need a
// host sync): an index outside the cache writes outside it. The CPU path checks them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvflow/cuda_utils.cuh"

namespace kvflow::cuda_kernels {

constexpr int kCacheMaxThreads = 512;

// The widest unit in {16, 8, 4, 2} bytes dividing `bits` (an OR of byte addresses and byte
// sizes), or 0 if none does.
inline int64_t copy_unit_bytes(uint64_t bits) {
  for (int64_t unit = 16; unit >= 2; unit /= 2) {
    if (bits % uint64_t(unit) == 0) return unit;
  }
  return 0;
}

// Calls f with a value of the unsigned type of `unit_bytes` bytes.
template <class F>
cudaError_t dispatch_copy_unit(int64_t unit_bytes, F&& f) {
  switch (unit_bytes) {
    case 16:
      return f(uint4{});
    case 8:
      return f(uint64_t{});
    case 4:
      return f(uint32_t{});
    case 2:
      return f(uint16_t{});
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename U>
__global__ void __launch_bounds__(kCacheMaxThreads)
    reshape_and_cache_kernel(const U* key,    // [num_tokens, token_units], token stride key_stride
                             int64_t key_stride,
                             const U* value,  // [num_tokens, token_units], token stride value_stride
                             int64_t value_stride,
                             U* key_cache,    // [num_slots, token_units]
                             U* value_cache,  // [num_slots, token_units]
                             const int64_t* slot_mapping,  // [num_tokens], -1 = skip
                             int64_t token_units) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  const U* k = key + t * key_stride;
  const U* v = value + t * value_stride;
  U* kc = key_cache + slot * token_units;
  U* vc = value_cache + slot * token_units;
  for (int64_t i = threadIdx.x; i < token_units; i += blockDim.x) {
    kc[i] = k[i];
    vc[i] = v[i];
  }
}

// key_cache[slot] = key[t] and value_cache[slot] = value[t], slot = slot_mapping[t], for every
// token whose slot is not -1 (a cache [num_blocks, block_size, ...] contiguous is [num_slots, ...]).
// Strides and token_elems count elements of elem_bytes bytes.
inline cudaError_t reshape_and_cache(const void* key,  // [num_tokens, num_kv_heads, head_dim], token stride key_stride
                                     int64_t key_stride,
                                     const void* value,  // like key, token stride value_stride
                                     int64_t value_stride,
                                     void* key_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                                     void* value_cache,  // [num_blocks, block_size, num_kv_heads, head_dim]
                                     const int64_t* slot_mapping,  // [num_tokens], -1 = skip
                                     int64_t num_tokens,
                                     int64_t token_elems,  // num_kv_heads * head_dim
                                     int64_t elem_bytes, cudaStream_t stream) {
  if (num_tokens == 0 || token_elems == 0) return cudaSuccess;
  if (num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  const uint64_t bits = reinterpret_cast<uintptr_t>(key) | reinterpret_cast<uintptr_t>(value) |
                        reinterpret_cast<uintptr_t>(key_cache) | reinterpret_cast<uintptr_t>(value_cache) |
                        uint64_t(key_stride * elem_bytes) | uint64_t(value_stride * elem_bytes) |
                        uint64_t(token_elems * elem_bytes);
  const int64_t unit = copy_unit_bytes(bits);
  if (unit < elem_bytes) return cudaErrorMisalignedAddress;  // not element-aligned
  return dispatch_copy_unit(unit, [&](auto tag) {
    using U = decltype(tag);
    const int64_t per_unit = unit / elem_bytes;
    const int64_t token_units = token_elems / per_unit;
    reshape_and_cache_kernel<U><<<unsigned(num_tokens), threads_for(token_units, kCacheMaxThreads), 0, stream>>>(
        static_cast<const U*>(key), key_stride / per_unit, static_cast<const U*>(value), value_stride / per_unit,
        static_cast<U*>(key_cache), static_cast<U*>(value_cache), slot_mapping, token_units);
    return cudaGetLastError();
  });
}

// blockIdx.x: the pair; blockIdx.y: the cache (layer 0 key, layer 0 value, layer 1 key, ...).
template <typename U>
__global__ void __launch_bounds__(kCacheMaxThreads)
    copy_blocks_kernel(const int64_t* cache_addresses,  // [num_caches]: base address of each cache
                       const int64_t* block_mapping,    // [num_pairs, 2] (src, dst)
                       int64_t block_units) {
  U* base = reinterpret_cast<U*>(cache_addresses[blockIdx.y]);
  const int64_t pair = blockIdx.x;
  const U* src = base + block_mapping[2 * pair] * block_units;
  U* dst = base + block_mapping[2 * pair + 1] * block_units;
  for (int64_t i = threadIdx.x; i < block_units; i += blockDim.x) dst[i] = src[i];
}

// For every (src, dst) pair and every cache: cache[dst] = cache[src]. No destination may be a
// source or appear twice (the blocks are copied in parallel).
inline cudaError_t copy_blocks(const int64_t* cache_addresses,  // [num_caches], on the device
                               int64_t num_caches,
                               uint64_t address_bits,  // OR of the same addresses, on the host (alignment)
                               const int64_t* block_mapping,  // [num_pairs, 2] (src, dst), on the device
                               int64_t num_pairs,
                               int64_t block_bytes,  // block_size * num_kv_heads * head_dim * element size
                               cudaStream_t stream) {
  if (num_pairs == 0 || num_caches == 0 || block_bytes == 0) return cudaSuccess;
  if (num_pairs > INT32_MAX || num_caches > 65535) return cudaErrorInvalidValue;
  const int64_t unit = copy_unit_bytes(address_bits | uint64_t(block_bytes));
  return dispatch_copy_unit(unit, [&](auto tag) {
    using U = decltype(tag);
    const int64_t block_units = block_bytes / unit;
    const dim3 grid{unsigned(num_pairs), unsigned(num_caches)};
    copy_blocks_kernel<U><<<grid, threads_for(block_units, kCacheMaxThreads), 0, stream>>>(cache_addresses,
                                                                                          block_mapping, block_units);
    return cudaGetLastError();
  });
}

}  // namespace kvflow::cuda_kernels
