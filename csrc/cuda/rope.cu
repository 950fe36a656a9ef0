// rotary_embedding on CUDA: checks (positions are not read on the host), device guard, current
// stream, dispatch on the query dtype and the cos_sin_cache dtype, then kvflow/rope.cuh.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/rope.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  check_device_type(query, "query", c10::DeviceType::CUDA);
  const RotaryGeometry g = check_rotary_args(positions, query, key, head_size, cos_sin_cache);
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* key_ptr = key.has_value() ? static_cast<T*>(key->data_ptr()) : nullptr;
    auto launch = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      return cuda_kernels::rotary_embedding(positions.data_ptr<int64_t>(), static_cast<T*>(query.data_ptr()),
                                            g.q_stride, g.num_q_heads, key_ptr, g.k_stride, g.num_kv_heads,
                                            head_size, static_cast<const C*>(cos_sin_cache.data_ptr()),
                                            g.rotary_dim, is_neox, g.num_tokens, stream);
    };
    return g.cache_is_float32 ? launch(float{}) : launch(T{});
  });
  TORCH_CHECK(err == cudaSuccess, "rotary_embedding: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
