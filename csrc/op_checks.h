// Argument checks shared by the CPU and CUDA implementations: dtypes, devices and shapes, each
// failure naming the argument. They read no tensor data (the CPU path checks values itself;
// CUDA kernels never synchronise with the host to do so). Each returns the geometry the
// kernels need.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/numeric.h"

namespace kvflow {

inline DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// The implementation registered for one device type received a tensor of another.
inline void check_device_type(const at::Tensor& t, const char* name, c10::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, name, " must be a ", c10::DeviceTypeName(type, /*lower_case=*/false),
              " tensor, got ", t.device());
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
}

inline void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  check_same_device(t, name, ref, ref_name);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but ", ref_name,
              " has dtype ", ref.scalar_type());
}

inline void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but the data is on ", ref.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A tensor [..., width] seen as rows: the last dimension has unit stride and the leading ones
// collapse into one row stride (a contiguous tensor, or a slice of the columns of one). Where
// row_view_grouped allows it, a [tokens, heads, width] view whose token stride is not heads x
// the head stride (the query heads of a merged QKV output) is rows in groups: group g starts
// group_stride elements after group g - 1, and its group_rows rows are stride apart.
struct RowView {
  int64_t rows;
  int64_t width;
  int64_t stride;
  int64_t group_rows = 1;    // rows itself (at least 1) when the rows are evenly strided
  int64_t group_stride = 0;

  // The element offset of row r.
  int64_t offset(int64_t r) const { return (r / group_rows) * group_stride + (r % group_rows) * stride; }
};

inline RowView row_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, name, " must have at least one dimension");
  const int64_t width = t.size(-1);
  TORCH_CHECK(width == 1 || t.stride(-1) == 1, name, " must have unit stride in its last dimension, got strides ",
              t.strides());
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  int64_t stride = width;
  if (t.dim() >= 2) {
    stride = t.stride(-2);
    for (int64_t d = t.dim() - 3; d >= 0; --d) {
      TORCH_CHECK(t.size(d) == 1 || t.stride(d) == t.stride(d + 1) * t.size(d + 1), name,
                  "'s leading dimensions must collapse into rows (strides ", t.strides(), ", sizes ", t.sizes(), ")");
    }
  }
  return {rows, width, stride, std::max<int64_t>(rows, 1), 0};
}

// row_view, or a [tokens, heads, width] tensor whose leading dimensions do not collapse as rows
// in groups of heads.
inline RowView row_view_grouped(const at::Tensor& t, const char* name) {
  const bool collapses = t.dim() != 3 || t.size(0) == 1 || t.stride(0) == t.stride(1) * t.size(1);
  if (collapses) return row_view(t, name);
  TORCH_CHECK(t.size(2) == 1 || t.stride(2) == 1, name, " must have unit stride in its last dimension, got strides ",
              t.strides());
  return {t.size(0) * t.size(1), t.size(2), t.stride(1), std::max<int64_t>(t.size(1), 1), t.stride(0)};
}

struct NormGeometry {
  RowView x;       // input (rms_norm) or input (fused_add_rms_norm)
  RowView y;       // out (rms_norm) or residual (fused_add_rms_norm)
  DType dtype;
};

