// paged_attention on CUDA: checks, device guard, current stream, the launch plan (from host
// integers only: max_query_len, max_seq_len, sizes), the split-KV workspace, dtype and head_dim
// dispatch, then kvflow/attention.cuh. Nothing here reads device memory, so the op is
// CUDA-graph capturable; cu_seqlens_q, seq_lens and block_tables are trusted as the CPU path
// validates them (see attention.cuh for the contract).
//
// Workspace: splitting long contexts over CTAs needs
//   num_splits * num_tokens * num_q_heads * (head_dim + 2) float32
// of scratch, never more than cuda_kernels::paged_attention_max_workspace_floats(head_dim,
// num_SMs) = 256 * num_SMs * (head_dim + 2) floats. A `workspace` at least that large (and
// 8-byte aligned) is used as is; otherwise the op allocates what it needs with at::empty, which
// under CUDA-graph capture comes from the graph's pool. Pass a workspace to capture without
// allocating.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "kvflow/attention.cuh"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cuda {

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& seq_lens, double scale, int64_t max_query_len, int64_t max_seq_len,
                     int64_t sliding_window, double logits_soft_cap, const std::optional<at::Tensor>& workspace) {
  check_device_type(query, "query", c10::DeviceType::CUDA);
  const AttentionGeometry g =
      check_paged_attention_args(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                 max_query_len, max_seq_len, sliding_window, logits_soft_cap, workspace);
  // The kernels take any power of two (as a shift); 16 and 32 are the supported, tested sizes.
  TORCH_CHECK(g.block_size == 16 || g.block_size == 32, "key_cache's block_size ", g.block_size,
              " is not supported on CUDA (supported: 16, 32)");
  if (g.num_tokens == 0) return;
  TORCH_CHECK(g.batch > 0, "query has ", g.num_tokens, " tokens but the batch is empty");
  TORCH_CHECK(max_query_len >= 1, "max_query_len must be >= 1 (an upper bound of every request's query length), got ",
              max_query_len);
  TORCH_CHECK(max_seq_len >= 1, "max_seq_len must be >= 1 (an upper bound of every seq_lens entry), got ",
              max_seq_len);
  TORCH_CHECK(max_seq_len <= INT32_MAX && g.num_tokens * g.num_q_heads <= INT32_MAX / 2 &&
                  g.num_kv_heads <= 65535,
              "paged_attention: sizes exceed the CUDA kernels' 32-bit indexing (max_seq_len ", max_seq_len,
              ", num_tokens ", g.num_tokens, ", num_q_heads ", g.num_q_heads, ")");

  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  cuda_kernels::PagedAttentionParams params{};
  params.out = out.data_ptr();
  params.query = query.data_ptr();
  params.q_stride = g.q_stride;
  params.key_cache = key_cache.data_ptr();
  params.value_cache = value_cache.data_ptr();
  params.block_tables = block_tables.data_ptr<int32_t>();
  params.max_blocks_per_seq = g.max_blocks_per_seq;
  params.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  params.seq_lens = seq_lens.data_ptr<int32_t>();
  params.num_tokens = int(g.num_tokens);
  params.batch = int(g.batch);
  params.num_q_heads = int(g.num_q_heads);
  params.num_kv_heads = int(g.num_kv_heads);
  params.block_shift = g.block_size == 16 ? 4 : 5;
  params.scale = float(scale);
  params.soft_cap = float(logits_soft_cap);
  params.sliding_window = sliding_window > INT32_MAX ? INT32_MAX : int(sliding_window);

  cuda_kernels::PagedAttentionPlan plan{};
  cudaError_t err =
      cuda_kernels::plan_paged_attention(params, g.head_dim, g.dtype, max_query_len, max_seq_len, &plan);
  TORCH_CHECK(err == cudaSuccess, "paged_attention: cannot plan the launch: ", cudaGetErrorString(err));

  at::Tensor scratch;
  if (plan.workspace_floats > 0) {
    if (workspace.has_value() && workspace->numel() >= plan.workspace_floats &&
        reinterpret_cast<uintptr_t>(workspace->data_ptr()) % 8 == 0) {
      params.workspace = workspace->data_ptr<float>();
    } else {
      scratch = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));
      params.workspace = scratch.data_ptr<float>();
    }
  }

  // Compiled head sizes: 64, 80, 96, 128, 256 (check_paged_attention_args admits only these).
  err = cuda_kernels::dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (g.head_dim) {
      case 64:
        return cuda_kernels::paged_attention<T, 64>(params, plan, stream);
      case 80:
        return cuda_kernels::paged_attention<T, 80>(params, plan, stream);
      case 96:
        return cuda_kernels::paged_attention<T, 96>(params, plan, stream);
      case 128:
        return cuda_kernels::paged_attention<T, 128>(params, plan, stream);
      case 256:
        return cuda_kernels::paged_attention<T, 256>(params, plan, stream);
      default:
        TORCH_CHECK(false, "paged_attention: head_dim ", g.head_dim, " is not compiled for CUDA (64, 80, 96, 128, 256)");
    }
  });
  TORCH_CHECK(err == cudaSuccess, "paged_attention: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvflow::cuda
