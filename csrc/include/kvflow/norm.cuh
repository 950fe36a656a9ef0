// RMSNorm on the GPU, plain, fused with the residual add before it, and added into the residual
// after it (rms_norm_add). One thread block per row; each
// thread accumulates the squares of its elements in float32, a block sum combines them, and a
// second pass scales and rounds once. Rows move in 16-byte packs when every pointer, row
// stride and the hidden size allow it, element by element otherwise. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvflow/cuda_utils.cuh"
#include "kvflow/numeric.h"

namespace kvflow::cuda_kernels {

// 1024 threads cover an 8192-wide 16-bit row with one pack each; wider rows loop.
constexpr int kNormMaxThreads = 1024;

// y[i] = x[i] * scale * (w[i] + weight_offset), rounded to T.
template <typename T>
__device__ __forceinline__ T scaled(T x, T w, float scale, float weight_offset) {
  return store_float<T>(load_float(x) * scale * (load_float(w) + weight_offset));
}

// Rows that come in groups (the heads of each token in a merged QKV output): row r of a view sits
// at (r / group_rows) * group_stride + (r % group_rows) * stride. Evenly strided rows are one
// group with group_stride 0.
struct RowGroups {
  int64_t in_group_rows = INT64_MAX, in_group_stride = 0;
  int64_t out_group_rows = INT64_MAX, out_group_stride = 0;

  __device__ __forceinline__ int64_t in_offset(int64_t r, int64_t stride) const {
    return (r / in_group_rows) * in_group_stride + (r % in_group_rows) * stride;
  }
  __device__ __forceinline__ int64_t out_offset(int64_t r, int64_t stride) const {
    return (r / out_group_rows) * out_group_stride + (r % out_group_rows) * stride;
  }
};

// 1 / sqrt(mean(x^2) + eps), written as the CPU kernels write it.
__device__ __forceinline__ float rms_scale(float sum_of_squares, int64_t hidden, float eps) {
  return 1.f / sqrtf(block_sum(sum_of_squares) / float(hidden) + eps);
}

// The block's 1 / rms of row x (every thread gets it): sum of squares, then block_sum.
template <typename T, bool kPacked>
__device__ __forceinline__ float row_rms_scale(const T* x, int64_t hidden, float eps) {
  float sum = 0.f;
  if constexpr (kPacked) {
    constexpr int N = Pack<T>::kSize;
    for (int64_t p = threadIdx.x; p < hidden / N; p += blockDim.x) {
      const Pack<T> v = load_pack(x + p * N);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float f = load_float(v.v[j]);
        sum += f * f;
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float f = load_float(x[i]);
      sum += f * f;
    }
  }
  return rms_scale(sum, hidden, eps);
}

// out may alias input: each thread writes only elements it has itself read.
template <typename T, bool kPacked>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_kernel(T* out,             // [rows, hidden], row stride out_stride
                    int64_t out_stride,
                    const T* input,     // [rows, hidden], row stride in_stride
                    int64_t in_stride,
                    const T* weight,    // [hidden]
                    int64_t hidden, float eps, float weight_offset, RowGroups groups) {
  const int64_t r = blockIdx.x;
  const T* x = input + groups.in_offset(r, in_stride);
  T* y = out + groups.out_offset(r, out_stride);
  const float scale = row_rms_scale<T, kPacked>(x, hidden, eps);
  if constexpr (kPacked) {
    constexpr int N = Pack<T>::kSize;
    const int64_t packs = hidden / N;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> v = load_pack(x + p * N);
      const Pack<T> w = load_pack(weight + p * N);
      Pack<T> r;
#pragma unroll
      for (int j = 0; j < N; ++j) r.v[j] = scaled(v.v[j], w.v[j], scale, weight_offset);
      store_pack(y + p * N, r);
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) y[i] = scaled(x[i], weight[i], scale, weight_offset);
  }
}

// residual = round(input + residual); input = rms_norm(residual) from the rounded values, so the
// result equals an unfused add then rms_norm in T. The second pass re-reads the residual
// elements the same thread wrote in the first.
template <typename T, bool kPacked>
__global__ void __launch_bounds__(kNormMaxThreads)
    fused_add_rms_norm_kernel(T* input,      // [rows, hidden], row stride in_stride
                              int64_t in_stride,
                              T* residual,   // [rows, hidden], row stride res_stride
                              int64_t res_stride,
                              const T* weight,  // [hidden]
                              int64_t hidden, float eps, float weight_offset) {
  T* x = input + int64_t(blockIdx.x) * in_stride;
  T* res = residual + int64_t(blockIdx.x) * res_stride;
  float sum = 0.f;
  if constexpr (kPacked) {
    constexpr int N = Pack<T>::kSize;
    const int64_t packs = hidden / N;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> a = load_pack(x + p * N);
      Pack<T> r = load_pack(res + p * N);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        r.v[j] = store_float<T>(load_float(a.v[j]) + load_float(r.v[j]));
        const float f = load_float(r.v[j]);
        sum += f * f;
      }
      store_pack(res + p * N, r);
    }
    const float scale = rms_scale(sum, hidden, eps);
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> r = load_pack(res + p * N);
      const Pack<T> w = load_pack(weight + p * N);
      Pack<T> o;
#pragma unroll
      for (int j = 0; j < N; ++j) o.v[j] = scaled(r.v[j], w.v[j], scale, weight_offset);
      store_pack(x + p * N, o);
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      res[i] = store_float<T>(load_float(x[i]) + load_float(res[i]));
      const float f = load_float(res[i]);
      sum += f * f;
    }
    const float scale = rms_scale(sum, hidden, eps);
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) x[i] = scaled(res[i], weight[i], scale, weight_offset);
  }
}