// grouped: rows may come in groups (row_view_grouped; rms_norm over heads); otherwise evenly strided.
inline NormGeometry check_norm_args(const at::Tensor& x, const char* x_name, const at::Tensor& y, const char* y_name,
                                    const at::Tensor& weight, double epsilon, bool grouped = false) {
  const DType dtype = kernel_dtype(x, x_name);
  check_like(y, y_name, x, x_name);
  check_like(weight, "weight", x, x_name);
  TORCH_CHECK(y.sizes() == x.sizes(), y_name, " has shape ", y.sizes(), " but ", x_name, " has shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must have shape [", x.size(-1), "], got ",
              weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK(epsilon > 0, "epsilon must be positive, got ", epsilon);
  if (grouped) return {row_view_grouped(x, x_name), row_view_grouped(y, y_name), dtype};
  return {row_view(x, x_name), row_view(y, y_name), dtype};
}

struct RotaryGeometry {
  int64_t num_tokens;
  int64_t num_q_heads;
  int64_t q_stride;
  int64_t num_kv_heads;  // 0 when there is no key
  int64_t k_stride;
  int64_t rotary_dim;
  int64_t max_position;
  DType dtype;
  bool cache_is_float32;
};

// query/key: [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size], each
// token's heads packed, the token stride free (views into a merged QKV output are fine).
inline int64_t rotary_heads(const at::Tensor& t, const char* name, int64_t num_tokens, int64_t head_size,
                            int64_t* token_stride) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, name, " must be [num_tokens, num_heads * head_size] or ",
              "[num_tokens, num_heads, head_size], got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == num_tokens, name, " has ", t.size(0), " tokens but positions has ", num_tokens);
  const int64_t features = t.dim() == 2 ? t.size(1) : t.size(1) * t.size(2);
  TORCH_CHECK(t.dim() == 2 || t.size(2) == head_size, name, "'s last dimension ", t.size(-1),
              " is not head_size ", head_size);
  TORCH_CHECK(features % head_size == 0, name, "'s ", features, " features are not a multiple of head_size ",
              head_size);
  TORCH_CHECK(t.stride(-1) == 1 && (t.dim() == 2 || t.stride(1) == head_size), name,
              " must hold each token's heads packed (unit inner stride), got strides ", t.strides());
  *token_stride = t.stride(0);
  return features / head_size;
}

inline RotaryGeometry check_rotary_args(const at::Tensor& positions, const at::Tensor& query,
                                        const std::optional<at::Tensor>& key, int64_t head_size,
                                        const at::Tensor& cos_sin_cache) {
  RotaryGeometry g{};
  g.dtype = kernel_dtype(query, "query");
  check_index_tensor(positions, "positions", at::kLong, query);
  TORCH_CHECK(positions.dim() == 1, "positions must be 1-D [num_tokens], got shape ", positions.sizes());
  TORCH_CHECK(head_size > 0, "head_size must be positive, got ", head_size);
  g.num_tokens = positions.size(0);
  g.num_q_heads = rotary_heads(query, "query", g.num_tokens, head_size, &g.q_stride);
  if (key.has_value()) {
    check_like(*key, "key", query, "query");
    g.num_kv_heads = rotary_heads(*key, "key", g.num_tokens, head_size, &g.k_stride);
  }
  TORCH_CHECK(cos_sin_cache.device() == query.device(), "cos_sin_cache is on ", cos_sin_cache.device(),
              " but query is on ", query.device());
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat || cos_sin_cache.scalar_type() == query.scalar_type(),
              "cos_sin_cache must be float32 or query's dtype ", query.scalar_type(), ", got ",
              cos_sin_cache.scalar_type());
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous [max_position, rotary_dim] tensor, got shape ", cos_sin_cache.sizes());
  g.rotary_dim = cos_sin_cache.size(1);
  g.max_position = cos_sin_cache.size(0);
  TORCH_CHECK(g.rotary_dim > 0 && g.rotary_dim % 2 == 0 && g.rotary_dim <= head_size,
              "cos_sin_cache's rotary_dim ", g.rotary_dim, " must be even and at most head_size ", head_size);
  g.cache_is_float32 = cos_sin_cache.scalar_type() == at::kFloat;
  return g;
}

struct GatedGeometry {
  RowView in;
  RowView out;
  DType dtype;
};

inline GatedGeometry check_gated_args(const at::Tensor& out, const at::Tensor& input) {
  const DType dtype = kernel_dtype(input, "input");
  check_like(out, "out", input, "input");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, "input's last dimension must be 2 * d (gate, up), got ",
              input.sizes());
  auto expected = input.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), "out must have shape ", at::IntArrayRef(expected), ", got ",
              out.sizes());
  return {row_view(input, "input"), row_view(out, "out"), dtype};
}

struct CacheGeometry {
  int64_t num_tokens;
  int64_t key_stride;    // token stride of key, in elements
  int64_t value_stride;  // token stride of value, in elements
  int64_t num_slots;     // num_blocks * block_size
  int64_t token_elems;   // num_kv_heads * head_dim
};

// One token's heads packed ([num_kv_heads, head_dim] contiguous), the token stride free.
inline int64_t kv_token_stride(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, name, " must be [num_tokens, num_kv_heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)), name,
              " must hold each token's heads packed, got strides ", t.strides());
  return t.stride(0);
}

inline void check_cache_tensor(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
}

