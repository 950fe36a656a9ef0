// rejection_sample on CUDA: the kernels of kvflow/rejection_sample.cuh around the sample kernel.
// Checks of dtypes, shapes and devices only: cu_rows and the draft ids stay on the device,
// unread by the host.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/rejection_sample.cuh"
#include "kvflow/sampling.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void rejection_sample(at::Tensor& out, at::Tensor& num_emitted, const at::Tensor& logits,
                      const at::Tensor& draft_token_ids, const at::Tensor& cu_rows, const at::Tensor& temperature,
                      const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                      const at::Tensor& seeds, const at::Tensor& offsets) {
  check_device_type(logits, "logits", c10::DeviceType::CUDA);
  const SamplingGeometry g = check_rejection_sample_args(out, num_emitted, logits, draft_token_ids, cu_rows,
                                                         temperature, top_k, top_p, min_p, seeds, offsets);
  const int64_t rows = logits.size(0);
  if (g.batch == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor row_temperature = at::empty({rows}, temperature.options());
  const at::Tensor row_top_k = at::empty({rows}, top_k.options());
  const at::Tensor row_top_p = at::empty({rows}, top_p.options());
  const at::Tensor row_min_p = at::empty({rows}, min_p.options());
  const at::Tensor row_seeds = at::empty({rows}, seeds.options());
  const at::Tensor row_offsets = at::empty({rows}, offsets.options());
  const cuda_kernels::RowSamplingParams spread{row_temperature.data_ptr<float>(), row_top_k.data_ptr<int32_t>(),
                                               row_top_p.data_ptr<float>(),       row_min_p.data_ptr<float>(),
                                               row_seeds.data_ptr<int64_t>(),     row_offsets.data_ptr<int64_t>()};
  cudaError_t err = cuda_kernels::spread_params(spread, temperature.data_ptr<float>(), top_k.data_ptr<int32_t>(),
                                                top_p.data_ptr<float>(), min_p.data_ptr<float>(),
                                                seeds.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                                                cu_rows.data_ptr<int64_t>(), g.batch, stream);
  TORCH_CHECK(err == cudaSuccess, "rejection_sample: CUDA kernel launch failed: ", cudaGetErrorString(err));
  at::Tensor drawn = at::empty({rows}, out.options());
  err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    return cuda_kernels::sample(drawn.data_ptr<int64_t>(), static_cast<const T*>(logits.data_ptr()),
                                logits.stride(0), rows, g.vocab, row_temperature.data_ptr<float>(),
                                row_top_k.data_ptr<int32_t>(), row_top_p.data_ptr<float>(),
                                row_min_p.data_ptr<float>(), row_seeds.data_ptr<int64_t>(),
                                row_offsets.data_ptr<int64_t>(), stream);
  });
  TORCH_CHECK(err == cudaSuccess, "rejection_sample: CUDA kernel launch failed: ", cudaGetErrorString(err));
  err = cuda_kernels::accept_drafts(out.data_ptr<int64_t>(), num_emitted.data_ptr<int64_t>(), drawn.data_ptr<int64_t>(),
                                    draft_token_ids.data_ptr<int64_t>(), cu_rows.data_ptr<int64_t>(), g.batch, stream);
  TORCH_CHECK(err == cudaSuccess, "rejection_sample: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
