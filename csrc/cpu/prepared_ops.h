// CPU ops split into a checking half, run once, and a kernel half over a range of the work, for
// callers that run the same op many times on different data: the executor's nodes check once
// what every layer's rope, cache write and attention share, and run inside one parallel region.
// The ops themselves are the two halves back to back.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"

namespace kvflow::cpu {

// paged_attention's work: its arguments (the caches' pointers may be swapped for another layer's
// of the same shape), the items for `threads` threads, and how the key splits merge.
struct PagedAttentionPlan {
  PagedAttentionArgs args{};
  PagedAttentionFn kernel = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<AttentionWorkItem> items;
  std::vector<int32_t> num_splits;  // [batch]
  int64_t max_splits = 1;
  int64_t items_per_grab = 1;
  at::Tensor partials;  // args.partials' storage when keys are split
};

PagedAttentionPlan plan_paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                                        int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                                        double logits_soft_cap, const std::optional<at::Tensor>& workspace,
                                        int64_t threads);

// One thread's part of the items: the next unclaimed ones, counted by `next` (zero to begin).
void run_attention_items(const PagedAttentionPlan& plan, const PagedAttentionArgs& args, std::atomic<int64_t>& next);

// After every item has run: the split results of query tokens [begin, end) merged into args.out.
void merge_attention_tokens(const PagedAttentionPlan& plan, const PagedAttentionArgs& args, int64_t begin,
                            int64_t end);

// rotary_embedding's kernel and arguments (positions range-checked unless the caller did), and
// the geometry they were checked to have.
struct RotaryPlan {
  RotaryArgs args{};
  RotaryFn kernel = nullptr;
  RotaryGeometry geometry{};
};

// The kernel for a checked geometry in the active table.
RotaryFn rotary_kernel(const RotaryGeometry& geometry);

// check_positions false: the caller has checked these positions against a table of this size.
RotaryPlan plan_rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                                 int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox,
                                 bool check_positions = true);

// reshape_and_cache's copies, slots range-checked and free of repeats.
struct CacheWritePlan {
  const char* key;
  const char* value;
  int64_t key_stride_bytes, value_stride_bytes;
  const int64_t* slots;  // [num_tokens], -1 skips a token
  int64_t num_tokens;
  int64_t row_bytes;  // one token's heads
};

// check_slots false: the caller has checked these slots against caches of this size.
CacheWritePlan plan_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                      bool check_slots = true);

// Tokens [begin, end) into the caches (of the shape the plan was checked against).
void write_cache_tokens(const CacheWritePlan& plan, void* key_cache, void* value_cache, int64_t begin, int64_t end);

}  // namespace kvflow::cpu