inline CacheGeometry check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value,
                                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                  const at::Tensor& slot_mapping) {
  kernel_dtype(key, "key");
  check_like(value, "value", key, "key");
  check_like(key_cache, "key_cache", key, "key");
  check_like(value_cache, "value_cache", key, "key");
  check_cache_tensor(key_cache, "key_cache");
  check_cache_tensor(value_cache, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache has shape ", value_cache.sizes(),
              " but key_cache has shape ", key_cache.sizes());
  CacheGeometry g{};
  g.key_stride = kv_token_stride(key, "key");
  g.value_stride = kv_token_stride(value, "value");
  TORCH_CHECK(value.sizes() == key.sizes(), "value has shape ", value.sizes(), " but key has shape ", key.sizes());
  TORCH_CHECK(key.size(1) == key_cache.size(2), "key has ", key.size(1), " kv heads but key_cache has ",
              key_cache.size(2));
  TORCH_CHECK(key.size(2) == key_cache.size(3), "key's head_dim ", key.size(2), " differs from key_cache's head_dim ",
              key_cache.size(3));
  check_index_tensor(slot_mapping, "slot_mapping", at::kLong, key);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [",
              key.size(0), "] (one slot per token), got shape ", slot_mapping.sizes());
  g.num_tokens = key.size(0);
  g.num_slots = key_cache.size(0) * key_cache.size(1);
  g.token_elems = key.size(1) * key.size(2);
  return g;
}

struct CopyBlocksGeometry {
  int64_t num_pairs;
  int64_t num_blocks;
  int64_t block_elems;  // block_size * num_kv_heads * head_dim
};

inline CopyBlocksGeometry check_copy_blocks_args(const std::vector<at::Tensor>& key_caches,
                                                 const std::vector<at::Tensor>& value_caches,
                                                 const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
              " layers but value_caches has ", value_caches.size());
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must be [num_pairs, 2] (src, dst), got shape ", block_mapping.sizes());
  CopyBlocksGeometry g{block_mapping.size(0), 0, 0};
  if (key_caches.empty()) return g;
  const at::Tensor& first = key_caches[0];
  kernel_dtype(first, "key_caches[0]");
  check_cache_tensor(first, "key_caches[0]");
  for (size_t i = 0; i < key_caches.size(); ++i) {
    for (const at::Tensor* cache : {&key_caches[i], &value_caches[i]}) {
      const char* name = cache == &key_caches[i] ? "key_caches" : "value_caches";
      check_like(*cache, name, first, "key_caches[0]");
      check_cache_tensor(*cache, name);
      TORCH_CHECK(cache->sizes() == first.sizes(), name, "[", i, "] has shape ", cache->sizes(),
                  " but key_caches[0] has shape ", first.sizes());
    }
  }
  check_index_tensor(block_mapping, "block_mapping", at::kLong, first);
  g.num_blocks = first.size(0);
  g.block_elems = first[0].numel();
  return g;
}

struct AttentionGeometry {
  int64_t num_tokens;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t q_stride;  // token stride of query, in elements
  int64_t num_blocks;
  int64_t block_size;
  int64_t batch;
  int64_t max_blocks_per_seq;
  DType dtype;
};

