// Device helpers shared by the CUDA kernels: float32 conversions of kvflow's element tags,
// 16-byte packs for vectorized loads and stores, and a float block sum. Torch-free.
//
// The 16-bit formats stay numeric.h's bit containers (float16, bfloat16) in memory; the CUDA
// intrinsics do the conversions, called explicitly, so nothing here depends on the implicit
// __half / __nv_bfloat16 operators that torch's build flags (__CUDA_NO_HALF_OPERATORS__ ...)
// switch off.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvflow/numeric.h"

namespace kvflow::cuda_kernels {

__device__ __forceinline__ float load_float(float x) { return x; }
__device__ __forceinline__ float load_float(float16 x) { return __half2float(__ushort_as_half(x.bits)); }
__device__ __forceinline__ float load_float(bfloat16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }

// float32 -> T, round to nearest even.
template <typename T>
__device__ __forceinline__ T store_float(float x);

template <>
__device__ __forceinline__ float store_float<float>(float x) {
  return x;
}

template <>
__device__ __forceinline__ float16 store_float<float16>(float x) {
  return float16{__half_as_ushort(__float2half_rn(x))};
}

template <>
__device__ __forceinline__ bfloat16 store_float<bfloat16>(float x) {
  return bfloat16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
}

// 16 bytes of T: 4 floats or 8 16-bit values, moved with one 128-bit load or store.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// p must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  Pack<T> pack;
  *reinterpret_cast<uint4*>(&pack) = *reinterpret_cast<const uint4*>(p);
  return pack;
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& pack) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&pack);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block, returned to every thread. blockDim.x must be a multiple of 32
// (at most 1024), and every thread of the block must call it, once per kernel.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x >> 5) ? warp_sums[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// Host side: may a kernel move 16-byte packs of a row that starts at `p`, has `width`
// elements of `elem_bytes` each, and whose next row is `stride` elements further?
inline bool pack_aligned(const void* p, int64_t stride, int64_t width, int64_t elem_bytes) {
  const int64_t per_pack = 16 / elem_bytes;
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride % per_pack == 0 && width % per_pack == 0;
}

// Threads for a block that spreads `units` pieces of one row over itself: a multiple of the
// warp size, from one warp up to `max_threads`.
inline unsigned threads_for(int64_t units, int64_t max_threads = 1024) {
  const int64_t warps = (units + 31) / 32;
  const int64_t capped = warps < 1 ? 1 : (warps > max_threads / 32 ? max_threads / 32 : warps);
  return unsigned(capped * 32);
}

// Calls f with a value of the element type that `dtype` names (float, float16 or bfloat16).
template <class F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(float16{});
    case DType::kBFloat16:
      return f(bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvflow::cuda_kernels
