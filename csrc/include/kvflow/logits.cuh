// A family's last step on the LM head's float32 logits, on the GPU (the twin of
// kvflow/cpu/logits.h): x / divisor, then cap * tanh(x / cap) where cap > 0. A grid-stride loop
// per row. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvflow::cuda_kernels {

constexpr int kScaleLogitsThreads = 256;

__global__ void __launch_bounds__(kScaleLogitsThreads)
    scale_logits_kernel(float* logits, int64_t row_stride, int64_t vocab, float inv_divisor, float soft_cap) {
  float* row = logits + int64_t(blockIdx.y) * row_stride;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vocab; i += int64_t(gridDim.x) * blockDim.x) {
    float x = row[i] * inv_divisor;
    if (soft_cap > 0.f) x = soft_cap * tanhf(x / soft_cap);
    row[i] = x;
  }
}

// logits [rows, vocab] (row stride row_stride), in place.
inline cudaError_t scale_logits(float* logits, int64_t row_stride, int64_t rows, int64_t vocab, float inv_divisor,
                                float soft_cap, cudaStream_t stream) {
  if (rows == 0 || vocab == 0) return cudaSuccess;
  if (rows > 65535) return cudaErrorInvalidValue;
  const int64_t blocks = (vocab + kScaleLogitsThreads - 1) / kScaleLogitsThreads;
  const dim3 grid(unsigned(blocks < 1024 ? blocks : 1024), unsigned(rows));
  scale_logits_kernel<<<grid, kScaleLogitsThreads, 0, stream>>>(logits, row_stride, vocab, inv_divisor, soft_cap);
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