inline AttentionGeometry check_paged_attention_args(const at::Tensor& out, const at::Tensor& query,
                                                    const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                    const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                                    const at::Tensor& seq_lens, int64_t max_query_len,
                                                    int64_t max_seq_len, int64_t sliding_window,
                                                    double logits_soft_cap,
                                                    const std::optional<at::Tensor>& workspace) {
  AttentionGeometry g{};
  g.dtype = kernel_dtype(query, "query");
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_q_heads, head_dim], got shape ", query.sizes());
  TORCH_CHECK(query.stride(2) == 1 && (query.size(1) == 1 || query.stride(1) == query.size(2)),
              "query must hold each token's heads packed, got strides ", query.strides());
  check_like(out, "out", query, "query");
  TORCH_CHECK(out.sizes() == query.sizes(), "out has shape ", out.sizes(), " but query has shape ", query.sizes());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  check_like(key_cache, "key_cache", query, "query");
  check_like(value_cache, "value_cache", query, "query");
  check_cache_tensor(key_cache, "key_cache");
  check_cache_tensor(value_cache, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache has shape ", value_cache.sizes(),
              " but key_cache has shape ", key_cache.sizes());
  g.num_tokens = query.size(0);
  g.num_q_heads = query.size(1);
  g.head_dim = query.size(2);
  g.q_stride = query.stride(0);
  g.num_blocks = key_cache.size(0);
  g.block_size = key_cache.size(1);
  g.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == g.head_dim, "key_cache's head_dim ", key_cache.size(3), " differs from query's ",
              g.head_dim);
  TORCH_CHECK(g.num_kv_heads > 0 && g.num_q_heads % g.num_kv_heads == 0, "num_q_heads ", g.num_q_heads,
              " is not a multiple of num_kv_heads ", g.num_kv_heads, " (key_cache.size(2))");
  TORCH_CHECK(g.head_dim == 64 || g.head_dim == 80 || g.head_dim == 96 || g.head_dim == 128 || g.head_dim == 256,
              "head_dim ", g.head_dim, " is not supported by paged_attention (supported: 64, 80, 96, 128, 256)");
  check_index_tensor(block_tables, "block_tables", at::kInt, query);
  check_index_tensor(cu_seqlens_q, "cu_seqlens_q", at::kInt, query);
  check_index_tensor(seq_lens, "seq_lens", at::kInt, query);
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [batch, max_blocks_per_seq], got shape ",
              block_tables.sizes());
  g.batch = block_tables.size(0);
  g.max_blocks_per_seq = block_tables.size(1);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == g.batch, "seq_lens must be [", g.batch,
              "] (one per block_tables row), got shape ", seq_lens.sizes());
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == g.batch + 1, "cu_seqlens_q must be [", g.batch + 1,
              "] (batch + 1), got shape ", cu_seqlens_q.sizes());
  TORCH_CHECK(max_query_len >= 0 && max_seq_len >= 0, "max_query_len and max_seq_len must be >= 0, got ",
              max_query_len, " and ", max_seq_len);
  TORCH_CHECK(max_seq_len <= g.max_blocks_per_seq * g.block_size, "max_seq_len ", max_seq_len,
              " exceeds what block_tables can address (", g.max_blocks_per_seq, " blocks of ", g.block_size, ")");
  TORCH_CHECK(sliding_window == -1 || sliding_window > 0, "sliding_window must be -1 (off) or positive, got ",
              sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0, "logits_soft_cap must be >= 0 (0 = off), got ", logits_soft_cap);
  if (workspace.has_value()) {
    TORCH_CHECK(workspace->scalar_type() == at::kFloat && workspace->is_contiguous() &&
                    workspace->device() == query.device(),
                "workspace must be a contiguous float32 tensor on ", query.device());
  }
  return g;
}

// logits [batch, vocab] with unit stride along the vocabulary (rows may be strided).
inline void check_logits_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [batch, vocab], got shape ", logits.sizes());
  TORCH_CHECK(logits.stride(1) == 1, "logits must have unit stride along the vocabulary");
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocabulary");
}

// scale_logits: float32 logits [rows, vocab] (unit stride along the vocabulary), a finite
// divisor > 0, a finite soft_cap >= 0 (0: no cap).
inline void check_scale_logits_args(const at::Tensor& logits, double divisor, double soft_cap) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "scale_logits needs float32 logits, got ", logits.scalar_type());
  check_logits_rows(logits);
  TORCH_CHECK(std::isfinite(divisor) && divisor > 0, "scale_logits: divisor = ", divisor, " must be finite and > 0");
  TORCH_CHECK(std::isfinite(soft_cap) && soft_cap >= 0, "scale_logits: soft_cap = ", soft_cap,
              " must be finite and >= 0 (0 = no cap)");
}

