// quantized_linear and quantized_embedding on CUDA, the weights in their GGUF blocks. Up to
// kGemvRows rows (decode), one warp per output feature: each lane dequantizes 32-weight chunks of
// the weight row in registers (gguf_blocks.h's decode_chunk, the definition the CPU kernels
// share) and multiplies them with the input rows in float32; the warp sums the lanes. More rows
// (prefill): the weight is dequantized once into a scratch of the compute dtype (float32 for a
// float32 out, bfloat16 otherwise) and multiplied by at::mm. The embedding dequantizes the rows
// its tokens name; an id outside the table writes zeros, as embedding does.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cuda_utils.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {
namespace {

using cpu::QuantFormat;
using cpu::WeightChunk;

constexpr int kGemvRows = 8;
constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ const uint8_t* chunk_block(const uint8_t* row, QuantFormat f, int64_t chunk) {
  return row + chunk / cpu::quant_block_chunks(f) * cpu::quant_block_bytes(f);
}

template <typename In, typename Out>
__global__ void quantized_gemv_kernel(Out* out, const In* input, int64_t input_stride, const uint8_t* weight,
                                      int64_t row_bytes, const float* bias, QuantFormat format, int64_t rows,
                                      int64_t out_features, int64_t out_stride, int64_t chunks) {
  const int64_t o = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (o >= out_features) return;
  const uint8_t* w = weight + o * row_bytes;
  float acc[kGemvRows] = {};
  for (int64_t c = lane; c < chunks; c += 32) {
    WeightChunk chunk;
    cpu::decode_chunk(format, chunk_block(w, format, c), int(c % cpu::quant_block_chunks(format)), &chunk);
    float values[cpu::kQuantBlock];
#pragma unroll
    for (int j = 0; j < cpu::kQuantBlock; ++j) values[j] = chunk.scale[j / 16] * float(chunk.code[j]) + chunk.offset;
    // Unrolled over the most rows, so that acc stays in registers (a loop to `rows` would index
    // it at run time and put it in local memory).
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r < rows) {
        // The chunk's 32 inputs in 16-byte loads (the host makes the rows 16-byte aligned).
        const In* x = input + r * input_stride + c * cpu::kQuantBlock;
        constexpr int kPack = cuda_kernels::Pack<In>::kSize;
        float sum = 0.f;
#pragma unroll
        for (int p = 0; p < cpu::kQuantBlock / kPack; ++p) {
          const cuda_kernels::Pack<In> pack = cuda_kernels::load_pack(x + p * kPack);
#pragma unroll
          for (int j = 0; j < kPack; ++j) sum += values[p * kPack + j] * cuda_kernels::load_float(pack.v[j]);
        }
        acc[r] += sum;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    if (r < rows) {
      const float total = cuda_kernels::warp_sum(acc[r]);
      if (lane == 0) out[r * out_stride + o] = cuda_kernels::store_float<Out>(total + (bias ? bias[o] : 0.f));
    }
  }
}

// One thread per chunk of the weight: dst [out_features, in_features] row-major.
template <typename T>
__global__ void dequantize_kernel(T* dst, const uint8_t* weight, int64_t row_bytes, QuantFormat format,
                                  int64_t out_features, int64_t chunks) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= out_features * chunks) return;
  const int64_t o = i / chunks, c = i % chunks;
  float values[cpu::kQuantBlock];
  cpu::dequantize_chunk(format, chunk_block(weight + o * row_bytes, format, c),
                        int(c % cpu::quant_block_chunks(format)), values);
  // Written as 16-byte stores: a chunk is 64 (bfloat16) or 128 (float32) aligned bytes.
  union {
    T values[cpu::kQuantBlock];
    uint4 vectors[cpu::kQuantBlock * sizeof(T) / sizeof(uint4)];
  } converted;
#pragma unroll
  for (int j = 0; j < cpu::kQuantBlock; ++j) converted.values[j] = cuda_kernels::store_float<T>(values[j]);
  uint4* row = reinterpret_cast<uint4*>(dst + o * chunks * cpu::kQuantBlock + c * cpu::kQuantBlock);
#pragma unroll
  for (int v = 0; v < int(sizeof(converted.vectors) / sizeof(uint4)); ++v) row[v] = converted.vectors[v];
}