// residual += round(rms_norm(input)): the norm rounded to T first, so the result equals an
// unfused rms_norm then add in T.
template <typename T, bool kPacked>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_add_kernel(T* residual,        // [rows, hidden], row stride res_stride
                        int64_t res_stride,
                        const T* input,     // [rows, hidden], row stride in_stride
                        int64_t in_stride,
                        const T* weight,    // [hidden]
                        int64_t hidden, float eps, float weight_offset) {
  const T* x = input + int64_t(blockIdx.x) * in_stride;
  T* res = residual + int64_t(blockIdx.x) * res_stride;
  const float scale = row_rms_scale<T, kPacked>(x, hidden, eps);
  if constexpr (kPacked) {
    constexpr int N = Pack<T>::kSize;
    const int64_t packs = hidden / N;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> v = load_pack(x + p * N);
      const Pack<T> w = load_pack(weight + p * N);
      Pack<T> r = load_pack(res + p * N);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        r.v[j] = store_float<T>(load_float(r.v[j]) + load_float(scaled(v.v[j], w.v[j], scale, weight_offset)));
      }
      store_pack(res + p * N, r);
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      res[i] = store_float<T>(load_float(res[i]) + load_float(scaled(x[i], weight[i], scale, weight_offset)));
    }
  }
}

// out[r, :] = input[r, :] * rsqrt(mean(input[r, :]^2) + eps) * (weight + weight_offset)
template <typename T>
cudaError_t rms_norm(T* out,             // [rows, hidden], row stride out_stride
                     int64_t out_stride,
                     const T* input,     // [rows, hidden], row stride in_stride
                     int64_t in_stride,
                     const T* weight,    // [hidden]
                     int64_t rows, int64_t hidden, float eps, float weight_offset, cudaStream_t stream,
                     RowGroups groups = {}) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  const bool packed = pack_aligned(out, out_stride, hidden, sizeof(T)) &&
                      pack_aligned(input, in_stride, hidden, sizeof(T)) && pack_aligned(weight, 0, hidden, sizeof(T)) &&
                      pack_aligned(out, groups.out_group_stride, hidden, sizeof(T)) &&
                      pack_aligned(input, groups.in_group_stride, hidden, sizeof(T));
  const unsigned threads = threads_for(packed ? hidden / Pack<T>::kSize : hidden, kNormMaxThreads);
  if (packed) {
    rms_norm_kernel<T, true><<<unsigned(rows), threads, 0, stream>>>(out, out_stride, input, in_stride, weight,
                                                                      hidden, eps, weight_offset, groups);
  } else {
    rms_norm_kernel<T, false><<<unsigned(rows), threads, 0, stream>>>(out, out_stride, input, in_stride, weight,
                                                                       hidden, eps, weight_offset, groups);
  }
  return cudaGetLastError();
}

// residual[r, :] += input[r, :]; input[r, :] = rms_norm(residual[r, :]) * (weight + weight_offset)
template <typename T>
cudaError_t fused_add_rms_norm(T* input,      // [rows, hidden], row stride in_stride
                               int64_t in_stride,
                               T* residual,   // [rows, hidden], row stride res_stride
                               int64_t res_stride,
                               const T* weight,  // [hidden]
                               int64_t rows, int64_t hidden, float eps, float weight_offset,
                               cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  const bool packed = pack_aligned(input, in_stride, hidden, sizeof(T)) &&
                      pack_aligned(residual, res_stride, hidden, sizeof(T)) &&
                      pack_aligned(weight, 0, hidden, sizeof(T));
  const unsigned threads = threads_for(packed ? hidden / Pack<T>::kSize : hidden, kNormMaxThreads);
  if (packed) {
    fused_add_rms_norm_kernel<T, true><<<unsigned(rows), threads, 0, stream>>>(input, in_stride, residual,
                                                                                res_stride, weight, hidden, eps,
                                                                                weight_offset);
  } else {
    fused_add_rms_norm_kernel<T, false><<<unsigned(rows), threads, 0, stream>>>(input, in_stride, residual,
                                                                                 res_stride, weight, hidden, eps,
                                                                                 weight_offset);
  }
  return cudaGetLastError();
}

// residual[r, :] += rms_norm(input[r, :]) * (weight + weight_offset), the norm rounded to T first
template <typename T>
cudaError_t rms_norm_add(T* residual,       // [rows, hidden], row stride res_stride
                         int64_t res_stride,
                         const T* input,    // [rows, hidden], row stride in_stride
                         int64_t in_stride,
                         const T* weight,   // [hidden]
                         int64_t rows, int64_t hidden, float eps, float weight_offset, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  const bool packed = pack_aligned(residual, res_stride, hidden, sizeof(T)) &&
                      pack_aligned(input, in_stride, hidden, sizeof(T)) && pack_aligned(weight, 0, hidden, sizeof(T));
  const unsigned threads = threads_for(packed ? hidden / Pack<T>::kSize : hidden, kNormMaxThreads);
  if (packed) {
    rms_norm_add_kernel<T, true><<<unsigned(rows), threads, 0, stream>>>(residual, res_stride, input, in_stride,
                                                                          weight, hidden, eps, weight_offset);
  } else {
    rms_norm_add_kernel<T, false><<<unsigned(rows), threads, 0, stream>>>(residual, res_stride, input, in_stride,
                                                                           weight, hidden, eps, weight_offset);
  }
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