// apply_token_bitmask: float32 logits [rows, vocab] (unit stride along the vocabulary); a
// contiguous int32 bitmask [mask rows, words] on the same device; rows, when given, a contiguous
// int64 [mask rows] of logits rows (checked in range by the caller, which can read them), else
// one mask row per logits row.
inline void check_token_bitmask_args(const at::Tensor& logits, const at::Tensor& bitmask,
                                     const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "apply_token_bitmask needs float32 logits, got ",
              logits.scalar_type());
  check_logits_rows(logits);
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, "apply_token_bitmask: bitmask must be int32 (32 tokens a word), got ",
              bitmask.scalar_type());
  TORCH_CHECK(bitmask.dim() == 2, "apply_token_bitmask: bitmask must be [mask rows, words], got shape ",
              bitmask.sizes());
  TORCH_CHECK(bitmask.is_contiguous(), "apply_token_bitmask: bitmask must be contiguous");
  TORCH_CHECK(bitmask.device() == logits.device(), "apply_token_bitmask: bitmask is on ", bitmask.device(),
              ", logits on ", logits.device());
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong, "apply_token_bitmask: rows must be int64, got ", rows->scalar_type());
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == bitmask.size(0), "apply_token_bitmask: rows must be [",
                bitmask.size(0), "] (one per mask row), got shape ", rows->sizes());
    TORCH_CHECK(rows->is_contiguous(), "apply_token_bitmask: rows must be contiguous");
    TORCH_CHECK(rows->device() == logits.device(), "apply_token_bitmask: rows is on ", rows->device(), ", logits on ",
                logits.device());
  } else {
    TORCH_CHECK(bitmask.size(0) == logits.size(0), "apply_token_bitmask: ", bitmask.size(0),
                " mask rows for ", logits.size(0), " logits rows; pass rows to mask some of them");
  }
}

struct SamplingGeometry {
  int64_t batch;
  int64_t vocab;
  DType dtype;
};

inline void check_row_param(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& logits) {
  check_index_tensor(t, name, dtype, logits);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0), name, " must be [", logits.size(0),
              "] (one value per row of logits), got shape ", t.sizes());
}

inline SamplingGeometry check_sampling_args(const at::Tensor& logits, const at::Tensor& temperature,
                                            const at::Tensor& top_k, const at::Tensor& top_p,
                                            const at::Tensor& min_p) {
  SamplingGeometry g{};
  g.dtype = kernel_dtype(logits, "logits");
  check_logits_rows(logits);
  g.batch = logits.size(0);
  g.vocab = logits.size(1);
  check_row_param(temperature, "temperature", at::kFloat, logits);
  check_row_param(top_k, "top_k", at::kInt, logits);
  check_row_param(top_p, "top_p", at::kFloat, logits);
  check_row_param(min_p, "min_p", at::kFloat, logits);
  return g;
}

// rejection_sample: logits [rows, vocab] (float32, float16 or bfloat16), draft_token_ids int64
// [rows], cu_rows int64 [requests + 1], out int64 [rows], num_emitted int64 [requests], the
// sampling parameters one per request (float32 temperature, top_p, min_p; int32 top_k; int64
// seeds, offsets). Values (cu_rows, draft ids) are checked by the CPU op only.
inline SamplingGeometry check_rejection_sample_args(const at::Tensor& out, const at::Tensor& num_emitted,
                                                    const at::Tensor& logits, const at::Tensor& draft_token_ids,
                                                    const at::Tensor& cu_rows, const at::Tensor& temperature,
                                                    const at::Tensor& top_k, const at::Tensor& top_p,
                                                    const at::Tensor& min_p, const at::Tensor& seeds,
                                                    const at::Tensor& offsets) {
  SamplingGeometry g{};
  g.dtype = kernel_dtype(logits, "logits");
  check_logits_rows(logits);
  g.vocab = logits.size(1);
  check_row_param(draft_token_ids, "draft_token_ids", at::kLong, logits);
  check_row_param(out, "out", at::kLong, logits);
  check_index_tensor(cu_rows, "cu_rows", at::kLong, logits);
  TORCH_CHECK(cu_rows.dim() == 1 && cu_rows.size(0) >= 1, "cu_rows must be [requests + 1], got shape ",
              cu_rows.sizes());
  g.batch = cu_rows.size(0) - 1;
  TORCH_CHECK(g.batch <= logits.size(0), "rejection_sample: ", g.batch, " requests for ", logits.size(0),
              " rows of logits; every request needs at least one row");
  for (const auto& [t, name, dtype] : {std::tuple{&temperature, "temperature", at::kFloat},
                                       std::tuple{&top_k, "top_k", at::kInt}, std::tuple{&top_p, "top_p", at::kFloat},
                                       std::tuple{&min_p, "min_p", at::kFloat}, std::tuple{&seeds, "seeds", at::kLong},
                                       std::tuple{&offsets, "offsets", at::kLong},
                                       std::tuple{&num_emitted, "num_emitted", at::kLong}}) {
    check_index_tensor(*t, name, dtype, logits);
    TORCH_CHECK(t->dim() == 1 && t->size(0) == g.batch, name, " must be [", g.batch,
                "] (one value per request), got shape ", t->sizes());
  }
  return g;
}

