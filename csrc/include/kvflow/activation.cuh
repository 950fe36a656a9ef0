// Gated activations of the MLP on the GPU: out = act(gate) * up, input = [gate | up]. One
// thread block per row, float32 math, 16-byte packs when every pointer, row stride and d
// allow it, element by element otherwise. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvflow/cuda_utils.cuh"
#include "kvflow/numeric.h"

namespace kvflow::cuda_kernels {

constexpr int kActivationMaxThreads = 1024;

// silu(x) = x / (1 + exp(-x))
struct Silu {
  __device__ __forceinline__ static float apply(float x) { return x / (1.f + expf(-x)); }
};

// gelu(x) = 0.5 x (1 + erf(x / sqrt(2)))
struct Gelu {
  __device__ __forceinline__ static float apply(float x) { return 0.5f * x * (1.f + erff(x * 0.7071067811865476f)); }
};

// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
struct GeluTanh {
  __device__ __forceinline__ static float apply(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(u));
  }
};

template <class Act, typename T>
__device__ __forceinline__ T gated(T gate, T up) {
  return store_float<T>(Act::apply(load_float(gate)) * load_float(up));
}

template <class Act, typename T, bool kPacked>
__global__ void __launch_bounds__(kActivationMaxThreads)
    gated_activation_kernel(T* out,          // [rows, d], row stride out_stride
                            int64_t out_stride,
                            const T* input,  // [rows, 2 * d], row stride in_stride
                            int64_t in_stride, int64_t d) {
  const T* gate = input + int64_t(blockIdx.x) * in_stride;
  const T* up = gate + d;
  T* y = out + int64_t(blockIdx.x) * out_stride;
  if constexpr (kPacked) {
    constexpr int N = Pack<T>::kSize;
    const int64_t packs = d / N;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> g = load_pack(gate + p * N);
      const Pack<T> u = load_pack(up + p * N);
      Pack<T> r;
#pragma unroll
      for (int j = 0; j < N; ++j) r.v[j] = gated<Act>(g.v[j], u.v[j]);
      store_pack(y + p * N, r);
    }
  } else {
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) y[i] = gated<Act>(gate[i], up[i]);
  }
}

// out[r, i] = Act(input[r, i]) * input[r, d + i] for i < d. Act is Silu, Gelu or GeluTanh.
template <class Act, typename T>
cudaError_t gated_activation(T* out,          // [rows, d], row stride out_stride
                             int64_t out_stride,
                             const T* input,  // [rows, 2 * d], row stride in_stride
                             int64_t in_stride, int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  // The up half starts d elements into the row, so d % N == 0 keeps it aligned too.
  const bool packed = pack_aligned(out, out_stride, d, sizeof(T)) && pack_aligned(input, in_stride, d, sizeof(T));
  const unsigned threads = threads_for(packed ? d / Pack<T>::kSize : d, kActivationMaxThreads);
  if (packed) {
    gated_activation_kernel<Act, T, true><<<unsigned(rows), threads, 0, stream>>>(out, out_stride, input, in_stride,
                                                                                   d);
  } else {
    gated_activation_kernel<Act, T, false><<<unsigned(rows), threads, 0, stream>>>(out, out_stride, input,
                                                                                    in_stride, d);
  }
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
