// reshape_and_cache and copy_blocks on CUDA: checks, device guard, current stream, then the
// byte-copy kernels of kvflow/cache.cuh (the copies need the element size, not the dtype).
// No slot or block index is read on the host: the kernels take them from device memory
// unchecked, where the CPU path range-checks them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvflow/cache.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  check_device_type(key, "key", c10::DeviceType::CUDA);
  const CacheGeometry g = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(key.device());
  const cudaError_t err = cuda_kernels::reshape_and_cache(
      key.data_ptr(), g.key_stride, value.data_ptr(), g.value_stride, key_cache.data_ptr(), value_cache.data_ptr(),
      slot_mapping.data_ptr<int64_t>(), g.num_tokens, g.token_elems, key.element_size(),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "reshape_and_cache: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void copy_blocks(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                 const at::Tensor& block_mapping) {
  const CopyBlocksGeometry g = check_copy_blocks_args(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || g.num_pairs == 0) return;
  const at::Tensor& first = key_caches[0];
  check_device_type(first, "key_caches", c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(first.device());
  // The kernel finds each cache through a device array of base addresses, ordered
  // (layer 0 key, layer 0 value, layer 1 key, ...), built here and copied on the current stream.
  const int64_t num_caches = 2 * static_cast<int64_t>(key_caches.size());
  at::Tensor addresses = at::empty({num_caches}, at::TensorOptions().dtype(at::kLong));
  int64_t* host = addresses.data_ptr<int64_t>();
  uint64_t address_bits = 0;
  for (size_t layer = 0; layer < key_caches.size(); ++layer) {
    host[2 * layer] = reinterpret_cast<int64_t>(key_caches[layer].data_ptr());
    host[2 * layer + 1] = reinterpret_cast<int64_t>(value_caches[layer].data_ptr());
    address_bits |= uint64_t(host[2 * layer]) | uint64_t(host[2 * layer + 1]);
  }
  // From pageable memory, the copy is staged before to() returns, so `addresses` may go.
  const at::Tensor device_addresses = addresses.to(first.device(), at::kLong, /*non_blocking=*/true);
  const cudaError_t err = cuda_kernels::copy_blocks(
      device_addresses.data_ptr<int64_t>(), num_caches, address_bits, block_mapping.data_ptr<int64_t>(), g.num_pairs,
      g.block_elems * first.element_size(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "copy_blocks: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