inline void check_penalty_args(const at::Tensor& logits, const at::Tensor& prompt_token_ids,
                               const at::Tensor& prompt_offsets, const at::Tensor& output_token_ids,
                               const at::Tensor& output_offsets, const at::Tensor& repetition_penalty,
                               const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "apply_penalties needs float32 logits, got ",
              logits.scalar_type());
  check_logits_rows(logits);
  const int64_t batch = logits.size(0);
  for (const auto& [ids, offsets, ids_name, offsets_name] :
       {std::tuple{&prompt_token_ids, &prompt_offsets, "prompt_token_ids", "prompt_offsets"},
        std::tuple{&output_token_ids, &output_offsets, "output_token_ids", "output_offsets"}}) {
    check_index_tensor(*ids, ids_name, at::kLong, logits);
    TORCH_CHECK(ids->dim() == 1, ids_name, " must be 1-D (all rows' tokens, packed), got shape ", ids->sizes());
    check_index_tensor(*offsets, offsets_name, at::kLong, logits);
    TORCH_CHECK(offsets->dim() == 1 && offsets->size(0) == batch + 1, offsets_name, " must be [", batch + 1,
                "] (batch + 1), got shape ", offsets->sizes());
  }
  check_row_param(repetition_penalty, "repetition_penalty", at::kFloat, logits);
  check_row_param(frequency_penalty, "frequency_penalty", at::kFloat, logits);
  check_row_param(presence_penalty, "presence_penalty", at::kFloat, logits);
}

inline DType check_logprobs_args(const at::Tensor& logits, const at::Tensor& token_ids, int64_t num_top) {
  const DType dtype = kernel_dtype(logits, "logits");
  check_logits_rows(logits);
  check_row_param(token_ids, "token_ids", at::kLong, logits);
  TORCH_CHECK(num_top >= 0 && num_top <= 20 && num_top <= logits.size(1), "num_top must be in [0, min(20, vocab)], got ",
              num_top, " for a vocabulary of ", logits.size(1));
  return dtype;
}

struct EmbeddingGeometry {
  int64_t num_tokens;
  int64_t vocab_size;
  int64_t row_bytes;  // one row of weight
};

// out [num_tokens, hidden] = weight[token_ids]: token_ids int64 [num_tokens], weight a contiguous
// [vocab_size, hidden], out contiguous of weight's dtype.
inline EmbeddingGeometry check_embedding_args(const at::Tensor& out, const at::Tensor& token_ids,
                                              const at::Tensor& weight) {
  kernel_dtype(weight, "weight");
  check_like(out, "out", weight, "weight");
  check_index_tensor(token_ids, "token_ids", at::kLong, weight);
  TORCH_CHECK(token_ids.dim() == 1, "token_ids must be 1-D [num_tokens], got shape ", token_ids.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [vocab_size, hidden] tensor, "
              "got shape ", weight.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == token_ids.size(0) && out.size(1) == weight.size(1) &&
                  out.is_contiguous(),
              "out must be a contiguous [", token_ids.size(0), ", ", weight.size(1), "] tensor, got shape ",
              out.sizes());
  return {token_ids.size(0), weight.size(0), weight.size(1) * weight.element_size()};
}

struct QuantizedLinearGeometry {
  cpu::QuantFormat format;
  int64_t rows, in_features, out_features, row_bytes;
  int64_t out_stride;  // elements from one output row to the next (out may be a column slice)
};

