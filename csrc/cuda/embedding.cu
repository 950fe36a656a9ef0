// embedding on CUDA: one block per token copies its row in 16-byte pieces where the row allows.
// Token ids are not read on the host (that would synchronise): an id outside the vocabulary
// writes a row of zeros instead of reading out of bounds; the engine checks ids on the host
// before they reach a device.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kvflow/cuda_utils.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {
namespace {

template <typename T>
__global__ void scaled_embedding_kernel(T* out, const int64_t* ids, const T* weight, int64_t vocab_size,
                                        int64_t width, float scale) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  T* row = out + t * width;
  const bool valid = id >= 0 && id < vocab_size;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    row[i] = cuda_kernels::store_float<T>(valid ? cuda_kernels::load_float(weight[id * width + i]) * scale : 0.f);
  }
}

template <class Piece>
__global__ void embedding_kernel(Piece* out, const int64_t* ids, const Piece* weight, int64_t vocab_size,
                                 int64_t pieces_per_row) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  Piece* row = out + t * pieces_per_row;
  if (id < 0 || id >= vocab_size) {
    for (int64_t i = threadIdx.x; i < pieces_per_row; i += blockDim.x) row[i] = Piece{};
    return;
  }
  const Piece* source = weight + id * pieces_per_row;
  for (int64_t i = threadIdx.x; i < pieces_per_row; i += blockDim.x) row[i] = source[i];
}

}  // namespace

void embedding(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight, double scale) {
  check_device_type(weight, "weight", c10::DeviceType::CUDA);
  const EmbeddingGeometry g = check_embedding_args(out, token_ids, weight);
  if (g.num_tokens == 0 || g.row_bytes == 0) return;
  const c10::cuda::CUDAGuard guard(weight.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto* ids = token_ids.data_ptr<int64_t>();
  if (scale != 1.0) {
    const cudaError_t err = cuda_kernels::dispatch_dtype(kernel_dtype(weight, "weight"), [&](auto tag) {
      using T = decltype(tag);
      scaled_embedding_kernel<<<g.num_tokens, 128, 0, stream>>>(static_cast<T*>(out.data_ptr()), ids,
                                                                 static_cast<const T*>(weight.data_ptr()),
                                                                 g.vocab_size, weight.size(1), float(scale));
      return cudaGetLastError();
    });
    TORCH_CHECK(err == cudaSuccess, "embedding: CUDA kernel launch failed: ", cudaGetErrorString(err));
    return;
  }
  const bool wide = g.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0;
  if (wide) {
    embedding_kernel<<<g.num_tokens, 128, 0, stream>>>(static_cast<int4*>(out.data_ptr()), ids,
                                                        static_cast<const int4*>(weight.data_ptr()), g.vocab_size,
                                                        g.row_bytes / 16);
  } else {
    embedding_kernel<<<g.num_tokens, 128, 0, stream>>>(static_cast<uint16_t*>(out.data_ptr()), ids,
                                                        static_cast<const uint16_t*>(weight.data_ptr()),
                                                        g.vocab_size, g.row_bytes / 2);
  }
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "embedding: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
