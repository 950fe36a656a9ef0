// sample, apply_sampling_filters, apply_penalties and compute_logprobs on CUDA: checks of dtypes,
// shapes and devices only (values are never read on the host, so nothing synchronises), device
// guard, current stream, dtype dispatch, then the kernels of kvflow/sampling.cuh.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/sampling.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void sample(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
            const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  const SamplingGeometry g = check_sampling_args(logits, temperature, top_k, top_p, min_p);
  check_row_param(seeds, "seeds", at::kLong, logits);
  check_row_param(offsets, "offsets", at::kLong, logits);
  check_row_param(out, "out", at::kLong, logits);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::sample(out.data_ptr<int64_t>(), static_cast<const T*>(logits.data_ptr()),
                                logits.stride(0), g.batch, g.vocab, temperature.data_ptr<float>(),
                                top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(), min_p.data_ptr<float>(),
                                seeds.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), stream);
  });
  TORCH_CHECK(err == cudaSuccess, "sample: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void apply_sampling_filters(at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                            const at::Tensor& top_p, const at::Tensor& min_p) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  const SamplingGeometry g = check_sampling_args(logits, temperature, top_k, top_p, min_p);
  TORCH_CHECK(g.dtype == DType::kFloat32, "apply_sampling_filters needs float32 logits, got ",
              logits.scalar_type());
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::apply_sampling_filters(
      logits.data_ptr<float>(), logits.stride(0), g.batch, g.vocab, temperature.data_ptr<float>(),
      top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(), min_p.data_ptr<float>(), stream);
  TORCH_CHECK(err == cudaSuccess, "apply_sampling_filters: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void apply_penalties(at::Tensor& logits, const at::Tensor& prompt_token_ids, const at::Tensor& prompt_offsets,
                     const at::Tensor& output_token_ids, const at::Tensor& output_offsets,
                     const at::Tensor& repetition_penalty, const at::Tensor& frequency_penalty,
                     const at::Tensor& presence_penalty) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  check_penalty_args(logits, prompt_token_ids, prompt_offsets, output_token_ids, output_offsets, repetition_penalty,
                     frequency_penalty, presence_penalty);
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  if (batch == 0 || vocab == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Per row: output counts and a prompt mark for each token; the kernel leaves it zeros again.
  at::Tensor scratch = at::zeros({batch, vocab}, logits.options().dtype(at::kInt));
  const cudaError_t err = cuda_kernels::apply_penalties(
      logits.data_ptr<float>(), logits.stride(0), batch, vocab, prompt_token_ids.data_ptr<int64_t>(),
      prompt_offsets.data_ptr<int64_t>(), output_token_ids.data_ptr<int64_t>(), output_offsets.data_ptr<int64_t>(),
      repetition_penalty.data_ptr<float>(), frequency_penalty.data_ptr<float>(), presence_penalty.data_ptr<float>(),
      scratch.data_ptr<int32_t>(), stream);
  TORCH_CHECK(err == cudaSuccess, "apply_penalties: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> compute_logprobs(const at::Tensor& logits, const at::Tensor& token_ids,
                                                                int64_t num_top) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  const DType dtype = check_logprobs_args(logits, token_ids, num_top);
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = logits.options().dtype(at::kFloat);
  at::Tensor chosen = at::empty({batch}, options);
  at::Tensor top_ids = at::empty({batch, num_top}, options.dtype(at::kLong));
  at::Tensor top_logprobs = at::empty({batch, num_top}, options);
  const cudaError_t err = cuda_kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::compute_logprobs(chosen.data_ptr<float>(), top_ids.data_ptr<int64_t>(),
                                          top_logprobs.data_ptr<float>(), static_cast<const T*>(logits.data_ptr()),
                                          logits.stride(0), batch, vocab, token_ids.data_ptr<int64_t>(), num_top,
                                          stream);
  });
  TORCH_CHECK(err == cudaSuccess, "compute_logprobs: CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {chosen, top_ids, top_logprobs};
}

}  // namespace kvflow::cuda
