// apply_token_bitmask on the GPU (the twin of kvflow/token_bitmask.h): one thread per logit of
// each masked row, a grid-stride loop along the vocabulary. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvflow::cuda_kernels {

constexpr int kTokenBitmaskThreads = 256;

// Mask row m applies to logits row rows[m] (or m when rows is null).
__global__ void __launch_bounds__(kTokenBitmaskThreads)
    apply_token_bitmask_kernel(float* logits, int64_t row_stride, int64_t vocab, const int32_t* bitmask,
                               int64_t num_words, const int64_t* rows) {
  const int64_t m = blockIdx.y;
  float* row = logits + (rows == nullptr ? m : rows[m]) * row_stride;
  const int32_t* words = bitmask + m * num_words;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < vocab; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t w = t / 32;
    const bool allowed = w < num_words && ((uint32_t(words[w]) >> (t % 32)) & 1u);
    if (!allowed) row[t] = -__int_as_float(0x7f800000);
  }
}

inline cudaError_t apply_token_bitmask(float* logits, int64_t row_stride, int64_t vocab, const int32_t* bitmask,
                                       int64_t mask_rows, int64_t num_words, const int64_t* rows,
                                       cudaStream_t stream) {
  if (mask_rows == 0 || vocab == 0) return cudaSuccess;
  if (mask_rows > 65535) return cudaErrorInvalidValue;
  const int64_t blocks = (vocab + kTokenBitmaskThreads - 1) / kTokenBitmaskThreads;
  const dim3 grid(unsigned(blocks < 1024 ? blocks : 1024), unsigned(mask_rows));
  apply_token_bitmask_kernel<<<grid, kTokenBitmaskThreads, 0, stream>>>(logits, row_stride, vocab, bitmask, num_words,
                                                                        rows);
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