template <typename T>
__global__ void quantized_embedding_kernel(T* out, const int64_t* ids, const uint8_t* weight, int64_t row_bytes,
                                           QuantFormat format, int64_t vocab_size, int64_t chunks, float scale) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  const bool valid = id >= 0 && id < vocab_size;
  T* row = out + t * chunks * cpu::kQuantBlock;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float values[cpu::kQuantBlock] = {};
    if (valid) {
      cpu::dequantize_chunk(format, chunk_block(weight + id * row_bytes, format, c),
                            int(c % cpu::quant_block_chunks(format)), values);
    }
#pragma unroll
    for (int j = 0; j < cpu::kQuantBlock; ++j) row[c * cpu::kQuantBlock + j] = cuda_kernels::store_float<T>(values[j] * scale);
  }
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void quantized_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t ggml_type,
                      const std::optional<at::Tensor>& bias) {
  const QuantizedLinearGeometry g =
      check_quantized_linear_args(out, input, weight, ggml_type, bias, c10::DeviceType::CUDA);
  if (g.rows == 0 || g.out_features == 0) return;
  const c10::cuda::CUDAGuard guard(weight.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t chunks = g.in_features / cpu::kQuantBlock;
  if (g.rows > kGemvRows) {
    const at::ScalarType compute = out.scalar_type();
    at::Tensor dense = at::empty({g.out_features, g.in_features}, weight.options().dtype(compute));
    const int64_t threads = g.out_features * chunks;
    const auto launch = [&](auto tag) {
      using T = decltype(tag);
      dequantize_kernel<<<(threads + 255) / 256, 256, 0, stream>>>(static_cast<T*>(dense.data_ptr()),
                                                                    weight.data_ptr<uint8_t>(), g.row_bytes, g.format,
                                                                    g.out_features, chunks);
    };
    if (compute == at::kFloat) {
      launch(float{});
    } else {
      launch(bfloat16{});
    }
    check_launch("quantized_linear");
    at::Tensor product = at::mm(input.to(compute), dense.t());
    if (bias.has_value()) product.add_(bias->to(compute));
    out.copy_(product);
    return;
  }
  const int64_t element = input.element_size();
  const bool aligned = input.stride(1) == 1 && reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0 &&
                       input.stride(0) * element % 16 == 0;
  const at::Tensor x = aligned ? input : input.clone(at::MemoryFormat::Contiguous);
  const at::Tensor bias_float = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const dim3 grid(unsigned((g.out_features + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const auto launch = [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    quantized_gemv_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<Out*>(out.data_ptr()), static_cast<const In*>(x.data_ptr()), x.stride(0),
        weight.data_ptr<uint8_t>(), g.row_bytes, bias_float.defined() ? bias_float.data_ptr<float>() : nullptr,
        g.format, g.rows, g.out_features, g.out_stride, chunks);
  };
  const bool in_float = x.scalar_type() == at::kFloat, out_float = out.scalar_type() == at::kFloat;
  if (in_float && out_float) {
    launch(float{}, float{});
  } else if (in_float) {
    launch(float{}, bfloat16{});
  } else if (out_float) {
    launch(bfloat16{}, float{});
  } else {
    launch(bfloat16{}, bfloat16{});
  }
  check_launch("quantized_linear");
}

void quantized_embedding(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight, int64_t ggml_type,
                         double scale) {
  const QuantizedEmbeddingGeometry g =
      check_quantized_embedding_args(out, token_ids, weight, ggml_type, c10::DeviceType::CUDA);
  if (g.num_tokens == 0 || g.hidden == 0) return;
  const c10::cuda::CUDAGuard guard(weight.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.out_dtype, [&](auto tag) {
    using T = decltype(tag);
    quantized_embedding_kernel<<<unsigned(g.num_tokens), 128, 0, stream>>>(
        static_cast<T*>(out.data_ptr()), token_ids.data_ptr<int64_t>(), weight.data_ptr<uint8_t>(), g.row_bytes,
        g.format, g.vocab_size, g.hidden / cpu::kQuantBlock, float(scale));
    return cudaGetLastError();
  });
  TORCH_CHECK(err == cudaSuccess, "quantized_embedding: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