inline void check_float_or_bfloat16(const at::Tensor& t, const char* name, c10::DeviceType device) {
  check_device_type(t, name, device);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// A weight in GGUF blocks of ggml_type: a contiguous uint8 [rows, row bytes] of whole blocks.
// Returns the format and the values a row holds.
inline std::pair<cpu::QuantFormat, int64_t> check_quantized_weight(const char* op, const at::Tensor& weight,
                                                                   int64_t ggml_type, const char* rows_name,
                                                                   c10::DeviceType device) {
  const int format = cpu::quant_format_of(ggml_type);
  TORCH_CHECK(cpu::interleaved_base_type(ggml_type) < 0, op, ": type ", ggml_type, " is kvflow's interleaved layout of",
              " GGML type ", cpu::interleaved_base_type(ggml_type), ", which only quantized_linear on the CPU runs");
  TORCH_CHECK(format >= 0, op, " runs GGML types ", cpu::kQuantTypesText, ", got type ", ggml_type);
  check_device_type(weight, "weight", device);
  TORCH_CHECK(weight.scalar_type() == at::kByte, "weight must be uint8 (the GGUF blocks' bytes), got ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [", rows_name,
              ", row bytes] tensor, got shape ", weight.sizes());
  const int64_t block_bytes = cpu::quant_block_bytes(cpu::QuantFormat(format)), row_bytes = weight.size(1);
  TORCH_CHECK(row_bytes % block_bytes == 0, "weight rows of GGML type ", ggml_type, " are whole ", block_bytes,
              "-byte blocks, got ", row_bytes, " bytes a row");
  return {cpu::QuantFormat(format), row_bytes / block_bytes * cpu::quant_block_values(cpu::QuantFormat(format))};
}

// out [rows, out_features] = input [rows, in_features] @ W^T (+ bias [out_features]), W in GGUF
// blocks (check_quantized_weight); input, out and bias float32 or bfloat16, out contiguous.
inline QuantizedLinearGeometry check_quantized_linear_args(const at::Tensor& out, const at::Tensor& input,
                                                           const at::Tensor& weight, int64_t ggml_type,
                                                           const std::optional<at::Tensor>& bias,
                                                           c10::DeviceType device) {
  const auto [format, in_features] = check_quantized_weight("quantized_linear", weight, ggml_type, "out_features", device);
  check_float_or_bfloat16(input, "input", device);
  check_float_or_bfloat16(out, "out", device);
  check_same_device(input, "input", weight, "weight");
  check_same_device(out, "out", weight, "weight");
  const int64_t block_values = cpu::quant_block_values(format), out_features = weight.size(0);
  TORCH_CHECK(input.dim() == 2 && input.size(1) == in_features, "input must be [rows, ", in_features,
              "] (the weight's ", in_features / block_values, " blocks of ", block_values, " a row), got shape ",
              input.sizes());
  const int64_t rows = input.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == out_features,
              "out must be [", rows, ", ", out_features, "], got shape ", out.sizes());
  // A column slice of a wider tensor is a valid out: a merged projection whose parts are of
  // different types writes each part's product into its columns.
  const int64_t out_stride = rows > 1 ? out.stride(0) : out_features;
  TORCH_CHECK((out.stride(1) == 1 || out_features <= 1) && out_stride >= out_features,
              "out must have contiguous rows (stride 1 along a row, rows at least ", out_features,
              " elements apart), got strides ", out.strides());
  if (bias.has_value()) {
    check_float_or_bfloat16(*bias, "bias", device);
    check_same_device(*bias, "bias", weight, "weight");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [", out_features, "], got shape ",
                bias->sizes());
  }
  return {format, rows, in_features, out_features, weight.size(1), out_stride};
}

struct QuantizedEmbeddingGeometry {
  cpu::QuantFormat format;
  int64_t num_tokens, vocab_size, row_bytes, hidden;
  DType out_dtype;
  bool interleaved = false;  // the table in kvflow's interleaved layout of format (the CPU's only)
};

// out [num_tokens, hidden] = the rows of a table in GGUF blocks that token_ids (int64) name.
inline QuantizedEmbeddingGeometry check_quantized_embedding_args(const at::Tensor& out, const at::Tensor& token_ids,
                                                                 const at::Tensor& weight, int64_t ggml_type,
                                                                 c10::DeviceType device) {
  const auto [format, hidden] = check_quantized_weight("quantized_embedding", weight, ggml_type, "vocab_size", device);
  const DType out_dtype = kernel_dtype(out, "out");
  check_device_type(out, "out", device);
  check_same_device(out, "out", weight, "weight");
  check_index_tensor(token_ids, "token_ids", at::kLong, weight);
  TORCH_CHECK(token_ids.dim() == 1, "token_ids must be 1-D [num_tokens], got shape ", token_ids.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == token_ids.size(0) && out.size(1) == hidden && out.is_contiguous(),
              "out must be a contiguous [", token_ids.size(0), ", ", hidden, "] tensor, got shape ", out.sizes());
  return {format, token_ids.size(0), weight.size(0), weight.size(1), hidden, out_dtype};
}

}  // namespace kvflow
