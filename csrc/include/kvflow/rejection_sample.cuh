// rejection_sample on the GPU, around the sample kernel: one thread per request spreads its
// sampling parameters to its rows (row j drawing at offset + j), the sample kernel draws every
// row, then one thread per request keeps its draws up to the first that differs from the row's
// draft. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvflow::cuda_kernels {

constexpr int kAcceptThreads = 128;

struct RowSamplingParams {
  float* temperature;
  int32_t* top_k;
  float* top_p;
  float* min_p;
  int64_t* seeds;
  int64_t* offsets;
};

__global__ void __launch_bounds__(kAcceptThreads)
    spread_params_kernel(RowSamplingParams rows, const float* temperature, const int32_t* top_k, const float* top_p,
                         const float* min_p, const int64_t* seeds, const int64_t* offsets, const int64_t* cu_rows,
                         int64_t requests) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= requests) return;
  for (int64_t r = cu_rows[b]; r < cu_rows[b + 1]; ++r) {
    rows.temperature[r] = temperature[b];
    rows.top_k[r] = top_k[b];
    rows.top_p[r] = top_p[b];
    rows.min_p[r] = min_p[b];
    rows.seeds[r] = seeds[b];
    rows.offsets[r] = offsets[b] + (r - cu_rows[b]);
  }
}

inline cudaError_t spread_params(const RowSamplingParams& rows, const float* temperature, const int32_t* top_k,
                                 const float* top_p, const float* min_p, const int64_t* seeds, const int64_t* offsets,
                                 const int64_t* cu_rows, int64_t requests, cudaStream_t stream) {
  if (requests == 0) return cudaSuccess;
  const int64_t blocks = (requests + kAcceptThreads - 1) / kAcceptThreads;
  spread_params_kernel<<<unsigned(blocks), kAcceptThreads, 0, stream>>>(rows, temperature, top_k, top_p, min_p, seeds,
                                                                       offsets, cu_rows, requests);
  return cudaGetLastError();
}

__global__ void __launch_bounds__(kAcceptThreads)
    accept_drafts_kernel(int64_t* out, int64_t* num_emitted, const int64_t* drawn, const int64_t* drafts,
                         const int64_t* cu_rows, int64_t requests) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= requests) return;
  const int64_t first = cu_rows[b], last = cu_rows[b + 1] - 1;
  int64_t r = first;
  for (; r <= last; ++r) {
    out[r] = drawn[r];
    if (r == last || drawn[r] != drafts[r]) break;
  }
  num_emitted[b] = r - first + 1;
  for (++r; r <= last; ++r) out[r] = -1;
}

inline cudaError_t accept_drafts(int64_t* out, int64_t* num_emitted, const int64_t* drawn, const int64_t* drafts,
                                 const int64_t* cu_rows, int64_t requests, cudaStream_t stream) {
  if (requests == 0) return cudaSuccess;
  const int64_t blocks = (requests + kAcceptThreads - 1) / kAcceptThreads;
  accept_drafts_kernel<<<unsigned(blocks), kAcceptThreads, 0, stream>>>(out, num_emitted, drawn, drafts, cu_rows,
                                                                       requests);
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
